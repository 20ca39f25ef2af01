use std::time::Duration;

use super::*;

fn ctx() -> PeerContext {
    PeerContext {
        workers: vec![],
        model: "qwen2-sim".into(),
        block_size: 16,
        port: 30000,
        metrics_port: 29100,
        work_dir: std::env::temp_dir(),
    }
}

fn urls() -> Vec<String> {
    (1..=4)
        .map(|i| format!("http://127.0.0.1:800{i}"))
        .collect()
}

#[test]
fn the_fleet_puts_producers_first_and_gives_the_gateway_their_roles() {
    let fleet = PdFleet {
        prefill: 1,
        decode: 3,
    };
    assert_eq!(fleet.workers(), 4);
    assert_eq!(fleet.worker_args()[0], ["--kv-role", "kv_producer"]);
    assert_eq!(fleet.worker_args()[3], ["--kv-role", "kv_consumer"]);
    assert_eq!(
        fleet.gateway_roles(),
        ["prefill", "decode", "decode", "decode"]
    );
    let all = urls();
    let (p, d) = fleet.split(&all);
    assert_eq!((p.len(), d.len()), (1, 3));
}

#[test]
fn vllm_router_gets_its_pd_flag_and_both_lists() {
    let all = urls();
    let (p, d) = all.split_at(2);
    let plan = peer_plan(PeerRouter::VllmRouter, &ctx(), p, d, "round_robin").unwrap();
    assert_eq!(plan.program, "vllm-router");
    let args = plan.args.join(" ");
    assert!(args.starts_with("--vllm-pd-disaggregation --prefill http://127.0.0.1:8001 --prefill http://127.0.0.1:8002 --decode http://127.0.0.1:8003 --decode http://127.0.0.1:8004 "), "{args}");
    assert!(args.contains("--policy round_robin"), "{args}");
    assert!(!args.contains("--worker-urls"), "{args}");
}

#[test]
fn smg_gets_each_prefill_workers_port_as_its_bootstrap_port() {
    let all = urls();
    let (p, d) = all.split_at(1);
    let plan = peer_plan(PeerRouter::Smg, &ctx(), p, d, "round_robin").unwrap();
    assert_eq!(plan.program, "smg");
    let args = plan.args.join(" ");
    assert!(
        args.starts_with("launch --pd-disaggregation --prefill http://127.0.0.1:8001 8001 --decode http://127.0.0.1:8002"),
        "{args}"
    );
    assert!(peer_plan(PeerRouter::Litellm, &ctx(), p, d, "x").is_none());
}

fn outcome(ttft_ms: u64, e2e_ms: u64, tokens: Option<u64>) -> RequestOutcome {
    RequestOutcome {
        ttft: Some(Duration::from_millis(ttft_ms)),
        e2e: Some(Duration::from_millis(e2e_ms)),
        completion_tokens: tokens,
        ..RequestOutcome::default()
    }
}

#[test]
fn time_per_output_token_excludes_the_first_and_falls_back_to_max_tokens() {
    assert_eq!(
        tpot(&outcome(100, 1100, Some(11)), 99),
        Some(Duration::from_millis(100))
    );
    assert_eq!(
        tpot(&outcome(100, 1100, None), 11),
        Some(Duration::from_millis(100))
    );
    assert_eq!(tpot(&outcome(100, 100, Some(1)), 1), None);
}

#[test]
fn goodput_counts_only_requests_meeting_both_slos() {
    // Short-prompt SLOs: TTFT 2 s, TPOT 100 ms (simulated; time scale 1).
    let fast = outcome(500, 500 + 255 * 50, Some(256));
    let slow_tokens = outcome(500, 500 + 255 * 200, Some(256));
    let slow_first = outcome(3000, 3000 + 255 * 50, Some(256));
    let failed = RequestOutcome {
        error: Some("500".into()),
        ..RequestOutcome::default()
    };
    let s = summarize(
        &[fast, slow_tokens, slow_first, failed],
        Duration::from_secs(60),
        1.0,
        PdWorkload::ShortPromptLongAnswer,
        2.0,
    );
    assert_eq!((s.n, s.errors), (4, 1));
    assert!((s.goodput_rpm - 1.0).abs() < 1e-9, "{s:?}");
    assert!((s.throughput_rpm - 3.0).abs() < 1e-9);
    assert!((s.kv_pulls_per_request - 0.5).abs() < 1e-9);
    assert!((s.median_tpot_s - 0.05).abs() < 1e-3, "{s:?}");
}

fn record(router: PdRouter, round: usize, goodput: f64) -> PdRecord {
    PdRecord {
        workload: PdWorkload::ShortPromptLongAnswer,
        concurrency: 32,
        router,
        round,
        summary: Some(PdSummary {
            goodput_rpm: goodput,
            ..PdSummary::default()
        }),
        unavailable: None,
        split_decision: None,
        wall_s: 1.0,
    }
}

#[test]
fn ratios_pair_runs_of_the_same_round_and_targets_judge_them() {
    let records = vec![
        record(PdRouter::KinferencePd, 0, 100.0),
        record(PdRouter::VllmRouterPd, 0, 50.0),
        record(PdRouter::KinferenceAggregated, 0, 104.0),
        record(PdRouter::KinferencePd, 1, 60.0),
        record(PdRouter::VllmRouterPd, 1, 60.0),
        record(PdRouter::KinferenceAggregated, 1, 61.0),
    ];
    let rows = rows(&records);
    let peer = rows
        .iter()
        .find(|r| r.router == PdRouter::VllmRouterPd)
        .unwrap();
    // Round ratios 2.0 and 1.0: median 1.5, where the medians of goodput (80 / 55) would say 1.45.
    assert_eq!(peer.kinference_goodput_ratio, Some(1.5));
    let t = targets(&rows, AGGREGATED_TOLERANCE);
    assert_eq!(t.len(), 2, "{t:?}");
    assert!(t.iter().all(|t| t.met), "{t:?}");
    let unavailable = PdRecord {
        summary: None,
        unavailable: Some("install failed".into()),
        ..record(PdRouter::SmgPd, 0, 0.0)
    };
    let rows = super::rows(&[records[0].clone(), unavailable]);
    assert!(rows[1].median.is_none() && rows[1].kinference_goodput_ratio.is_none());
}
