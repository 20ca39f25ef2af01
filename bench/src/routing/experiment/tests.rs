use super::*;

#[test]
fn scaled_request_counts_grow_with_concurrency_above_a_floor() {
    let count = RequestCount::Scaled {
        min: 40,
        per_user: 4,
    };
    assert_eq!(count.for_concurrency(1), 40);
    assert_eq!(count.for_concurrency(32), 128);
    assert_eq!(RequestCount::Fixed(7).for_concurrency(32), 7);
}

#[test]
fn multi_turn_runs_hold_two_conversations_per_user() {
    let config = ExperimentConfig {
        workloads: vec![WorkloadKind::MultiTurn],
        concurrency: vec![1, 32],
        policies: vec![Policy::Random],
        requests: RequestCount::Scaled {
            min: 96,
            per_user: 3,
        },
        warmup: None,
        seed: 1,
        time_scale: 1.0,
        shape: WorkloadShape::default(),
        settle: Duration::ZERO,
    };
    // Turns 4-8: six on average, so 32 users need 384 requests for two sessions each.
    assert_eq!(config.requests_for(WorkloadKind::MultiTurn, 32), 384);
    assert_eq!(config.requests_for(WorkloadKind::MultiTurn, 1), 96);
    assert_eq!(config.requests_for(WorkloadKind::SharedPrefix, 32), 96);
    let (_, measured) = config.sequences(WorkloadKind::MultiTurn, 32);
    assert_eq!(measured.len(), 384);
    assert!(
        measured.sessions.len() >= 2 * 32 - 1,
        "{} sessions",
        measured.sessions.len()
    );
    // A fixed count is what the user asked for.
    let fixed = ExperimentConfig {
        requests: RequestCount::Fixed(24),
        ..config
    };
    assert_eq!(fixed.requests_for(WorkloadKind::MultiTurn, 32), 24);
}

#[test]
fn bursty_runs_schedule_bursts_of_the_concurrency_and_heterogeneous_runs_a_mixed_fleet() {
    let config = ExperimentConfig {
        workloads: vec![WorkloadKind::Bursty, WorkloadKind::Heterogeneous],
        concurrency: vec![8],
        policies: vec![Policy::Random],
        requests: RequestCount::Fixed(20),
        warmup: Some(4),
        seed: 3,
        time_scale: 1.0,
        shape: WorkloadShape::default(),
        settle: Duration::ZERO,
    };
    let (warmup, measured) = config.sequences(WorkloadKind::Bursty, 8);
    assert!(warmup.sessions.iter().all(|s| s.arrival_s.is_none()));
    let arrivals: Vec<f64> = measured
        .sessions
        .iter()
        .map(|s| s.arrival_s.expect("scheduled"))
        .collect();
    let period = config.shape.burst_period_s;
    let first_burst = arrivals.iter().filter(|&&a| a < period).count();
    assert_eq!((arrivals.len(), first_burst), (20, 8));
    assert!(arrivals.iter().all(|&a| a < 3.0 * period));
    assert_eq!(config.users_for(WorkloadKind::Bursty, 8), 32);
    assert_eq!(config.users_for(WorkloadKind::SharedPrefix, 8), 8);

    let (_, measured) = config.sequences(WorkloadKind::Heterogeneous, 8);
    assert!(measured.sessions.iter().all(|s| s.arrival_s.is_none()));
    assert_eq!(
        config.fleet_for(WorkloadKind::Heterogeneous),
        Some(FleetPlan::heterogeneous())
    );
    assert_eq!(config.fleet_for(WorkloadKind::Bursty), None);
}
