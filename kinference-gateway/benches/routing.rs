//! Routing micro-benchmarks (issue 3, item 4):
//! - the routing decision for a 2,000-block prompt over 100 workers, tokenization excluded
//!   (target p99 < 50 us); criterion reports the mean, and a timed pass prints p50/p99, then one
//!   with the CPU's caches emptied before each decision;
//! - tokenization + block keys of an ~8k-token chat prompt (target < 2 ms), never seen (`cold`) and
//!   with its earlier messages seen before (`warm`: the tokenizer's segment cache);
//! - KV index memory per (block, worker), measured by a counting allocator (target <= 16 bytes);
//! - KV index insert rate (what applying agent deltas costs).
//!
//! Run: `cargo bench -p kinference-gateway --bench routing`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use kinference_api::KeyHasher;
use kinference_api::summary::{self as pb, Summary, summary};
use kinference_api::tokenize::ModelTokenizer;
use kinference_gateway::routing::kv_index::{KvIndex, WorkerId};
use kinference_gateway::routing::tokenize::PromptTokens;
use kinference_gateway::routing::{
    ModelConfig, Prompt, RouteRequest, Router, RoutingConfig, RoutingMode, RoutingTuning,
    WorkerConfig,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Counts live heap bytes, so index memory is measured rather than estimated.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: delegates every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const WORKERS: usize = 100;
const BLOCKS_PER_WORKER: usize = 20_000;
const PROMPT_BLOCKS: usize = 2_000;
const BLOCK: usize = 16;

fn tokenizer_dir() -> PathBuf {
    // cargo runs benchmarks in the package's directory; a relative override is meant from the
    // workspace root, where the command is typed.
    let root = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let dir = std::env::var_os("KINFERENCE_TOKENIZER_DIR")
        .map(|d| root.join(d))
        .unwrap_or_else(|| root.join(".assets/qwen2"));
    assert!(
        dir.join("tokenizer.json").exists(),
        "no tokenizer at {}: run `cargo xtask setup`",
        dir.display()
    );
    dir
}

/// 100 workers with 20k blocks each (2M pairs); the prompt's first 1,500 blocks on worker 7, its
/// first 500 on workers 10-19, nothing of it elsewhere.
fn loaded_router(rng: &mut StdRng) -> (Router, Vec<u32>) {
    let config = RoutingConfig {
        workers: (0..WORKERS)
            .map(|i| WorkerConfig {
                url: format!("http://10.0.{}.{}:8000", i / 250, i % 250),
                model: "m".into(),
                role: Default::default(),
            })
            .collect(),
        models: vec![ModelConfig {
            name: "m".into(),
            tokenizer_dir: None,
            serves_messages: false,
            profile: None,
        }],
        agents: vec!["http://agent.invalid:7070".into()],
        mode: RoutingMode::Kinference,
    };
    let tuning = RoutingTuning {
        connect_agents: false,
        ..RoutingTuning::default()
    };
    let router = Router::with_tuning(config, tuning).expect("router");
    let tokens: Vec<u32> = (0..PROMPT_BLOCKS * BLOCK)
        .map(|_| rng.random_range(0..150_000))
        .collect();
    let keys = KeyHasher::for_model("m").keys(None, &tokens, BLOCK);
    let workers = (0..WORKERS)
        .map(|i| {
            let mut k: Vec<u64> = (0..BLOCKS_PER_WORKER).map(|_| rng.random()).collect();
            if i == 7 {
                k.extend_from_slice(&keys[..1_500]);
            } else if (10..20).contains(&i) {
                k.extend_from_slice(&keys[..500]);
            }
            pb::WorkerState {
                worker_id: format!("http://10.0.{}.{}:8000", i / 250, i % 250),
                model: "m".into(),
                block_size: BLOCK as u32,
                keys: k,
                role: String::new(),
                offloaded_keys: Vec::new(),
                data_parallel_rank: None,
                load: Some(pb::WorkerLoad {
                    running: rng.random_range(0..8),
                    waiting: 0,
                    metrics_ok: true,
                    ..Default::default()
                }),
            }
        })
        .collect();
    router.apply_agent_summary(
        0,
        Summary {
            kind: Some(summary::Kind::Snapshot(pb::Snapshot {
                node: "bench".into(),
                epoch: 1,
                workers,
                node_state: None,
            })),
        },
    );
    (router, tokens)
}

fn decision(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(1);
    let (router, tokens) = loaded_router(&mut rng);
    let first = router.pick_tokens("m", &tokens, false).expect("pick");
    assert_eq!(
        first.worker, "http://10.0.0.7:8000",
        "the prefix holder wins"
    );
    drop(first);
    c.bench_function("routing_decision_2000_blocks_100_workers", |b| {
        b.iter(|| {
            let d = router
                .pick_tokens("m", black_box(&tokens), false)
                .expect("pick");
            black_box(&d.worker);
        })
    });
    // The decision includes computing the prompt's 2,000 block keys; this is that part alone.
    let hasher = KeyHasher::for_model("m");
    c.bench_function("block_keys_2000_blocks", |b| {
        b.iter(|| black_box(hasher.keys(None, black_box(&tokens), BLOCK)))
    });
    // Tail latency: criterion reports means, so time single decisions too, each after `prepare(i)`.
    let time_decisions = |n: usize, prepare: &mut dyn FnMut(usize)| -> Vec<Duration> {
        (0..n)
            .map(|i| {
                prepare(i);
                let t = Instant::now();
                let d = router.pick_tokens("m", &tokens, false).expect("pick");
                let e = t.elapsed();
                drop(d);
                e
            })
            .collect()
    };
    let mut samples = time_decisions(20_000, &mut |_| {});
    print_percentiles(
        "routing decision (2,000 blocks, 100 workers, 2M index pairs)",
        &mut samples,
    );
    // The worst case of a running gateway: between two decisions it parses, tokenizes and relays
    // other requests, which can push the workers' state out of the CPU's caches. Writing through a
    // buffer larger than the last-level cache before each decision puts all of it out.
    let mut scratch = vec![0u8; COLD_SCRATCH_BYTES];
    let mut samples = time_decisions(2_000, &mut |i| {
        for line in scratch.chunks_mut(64) {
            line[0] = line[0].wrapping_add(i as u8);
        }
        black_box(&scratch);
    });
    print_percentiles(
        "routing decision, caches cold (same router and prompt)",
        &mut samples,
    );
}

/// A pick within a policy pool's member list (its workers' URLs, as the policy stage hands them
/// over) against a pick among every worker of the model: what finding the pool's workers costs.
fn pool_pick(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(1);
    let (router, tokens) = loaded_router(&mut rng);
    let members: Vec<String> = router.workers().into_iter().map(|w| w.url).collect();
    let known = PromptTokens::default();
    known.set("m", Some(tokens.into()));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let pick = |within: Option<&[String]>| {
        let req = RouteRequest {
            model: "m",
            prompt: Prompt::Text(""),
            debug: false,
            tokens: Some(&known),
            salt: None,
            session: None,
            answers: Default::default(),
        };
        let d = runtime
            .block_on(router.pick_except(req, within, &[]))
            .expect("pick");
        black_box(&d.worker);
    };
    let pool: kinference_crds::InferencePoolSpec = serde_json::from_value(serde_json::json!({
        "models": ["m"],
        "endpoints": members.iter().map(|u| serde_json::json!({"url": u})).collect::<Vec<_>>(),
        "gpuClass": "l40s",
        "prices": {"cachedInputPerMillion": 0.0, "uncachedInputPerMillion": 0.0, "outputPerMillion": 0.0},
    }))
    .expect("pool");
    c.bench_function("pool_members_100_endpoints", |b| {
        b.iter(|| {
            black_box(kinference_gateway::policy::pool_members::members(
                &pool, None,
            ))
        })
    });
    c.bench_function("pick_among_every_worker_100", |b| b.iter(|| pick(None)));
    c.bench_function("pick_within_pool_of_100", |b| {
        b.iter(|| pick(Some(&members)))
    });
}

/// Bytes written through before each cold decision: twice a 32 MiB last-level cache.
const COLD_SCRATCH_BYTES: usize = 64 << 20;

fn print_percentiles(what: &str, samples: &mut [Duration]) {
    samples.sort_unstable();
    let pct = |p: f64| samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)];
    println!(
        "{what}: p50 {:?}  p90 {:?}  p99 {:?}  p99.9 {:?}  max {:?}",
        pct(0.50),
        pct(0.90),
        pct(0.99),
        pct(0.999),
        samples[samples.len() - 1]
    );
}

