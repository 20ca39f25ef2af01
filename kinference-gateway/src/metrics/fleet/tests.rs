use kinference_api::summary::{self as pb, Summary, summary};

use super::*;
use crate::routing::{RoutingConfig, RoutingTuning, WorkerConfig};

fn view(url: &str, healthy: bool, in_flight: usize, agent_live: bool) -> WorkerView {
    WorkerView {
        url: url.into(),
        model: "m".into(),
        healthy,
        in_flight,
        agent_live,
        cached_blocks: 0,
    }
}

fn estimate(url: &str, ttft_s: f64, waiting: Option<u32>, kv_usage: Option<f32>) -> WorkerEstimate {
    WorkerEstimate {
        worker: url.into(),
        ttft_s: Some(ttft_s),
        cached_tokens: 0,
        in_flight: 0,
        waiting,
        kv_usage,
    }
}

use SignalState::{Absent, Fallback, Live, Stale, Unknown};

#[test]
fn signals_say_what_is_live_lost_or_never_there() {
    let live = view("http://a", true, 0, true);
    let fresh = estimate("http://a", 0.1, Some(2), Some(0.5));
    assert_eq!(
        worker_signals(&live, Some(&fresh), true, true),
        [Live, Live, Unknown, Live]
    );
    // The agent streams, but its scrape of the engine is old.
    let no_scrape = estimate("http://a", 0.1, None, None);
    assert_eq!(
        worker_signals(&live, Some(&no_scrape), true, false),
        [Live, Stale, Unknown, Fallback]
    );
    // An agent is followed but says nothing of this worker (stream down, or stale).
    let lost = view("http://a", true, 0, false);
    assert_eq!(
        worker_signals(&lost, Some(&no_scrape), true, true),
        [Stale, Stale, Stale, Live]
    );
    // `--worker` mode: no agent at all.
    assert_eq!(
        worker_signals(&lost, Some(&no_scrape), false, false),
        [Absent, Absent, Absent, Fallback]
    );
    // Unhealthy (no estimate): the agent's stream decides.
    let unhealthy = view("http://a", false, 0, true);
    assert_eq!(worker_signals(&unhealthy, None, true, true)[1], Live);
}

#[test]
fn pool_figures_median_ttft_summed_queue_mean_usage() {
    let a = view("http://a", true, 3, true);
    let b = view("http://b", true, 1, true);
    let c = view("http://c", false, 0, false);
    let estimates = [
        estimate("http://a", 0.4, Some(5), Some(0.5)),
        estimate("http://b", 0.1, Some(1), Some(0.25)),
        estimate("http://x", 0.2, None, None),
    ];
    let figures = pool_figures(&[&a, &b, &c], &estimates);
    assert_eq!(
        figures,
        PoolFigures {
            healthy: 2,
            unhealthy: 1,
            in_flight: 4,
            waiting: Some(6),
            kv_usage: Some(0.375),
            ttft_s: Some(0.2),
        }
    );
    assert_eq!(median(&[0.1, 0.3]), Some(0.2));
    // Nothing reported: the figures are unknown, not zero.
    let none = pool_figures(&[&c], &[]);
    assert_eq!(
        (none.waiting, none.kv_usage, none.ttft_s),
        (None, None, None)
    );
}

fn router(agents: &[&str]) -> Router {
    let config = RoutingConfig {
        workers: ["http://w0", "http://w1"]
            .iter()
            .map(|url| WorkerConfig {
                url: (*url).into(),
                model: "m".into(),
                role: Default::default(),
            })
            .collect(),
        agents: agents.iter().map(|a| (*a).to_string()).collect(),
        ..RoutingConfig::default()
    };
    let tuning = RoutingTuning {
        connect_agents: false,
        ..RoutingTuning::default()
    };
    Router::with_tuning(config, tuning).unwrap()
}

fn exposition(fleet: &Fleet) -> String {
    let mut registry = Registry::default();
    fleet.register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    text
}

#[tokio::test]
async fn without_agents_the_signals_are_absent_and_the_ttft_still_estimated() {
    let router = router(&[]);
    let fleet = Fleet::default();
    let snapshot = fleet.refresh(&router, &[]).await;
    assert_eq!(snapshot.workers.len(), 2);
    assert_eq!(
        snapshot.workers[0].signals,
        [Absent, Absent, Absent, Fallback]
    );
    let text = exposition(&fleet);
    for line in [
        "kinference_gateway_pool_workers{model=\"m\",pool=\"\",state=\"healthy\"} 2",
        "kinference_gateway_pool_requests_in_flight{model=\"m\",pool=\"\"} 0",
        "kinference_gateway_routing_signal{model=\"m\",signal=\"kv_events\",state=\"absent\"} 2",
        "kinference_gateway_routing_signal{model=\"m\",signal=\"kv_events\",state=\"live\"} 0",
        "kinference_gateway_routing_signal{model=\"m\",signal=\"tokenizer\",state=\"fallback\"} 2",
    ] {
        assert!(text.contains(line), "{line} missing:\n{text}");
    }
    assert!(
        text.contains("kinference_gateway_pool_estimated_ttft_seconds{model=\"m\",pool=\"\"} "),
        "{text}"
    );
    // Without an agent the engine's figures are unknown: no series rather than a false zero.
    assert!(
        !text.contains("kinference_gateway_pool_requests_waiting{"),
        "{text}"
    );
    assert!(
        !text.contains("kinference_gateway_pool_kv_cache_usage_ratio{"),
        "{text}"
    );
}

