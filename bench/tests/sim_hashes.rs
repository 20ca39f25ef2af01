//! The simulator's block hashing and event encoding reproduce a real vLLM 0.32 run exactly:
//! `bench/fixtures/vllm-0.32/events-run2.jsonl` (default sha256/pickle hashing, no PYTHONHASHSEED,
//! block size 32, a 10-block cache so evictions and re-stores with a parent appear).

use std::collections::HashMap;

use kinference_bench::sim::cache::{
    BlockDigest, KvCacheEvent, event_hash, hash_blocks, hash_blocks_salted,
};
use kinference_bench::sim::kv_events::{EventFormat, encode_batch};
use serde_json::Value;

const RUN2: &str = include_str!("../fixtures/vllm-0.32/events-run2.jsonl");
/// One prompt under two cache salts and none (`bench/real-vllm/salt_capture.py`, same settings).
const SALTED: &str = include_str!("../fixtures/vllm-0.32/salted-events.jsonl");

fn lines() -> Vec<Value> {
    RUN2.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("fixture line is JSON"))
        .collect()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("u64"))
        .collect()
}

fn to_event(e: &Value) -> KvCacheEvent {
    match e["type"].as_str().expect("type") {
        "BlockStored" => KvCacheEvent::BlockStored {
            block_hashes: u64s(&e["block_hashes"]),
            parent_block_hash: e["parent_block_hash"].as_u64(),
            token_ids: u64s(&e["token_ids"])
                .into_iter()
                .map(|t| t as u32)
                .collect(),
            block_size: e["block_size"].as_u64().expect("block_size") as usize,
            // The captures are of base-model requests.
            lora: None,
            salt: None,
        },
        "BlockRemoved" => KvCacheEvent::BlockRemoved {
            block_hashes: u64s(&e["block_hashes"]),
        },
        "AllBlocksCleared" => KvCacheEvent::AllBlocksCleared,
        other => panic!("unexpected event type {other}"),
    }
}

#[test]
fn tokens_2000_to_2095_give_the_live_hashes() {
    let tokens: Vec<u32> = (2000..2096).collect();
    let got: Vec<u64> = hash_blocks(None, &tokens, 32)
        .iter()
        .map(event_hash)
        .collect();
    assert_eq!(
        got,
        vec![
            5664945049465125586,
            9368186330673276797,
            2774320024382329566
        ]
    );
}

#[test]
fn every_block_stored_of_the_live_run_is_reproduced() {
    // Full digests by their published low 64 bits, learned as the chain goes (the parent of a
    // re-stored suffix is a block announced earlier).
    let mut digests: HashMap<u64, BlockDigest> = HashMap::new();
    let mut stored = 0;
    let mut with_parent = 0;
    for line in lines() {
        for e in line["batch"][1].as_array().expect("events") {
            if e["type"] != "BlockStored" {
                continue;
            }
            let bs = e["block_size"].as_u64().expect("block_size") as usize;
            let tokens: Vec<u32> = u64s(&e["token_ids"])
                .into_iter()
                .map(|t| t as u32)
                .collect();
            let parent = e["parent_block_hash"].as_u64().map(|p| {
                with_parent += 1;
                *digests
                    .get(&p)
                    .unwrap_or_else(|| panic!("parent {p} was never stored before"))
            });
            let ours = hash_blocks(parent.as_ref(), &tokens, bs);
            let got: Vec<u64> = ours.iter().map(event_hash).collect();
            assert_eq!(got, u64s(&e["block_hashes"]), "seq {}", line["seq"]);
            for d in ours {
                digests.insert(event_hash(&d), d);
            }
            stored += 1;
        }
    }
    assert!(stored >= 20, "only {stored} BlockStored events checked");
    assert!(with_parent >= 5, "only {with_parent} chained from a parent");
}

#[test]
fn batches_encode_to_the_live_payload_layout() {
    for line in lines() {
        let batch = &line["batch"];
        let events: Vec<KvCacheEvent> = batch[1]
            .as_array()
            .expect("events")
            .iter()
            .map(to_event)
            .collect();
        let ts = batch[0].as_f64().expect("ts");
        let rank = batch[2].as_i64().expect("rank");
        let payload = encode_batch(ts, &events, rank, EventFormat::Map);
        assert_eq!(
            payload.len() as u64,
            line["payload_len"].as_u64().expect("len"),
            "seq {}",
            line["seq"]
        );
        let head: String = payload[..16].iter().map(|b| format!("{b:02x}")).collect();
        let live = line["payload_head_hex"].as_str().expect("head");
        // Bytes 2..10 are the float64 timestamp, whose JSON round trip may differ in the last bit.
        assert_eq!(&head[..4], &live[..4], "seq {}", line["seq"]);
        assert_eq!(&head[20..], &live[20..], "seq {}", line["seq"]);
    }
}

#[test]
fn salted_prompts_give_the_live_hashes_and_extra_keys() {
    let tokens: Vec<u32> = (3000..3096).collect();
    let mut salts = Vec::new();
    for line in SALTED.lines().filter(|l| !l.trim().is_empty()) {
        let line: Value = serde_json::from_str(line).expect("fixture line is JSON");
        let batch = &line["batch"];
        let e = &batch[1][0];
        assert_eq!(
            u64s(&e["token_ids"]),
            tokens.iter().map(|&t| u64::from(t)).collect::<Vec<_>>()
        );
        let salt = e["extra_keys"][0][0].as_str().map(str::to_string);
        let got: Vec<u64> = hash_blocks_salted(None, &tokens, 32, salt.as_deref())
            .iter()
            .map(event_hash)
            .collect();
        assert_eq!(got, u64s(&e["block_hashes"]), "salt {salt:?}");
        // The event the simulator publishes for it: same hashes, the salt as block 0's extra key.
        let event = KvCacheEvent::BlockStored {
            block_hashes: got,
            parent_block_hash: None,
            token_ids: tokens.clone(),
            block_size: 32,
            lora: None,
            salt: salt.as_deref().map(std::sync::Arc::from),
        };
        let ts = batch[0].as_f64().expect("ts");
        let payload = encode_batch(
            ts,
            &[event],
            batch[2].as_i64().expect("rank"),
            EventFormat::Map,
        );
        if salt.is_some() {
            // An unsalted batch from 0.32 lists a null per block; the simulator sends none then.
            assert_eq!(
                payload.len() as u64,
                line["payload_len"].as_u64().expect("len"),
                "salt {salt:?}"
            );
        }
        salts.push(salt);
    }
    assert_eq!(
        salts,
        [
            Some("kinference-salt-a".into()),
            Some("kinference-salt-b".into()),
            None
        ]
    );
    assert_ne!(
        hash_blocks_salted(None, &tokens, 32, Some("a"))[1],
        hash_blocks(None, &tokens, 32)[1],
        "the first block's salt reaches the next through the chain"
    );
}
