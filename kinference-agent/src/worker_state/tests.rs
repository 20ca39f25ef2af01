use std::collections::HashSet;

use super::*;
use crate::kv_events::EventBatch;
use crate::kv_events::decode_batch;
use crate::kv_events::encode::{EncodeOptions, EventFormat, encode_batch};

const MODEL: &str = "qwen2-sim";

fn stored(hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u32>, bs: u32) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.collect(),
        block_size: bs,
        medium: Medium::Gpu,
        lora: None,
        extra_keys: Vec::new(),
    }
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: Medium::Gpu,
    }
}

fn set(keys: Vec<BlockKey>) -> HashSet<BlockKey> {
    keys.into_iter().collect()
}

#[test]
fn keys_match_the_gateway_computation_across_a_parent_chain() {
    let h = KeyHasher::for_model(MODEL);
    let tokens: Vec<u32> = (0..64).collect();
    let expected = h.keys(None, &tokens, 16);

    let mut s = WorkerState::new(MODEL, 1000);
    // Two blocks first, then two more chained from the second engine hash.
    s.apply(&stored(&[11, 12], None, 0..32, 16));
    s.apply(&stored(&[13, 14], Some(12), 32..64, 16));
    assert_eq!(set(s.keys()), set(expected.clone()));
    assert_eq!(s.block_size(), Some(16));

    // Removal resolves through the engine-hash map.
    s.apply(&removed(&[14]));
    assert_eq!(set(s.keys()), set(expected[..3].to_vec()));
}

#[test]
fn unknown_parent_is_skipped_not_mis_keyed() {
    let mut s = WorkerState::new(MODEL, 1000);
    let stats = s.apply(&stored(&[21, 22], Some(999), 0..32, 16));
    assert_eq!(stats.unresolved_parents, 2);
    assert!(s.is_empty());
    let stats = s.apply(&removed(&[21]));
    assert_eq!(stats.unknown_removals, 1);
}

#[test]
fn deltas_are_net_changes() {
    let mut s = WorkerState::new(MODEL, 1000);
    s.apply(&stored(&[1, 2], None, 0..32, 16));
    let d = s.take_delta();
    assert_eq!(d.added.len(), 2);
    assert!(!d.cleared && d.removed.is_empty());

    // Added then removed inside one window: nothing to send.
    s.apply(&stored(&[3], Some(2), 32..48, 16));
    s.apply(&removed(&[3]));
    assert!(s.take_delta().is_empty());

    // Removed then re-added: nothing either.
    let k1 = s.keys();
    s.apply(&removed(&[2]));
    s.apply(&stored(&[2], Some(1), 16..32, 16));
    assert!(s.take_delta().is_empty());
    assert_eq!(set(s.keys()), set(k1));

    s.apply(&removed(&[1]));
    let d = s.take_delta();
    assert_eq!(d.removed.len(), 1);
    assert!(d.added.is_empty());
}

#[test]
fn clear_resets_and_the_next_delta_carries_the_full_set() {
    let mut s = WorkerState::new(MODEL, 1000);
    s.apply(&stored(&[1, 2], None, 0..32, 16));
    s.take_delta();
    s.apply(&KvEvent::AllBlocksCleared);
    s.apply(&stored(&[7], None, 100..116, 16));
    let d = s.take_delta();
    assert!(d.cleared);
    assert_eq!(d.added, s.keys());
    assert_eq!(s.len(), 1);
    assert!(s.take_delta().is_empty());
}

#[test]
fn a_restart_seen_in_the_metrics_clears_once_whichever_signal_comes_first() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    // The metrics come first: cleared, and the event sequence's restart is then the same one.
    let mut s = WorkerState::new(MODEL, 1000);
    s.apply(&stored(&[1, 2], None, 0..8, 4));
    assert!(s.restarted(now - 5.0));
    assert!(s.is_empty());
    assert!(s.take_delta().cleared);
    assert!(s.take_restart_note());
    assert!(!s.take_restart_note(), "consumed");
    // The same start time again clears nothing: the new engine's blocks stay.
    s.apply(&stored(&[3], None, 0..4, 4));
    assert!(!s.restarted(now - 5.0));
    assert_eq!(s.len(), 1);

    // The event sequence came first (cleared after the process started): nothing more to do.
    let mut s = WorkerState::new(MODEL, 1000);
    s.clear();
    s.apply(&stored(&[3], None, 0..4, 4));
    assert!(!s.restarted(now - 5.0));
    assert_eq!(s.len(), 1);
    assert!(!s.take_restart_note());
    // A later restart still clears.
    assert!(s.restarted(now + 60.0));
    assert!(s.is_empty());
}

