use rand::SeedableRng;
use rand::rngs::StdRng;

use super::*;

fn cfg() -> EstimatorConfig {
    EstimatorConfig::default()
}

#[test]
fn learns_rates_from_observed_ttfts() {
    let cfg = cfg();
    let mut r = Rates::prior(&cfg);
    // The true worker: 40 ms overhead, 2,000 tokens/s (the prior says 20 ms and 5,000 tokens/s).
    let truth = |work: f64| 0.04 + work / 2_000.0;
    for i in 0..200 {
        let work = if i % 2 == 0 { 4_000.0 } else { 50.0 };
        r.observe(truth(work), work, &cfg);
    }
    assert!((1.0 / r.s_per_token - 2_000.0).abs() < 100.0, "{r:?}");
    assert!((r.overhead_s - 0.04).abs() < 0.01, "{r:?}");
}

#[test]
fn learning_is_robust_to_outliers_and_garbage() {
    let cfg = cfg();
    let mut r = Rates::prior(&cfg);
    for _ in 0..50 {
        r.observe(0.02 + 4_000.0 / 5_000.0, 4_000.0, &cfg);
    }
    let settled = r.clone();
    // One absurd sample (a stalled connection) moves the rate by at most 3x * alpha.
    r.observe(600.0, 4_000.0, &cfg);
    assert!(r.s_per_token < settled.s_per_token * 1.25, "{r:?}");
    r.observe(f64::NAN, 4_000.0, &cfg);
    r.observe(-1.0, 4_000.0, &cfg);
    assert!(r.s_per_token.is_finite() && r.s_per_token > 0.0);
}

#[test]
fn estimate_counts_only_uncached_tokens_and_queue() {
    let cfg = cfg();
    let r = Rates {
        s_per_token: 0.001,
        overhead_s: 0.01,
        samples: 0,
        rate_samples: 0,
        last_observed: None,
        attention_pair_tokens: 0.0,
    };
    let cold = estimate(
        &r,
        &Inputs {
            prompt_tokens: 1_000,
            cached_tokens: 0,
            offloaded_tokens: 0,
            queue_tokens: 0.0,
            running: 0,
        },
        &cfg,
    );
    let warm = estimate(
        &r,
        &Inputs {
            prompt_tokens: 1_000,
            cached_tokens: 900,
            offloaded_tokens: 0,
            queue_tokens: 0.0,
            running: 0,
        },
        &cfg,
    );
    let busy = estimate(
        &r,
        &Inputs {
            prompt_tokens: 1_000,
            cached_tokens: 900,
            offloaded_tokens: 0,
            queue_tokens: 2_000.0,
            running: 2,
        },
        &cfg,
    );
    assert!((cold.ttft_s - 1.01).abs() < 1e-9);
    assert!((warm.ttft_s - 0.11).abs() < 1e-9);
    assert!((busy.queue_s - (2_000.0 + 32.0) * 0.001).abs() < 1e-9);
    assert!(busy.ttft_s > cold.ttft_s);
}

#[test]
fn a_cold_prompt_among_ties_goes_to_the_emptiest_cache() {
    let cfg = cfg();
    let mut rng = StdRng::seed_from_u64(11);
    let worker = |held_blocks| Scored {
        cost_s: 0.5,
        load: 0,
        cached_tokens: 0,
        held_blocks,
    };
    // Caches of 4,000, 1,200 and 3,900 blocks: the prompt is stored where it evicts least.
    let scored = [worker(4_000), worker(1_200), worker(3_900)];
    for _ in 0..50 {
        assert_eq!(choose(&scored, &cfg, &mut rng).map(|(i, _)| i), Some(1));
    }
    // Near-equal caches (within 2%) are still drawn at random.
    let scored = [worker(4_000), worker(3_990), worker(1_000)];
    let scored = &scored[..2];
    let mut seen = [0usize; 2];
    for _ in 0..200 {
        let (i, why) = choose(scored, &cfg, &mut rng).unwrap();
        assert_eq!(why, Why::TieSpread);
        seen[i] += 1;
    }
    assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
    // A cheaper estimate still wins over an emptier cache.
    let scored = [
        Scored {
            cost_s: 0.2,
            ..worker(4_000)
        },
        worker(10),
    ];
    assert_eq!(choose(&scored, &cfg, &mut rng).map(|(i, _)| i), Some(0));
}

#[test]
fn ties_are_spread_at_random() {
    let cfg = cfg();
    let mut rng = StdRng::seed_from_u64(7);
    let scored = vec![
        Scored {
            cost_s: 0.5,
            load: 0,
            cached_tokens: 0,
            held_blocks: 0,
        };
        4
    ];
    let mut counts = [0usize; 4];
    for _ in 0..400 {
        let (i, why) = choose(&scored, &cfg, &mut rng).unwrap();
        assert_eq!(why, Why::TieSpread);
        counts[i] += 1;
    }
    assert!(counts.iter().all(|c| *c > 50), "{counts:?}");
}

#[test]
fn strict_best_wins_with_its_reason() {
    let cfg = cfg();
    let mut rng = StdRng::seed_from_u64(1);
    let scored = vec![
        Scored {
            cost_s: 1.0,
            load: 0,
            cached_tokens: 0,
            held_blocks: 0,
        },
        Scored {
            cost_s: 0.1,
            load: 3,
            cached_tokens: 900,
            held_blocks: 0,
        },
    ];
    assert_eq!(choose(&scored, &cfg, &mut rng), Some((1, Why::CacheHit)));
    let scored = vec![
        Scored {
            cost_s: 1.0,
            load: 5,
            cached_tokens: 0,
            held_blocks: 0,
        },
        Scored {
            cost_s: 0.5,
            load: 0,
            cached_tokens: 0,
            held_blocks: 0,
        },
    ];
    assert_eq!(choose(&scored, &cfg, &mut rng), Some((1, Why::LeastLoaded)));
}

