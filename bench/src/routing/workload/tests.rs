use super::*;

fn small_shape() -> WorkloadShape {
    WorkloadShape {
        shared_prefixes: 3,
        prefix_words: 200,
        question_words: (5, 10),
        max_tokens: 8,
        first_turn_words: (50, 80),
        followup_words: (5, 10),
        turns: (2, 4),
        turn_max_tokens: 12,
        burst_period_s: 10.0,
        burst_spread_s: 0.5,
    }
}

#[test]
fn same_seed_gives_the_same_sequence_and_another_seed_does_not() {
    for kind in WorkloadKind::ALL {
        let a = Workload::generate(kind, &small_shape(), 7, 40);
        let b = Workload::generate(kind, &small_shape(), 7, 40);
        let c = Workload::generate(kind, &small_shape(), 8, 40);
        assert_eq!(a, b, "{kind}");
        assert_ne!(a, c, "{kind}");
        assert_eq!(a.len(), 40, "{kind}");
    }
}

#[test]
fn a_shorter_sequence_is_a_prefix_of_a_longer_one() {
    for kind in WorkloadKind::ALL {
        let short: Vec<_> = Workload::generate(kind, &small_shape(), 3, 17)
            .requests()
            .cloned()
            .collect();
        let long: Vec<_> = Workload::generate(kind, &small_shape(), 3, 50)
            .requests()
            .cloned()
            .collect();
        assert_eq!(short[..], long[..17], "{kind}");
    }
}

#[test]
fn shared_prefix_requests_reuse_a_few_long_system_prompts_with_distinct_questions() {
    let w = Workload::generate(WorkloadKind::SharedPrefix, &small_shape(), 1, 60);
    let systems: std::collections::HashSet<_> = w
        .requests()
        .map(|r| r.messages[0].content.clone())
        .collect();
    let questions: std::collections::HashSet<_> = w
        .requests()
        .map(|r| r.messages[1].content.clone())
        .collect();
    assert_eq!(systems.len(), 3);
    assert_eq!(questions.len(), 60);
    for r in w.requests() {
        assert_eq!(r.messages[0].role, "system");
        assert!(r.messages[0].content.split_whitespace().count() > 200);
        assert!(r.messages[1].content.split_whitespace().count() <= 13);
    }
}

#[test]
fn unique_prompts_share_no_leading_text_and_have_similar_lengths() {
    let w = Workload::generate(WorkloadKind::Unique, &small_shape(), 1, 30);
    let prompts: Vec<&str> = w
        .requests()
        .map(|r| r.messages[0].content.as_str())
        .collect();
    for (i, a) in prompts.iter().enumerate() {
        for b in &prompts[i + 1..] {
            // The labels differ within the first few characters, far less than one 16-token block.
            let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
            assert!(common < 40, "{common} common leading bytes");
        }
        let words = w
            .requests()
            .nth(i)
            .map(ChatRequest::words)
            .unwrap_or_default();
        assert!((205..=220).contains(&words), "{words} words");
    }
}

#[test]
fn each_turn_resends_the_previous_history_plus_one_reply_and_one_new_message() {
    let w = Workload::generate(WorkloadKind::MultiTurn, &small_shape(), 5, 40);
    assert!(w.sessions.len() >= 10);
    for s in &w.sessions {
        for pair in s.requests.windows(2) {
            let (prev, next) = (&pair[0], &pair[1]);
            assert_eq!(next.turn, prev.turn + 1);
            assert_eq!(next.messages.len(), prev.messages.len() + 2);
            assert_eq!(next.messages[..prev.messages.len()], prev.messages[..]);
            assert_eq!(next.messages[prev.messages.len()].role, "assistant");
            assert_eq!(next.messages.last().map(|m| m.role), Some("user"));
        }
    }
}

#[test]
fn the_body_is_an_openai_streaming_chat_request() {
    let w = Workload::generate(WorkloadKind::SharedPrefix, &small_shape(), 1, 1);
    let req = w.requests().next().cloned();
    let body = req.map(|r| r.body("qwen2-sim", true)).unwrap_or_default();
    assert_eq!(body["model"], "qwen2-sim");
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"]["include_usage"], true);
    assert_eq!(body["max_tokens"], 8);
    assert_eq!(body["messages"][0]["role"], "system");
}

#[test]
fn workload_names_round_trip() {
    for kind in WorkloadKind::ALL {
        assert_eq!(kind.as_str().parse::<WorkloadKind>().ok(), Some(kind));
    }
    assert!("shared".parse::<WorkloadKind>().is_err());
}

#[test]
fn a_warm_up_phase_splits_off_whole_sessions() {
    let w = Workload::generate(WorkloadKind::SharedPrefix, &small_shape(), 1, 30);
    let all: Vec<_> = w.requests().cloned().collect();
    let (warm, rest) = w.split_at_requests(10);
    assert_eq!(warm.len(), 10);
    assert_eq!(rest.len(), 20);
    assert_eq!(rest.requests().next(), Some(&all[10]));
    let mt = Workload::generate(WorkloadKind::MultiTurn, &small_shape(), 1, 30);
    let (warm, rest) = mt.split_at_requests(5);
    assert!(warm.len() >= 5);
    assert_eq!(warm.len() + rest.len(), 30);
    assert!(rest.sessions.iter().all(|s| s.requests[0].turn == 0));
    let (none, all) =
        Workload::generate(WorkloadKind::Unique, &small_shape(), 1, 4).split_at_requests(0);
    assert!(none.is_empty());
    assert_eq!(all.len(), 4);
}

#[test]
fn heterogeneous_and_bursty_send_the_shared_prefix_requests() {
    let shared = Workload::generate(WorkloadKind::SharedPrefix, &small_shape(), 9, 20);
    for kind in [WorkloadKind::Heterogeneous, WorkloadKind::Bursty] {
        let w = Workload::generate(kind, &small_shape(), 9, 20);
        assert_eq!(w.kind, kind);
        assert!(w.requests().eq(shared.requests()), "{kind}");
        assert!(w.sessions.iter().all(|s| s.arrival_s.is_none()), "{kind}");
    }
}

#[test]
fn bursts_arrive_every_period_in_groups_of_the_burst_size_the_same_for_a_seed() {
    let shape = small_shape();
    let scheduled = |seed: u64| {
        let mut w = Workload::generate(WorkloadKind::Bursty, &shape, 1, 23);
        w.schedule_bursts(&shape, 8, seed);
        w
    };
    let w = scheduled(4);
    assert_eq!(w, scheduled(4), "same seed, same schedule");
    assert_ne!(
        w,
        scheduled(5),
        "another seed spreads the bursts differently"
    );
    let arrivals: Vec<f64> = w
        .sessions
        .iter()
        .map(|s| s.arrival_s.expect("scheduled"))
        .collect();
    assert!(
        arrivals.windows(2).all(|p| p[0] <= p[1]),
        "in arrival order"
    );
    // 23 sessions: bursts of 8, 8 and 7, at 0, 10 and 20 s, each spread over its first 0.5 s.
    for (burst, size) in [(0.0, 8), (10.0, 8), (20.0, 7)] {
        let within = arrivals
            .iter()
            .filter(|&&a| a >= burst && a < burst + shape.burst_spread_s)
            .count();
        assert_eq!(within, size, "burst at {burst} s: {arrivals:?}");
    }
    // The schedule only reorders sessions inside a burst: the requests are the same.
    let mut sent: Vec<usize> = w.requests().map(|r| r.session).collect();
    sent.sort_unstable();
    assert_eq!(sent, (0..23).collect::<Vec<_>>());
}