#[test]
fn two_tiers_holding_one_block_keep_the_key_until_both_drop_it() {
    let mut s = WorkerState::new(MODEL, 1000);
    s.apply(&stored(&[5], None, 0..16, 16));
    s.apply(&KvEvent::BlockStored {
        block_hashes: vec![5],
        parent_block_hash: None,
        token_ids: (0..16).collect(),
        block_size: 16,
        medium: Medium::Cpu,
        lora: None,
        extra_keys: Vec::new(),
    });
    assert_eq!(s.len(), 1);
    s.apply(&removed(&[5]));
    assert_eq!(s.len(), 1, "the CPU tier still holds it");
    s.apply(&KvEvent::BlockRemoved {
        block_hashes: vec![5],
        medium: Medium::Cpu,
    });
    assert!(s.is_empty());
}

/// vLLM's native CPU offloading: a block copied to the CPU tier (`medium: "CPU"`), then evicted from
/// the GPU, then loaded back.
#[test]
fn a_block_offloaded_to_cpu_moves_from_keys_to_offloaded_keys_and_back() {
    let cpu_stored = KvEvent::BlockStored {
        block_hashes: vec![5],
        parent_block_hash: None,
        token_ids: (0..16).collect(),
        block_size: 16,
        medium: Medium::Cpu,
        lora: None,
        extra_keys: Vec::new(),
    };
    let mut s = WorkerState::new(MODEL, 1000);
    s.apply(&stored(&[5], None, 0..16, 16));
    let key = s.keys()[0];
    s.take_delta();

    s.apply(&cpu_stored);
    assert_eq!(s.tier(key), Some(Tier::Gpu), "the GPU copy still counts");
    assert!(s.take_delta().is_empty());

    s.apply(&removed(&[5]));
    assert_eq!(s.tier(key), Some(Tier::Offloaded));
    assert!(s.keys().is_empty());
    assert_eq!(s.offloaded_keys(), [key]);
    let d = s.take_delta();
    assert_eq!((d.removed, d.offloaded_added), (vec![key], vec![key]));
    assert!(d.added.is_empty() && d.offloaded_removed.is_empty());

    // Loaded back onto the GPU: one list again.
    s.apply(&stored(&[5], None, 0..16, 16));
    let d = s.take_delta();
    assert_eq!((d.added, d.offloaded_removed), (vec![key], vec![key]));
    assert!(d.removed.is_empty() && d.offloaded_added.is_empty());

    // A restart's full resend keeps the tiers apart.
    s.apply(&removed(&[5]));
    s.clear();
    s.apply(&cpu_stored);
    let d = s.take_delta();
    assert!(d.cleared && d.added.is_empty());
    assert_eq!(d.offloaded_added, [key]);
}

#[test]
fn cap_bounds_memory_and_counts_drops() {
    let mut s = WorkerState::new(MODEL, 3);
    let stats = s.apply(&stored(&[1, 2, 3, 4, 5], None, 0..80, 16));
    assert_eq!(s.len(), 3);
    assert_eq!(stats.dropped_over_cap, 2);
}

#[test]
fn maps_shrink_after_mass_eviction() {
    let mut s = WorkerState::new(MODEL, 1 << 20);
    let hashes: Vec<u64> = (1..=50_000).collect();
    s.apply(&stored(&hashes, None, 0..50_000 * 16, 16));
    let big = s.approx_bytes();
    s.apply(&removed(&hashes[..49_000]));
    s.take_delta();
    assert_eq!(s.len(), 1000);
    assert!(s.approx_bytes() < big / 4, "{} vs {big}", s.approx_bytes());
}

#[test]
fn real_capture_replays_to_the_expected_key_set() {
    // events-run2: a 10-block cache with evictions, a re-stored suffix with a parent, and a reset.
    let path = format!(
        "{}/../bench/fixtures/vllm-0.32/events-run2.jsonl",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).expect("fixture");
    let mut s = WorkerState::new("tiny", 1000);
    let mut engine_live: HashSet<u64> = HashSet::new();
    let mut total = ApplyStats::default();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("json");
        // Through the real wire bytes, not the JSON.
        let batch = json_batch(&v["batch"]);
        let bytes = encode_batch(&batch, EncodeOptions::default());
        let batch = decode_batch(&bytes).expect("decodes");
        for e in &batch.events {
            match e {
                KvEvent::BlockStored { block_hashes, .. } => engine_live.extend(block_hashes),
                KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.iter().for_each(|h| {
                    engine_live.remove(h);
                }),
                KvEvent::AllBlocksCleared => engine_live.clear(),
                KvEvent::Unknown => {}
            }
        }
        total.add(s.apply_all(&batch.events));
    }
    assert_eq!(total.unresolved_parents, 0);
    assert_eq!(total.unknown_removals, 0);
    // The capture's cache holds at most 10 blocks; our view holds exactly one key per live engine block.
    assert_eq!(s.len(), engine_live.len());
    assert!(s.len() <= 10);
    assert_eq!(s.block_size(), Some(32));
}