#[test]
fn load_guard_caps_piling_onto_one_worker() {
    let cfg = cfg();
    let mut rng = StdRng::seed_from_u64(1);
    // The cached worker looks best but already has 33 more requests than the idle one.
    let scored = vec![
        Scored {
            cost_s: 0.1,
            load: 33,
            cached_tokens: 5_000,
            held_blocks: 0,
        },
        Scored {
            cost_s: 2.0,
            load: 0,
            cached_tokens: 0,
            held_blocks: 0,
        },
    ];
    assert_eq!(choose(&scored, &cfg, &mut rng), Some((1, Why::LoadGuard)));
    // At 32 it is still allowed; relative slack applies once every worker is busy.
    assert!(within_guard(32, 0, &cfg));
    assert!(within_guard(80, 40, &cfg));
    assert!(!within_guard(81, 40, &cfg));
}

#[test]
fn near_ties_prefer_the_cache_then_spread() {
    let cfg = cfg();
    let mut rng = StdRng::seed_from_u64(3);
    let scored = vec![
        Scored {
            cost_s: 1.00,
            load: 0,
            cached_tokens: 0,
            held_blocks: 0,
        },
        Scored {
            cost_s: 1.01,
            load: 1,
            cached_tokens: 4_000,
            held_blocks: 0,
        },
        Scored {
            cost_s: 1.00,
            load: 0,
            cached_tokens: 0,
            held_blocks: 0,
        },
    ];
    assert_eq!(choose(&scored, &cfg, &mut rng), Some((1, Why::CacheHit)));
}

fn ledger(in_flight: usize, awaiting: usize, pending: f64) -> Ledger {
    Ledger {
        in_flight,
        awaiting_first_token: awaiting,
        pending_prefill_tokens: pending,
        avg_uncached: 500.0,
    }
}

fn kernel(in_flight: u32, waiting: u32) -> Option<KernelQueue> {
    Some(KernelQueue {
        in_flight,
        waiting,
        waits_for_body: false,
    })
}

/// [`queue`] with views taken now, nothing of ours lingering in them.
fn queue_now(
    ledger: &Ledger,
    kernel: Option<KernelQueue>,
    engine: Option<EngineQueue>,
    cfg: &EstimatorConfig,
) -> (Queue, QueueSignal) {
    let ours = Seen {
        in_flight: ledger.in_flight,
        waiting: ledger.awaiting_first_token,
    };
    queue(
        ledger,
        kernel.map(|k| (k, ours)),
        engine.map(|e| (e, ours)),
        cfg,
    )
}

#[test]
fn our_finished_responses_the_kernel_still_counts_are_not_other_clients() {
    let cfg = cfg();
    // One request of ours in flight; the kernel counts 4, three of them our responses that ended within
    // the agent's idle gap (their connections idle, not yet reused).
    let ours = Seen {
        in_flight: 4,
        waiting: 0,
    };
    let (q, _) = queue(
        &ledger(1, 0, 0.0),
        Some((
            KernelQueue {
                in_flight: 4,
                waiting: 0,
                waits_for_body: false,
            },
            ours,
        )),
        None,
        &cfg,
    );
    assert_eq!((q.running, q.others, q.others_waiting), (1, 0, 0), "{q:?}");
    assert!(q.queue_tokens.abs() < 1e-9);
    // Compared with the ledger as it is now, the same view shows three phantom clients, all waiting.
    let (q, _) = queue_now(&ledger(1, 1, 500.0), kernel(4, 0), None, &cfg);
    assert_eq!((q.running, q.others), (4, 3));

    // A view older than our two newest requests: they are not in it, so they do not hide others.
    let ours = Seen {
        in_flight: 1,
        waiting: 1,
    };
    let (q, _) = queue(
        &ledger(3, 3, 1_500.0),
        Some((
            KernelQueue {
                in_flight: 3,
                waiting: 3,
                waits_for_body: false,
            },
            ours,
        )),
        None,
        &cfg,
    );
    assert_eq!((q.running, q.others, q.others_waiting), (5, 2, 2), "{q:?}");
    assert!((q.queue_tokens - 2_500.0).abs() < 1e-9, "{q:?}");
}

#[test]
fn the_kernel_view_adds_only_other_clients_requests() {
    let cfg = cfg();
    // We have 2 in flight there (1 before its first token, 1,000 tokens pending); the kernel sees 5.
    let (q, signal) = queue_now(&ledger(2, 1, 1_000.0), kernel(5, 0), None, &cfg);
    assert_eq!(signal, QueueSignal::Kernel);
    assert_eq!(q.running, 5, "the total, not 2 + 5");
    assert_eq!(q.others, 3);
    // Others wait at our own fraction (1/2): 1.5 -> 2 requests of our average 500 uncached tokens.
    assert_eq!(q.others_waiting, 2);
    assert!((q.queue_tokens - 2_000.0).abs() < 1e-9, "{q:?}");

    // The kernel sees only our own requests: nothing is added to the ledger.
    let (q, _) = queue_now(&ledger(2, 1, 1_000.0), kernel(2, 1), None, &cfg);
    assert_eq!((q.running, q.others, q.others_waiting), (2, 0, 0));
    assert!((q.queue_tokens - 1_000.0).abs() < 1e-9);

    // A kernel view older than our newest request shows less than the ledger: never negative others.
    let (q, _) = queue_now(&ledger(4, 4, 3_000.0), kernel(1, 1), None, &cfg);
    assert_eq!((q.running, q.others, q.others_waiting), (4, 0, 0));
    assert!((q.queue_tokens - 3_000.0).abs() < 1e-9);
}