/// An ~8k-token chat; `tag` makes every message's text unique (nothing in the segment cache).
fn chat_8k(tag: u64) -> serde_json::Value {
    let para = "The shipment manifest lists pallets, their weights, destinations and customs codes; \
                each entry must be checked against the carrier's tariff before dispatch. ";
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": format!("[{tag}] {}", para.repeat(120))}),
    ];
    for turn in 0..8 {
        messages.push(serde_json::json!({"role": "user", "content": format!("[{tag}] Turn {turn}: {}", para.repeat(20))}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("[{tag}] {}", para.repeat(10))}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "Summarize the open issues."}));
    serde_json::Value::Array(messages)
}

/// Tokenization + keys of an ~8k-token chat: `cold`, a prompt never seen (every message new); `warm`,
/// the same conversation again with a new last question (its earlier messages come from the
/// tokenizer's segment cache, as a shared system prompt or a multi-turn history does).
fn tokenize_keys(c: &mut Criterion) {
    let tok = ModelTokenizer::from_dir(tokenizer_dir()).expect("tokenizer");
    let hasher = KeyHasher::for_model("m");
    let n = tok.encode_chat(&chat_8k(0)).expect("encode").len();
    println!("chat prompt: {n} tokens");
    let mut tag = 1u64;
    c.bench_function("tokenize_and_keys_8k_chat_cold", |b| {
        b.iter_batched(
            || {
                tag += 1;
                chat_8k(tag)
            },
            |messages| {
                let ids = tok.encode_chat(black_box(&messages)).expect("encode");
                black_box(hasher.keys(None, &ids, BLOCK));
            },
            criterion::BatchSize::SmallInput,
        )
    });
    let mut messages = chat_8k(0);
    let mut question = 0u64;
    c.bench_function("tokenize_and_keys_8k_chat_warm", |b| {
        b.iter_batched(
            || {
                question += 1;
                let last = messages
                    .as_array_mut()
                    .and_then(|m| m.last_mut())
                    .expect("messages");
                last["content"] = format!("Question {question}: summarize the open issues.").into();
                messages.clone()
            },
            |messages| {
                let ids = tok.encode_chat(black_box(&messages)).expect("encode");
                black_box(hasher.keys(None, &ids, BLOCK));
            },
            criterion::BatchSize::SmallInput,
        )
    });
}

