use super::*;

fn outcome(ttft_ms: u64, e2e_ms: u64) -> RequestOutcome {
    RequestOutcome {
        ttft: Some(Duration::from_millis(ttft_ms)),
        e2e: Some(Duration::from_millis(e2e_ms)),
        worker: Some("http://w1".into()),
        prompt_tokens: Some(100),
        cached_tokens: Some(25),
        ..RequestOutcome::default()
    }
}

fn failed() -> RequestOutcome {
    RequestOutcome {
        error: Some("status 503".into()),
        worker: Some("http://w2".into()),
        ..RequestOutcome::default()
    }
}

#[test]
fn summary_converts_to_simulated_time_and_counts_goodput_within_the_slo() {
    // Wall-clock times at time scale 0.1: 100 ms wall = 1 s simulated.
    let outcomes = vec![
        outcome(100, 500),  // 1 s TTFT: within an 8 s SLO
        outcome(300, 900),  // 3 s
        outcome(700, 1200), // 7 s
        outcome(900, 1500), // 9 s: misses the SLO
        failed(),
    ];
    // 6 s wall = 60 s simulated = one simulated minute.
    let s = summarize(&outcomes, Duration::from_secs(6), 0.1, 8.0);
    assert_eq!(s.n, 5);
    assert_eq!(s.errors, 1);
    assert!((s.median_ttft_s - 5.0).abs() < 1e-9, "{}", s.median_ttft_s);
    // p90 of [1,3,7,9] = 7 + 0.7 * 2 = 8.4
    assert!((s.p90_ttft_s - 8.4).abs() < 1e-9, "{}", s.p90_ttft_s);
    assert!((s.median_e2e_s - 10.5).abs() < 1e-9, "{}", s.median_e2e_s);
    assert!((s.duration_s - 60.0).abs() < 1e-9);
    assert!((s.goodput_rpm - 3.0).abs() < 1e-9, "{}", s.goodput_rpm);
    assert!((s.throughput_rpm - 4.0).abs() < 1e-9);
    assert!((s.slo_met_share - 0.75).abs() < 1e-9);
    assert!((s.cached_token_share - 0.25).abs() < 1e-9);
    assert!((s.mean_prompt_tokens - 100.0).abs() < 1e-9);
    assert_eq!(s.per_worker.get("http://w1"), Some(&4));
    assert_eq!(s.per_worker.get("http://w2"), Some(&1));
}

#[test]
fn goodput_scales_with_the_run_duration() {
    let outcomes: Vec<_> = (0..10).map(|_| outcome(10, 20)).collect();
    let one_min = summarize(&outcomes, Duration::from_secs(60), 1.0, 4.0);
    let two_min = summarize(&outcomes, Duration::from_secs(120), 1.0, 4.0);
    assert!((one_min.goodput_rpm - 10.0).abs() < 1e-9);
    assert!((two_min.goodput_rpm - 5.0).abs() < 1e-9);
}

#[test]
fn a_run_with_only_failures_has_no_latency_figures_and_no_goodput() {
    let s = summarize(&[failed(), failed()], Duration::from_secs(1), 1.0, 8.0);
    assert_eq!(s.errors, 2);
    assert!(s.median_ttft_s.is_nan());
    assert_eq!(s.goodput_rpm, 0.0);
    assert_eq!(s.slo_met_share, 0.0);
}

#[test]
fn geometric_mean_ignores_non_positive_values() {
    assert!((geometric_mean([1.0, 4.0]) - 2.0).abs() < 1e-12);
    assert!((geometric_mean([2.0, f64::NAN, 8.0, 0.0]) - 4.0).abs() < 1e-12);
    assert!(geometric_mean([]).is_nan());
}