#[test]
fn a_kernel_that_waits_for_the_first_body_byte_sizes_the_others_prefill_exactly() {
    let cfg = cfg();
    let exact = |in_flight, waiting| {
        Some(KernelQueue {
            in_flight,
            waiting,
            waits_for_body: true,
        })
    };
    // Ours: 2 in flight, 1 before its first token. The kernel sees 5 in flight, 1 waiting (ours): the
    // three others are all decoding, so none of them adds prefill, whatever our own waiting fraction.
    let (q, signal) = queue_now(&ledger(2, 1, 1_000.0), exact(5, 1), None, &cfg);
    assert_eq!(signal, QueueSignal::Kernel);
    assert_eq!((q.running, q.others, q.others_waiting), (5, 3, 0), "{q:?}");
    assert!((q.queue_tokens - 1_000.0).abs() < 1e-9, "{q:?}");
    // The same figures from a kernel that ends `waiting` at the headers: the fraction guess adds 2.
    let (q, _) = queue_now(&ledger(2, 1, 1_000.0), kernel(5, 1), None, &cfg);
    assert_eq!(q.others_waiting, 2, "{q:?}");

    // Three others waiting while ours are all decoding: all three queue ahead (fraction 0 would say none).
    let (q, _) = queue_now(&ledger(2, 0, 0.0), exact(5, 3), None, &cfg);
    assert_eq!((q.running, q.others, q.others_waiting), (5, 3, 3), "{q:?}");
    assert!((q.queue_tokens - 1_500.0).abs() < 1e-9, "{q:?}");
    // A stale engine counter does not override the kernel's exact count.
    let engine = Some(EngineQueue {
        running: 1,
        waiting: 6,
    });
    let (q, _) = queue_now(&ledger(2, 0, 0.0), exact(5, 3), engine, &cfg);
    assert_eq!(q.others_waiting, 3, "{q:?}");
    // Waiting requests the in-flight figure missed (read a moment apart) still count as others.
    let (q, _) = queue_now(&ledger(2, 0, 0.0), exact(2, 2), None, &cfg);
    assert_eq!((q.others, q.others_waiting), (2, 2), "{q:?}");
}

#[test]
fn requests_the_kernel_shows_waiting_beyond_ours_count_as_queued() {
    let cfg = cfg();
    // Non-streaming traffic: the kernel knows which requests have no response yet. Ours are all past
    // their first token (fraction 0), yet 4 others are waiting.
    let (q, _) = queue_now(&ledger(1, 0, 0.0), kernel(6, 4), None, &cfg);
    assert_eq!((q.running, q.others, q.others_waiting), (6, 5, 4));
    assert!((q.queue_tokens - 2_000.0).abs() < 1e-9);
    // The waiting count can never exceed the others.
    let (q, _) = queue_now(&ledger(0, 0, 0.0), kernel(2, 9), None, &cfg);
    assert_eq!((q.others, q.others_waiting), (2, 2));
}

#[test]
fn without_a_kernel_view_the_engine_counters_then_the_ledger_are_used() {
    let cfg = cfg();
    let engine = Some(EngineQueue {
        running: 3,
        waiting: 2,
    });
    // No request of ours there: the waiting fraction is the engine's (2 of 5).
    let (q, signal) = queue_now(&ledger(0, 0, 0.0), None, engine, &cfg);
    assert_eq!(signal, QueueSignal::Engine);
    assert_eq!((q.running, q.others, q.others_waiting), (5, 5, 2));
    // The kernel view wins over the engine counters when both are there.
    let (q, signal) = queue_now(&ledger(0, 0, 0.0), kernel(1, 0), engine, &cfg);
    assert_eq!(signal, QueueSignal::Kernel);
    assert_eq!(q.running, 1);
    // Nothing but the ledger: other clients are invisible.
    let (q, signal) = queue_now(&ledger(3, 2, 900.0), None, None, &cfg);
    assert_eq!(signal, QueueSignal::Ledger);
    assert_eq!((q.running, q.others), (3, 0));
    assert!((q.queue_tokens - 900.0).abs() < 1e-9);
}

mod replicas {
    //! Two gateway replicas share two workers; the agent's kernel view carries one's load to the other.

    use std::time::Duration;

    use kinference_api::summary::{self as pb, Summary, summary};

    use super::super::super::{
        ModelConfig, Router, RoutingConfig, RoutingMode, RoutingTuning, WorkerConfig,
    };

    const W0: &str = "http://w0";
    const W1: &str = "http://w1";

