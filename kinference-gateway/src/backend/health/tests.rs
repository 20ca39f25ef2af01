use std::sync::Arc;

use prometheus_client::registry::Registry;

use super::{Health, HealthSettings, WorkerState};
use crate::metrics::Metrics;
use crate::routing::{Router, RoutingConfig, RoutingMode, WorkerConfig};

/// A health record over `n` workers of one model, `http://w0` ..
fn health(n: usize, settings: HealthSettings) -> (Health, Arc<Router>, Metrics) {
    let router = Arc::new(
        Router::new(RoutingConfig {
            workers: (0..n)
                .map(|i| WorkerConfig {
                    url: format!("http://w{i}"),
                    model: "m".into(),
                    role: Default::default(),
                })
                .collect(),
            models: vec![],
            agents: vec![],
            mode: RoutingMode::LeastOutstanding,
        })
        .expect("router"),
    );
    let metrics = Metrics::new();
    let health = metrics.with_registry(|r: &mut Registry| {
        Health::new(settings, Arc::clone(&router), metrics.clone(), r)
    });
    (health, router, metrics)
}

fn state(health: &Health, worker: &str) -> WorkerState {
    health
        .states()
        .into_iter()
        .find(|(w, _)| w == worker)
        .map(|(_, s)| s)
        .expect("known worker")
}

fn routable(router: &Router, worker: &str) -> bool {
    router
        .workers()
        .iter()
        .any(|w| w.url == worker && w.healthy)
}