fn json_batch(v: &serde_json::Value) -> EventBatch {
    let a = v.as_array().expect("batch");
    let hashes = |v: &serde_json::Value| {
        v.as_array()
            .expect("h")
            .iter()
            .map(|h| h.as_u64().expect("u64"))
            .collect()
    };
    EventBatch {
        ts: a[0].as_f64().expect("ts"),
        events: a[1]
            .as_array()
            .expect("events")
            .iter()
            .map(|e| match e["type"].as_str().expect("type") {
                "BlockStored" => KvEvent::BlockStored {
                    block_hashes: hashes(&e["block_hashes"]),
                    parent_block_hash: e["parent_block_hash"].as_u64(),
                    token_ids: e["token_ids"]
                        .as_array()
                        .expect("t")
                        .iter()
                        .map(|t| t.as_u64().expect("t") as u32)
                        .collect(),
                    block_size: e["block_size"].as_u64().expect("bs") as u32,
                    medium: Medium::Gpu,
                    lora: None,
                    extra_keys: Vec::new(),
                },
                "BlockRemoved" => KvEvent::BlockRemoved {
                    block_hashes: hashes(&e["block_hashes"]),
                    medium: Medium::Gpu,
                },
                _ => KvEvent::AllBlocksCleared,
            })
            .collect(),
        data_parallel_rank: a[2].as_i64(),
    }
}

/// The real capture's first `BlockStored` (events-run1, tokens 1000..1095, block size 32) as vLLM
/// publishes it for a request to the adapter `sql-lora`: `lora_name` set and, on every block, the
/// adapter's name in `extra_keys` (`to_event_extra_keys`, vLLM 0.31+); `image` adds a multimodal
/// `(identifier, offset)` key to the second block. Through the real wire bytes in both event formats.
fn captured_lora_event(format: EventFormat, image: bool) -> KvEvent {
    let path = format!(
        "{}/../bench/fixtures/vllm-0.32/events-run1.jsonl",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).expect("fixture");
    let line: serde_json::Value =
        serde_json::from_str(text.lines().next().expect("a line")).expect("json");
    let mut batch = json_batch(&line["batch"]);
    let KvEvent::BlockStored {
        lora, extra_keys, ..
    } = &mut batch.events[0]
    else {
        panic!("the capture starts with a BlockStored");
    };
    let name = || ExtraKey::Str("sql-lora".into());
    *lora = Some(Lora::Name("sql-lora".into()));
    *extra_keys = vec![vec![name()], vec![name()], vec![name()]];
    if image {
        // msgpack ["img-7f3a", 12]
        let pair = [&[0x92, 0xa8][..], b"img-7f3a", &[0x0c]].concat();
        extra_keys[1].push(ExtraKey::Raw(pair));
    }
    let bytes = encode_batch(
        &batch,
        EncodeOptions {
            format,
            bin_hashes: false,
        },
    );
    let mut decoded = decode_batch(&bytes).expect("decodes");
    decoded.events.swap_remove(0)
}

fn capture_tokens() -> Vec<u32> {
    (1000..1096).collect()
}

#[test]
fn an_adapters_blocks_are_keyed_as_requests_for_the_adapter_key_them() {
    for format in [EventFormat::Map, EventFormat::Array] {
        let mut s = WorkerState::new("tiny", 1000);
        s.apply(&captured_lora_event(format, false));
        // The gateway hashes a request for `sql-lora` under that name.
        let adapter = KeyHasher::for_model("sql-lora").keys(None, &capture_tokens(), 32);
        let base = KeyHasher::for_model("tiny").keys(None, &capture_tokens(), 32);
        assert_eq!(set(s.keys()), set(adapter.clone()), "{format:?}");
        assert!(base.iter().all(|k| !s.contains(*k)), "not a base-model hit");
    }
}

