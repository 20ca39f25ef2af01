use super::*;

#[test]
fn the_heterogeneous_fleet_mixes_speeds_and_cache_sizes_and_slows_a_fast_worker_halfway() {
    let plan = FleetPlan::heterogeneous();
    assert_eq!(plan.workers.len(), 4);
    let fast: Vec<_> = plan.workers.iter().filter(|w| w.slowdown == 1.0).collect();
    let slow: Vec<_> = plan.workers.iter().filter(|w| w.slowdown > 1.0).collect();
    assert_eq!((fast.len(), slow.len()), (2, 2));
    assert!(
        fast.iter()
            .all(|f| slow.iter().all(|s| f.num_blocks > s.num_blocks))
    );
    let event = plan.event.expect("a mid-run event");
    assert_eq!(plan.workers[event.worker].slowdown, 1.0, "a fast worker");
    assert!(matches!(event.change, FleetChange::Slowdown(f) if f > 1.0));
    assert_eq!(event.at_session(96), 48);
}

#[test]
fn the_restart_fleet_is_the_same_fleet_with_a_fast_worker_restarted_halfway() {
    let plan = FleetPlan::restart();
    assert_eq!(plan.workers, FleetPlan::heterogeneous().workers);
    let event = plan.event.expect("a mid-run event");
    assert_eq!(plan.workers[event.worker].slowdown, 1.0, "a fast worker");
    assert!(matches!(event.change, FleetChange::Restart { down_s } if down_s > 0.0));
    assert_eq!(event.at_session(96), 48);
}

#[test]
fn worker_args_are_vllm_sim_flags_one_list_per_worker() {
    let plan = FleetPlan::heterogeneous();
    let args = plan.worker_args();
    assert_eq!(args.len(), 4);
    assert_eq!(args[0], ["--slowdown", "1", "--num-blocks", "4096"]);
    assert_eq!(args[3], ["--slowdown", "2.5", "--num-blocks", "1365"]);
}

#[test]
fn an_event_fires_inside_the_run_whatever_its_share() {
    let at = |share: f64, sessions: usize| {
        FleetEvent {
            at_share: share,
            worker: 0,
            change: FleetChange::Slowdown(2.0),
        }
        .at_session(sessions)
    };
    assert_eq!(at(0.0, 10), 0);
    assert_eq!(at(1.0, 10), 9);
    assert_eq!(at(7.0, 10), 9);
    assert_eq!(at(0.5, 1), 0);
    assert_eq!(at(0.5, 0), 0);
}