#[test]
fn one_failed_probe_ejects_nothing_three_do_and_two_good_ones_bring_it_back() {
    let (health, router, metrics) = health(2, HealthSettings::default());
    health.probe("http://w0", true);
    health.probe("http://w0", false);
    health.probe("http://w0", false);
    assert_eq!(state(&health, "http://w0"), WorkerState::Healthy);
    assert!(routable(&router, "http://w0"));
    // A success in between starts the count again.
    health.probe("http://w0", true);
    health.probe("http://w0", false);
    health.probe("http://w0", false);
    assert!(routable(&router, "http://w0"));
    health.probe("http://w0", false);
    assert_eq!(state(&health, "http://w0"), WorkerState::Ejected);
    assert!(!routable(&router, "http://w0"));
    let text = metrics.encode();
    assert!(
        text.contains(r#"kinference_gateway_worker_health{worker="http://w0",state="ejected"} 1"#),
        "{text}"
    );

    health.probe("http://w0", true);
    assert!(
        !routable(&router, "http://w0"),
        "one good probe is not enough"
    );
    health.probe("http://w0", true);
    assert_eq!(state(&health, "http://w0"), WorkerState::Healthy);
    assert!(routable(&router, "http://w0"));
    assert!(
        metrics
            .encode()
            .contains(r#"kinference_gateway_worker_health{worker="http://w0",state="healthy"} 1"#)
    );
}

#[test]
fn the_first_probe_decides() {
    let (health, router, _) = health(2, HealthSettings::default());
    assert!(!health.any_starting(), "nothing probed yet");
    health.probe("http://w0", false);
    assert!(
        !routable(&router, "http://w0"),
        "down at start: out at once"
    );
    assert!(
        health.any_starting(),
        "probed again soon, not a full interval later"
    );
    // Never in service yet: its first good probe brings it in (a fleet still loading).
    health.probe("http://w0", true);
    assert!(routable(&router, "http://w0"));
    assert!(!health.any_starting());
}

#[test]
fn refused_connections_count_toward_the_threshold_with_probe_failures() {
    let (health, router, _) = health(3, HealthSettings::default());
    for w in ["http://w0", "http://w1", "http://w2"] {
        health.probe(w, true);
    }
    // One refusal, or two, is a passing accident: the worker keeps its traffic.
    health.connect_failed("http://w0");
    health.connect_failed("http://w0");
    assert_eq!(state(&health, "http://w0"), WorkerState::Healthy);
    assert!(routable(&router, "http://w0"));
    // The third consecutive failure ejects it, as three failed probes would.
    health.connect_failed("http://w0");
    assert_eq!(state(&health, "http://w0"), WorkerState::Ejected);
    assert!(!routable(&router, "http://w0"), "the router still picks it");

    // A good probe starts the count again; refusals and failed probes add up.
    health.connect_failed("http://w1");
    health.probe("http://w1", true);
    health.connect_failed("http://w1");
    health.connect_failed("http://w1");
    assert_eq!(state(&health, "http://w1"), WorkerState::Healthy);
    health.probe("http://w1", false);
    assert_eq!(state(&health, "http://w1"), WorkerState::Ejected);

    // Fast path: with its last probe failed too, one refusal ejects at once.
    health.probe("http://w2", false);
    assert!(
        routable(&router, "http://w2"),
        "one failed probe ejects nothing"
    );
    health.connect_failed("http://w2");
    assert_eq!(state(&health, "http://w2"), WorkerState::Ejected);
    // Back only after the good probes, like any ejected worker.
    health.probe("http://w2", true);
    assert!(!routable(&router, "http://w2"));
    health.probe("http://w2", true);
    assert!(routable(&router, "http://w2"));
}

fn outlier_settings() -> HealthSettings {
    HealthSettings {
        outlier_error_rate: 0.5,
        outlier_min_requests: 10,
        outlier_window_ms: 60_000,
        outlier_ejection_ms: 0,
        outlier_max_ejected_percent: 50,
        ..HealthSettings::default()
    }
}

#[test]
fn a_worker_whose_requests_fail_is_ejected_as_an_outlier_and_returns_after_the_ejection() {
    let (health, router, _) = health(4, outlier_settings());
    for w in 0..4 {
        health.probe(&format!("http://w{w}"), true);
    }
    // Under the minimum count nothing happens; 4 errors in 10 is under the rate.
    for i in 0..10 {
        health.observe("http://w0", i % 10 >= 4);
    }
    assert_eq!(state(&health, "http://w0"), WorkerState::Healthy);
    for _ in 0..10 {
        health.observe("http://w1", false);
    }
    assert_eq!(state(&health, "http://w1"), WorkerState::Outlier);
    assert!(!routable(&router, "http://w1"));
    // Its probes pass, but it stays out until the ejection time is over.
    health.probe("http://w1", true);
    assert!(!routable(&router, "http://w1"));
    health.expire();
    assert_eq!(state(&health, "http://w1"), WorkerState::Healthy);
    assert!(routable(&router, "http://w1"));
}

#[test]
fn the_cap_keeps_most_of_the_fleet_in_service_when_every_worker_fails() {
    let settings = HealthSettings {
        outlier_ejection_ms: 60_000,
        ..outlier_settings()
    };
    let (health, router, metrics) = health(4, settings);
    for w in 0..4 {
        health.probe(&format!("http://w{w}"), true);
    }
    for w in 0..4 {
        for _ in 0..10 {
            health.observe(&format!("http://w{w}"), false);
        }
    }
    let states: Vec<WorkerState> = (0..4)
        .map(|w| state(&health, &format!("http://w{w}")))
        .collect();
    // 50% of 4: the first two flagged are out, the others spared.
    assert_eq!(
        states,
        vec![
            WorkerState::Outlier,
            WorkerState::Outlier,
            WorkerState::Spared,
            WorkerState::Spared
        ]
    );
    let routed = router.workers().iter().filter(|w| w.healthy).count();
    assert_eq!(routed, 2);
    assert!(
        metrics
            .encode()
            .contains(r#"kinference_gateway_worker_health{worker="http://w3",state="spared"} 1"#)
    );

    // A worker down by its probes uses the room first: one outlier goes back into service.
    for _ in 0..3 {
        health.probe("http://w3", false);
    }
    let states: Vec<WorkerState> = (0..4)
        .map(|w| state(&health, &format!("http://w{w}")))
        .collect();
    assert_eq!(
        states,
        vec![
            WorkerState::Outlier,
            WorkerState::Spared,
            WorkerState::Spared,
            WorkerState::Ejected
        ]
    );
}

#[test]
fn a_single_worker_is_never_ejected_as_an_outlier() {
    let (health, router, _) = health(1, outlier_settings());
    health.probe("http://w0", true);
    for _ in 0..20 {
        health.observe("http://w0", false);
    }
    assert_eq!(state(&health, "http://w0"), WorkerState::Spared);
    assert!(routable(&router, "http://w0"));
}

#[test]
fn the_first_probe_decides_for_every_worker_whichever_answers_first() {
    let (health, router, _) = health(2, HealthSettings::default());
    // w1's probe lands first and publishes every worker's state; w0's first probe still decides.
    health.probe("http://w1", true);
    health.probe("http://w0", false);
    assert!(!routable(&router, "http://w0"));
    assert!(routable(&router, "http://w1"));
}

#[test]
fn a_worker_that_left_is_forgotten_and_a_new_one_at_its_address_starts_afresh() {
    let (health, router, metrics) = health(1, HealthSettings::default());
    assert!(router.upsert_worker("http://pod", "m"));
    health.probe("http://pod", true);
    for _ in 0..3 {
        health.connect_failed("http://pod");
    }
    assert_eq!(state(&health, "http://pod"), WorkerState::Ejected);
    assert!(
        metrics
            .encode()
            .contains(r#"kinference_gateway_worker_healthy{worker="http://pod"} 0"#)
    );
    router.remove_worker("http://pod");
    health.forget_unlisted(&router.workers());
    let text = metrics.encode();
    assert!(
        !text.contains(r#"kinference_gateway_worker_health{worker="http://pod""#),
        "{text}"
    );
    assert!(
        !text.contains(r#"kinference_gateway_worker_healthy{worker="http://pod"}"#),
        "{text}"
    );
    // A new pod with the same IP: its first good probe brings it in (the old pod needed two).
    assert!(router.upsert_worker("http://pod", "m"));
    health.probe("http://pod", true);
    assert!(routable(&router, "http://pod"));
}