    fn router(tuning: RoutingTuning) -> Router {
        let config = RoutingConfig {
            workers: [W0, W1]
                .iter()
                .map(|url| WorkerConfig {
                    url: url.to_string(),
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
            agents: vec!["http://127.0.0.1:1".into()],
            mode: RoutingMode::Kinference,
        };
        Router::with_tuning(
            config,
            RoutingTuning {
                connect_agents: false,
                ..tuning
            },
        )
        .expect("router")
    }

    /// The agent's snapshot: both workers idle by their scraped counters (the last scrape predates the
    /// burst), `w0` with `in_flight` requests in the kernel view when `kernel_ok`.
    fn snapshot(in_flight: u32, kernel_ok: bool) -> Summary {
        kernel_snapshot([in_flight, 0], kernel_ok, 0)
    }

    /// The agent's snapshot with per-worker kernel in-flight counts and the agent's idle gap.
    fn kernel_snapshot(in_flight: [u32; 2], kernel_ok: bool, idle_gap_ms: u32) -> Summary {
        let load = |k: u32| pb::WorkerLoad {
            metrics_ok: true,
            kernel_ok,
            kernel_in_flight: k,
            kernel_idle_gap_ms: idle_gap_ms,
            ..Default::default()
        };
        let worker = |url: &str, k: u32| pb::WorkerState {
            worker_id: url.into(),
            model: "m".into(),
            block_size: 16,
            keys: vec![],
            load: Some(load(k)),
            role: String::new(),
            offloaded_keys: Vec::new(),
            data_parallel_rank: None,
        };
        Summary {
            kind: Some(summary::Kind::Snapshot(pb::Snapshot {
                node: "n1".into(),
                epoch: 1,
                workers: vec![worker(W0, in_flight[0]), worker(W1, in_flight[1])],
                node_state: None,
            })),
        }
    }

    fn tokens() -> Vec<u32> {
        (0..2_000).collect()
    }

    /// Field `name` of candidate `url` in a decision's explanation.
    fn field<'a>(explain: &'a str, url: &str, name: &str) -> &'a str {
        let candidate = explain
            .split("; ")
            .find(|c| c.trim_start_matches('*').starts_with(&format!("{url} ")))
            .unwrap_or_else(|| panic!("{url} in {explain}"));
        candidate
            .split(' ')
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("{name} in {candidate}"))
    }

    #[tokio::test]
    async fn a_replica_sees_the_other_replicas_load_through_the_kernel_view() {
        // Replica B has just sent 6 requests to w0; replica A's ledger is empty.
        let a = router(RoutingTuning::default());
        a.apply_agent_summary(0, snapshot(6, true));
        for _ in 0..3 {
            let d = a.pick_tokens("m", &tokens(), true).expect("decision");
            let explain = d.explain.clone().expect("explain");
            assert_eq!(d.worker, W1, "{explain}");
            assert_eq!(field(&explain, W0, "others"), "6", "{explain}");
            assert_eq!(field(&explain, W0, "kernel"), "live", "{explain}");
            assert_eq!(field(&explain, W0, "signal"), "kernel", "{explain}");
            let busy: f64 = field(&explain, W0, "est_s").parse().expect("est_s");
            let idle: f64 = field(&explain, W1, "est_s").parse().expect("est_s");
            assert!(busy > idle, "{explain}");
            // The ticket is released here: A's own ledger stays empty, only the kernel view tells.
        }

        // The same without a kernel view: A cannot tell the workers apart and spreads at random.
        let a = router(RoutingTuning::default());
        a.apply_agent_summary(0, snapshot(6, false));
        let d = a.pick_tokens("m", &tokens(), true).expect("decision");
        let explain = d.explain.clone().expect("explain");
        assert_eq!(field(&explain, W0, "others"), "0", "{explain}");
        assert_eq!(field(&explain, W0, "kernel"), "ebpf_off", "{explain}");
        assert_eq!(d.reason, "tie_spread", "{explain}");
    }

    /// Sends `n` requests through `router` and ends them; returns how many went to each worker.
    fn finish_requests(router: &Router, n: usize) -> [u32; 2] {
        let mut per_worker = [0; 2];
        for _ in 0..n {
            let d = router.pick_tokens("m", &tokens(), false).expect("decision");
            per_worker[usize::from(d.worker == W1)] += 1;
            d.ticket.finish(true, 16, None);
        }
        per_worker
    }

    #[tokio::test]
    async fn a_gateways_own_finished_responses_lingering_in_the_kernel_view_are_not_others() {
        // The gateway's requests have ended, but the kernel still counts their responses (their kept-alive
        // connections have not reached the agent's idle gap): they are this gateway's, not other clients'.
        let a = router(RoutingTuning::default());
        a.apply_agent_summary(0, kernel_snapshot([0, 0], true, 0));
        let ended = finish_requests(&a, 4);
        a.apply_agent_summary(0, kernel_snapshot(ended, true, 500));
        let d = a.pick_tokens("m", &tokens(), true).expect("decision");
        let explain = d.explain.clone().expect("explain");
        for url in [W0, W1] {
            assert_eq!(field(&explain, url, "others"), "0", "{explain}");
            assert_eq!(field(&explain, url, "running"), "0", "{explain}");
        }

        // Past the idle gap the kernel no longer counts them, so a view that still does shows others.
        let b = router(RoutingTuning::default());
        b.apply_agent_summary(0, kernel_snapshot([0, 0], true, 0));
        let ended = finish_requests(&b, 4);
        std::thread::sleep(Duration::from_millis(30));
        b.apply_agent_summary(0, kernel_snapshot(ended, true, 1));
        let d = b.pick_tokens("m", &tokens(), true).expect("decision");
        let explain = d.explain.clone().expect("explain");
        let others: u32 = [W0, W1]
            .iter()
            .map(|url| {
                field(&explain, url, "others")
                    .parse::<u32>()
                    .expect("others")
            })
            .sum();
        assert_eq!(others, 4, "{explain}");
    }

    #[tokio::test]
    async fn a_missing_or_stale_kernel_view_is_counted_by_reason() {
        let metric = |router: &Router, reason: &str| {
            let mut registry = prometheus_client::registry::Registry::default();
            router.register_metrics(&mut registry);
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
            let series =
                format!("kinference_routing_kernel_view_missing_total{{reason=\"{reason}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&series)?.parse::<f64>().ok())
                .unwrap_or(0.0)
        };

        let off = router(RoutingTuning::default());
        off.apply_agent_summary(0, snapshot(0, false));
        let _ = off.pick_tokens("m", &tokens(), false).expect("decision");
        assert_eq!(metric(&off, "ebpf_off"), 2.0, "both candidates, once each");

        let mut tuning = RoutingTuning::default();
        tuning.estimator.kernel_max_age = Duration::from_millis(20);
        let stale = router(tuning);
        stale.apply_agent_summary(0, snapshot(6, true));
        std::thread::sleep(Duration::from_millis(40));
        let d = stale.pick_tokens("m", &tokens(), true).expect("decision");
        let explain = d.explain.clone().expect("explain");
        assert_eq!(field(&explain, W0, "kernel"), "stale", "{explain}");
        assert_eq!(
            field(&explain, W0, "others"),
            "0",
            "stale kernel figures are not used: {explain}"
        );
        assert_eq!(metric(&stale, "stale"), 2.0);

        let live = router(RoutingTuning::default());
        live.apply_agent_summary(0, snapshot(6, true));
        let _ = live.pick_tokens("m", &tokens(), false).expect("decision");
        assert_eq!(metric(&live, "ebpf_off") + metric(&live, "stale"), 0.0);
    }

    #[tokio::test]
    async fn awaiting_first_token_follows_the_tickets() {
        let a = router(RoutingTuning::default());
        a.apply_agent_summary(0, snapshot(0, true));
        let mut first = a.pick_tokens("m", &tokens(), false).expect("decision");
        let second = a.pick_tokens("m", &tokens(), false).expect("decision");
        let awaiting = |r: &Router| -> usize {
            r.shared
                .workers
                .read()
                .all()
                .iter()
                .map(|w| w.state.lock().awaiting_first_token)
                .sum()
        };
        assert_eq!(awaiting(&a), 2);
        first.ticket.first_token();
        assert_eq!(awaiting(&a), 1);
        first.ticket.finish(true, 16, None);
        assert_eq!(
            awaiting(&a),
            1,
            "finishing after the first token changes nothing"
        );
        drop(second);
        assert_eq!(awaiting(&a), 0, "a dropped ticket releases its count");
    }
}

