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
