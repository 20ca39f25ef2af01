use super::*;

fn b(x: &[u8]) -> Bytes {
    Bytes::copy_from_slice(x)
}

#[test]
fn replay_replies_of_both_vllm_shapes_parse() {
    let seq = 7u64.to_be_bytes();
    let payload = b(b"\x93\x00\x90\xc0");
    // <= 0.25 as a DEALER sees it: ["", seq, payload], end ["", ff*8, ""].
    let old = [b(b""), b(&seq), payload.clone()];
    assert_eq!(
        parse_replay_reply(&old).ok(),
        Some(ReplayReply::Batch {
            seq: 7,
            payload: &payload
        })
    );
    assert_eq!(
        parse_replay_reply(&[b(b""), b(&END_SEQ), b(b"")]).ok(),
        Some(ReplayReply::End)
    );
    // >= 0.26: ["", topic, seq, payload], end ["", "", ff*8, ""]; also with the default empty topic.
    let new = [b(b""), b(b"kv@w1@m"), b(&seq), payload.clone()];
    assert_eq!(
        parse_replay_reply(&new).ok(),
        Some(ReplayReply::Batch {
            seq: 7,
            payload: &payload
        })
    );
    let new_empty_topic = [b(b""), b(b""), b(&seq), payload.clone()];
    assert_eq!(
        parse_replay_reply(&new_empty_topic).ok(),
        Some(ReplayReply::Batch {
            seq: 7,
            payload: &payload
        })
    );
    assert_eq!(
        parse_replay_reply(&[b(b""), b(b""), b(&END_SEQ), b(b"")]).ok(),
        Some(ReplayReply::End)
    );
    // Garbage is an error.
    assert!(parse_replay_reply(&[b(b""), b(b"short"), b(b"x")]).is_err());
    assert!(parse_replay_reply(&[b(b"x")]).is_err());
}

#[test]
fn tracker_tells_gaps_duplicates_and_restarts_apart() {
    let mut t = SeqTracker::default();
    assert_eq!(t.classify(0), Verdict::Apply);
    assert_eq!(t.classify(3), Verdict::Gap { from: 0 });
    t.applied_live(0);
    t.applied_live(1);
    assert_eq!(t.classify(2), Verdict::Apply);
    assert_eq!(t.classify(5), Verdict::Gap { from: 2 });
    assert_eq!(t.classify(0), Verdict::Restart);
    assert_eq!(t.classify(1), Verdict::Restart);

    // After a replay from 2 that applied up to 9, live 2..=9 are duplicates, 10 is next, 1 is a restart.
    t.last = Some(9);
    t.dup_floor = Some(2);
    assert_eq!(t.classify(4), Verdict::Duplicate);
    assert_eq!(t.classify(10), Verdict::Apply);
    assert_eq!(t.classify(1), Verdict::Restart);
    t.caught_up(8);
    assert_eq!(
        t.classify(3),
        Verdict::Duplicate,
        "live has not reached the replay's end yet"
    );
    t.caught_up(9);
    assert_eq!(
        t.classify(3),
        Verdict::Restart,
        "live reached the replay's end"
    );
    t.dup_floor = Some(2);
    t.applied_live(10);
    assert_eq!(
        t.classify(4),
        Verdict::Restart,
        "once live is past the replay, going back is a restart"
    );
}

/// A batch of one stored block of `tokens`, stamped with `rank` as vLLM's publisher stamps its own.
fn stored_batch(hash: u64, tokens: u32, rank: Option<i64>) -> Vec<u8> {
    use crate::kv_events::encode::{EncodeOptions, encode_batch};
    use crate::kv_events::{EventBatch, KvEvent, Medium};
    let batch = EventBatch {
        ts: 1.0,
        events: vec![KvEvent::BlockStored {
            block_hashes: vec![hash],
            parent_block_hash: None,
            token_ids: (tokens..tokens + 16).collect(),
            block_size: 16,
            medium: Medium::Gpu,
            lora: None,
            extra_keys: Vec::new(),
        }],
        data_parallel_rank: rank,
    };
    encode_batch(&batch, EncodeOptions::default())
}

fn ingest(data_parallel_size: Option<u32>) -> Ingest {
    let registry = Arc::new(Registry::default());
    let metrics = AgentMetrics::default();
    let spec = WorkerSpec {
        url: "http://w".into(),
        model: "m".into(),
        kv_events_endpoint: None,
        kv_events_bind: true,
        kv_replay_endpoint: None,
        kv_topic: None,
        role: None,
        data_parallel_size,
    };
    Ingest {
        slot: registry.upsert(spec, 1000),
        rank: 0,
        m: WorkerMetrics::new(&metrics, "http://w"),
        registry,
        cap_warned: false,
    }
}

#[test]
fn blocks_of_two_ranks_stay_apart() {
    let mut ingest = ingest(Some(2));
    // The same tokens on both ranks, and one block of rank 1 alone; all through one socket.
    ingest.apply_payload(0, &stored_batch(1, 0, Some(0)));
    ingest.apply_payload(1, &stored_batch(2, 0, Some(1)));
    ingest.apply_payload(2, &stored_batch(3, 100, Some(1)));
    let rank0 = ingest.slot.ranks()[0].lock().keys();
    let rank1 = ingest.slot.ranks()[1].lock().keys();
    assert_eq!(rank0.len(), 1, "rank 0 holds its block only");
    assert_eq!(rank1.len(), 2, "rank 1 holds its two blocks");
    assert!(
        rank1.contains(&rank0[0]),
        "the shared prefix is on both ranks"
    );
    // A batch naming a rank the worker does not have stays with the socket's rank.
    ingest.apply_payload(3, &stored_batch(4, 200, Some(7)));
    assert_eq!(ingest.slot.ranks()[0].lock().len(), 2);
}

#[test]
fn a_rank_less_worker_keeps_one_cache_whatever_the_batches_say() {
    let mut ingest = ingest(None);
    ingest.apply_payload(0, &stored_batch(1, 0, Some(0)));
    ingest.apply_payload(1, &stored_batch(2, 100, Some(1)));
    assert_eq!(ingest.slot.ranks().len(), 1);
    assert_eq!(ingest.slot.kv().lock().len(), 2);
}

#[test]
fn rank_endpoints_shift_as_vllm_shifts_them() {
    assert_eq!(
        WorkerSpec::rank_endpoint("tcp://127.0.0.1:5557", 0),
        "tcp://127.0.0.1:5557"
    );
    assert_eq!(
        WorkerSpec::rank_endpoint("tcp://127.0.0.1:5557", 2),
        "tcp://127.0.0.1:5559"
    );
    assert_eq!(
        WorkerSpec::rank_endpoint("tcp://*:0", 1),
        "tcp://*:0",
        "an ephemeral port is left alone"
    );
    assert_eq!(
        WorkerSpec::rank_endpoint("ipc:///tmp/kv", 1),
        "ipc:///tmp/kv_dp1"
    );
}