fn summary_of(workers: &[(&str, u32, f32)]) -> Summary {
    Summary {
        kind: Some(summary::Kind::Snapshot(pb::Snapshot {
            node: "n1".into(),
            epoch: 1,
            workers: workers
                .iter()
                .map(|(url, waiting, kv_usage)| pb::WorkerState {
                    worker_id: (*url).into(),
                    model: "m".into(),
                    block_size: 16,
                    keys: vec![1, 2],
                    role: String::new(),
                    offloaded_keys: Vec::new(),
                    data_parallel_rank: None,
                    load: Some(pb::WorkerLoad {
                        running: 1,
                        waiting: *waiting,
                        kv_usage: *kv_usage,
                        metrics_ok: true,
                        ..Default::default()
                    }),
                })
                .collect(),
            node_state: None,
        })),
    }
}

#[tokio::test]
async fn an_agent_brings_the_engine_figures_and_its_loss_shows_as_stale() {
    let router = router(&["http://agent:7070"]);
    let fleet = Fleet::default();
    // Followed, nothing heard yet: every agent signal is stale.
    let before = fleet.refresh(&router, &[]).await;
    assert_eq!(before.workers[0].signals, [Stale, Stale, Stale, Fallback]);
    let text = exposition(&fleet);
    assert!(text.contains(
        "kinference_gateway_routing_signal{model=\"m\",signal=\"engine_metrics\",state=\"stale\"} 2"
    ), "{text}");

    router.apply_agent_summary(
        0,
        summary_of(&[("http://w0", 3, 0.5), ("http://w1", 1, 0.25)]),
    );
    let after = fleet.refresh(&router, &[]).await;
    assert_eq!(after.workers[0].signals, [Live, Live, Unknown, Fallback]);
    let json = after.workers[1].signals_json();
    assert_eq!(json["kv_events"], "live");
    assert_eq!(json["ebpf"], "unknown");
    let text = exposition(&fleet);
    for line in [
        "kinference_gateway_pool_requests_waiting{model=\"m\",pool=\"\"} 4",
        "kinference_gateway_pool_kv_cache_usage_ratio{model=\"m\",pool=\"\"} 0.375",
        "kinference_gateway_routing_signal{model=\"m\",signal=\"engine_metrics\",state=\"live\"} 2",
        "kinference_gateway_routing_signal{model=\"m\",signal=\"engine_metrics\",state=\"stale\"} 0",
    ] {
        assert!(text.contains(line), "{line} missing:\n{text}");
    }
}

#[test]
fn pool_series_split_a_models_workers_by_inference_pool() {
    let views = [
        view("http://a", true, 1, true),
        view("http://b", true, 2, true),
        view("http://c", false, 4, true),
    ];
    let workers: Vec<&WorkerView> = views.iter().collect();
    let estimates = [
        estimate("http://a", 0.1, Some(1), Some(0.2)),
        estimate("http://b", 0.3, Some(5), Some(0.6)),
    ];
    let pool = |name: &str, workers: Option<&[&str]>| PoolMembers {
        name: name.into(),
        models: vec!["m".into()],
        workers: workers.map(|w| w.iter().map(|u| u.to_string()).collect()),
    };
    let of = |series: &[PoolSeries], pool: &str| {
        series
            .iter()
            .find(|s| s.pool == pool)
            .map(|s| s.figures.clone())
            .unwrap_or_else(|| panic!("no series for pool {pool:?}: {series:?}"))
    };

    // Without pools: one series, as before, with an empty pool label.
    let series = pool_series("m", &workers, &estimates, &[]);
    assert_eq!(series.len(), 1);
    assert_eq!(of(&series, "").in_flight, 7);

    // Two pools: each over its own workers; c, in neither, has the empty-pool series.
    let pools = [
        pool("near", Some(&["http://a"])),
        pool("far", Some(&["http://b"])),
    ];
    let series = pool_series("m", &workers, &estimates, &pools);
    assert_eq!(series.len(), 3, "{series:?}");
    let near = of(&series, "near");
    assert_eq!(
        (near.healthy, near.in_flight, near.waiting),
        (1, 1, Some(1))
    );
    let far = of(&series, "far");
    assert_eq!((far.healthy, far.in_flight, far.waiting), (1, 2, Some(5)));
    let rest = of(&series, "");
    assert_eq!((rest.healthy, rest.unhealthy, rest.in_flight), (0, 1, 4));

    // A pool without a worker list stands for every worker of its model: no leftover series.
    let series = pool_series("m", &workers, &estimates, &[pool("all", None)]);
    assert_eq!(series.len(), 1);
    assert_eq!(of(&series, "all").in_flight, 7);
    // Pools of another model add nothing.
    let other = PoolMembers {
        models: vec!["other".into()],
        ..pool("x", None)
    };
    assert_eq!(pool_series("m", &workers, &estimates, &[other]).len(), 1);
}
