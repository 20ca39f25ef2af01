//! Agent event ingest: block events per second per core for decode + key recompute + apply.
//!
//! The input is real wire bytes (vLLM's map format, as the encoder writes them): each batch stores one
//! prompt's blocks and evicts an older prompt's, so the state stays at a steady size like a full cache.
//! Target (issue 3): >= 1M block events/s on one core.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kinference_agent::kv_events::encode::{EncodeOptions, EventFormat, encode_batch};
use kinference_agent::kv_events::{EventBatch, KvEvent, Medium, decode_batch};
use kinference_agent::worker_state::WorkerState;

struct Workload {
    name: &'static str,
    payloads: Vec<Vec<u8>>,
    block_events: u64,
}

/// `prompts` batches; each stores `blocks` blocks of `bs` tokens (a prompt) and removes the blocks of
/// the prompt stored `resident` batches earlier.
fn workload(
    name: &'static str,
    prompts: u32,
    blocks: u32,
    bs: u32,
    resident: u32,
    format: EventFormat,
) -> Workload {
    let hash = |p: u32, b: u32| ((p as u64) << 20 | b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut payloads = Vec::new();
    let mut block_events = 0;
    for p in 0..prompts {
        let mut events = vec![KvEvent::BlockStored {
            block_hashes: (0..blocks).map(|b| hash(p, b)).collect(),
            parent_block_hash: None,
            token_ids: (0..blocks * bs)
                .map(|t| (p * 7919 + t * 31) % 151_000)
                .collect(),
            block_size: bs,
            medium: Medium::Gpu,
            lora: None,
            extra_keys: Vec::new(),
        }];
        let old = (p + prompts - resident) % prompts;
        events.push(KvEvent::BlockRemoved {
            block_hashes: (0..blocks).map(|b| hash(old, b)).collect(),
            medium: Medium::Gpu,
        });
        block_events += 2 * blocks as u64;
        let batch = EventBatch {
            ts: 1.8e9,
            events,
            data_parallel_rank: Some(0),
        };
        payloads.push(encode_batch(
            &batch,
            EncodeOptions {
                format,
                bin_hashes: false,
            },
        ));
    }
    Workload {
        name,
        payloads,
        block_events,
    }
}

fn ingest(c: &mut Criterion) {
    let workloads = [
        workload("bs16_x4_map", 1000, 4, 16, 256, EventFormat::Map),
        workload("bs16_x4_array", 1000, 4, 16, 256, EventFormat::Array),
        workload(
            "bs32_x8_map_64k_resident",
            16_384,
            8,
            32,
            8192,
            EventFormat::Map,
        ),
    ];
    let mut g = c.benchmark_group("ingest");
    g.measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1))
        .sample_size(20);
    for w in &workloads {
        let mut state = WorkerState::new("qwen2-sim", 4_000_000);
        // Warm to the steady state once, so every measured pass sees a full cache.
        for p in &w.payloads {
            state.apply_all(&decode_batch(p).expect("valid").events);
        }
        g.throughput(Throughput::Elements(w.block_events));
        g.bench_function(format!("decode_hash_apply/{}", w.name), |b| {
            b.iter(|| {
                for p in &w.payloads {
                    let batch = decode_batch(black_box(p)).expect("valid");
                    black_box(state.apply_all(&batch.events));
                }
                // The summary drain runs every few ms in the agent; include it.
                black_box(state.take_delta());
            })
        });
        g.bench_function(format!("decode_only/{}", w.name), |b| {
            b.iter(|| {
                for p in &w.payloads {
                    black_box(decode_batch(black_box(p)).expect("valid"));
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, ingest);
criterion_main!(benches);
