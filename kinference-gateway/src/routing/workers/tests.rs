use std::time::{Duration, Instant};

use super::*;

#[test]
fn the_ledger_as_a_view_saw_it() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut log = LedgerLog::default();
    // Three requests: A 0-40 ms (first token at 20), B 10 ms-, C 60 ms-; now: B and C in flight, C awaiting.
    log.started(at(0));
    log.started(at(10));
    log.first_token(at(20));
    log.first_token(at(30));
    log.ended(at(40));
    log.started(at(60));
    let (in_flight, awaiting) = (2, 1);

    // A view taken at 50 ms: B in flight, nothing awaiting; A ended 10 ms before it.
    assert_eq!(
        log.seen(in_flight, awaiting, at(50), Duration::ZERO),
        Seen {
            in_flight: 1,
            waiting: 0
        }
    );
    // The same view from the kernel, where a response lingers 20 ms after its end: A still counts.
    assert_eq!(
        log.seen(in_flight, awaiting, at(50), Duration::from_millis(20)),
        Seen {
            in_flight: 2,
            waiting: 0
        }
    );
    // A view taken at 15 ms: A and B in flight, both awaiting.
    assert_eq!(
        log.seen(in_flight, awaiting, at(15), Duration::ZERO),
        Seen {
            in_flight: 2,
            waiting: 2
        }
    );
    // A view taken now is the ledger itself.
    assert_eq!(
        log.seen(in_flight, awaiting, at(70), Duration::ZERO),
        Seen {
            in_flight: 2,
            waiting: 1
        }
    );
}

#[test]
fn counting_the_later_entries_agrees_with_a_full_bisection() {
    let t0 = Instant::now();
    let at = |us: u64| t0 + Duration::from_micros(us);
    let mut rng = rand::rng();
    for len in [0usize, 1, 2, 3, 7, 64, 1000, 5000] {
        // A list that wraps around its ring buffer, as a long-running one does: its head is moved
        // half-way in before it is filled.
        let mut list: VecDeque<Instant> = VecDeque::with_capacity(len);
        for _ in 0..len / 2 {
            list.push_back(t0);
        }
        while list.pop_front().is_some() {}
        // Sorted, with runs of equal stamps (requests stamped in the same microsecond).
        let mut now = 0u64;
        for _ in 0..len {
            now += rand::Rng::random_range(&mut rng, 0..3u64);
            list.push_back(at(now));
        }
        assert!(
            len < 2 || !list.as_slices().1.is_empty(),
            "len {len}: no wrap"
        );
        for probe in 0..=now + 2 {
            let t = at(probe);
            let expected = list.len() - list.partition_point(|x| *x <= t);
            assert_eq!(
                LedgerLog::after(&list, t),
                expected,
                "len {len}, t +{probe} us"
            );
        }
    }
}

#[test]
fn the_log_stays_bounded() {
    let t0 = Instant::now();
    let mut log = LedgerLog::default();
    for i in 0..(LedgerLog::CAP as u64 + 100) {
        log.started(t0 + Duration::from_micros(i));
    }
    assert_eq!(log.starts.len(), LedgerLog::CAP);
    // An entry past the horizon drops everything older than it.
    log.started(t0 + LedgerLog::HORIZON + Duration::from_secs(1));
    assert_eq!(log.starts.len(), 1);
}

#[test]
fn the_backlog_drains_first_come_first_served() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut b = Backlog::default();
    assert_eq!(b.tokens(at(0)), 0.0);
    // 1,000 tokens/s. A 1,000-token prompt, then 400 ms later a 500-token one.
    let first = b.push(1_000.0, at(0), 1e-3);
    assert!((b.tokens(at(400)) - 600.0).abs() < 1e-6);
    let second = b.push(500.0, at(400), 1e-3);
    assert!((b.tokens(at(400)) - 1_100.0).abs() < 1e-6);
    // The first prompt's first token came early (the worker is faster than the rate): only the second
    // one's tokens are left, and they drain from there.
    b.reached(first, at(500));
    assert!((b.tokens(at(500)) - 500.0).abs() < 1e-6);
    assert!((b.tokens(at(700)) - 300.0).abs() < 1e-6);
    // A late first token never moves the queue backwards, and the queue never goes below empty.
    b.reached(first, at(800));
    assert!((b.tokens(at(800)) - 200.0).abs() < 1e-6);
    assert_eq!(b.tokens(at(5_000)), 0.0);
    b.reached(second, at(900));
    assert_eq!(b.tokens(at(900)), 0.0);
    // An idle spell does not bank capacity: work enqueued after it starts from its full size.
    b.push(300.0, at(10_000), 1e-3);
    assert!((b.tokens(at(10_000)) - 300.0).abs() < 1e-6);
}

#[test]
fn prompts_in_flight_share_their_leading_blocks_and_leave_when_their_request_ends() {
    let mut prompts = InFlightPrompts::default();
    let now = Instant::now();
    let a = prompts.add(vec![1, 2, 3, 4].into(), now, 0.1);
    let b = prompts.add(vec![1, 2, 9].into(), now, 0.1);
    assert_eq!(prompts.len(), 2);
    assert_eq!(
        prompts.shared_run(&[1, 2, 3, 7]),
        3,
        "the longest shared run"
    );
    assert_eq!(prompts.shared_run(&[1, 2, 9, 9]), 3);
    assert_eq!(prompts.shared_run(&[5, 2, 3]), 0, "leading blocks only");
    prompts.remove(a);
    assert_eq!(prompts.shared_run(&[1, 2, 3, 7]), 2);
    prompts.remove(a);
    prompts.remove(b);
    assert!(prompts.is_empty());
    assert_eq!(prompts.shared_run(&[1, 2, 3]), 0);
}

#[test]
fn a_worker_is_late_once_a_request_waits_past_twice_its_estimate() {
    let mut prompts = InFlightPrompts::default();
    let sent = Instant::now();
    let at = |s: f64| sent + Duration::from_secs_f64(s);
    assert_eq!(prompts.lateness(at(10.0)), 1.0, "nothing in flight");
    let slow = prompts.add(vec![1].into(), sent, 0.5);
    let _fast = prompts.add(vec![2].into(), sent, 2.0);
    assert_eq!(prompts.lateness(at(0.9)), 1.0, "within twice its estimate");
    // 6 s against an estimate of 0.5 s: 6 times twice the estimate.
    assert!((prompts.lateness(at(6.0)) - 6.0).abs() < 1e-9);
    // Its first token came: the other one (estimated 2 s) is not late at 3 s, and at 6 s (three times its
    // estimate) it is 1.5 times past the allowance.
    prompts.first_token(slow);
    assert_eq!(prompts.lateness(at(3.0)), 1.0);
    assert!((prompts.lateness(at(6.0)) - 1.5).abs() < 1e-9);
    // A tiny estimate counts as 50 ms: noise is not lateness.
    let _tiny = prompts.add(vec![3].into(), sent, 0.001);
    assert_eq!(prompts.lateness(at(0.04)), 1.0);
    assert!((prompts.lateness(at(0.2)) - 4.0).abs() < 1e-9);
}