#[test]
fn base_and_adapter_blocks_of_the_same_tokens_are_held_apart() {
    let mut s = WorkerState::new("tiny", 1000);
    let base = stored(&[1, 2, 3], None, 1000..1096, 32);
    s.apply(&base);
    s.apply(&captured_lora_event(EventFormat::Map, false));
    assert_eq!(s.len(), 6, "three base keys and three adapter keys");
    // The adapter's blocks evicted: the base model's stay.
    let KvEvent::BlockStored { block_hashes, .. } = captured_lora_event(EventFormat::Map, false)
    else {
        unreachable!()
    };
    s.apply(&KvEvent::BlockRemoved {
        block_hashes,
        medium: Medium::Gpu,
    });
    let base_keys = KeyHasher::for_model("tiny").keys(None, &capture_tokens(), 32);
    assert_eq!(set(s.keys()), set(base_keys));
}

#[test]
fn a_block_with_an_image_key_and_its_descendants_match_no_plain_prompt() {
    let mut s = WorkerState::new("tiny", 1000);
    s.apply(&captured_lora_event(EventFormat::Array, true));
    let adapter = KeyHasher::for_model("sql-lora").keys(None, &capture_tokens(), 32);
    assert!(
        s.contains(adapter[0]),
        "the first block has only the adapter"
    );
    assert!(
        !s.contains(adapter[1]),
        "the image's block is not a text hit"
    );
    assert!(!s.contains(adapter[2]), "nor is anything chained after it");
    assert_eq!(s.len(), 3);
}

#[test]
fn an_adapter_known_only_by_number_gets_keys_no_request_produces() {
    let mut s = WorkerState::new("tiny", 1000);
    let mut e = stored(&[1, 2, 3], None, 1000..1096, 32);
    if let KvEvent::BlockStored { lora, .. } = &mut e {
        *lora = Some(Lora::Id(2));
    }
    s.apply(&e);
    assert_eq!(s.len(), 3);
    let base = KeyHasher::for_model("tiny").keys(None, &capture_tokens(), 32);
    assert!(base.iter().all(|k| !s.contains(*k)));
}

/// The events of a real vLLM 0.32 worker for one 96-token prompt sent under the salts
/// `kinference-salt-a`, `kinference-salt-b` and none (`bench/real-vllm/salt_capture.py`), each
/// through the wire bytes and the decoder, with the salt of each (`None`: unsalted).
fn captured_salted_events() -> Vec<(Option<String>, KvEvent)> {
    let path = format!(
        "{}/../bench/fixtures/vllm-0.32/salted-events.jsonl",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).expect("fixture");
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let line: serde_json::Value = serde_json::from_str(line).expect("json");
        let mut batch = json_batch(&line["batch"]);
        let raw = line["batch"][1].as_array().expect("events");
        let mut salt = None;
        for (event, json) in batch.events.iter_mut().zip(raw) {
            if let KvEvent::BlockStored { extra_keys, .. } = event {
                *extra_keys = json["extra_keys"]
                    .as_array()
                    .expect("vLLM 0.32 sends extra_keys")
                    .iter()
                    .map(|keys| {
                        keys.as_array()
                            .into_iter()
                            .flatten()
                            .map(|k| ExtraKey::Str(k.as_str().expect("a salt").to_string()))
                            .collect()
                    })
                    .collect();
                salt = extra_keys.first().and_then(|k| match k.first() {
                    Some(ExtraKey::Str(s)) => Some(s.clone()),
                    _ => None,
                });
            }
        }
        let bytes = encode_batch(
            &batch,
            EncodeOptions {
                format: EventFormat::Map,
                bin_hashes: false,
            },
        );
        let mut decoded = decode_batch(&bytes).expect("decodes");
        out.push((salt, decoded.events.swap_remove(0)));
    }
    out
}

#[test]
fn salted_blocks_of_real_vllm_key_as_the_gateway_keys_salted_prompts() {
    let captured = captured_salted_events();
    let salts: Vec<Option<&str>> = captured.iter().map(|(s, _)| s.as_deref()).collect();
    assert_eq!(
        salts,
        [Some("kinference-salt-a"), Some("kinference-salt-b"), None]
    );
    let h = KeyHasher::for_model("tiny");
    let tokens: Vec<u32> = (3000..3096).collect();
    for (salt, event) in &captured {
        let mut s = WorkerState::new("tiny", 1000);
        s.apply(event);
        assert_eq!(s.len(), 3);
        for other in &salts {
            let keys = h.salted_keys(*other, &tokens, 32);
            let held = keys.iter().filter(|k| s.contains(**k)).count();
            if *other == salt.as_deref() {
                assert_eq!(held, 3, "{salt:?}: the gateway's keys are the agent's");
            } else {
                assert_eq!(held, 0, "{salt:?} holds nothing of {other:?}'s prompt");
            }
        }
    }
}