#[test]
fn a_worker_without_samples_borrows_the_fleet_rates() {
    let cfg = EstimatorConfig::default();
    let mut fleet = Rates::prior(&cfg);
    // The fleet learned that prefill is ten times faster than the prior assumed.
    for _ in 0..50 {
        fleet.observe(0.02 + 8_000.0 * fleet.s_per_token / 10.0, 8_000.0, &cfg);
    }
    let now = std::time::Instant::now();
    let unseen = Rates::prior(&cfg);
    let b = blended(&unseen, &fleet, now);
    assert_eq!(
        b.s_per_token, fleet.s_per_token,
        "no own samples: the fleet's rate"
    );

    // A worker with many recent samples of its own keeps (mostly) its own rate.
    let mut own = Rates::prior(&cfg);
    own.s_per_token = fleet.s_per_token * 4.0;
    own.samples = 1_000;
    own.rate_samples = 1_000;
    own.last_observed = Some(now);
    let b = blended(&own, &fleet, now);
    assert!((b.s_per_token / own.s_per_token) > 0.95);

    // The same samples, not refreshed for several half-lives (the worker got no traffic since), fade
    // back toward the fleet's rate, so a worker that once looked slow is tried again.
    let later = now + std::time::Duration::from_secs(300);
    let b = blended(&own, &fleet, later);
    assert!((b.s_per_token / fleet.s_per_token) < 1.01, "{b:?}");
    let b = blended(&own, &fleet, now + std::time::Duration::from_secs(20));
    let half_weight = 500.0 / (500.0 + 64.0);
    let expected = half_weight * own.s_per_token + (1.0 - half_weight) * fleet.s_per_token;
    assert!((b.s_per_token / expected - 1.0).abs() < 1e-9, "{b:?}");

    // Samples that taught only the overhead (cached prompts, little work) leave the rate to the fleet.
    let mut cached_only = Rates::prior(&cfg);
    for _ in 0..200 {
        cached_only.observe(0.03, 100.0, &cfg);
    }
    assert_eq!((cached_only.samples, cached_only.rate_samples), (200, 0));
    let b = blended(&cached_only, &fleet, std::time::Instant::now());
    assert_eq!(b.s_per_token, fleet.s_per_token);
    // ... while its overhead is its own by the weight of its 200 samples.
    let w = 200.0 / (200.0 + 64.0);
    let expected = w * cached_only.overhead_s + (1.0 - w) * fleet.overhead_s;
    assert!((b.overhead_s / expected - 1.0).abs() < 1e-3, "{b:?}");
}

#[test]
fn leaving_a_cached_prefix_must_beat_the_holders_queue_by_the_prefill_it_duplicates() {
    // As on the shared-prefix benchmark: the holder has a cold prompt and some more queued ahead (9,000
    // tokens); another worker is idle and cold.
    let rates = Rates {
        s_per_token: 4e-5,
        overhead_s: 0.01,
        samples: 100,
        rate_samples: 100,
        last_observed: None,
        attention_pair_tokens: 0.0,
    };
    let holder = Inputs {
        prompt_tokens: 7_646,
        cached_tokens: 7_584,
        offloaded_tokens: 0,
        queue_tokens: 9_000.0,
        running: 1,
    };
    let cold = Inputs {
        prompt_tokens: 7_646,
        cached_tokens: 0,
        offloaded_tokens: 0,
        queue_tokens: 0.0,
        running: 1,
    };
    let pick = |cfg: &EstimatorConfig| {
        let scored: Vec<Scored> = [holder, cold]
            .iter()
            .map(|i| Scored {
                cost_s: estimate(&rates, i, cfg).cost_s,
                load: i.running,
                cached_tokens: i.cached_tokens,
                held_blocks: 0,
            })
            .collect();
        choose(&scored, cfg, &mut StdRng::seed_from_u64(3)).map(|(i, _)| i)
    };
    let greedy = EstimatorConfig {
        prefill_externality: 0.0,
        ..cfg()
    };
    assert_eq!(
        pick(&greedy),
        Some(1),
        "by TTFT alone the cold worker is faster"
    );
    assert_eq!(
        pick(&cfg()),
        Some(0),
        "counting the duplicated prefill, the holder"
    );
    // The TTFT estimate itself is unchanged by the term.
    assert_eq!(
        estimate(&rates, &cold, &cfg()).ttft_s,
        estimate(&rates, &cold, &greedy).ttft_s
    );

    // When the holder's queue is worse than the cold prefill by more than half a prefill, it is left.
    let swamped = Inputs {
        queue_tokens: 12_000.0,
        ..holder
    };
    let scored: Vec<Scored> = [swamped, cold]
        .iter()
        .map(|i| Scored {
            cost_s: estimate(&rates, i, &cfg()).cost_s,
            load: i.running,
            cached_tokens: i.cached_tokens,
            held_blocks: 0,
        })
        .collect();
    assert_eq!(
        choose(&scored, &cfg(), &mut StdRng::seed_from_u64(3)).map(|(i, _)| i),
        Some(1)
    );
}