fn index_memory(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(2);
    let measure = |name: &str, shared_fraction: f64, rng: &mut StdRng| {
        let before = LIVE.load(Ordering::Relaxed);
        let mut idx = KvIndex::new(usize::MAX);
        let shared: Vec<u64> = (0..(BLOCKS_PER_WORKER as f64 * shared_fraction) as usize)
            .map(|_| rng.random())
            .collect();
        for w in 0..WORKERS as WorkerId {
            for k in &shared {
                idx.insert(*k, w);
            }
            for _ in shared.len()..BLOCKS_PER_WORKER {
                idx.insert(rng.random(), w);
            }
        }
        let bytes = LIVE.load(Ordering::Relaxed) - before;
        println!(
            "index memory, {name}: {} pairs, {} keys, {:.1} bytes per (block, worker) measured \
             ({:.1} by the index's own estimate)",
            idx.pairs(),
            idx.keys(),
            bytes as f64 / idx.pairs() as f64,
            idx.memory_bytes() as f64 / idx.pairs() as f64
        );
        idx
    };
    drop(measure("every block on one worker", 0.0, &mut rng));
    drop(measure(
        "10% of each worker's blocks shared by all",
        0.1,
        &mut rng,
    ));
    drop(measure("half shared by all", 0.5, &mut rng));

    let keys: Vec<u64> = (0..1_000_000).map(|_| rng.random()).collect();
    c.bench_function("index_insert_1m_pairs_8_workers", |b| {
        b.iter(|| {
            let mut idx = KvIndex::new(usize::MAX);
            for (i, k) in keys.iter().enumerate() {
                idx.insert(*k, (i % 8) as WorkerId);
            }
            black_box(idx.pairs())
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(5));
    targets = decision, pool_pick, tokenize_keys, index_memory
}
criterion_main!(benches);