#[test]
fn a_prompt_cold_everywhere_is_chosen_as_by_ttft() {
    let rates = Rates::prior(&cfg());
    let greedy = EstimatorConfig {
        prefill_externality: 0.0,
        ..cfg()
    };
    for queues in [[0.0, 500.0, 9_000.0], [4_000.0, 100.0, 3_000.0]] {
        let inputs: Vec<Inputs> = queues
            .iter()
            .map(|q| Inputs {
                prompt_tokens: 3_000,
                cached_tokens: 0,
                offloaded_tokens: 0,
                queue_tokens: *q,
                running: 2,
            })
            .collect();
        let pick = |cfg: &EstimatorConfig| {
            let scored: Vec<Scored> = inputs
                .iter()
                .map(|i| Scored {
                    cost_s: estimate(&rates, i, cfg).cost_s,
                    load: i.running,
                    cached_tokens: 0,
                    held_blocks: 0,
                })
                .collect();
            choose(&scored, cfg, &mut StdRng::seed_from_u64(5))
        };
        assert_eq!(pick(&cfg()), pick(&greedy), "{queues:?}");
    }
}

#[test]
fn kv_room_counts_capacity_less_in_use_less_what_the_queue_ahead_allocates() {
    // 2,048 blocks, 90% held by running requests, 2,000 prefill tokens queued (125 blocks of 16).
    let room = KvRoom::new(2048, 0.9, 2000.0, 16);
    assert_eq!((room.in_use, room.queued, room.free()), (1843, 125, 80));
    assert_eq!(
        room.surviving(340, 0),
        80,
        "only the room left keeps leading blocks"
    );
    assert_eq!(room.surviving(50, 0), 50, "a run that fits survives whole");
    // Blocks shared with a request in flight there survive whatever the room; the rest takes the room.
    assert_eq!(room.surviving(340, 200), 280);
    assert_eq!(room.surviving(340, 340), 340);
    assert_eq!(room.surviving(340, 1_000), 340, "never more than the run");
    // Over-full (the queue alone outgrows the room) and garbage usage never underflow.
    assert_eq!(KvRoom::new(2048, 0.99, 2000.0, 16).surviving(340, 0), 0);
    assert_eq!(KvRoom::new(2048, 0.99, 2000.0, 16).surviving(340, 300), 300);
    assert_eq!(KvRoom::new(2048, f32::NAN, 0.0, 16).free(), 2048);
    assert_eq!(KvRoom::new(2048, 7.0, 0.0, 16).free(), 0);
}

/// A 6,000-token conversation turn: worker 0 holds 340 blocks (5,440 tokens) of its prefix with 2,000
/// prefill tokens queued ahead; worker 1 holds nothing and is idle. Both run 10 requests.
fn pressure_choice(holder_room: Option<KvRoom>) -> (usize, Why) {
    let c = cfg();
    let rates = Rates::prior(&c);
    let run = 340;
    let cached = holder_room.map_or(run, |r| r.surviving(run, 0)) * 16;
    let holder = estimate(
        &rates,
        &Inputs {
            prompt_tokens: 6000,
            cached_tokens: cached,
            offloaded_tokens: 0,
            queue_tokens: 2000.0,
            running: 10,
        },
        &c,
    );
    let cold = estimate(
        &rates,
        &Inputs {
            prompt_tokens: 6000,
            cached_tokens: 0,
            offloaded_tokens: 0,
            queue_tokens: 0.0,
            running: 10,
        },
        &c,
    );
    let scored = [holder, cold].map(|e| Scored {
        cost_s: e.cost_s,
        load: 10,
        cached_tokens: 0,
        held_blocks: 0,
    });
    choose(&scored, &c, &mut StdRng::seed_from_u64(1)).unwrap()
}

#[test]
fn a_prefix_the_queue_ahead_will_evict_stops_drawing_the_request() {
    // Capacity unknown: the run counts in full (today's behaviour). Holder: work 2,000 + 160 + 560 =
    // 2,720 tokens, 0.56 s + 0.06 s externality; cold worker: 6,160 tokens, 1.25 s + 0.60 s.
    assert_eq!(pressure_choice(None).0, 0);
    // Room to spare (half the cache in use): nothing is discounted, same choice.
    assert_eq!(
        pressure_choice(Some(KvRoom::new(2048, 0.5, 2000.0, 16))).0,
        0
    );
    // 95% in use: 1,946 blocks held + 125 queued exceed 2,048, so the queue ahead evicts the whole
    // prefix; the holder now costs 8,160 tokens (1.65 s) + 0.60 s, more than the cold worker.
    assert_eq!(
        pressure_choice(Some(KvRoom::new(2048, 0.95, 2000.0, 16))),
        (1, Why::LeastLoaded)
    );
}

fn at(cost_s: f64, load: usize) -> Scored {
    Scored {
        cost_s,
        load,
        cached_tokens: 0,
        held_blocks: 0,
    }
}

#[test]
fn a_session_stays_on_its_worker_unless_another_is_clearly_faster() {
    let cfg = EstimatorConfig::default();
    // Worker 1 held the conversation; worker 0 is estimated 20% faster: within a 25% slack.
    let scored = [at(1.0, 2), at(1.2, 3)];
    assert!(prefer_session(&scored, 0, 1, 0.25, &cfg));
    // Twice as slow: the faster worker keeps the request.
    let scored = [at(1.0, 2), at(2.0, 3)];
    assert!(!prefer_session(&scored, 0, 1, 0.25, &cfg));
    // Small costs: within the absolute 50 ms.
    let scored = [at(0.02, 0), at(0.06, 0)];
    assert!(prefer_session(&scored, 0, 1, 0.0, &cfg));
    // Already the pick: nothing to change.
    assert!(!prefer_session(&scored, 1, 1, 0.25, &cfg));
}

#[test]
fn a_session_worker_over_the_load_guard_is_left() {
    let cfg = EstimatorConfig::default();
    let scored = [at(1.0, 0), at(1.0, cfg.guard_abs + 1)];
    assert!(!prefer_session(&scored, 0, 1, 0.25, &cfg));
}

#[test]
fn a_gpu_hit_beats_an_equal_cpu_hit_and_a_cpu_hit_beats_a_miss() {
    let cfg = EstimatorConfig::default();
    let rates = Rates::prior(&cfg);
    let on = |cached_tokens, offloaded_tokens| {
        estimate(
            &rates,
            &Inputs {
                prompt_tokens: 4096,
                cached_tokens,
                offloaded_tokens,
                queue_tokens: 0.0,
                running: 2,
            },
            &cfg,
        )
    };
    let (gpu, cpu, miss) = (on(4000, 0), on(0, 4000), on(0, 0));
    assert!(gpu.ttft_s < cpu.ttft_s, "{gpu:?} {cpu:?}");
    assert!(cpu.ttft_s < miss.ttft_s, "{cpu:?} {miss:?}");
    assert!(gpu.cost_s < cpu.cost_s && cpu.cost_s < miss.cost_s);
    // Loading 4000 tokens back costs a tenth of computing them.
    let load = cpu.work - gpu.work;
    assert!((load - 400.0).abs() < 1e-6, "{load}");
}

/// The measured prefills of the calibration that made the `cpu-qwen2-small` profile (vLLM 0.32 on CPU):
/// `(uncached, cached, median TTFT in seconds)` per setting.
fn calibrated_prefills() -> Vec<(f64, f64, f64)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../bench/results/real-vllm/calibration-cpu-qwen2-small.json"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect(path))
            .expect("calibration json");
    let mut settings: std::collections::BTreeMap<(u64, u64), Vec<f64>> = Default::default();
    let points = &report["engine"]["points"];
    for kind in ["prefill", "cached"] {
        for p in points[kind].as_array().expect(kind) {
            let key = (
                p["uncached"].as_u64().unwrap(),
                p["cached"].as_u64().unwrap(),
            );
            settings
                .entry(key)
                .or_default()
                .push(p["ttft_s"].as_f64().unwrap());
        }
    }
    settings
        .into_iter()
        .map(|((u, c), mut ttfts)| {
            ttfts.sort_by(f64::total_cmp);
            (u as f64, c as f64, ttfts[ttfts.len() / 2])
        })
        .collect()
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

#[test]
fn the_cpu_profile_reproduces_the_engines_measured_prefills() {
    let cfg = cfg();
    let points = calibrated_prefills();
    assert!(points.len() >= 8, "{points:?}");
    let ape = |rates: &Rates| -> Vec<f64> {
        points
            .iter()
            .map(|&(u, c, measured)| {
                let inputs = Inputs {
                    prompt_tokens: (u + c) as usize,
                    cached_tokens: c as usize,
                    ..Default::default()
                };
                (estimate(rates, &inputs, &cfg).ttft_s - measured).abs() / measured
            })
            .collect()
    };
    let profile = Rates::from_profile(profiles::profile("cpu-qwen2-small").expect("profile"));
    let with_attention = ape(&profile);

    // The best a cost linear in uncached tokens can do on the same points: least squares.
    let n = points.len() as f64;
    let (mx, my) = (
        points.iter().map(|p| p.0).sum::<f64>() / n,
        points.iter().map(|p| p.2).sum::<f64>() / n,
    );
    let slope = points.iter().map(|p| (p.0 - mx) * (p.2 - my)).sum::<f64>()
        / points.iter().map(|p| (p.0 - mx).powi(2)).sum::<f64>();
    let linear = ape(&Rates {
        s_per_token: slope,
        overhead_s: my - slope * mx,
        attention_pair_tokens: 0.0,
        ..Rates::prior(&cfg)
    });

    let (ours, best_linear) = (median(with_attention.clone()), median(linear.clone()));
    assert!(ours <= 0.10, "profile MdAPE {ours:.3}: {with_attention:?}");
    let worst = with_attention.iter().copied().fold(0.0, f64::max);
    assert!(
        worst <= 0.30,
        "profile worst {worst:.3}: {with_attention:?}"
    );
    assert!(
        best_linear > 2.0 * ours,
        "linear {best_linear:.3} against the profile's {ours:.3}"
    );
}

#[test]
fn attention_makes_a_long_context_costlier_only_under_a_profile() {
    let cfg = cfg();
    // The same 256 new tokens after a short and after a long cached prefix.
    let after = |cached: usize| Inputs {
        prompt_tokens: cached + 256,
        cached_tokens: cached,
        ..Default::default()
    };
    let plain = Rates::prior(&cfg);
    let short = estimate(&plain, &after(128), &cfg);
    let long = estimate(&plain, &after(8_000), &cfg);
    assert_eq!(short.work, long.work);
    assert_eq!(short.prefill, 256.0);

    let profiled = Rates::from_profile(profiles::profile("cpu-qwen2-small").expect("profile"));
    let short = estimate(&profiled, &after(128), &cfg);
    let long = estimate(&profiled, &after(8_000), &cfg);
    // 256 x 8,000 more pairs at 1.1e-3 tokens each: about 2,250 tokens more.
    let extra = long.prefill - short.prefill;
    assert!(
        (extra - 256.0 * 7_872.0 * profiled.attention_pair_tokens).abs() < 1e-6,
        "{extra}"
    );
    assert!(long.ttft_s > 2.0 * short.ttft_s, "{long:?} {short:?}");
    // The prefill it adds to the worker's queue is the same figure the estimate charged.
    assert!(long.work >= long.prefill);
}

#[test]
fn every_profile_is_sane_and_named_once() {
    // The InferenceModel CRD offers exactly the profiles the gateway has: its schema names them.
    let offered: Vec<&str> = kinference_crds::EngineProfile::ALL
        .iter()
        .map(|p| p.as_str())
        .collect();
    let names = profiles::names();
    assert_eq!(
        offered, names,
        "InferenceModel's engineProfile against the gateway's table"
    );
    let unique: std::collections::HashSet<_> = names.iter().collect();
    assert_eq!(unique.len(), names.len(), "{names:?}");
    for p in profiles::PROFILES {
        let r = Rates::from_profile(p);
        assert!(r.s_per_token > 0.0 && r.s_per_token.is_finite(), "{p:?}");
        assert!(r.overhead_s > 0.0 && r.overhead_s < 1.0, "{p:?}");
        assert!(
            (0.0..0.01).contains(&r.attention_pair_tokens),
            "{p:?}: a pair costs far less than a token"
        );
    }
}

mod profiled_models {
    use crate::routing::{
        BuildError, ModelConfig, Router, RoutingConfig, RoutingMode, RoutingTuning, WorkerConfig,
    };

    fn config(profile: Option<&str>) -> RoutingConfig {
        RoutingConfig {
            workers: vec![WorkerConfig {
                url: "http://w0".into(),
                model: "m".into(),
                role: Default::default(),
            }],
            models: vec![ModelConfig {
                name: "m".into(),
                tokenizer_dir: None,
                serves_messages: false,
                profile: profile.map(str::to_string),
            }],
            agents: vec![],
            mode: RoutingMode::Kinference,
        }
    }

    /// The estimate for a cold prompt of `prompt_tokens` tokens: a new one on every call (the router
    /// credits a routed prompt to its worker).
    fn estimated_s(router: &Router, prompt_tokens: u32) -> f64 {
        static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let start = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) * 100_000;
        let tokens: Vec<u32> = (start..start + prompt_tokens).collect();
        let d = router.pick_tokens("m", &tokens, true).expect("decision");
        let explain = d.explain.expect("explain");
        explain
            .split(' ')
            .find_map(|kv| kv.strip_prefix("est_s="))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("est_s in {explain}"))
    }

    #[test]
    fn a_models_profile_gives_its_workers_priors_and_an_unknown_one_is_refused() {
        let tuning = || RoutingTuning {
            connect_agents: false,
            ..Default::default()
        };
        let plain = Router::with_tuning(config(None), tuning()).expect("router");
        let cpu = Router::with_tuning(config(Some("cpu-qwen2-small")), tuning()).expect("router");
        // A cold 2,048-token prompt on an idle worker: vLLM 0.32 on CPU measured 335 ms.
        let measured = 0.335;
        let est = estimated_s(&cpu, 2_048);
        assert!((est - measured).abs() / measured < 0.1, "{est}");
        // Without a profile, the default priors (5,000 tokens/s, no attention term) say about 0.43 s.
        let default = estimated_s(&plain, 2_048);
        assert!((default - est).abs() > 0.05, "{default} vs {est}");

        let refused = Router::with_tuning(config(Some("cpu-qwen3-huge")), tuning());
        match refused {
            Err(e @ BuildError::UnknownProfile { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("cpu-qwen3-huge") && text.contains("cpu-qwen2-small"),
                    "{text}"
                );
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("an unknown profile must be refused"),
        }
    }

    #[test]
    fn a_profile_set_on_reload_applies_to_the_workers_already_there() {
        let tuning = RoutingTuning {
            connect_agents: false,
            ..Default::default()
        };
        let router = Router::with_tuning(config(None), tuning).expect("router");
        let default = estimated_s(&router, 2_048);
        router
            .set_model_profile("m", Some("cpu-qwen2-small"))
            .expect("known profile");
        let profiled = estimated_s(&router, 2_048);
        assert!((profiled - 0.335).abs() / 0.335 < 0.1, "{profiled}");
        // An unknown name changes nothing.
        assert!(router.set_model_profile("m", Some("tpu-v9")).is_err());
        assert_eq!(estimated_s(&router, 2_048), profiled);
        // Back to the defaults.
        router.set_model_profile("m", None).expect("none");
        assert_eq!(estimated_s(&router, 2_048), default);
    }
}
