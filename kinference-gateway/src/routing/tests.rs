use kinference_api::KeyHasher;

use super::*;

fn config(mode: RoutingMode) -> RoutingConfig {
    RoutingConfig {
        workers: vec![
            WorkerConfig {
                url: "http://w1".into(),
                model: "m".into(),
                role: Default::default(),
            },
            WorkerConfig {
                url: "http://w2".into(),
                model: "m".into(),
                role: Default::default(),
            },
        ],
        models: vec![ModelConfig {
            name: "m".into(),
            tokenizer_dir: None,
            serves_messages: false,
            profile: None,
        }],
        agents: vec![],
        mode,
    }
}

fn req(prompt: &str) -> RouteRequest<'_> {
    RouteRequest {
        model: "m",
        prompt: Prompt::Text(prompt),
        debug: true,
        tokens: None,
        salt: None,
        session: None,
        answers: Default::default(),
    }
}

#[tokio::test]
async fn least_outstanding_spreads_and_tickets_release() {
    let router = Router::new(config(RoutingMode::LeastOutstanding)).unwrap();
    let a = router.pick(req("hello")).await.unwrap();
    let b = router.pick(req("hello")).await.unwrap();
    assert_ne!(a.worker, b.worker);
    assert_eq!(
        router.workers().iter().map(|w| w.in_flight).sum::<usize>(),
        2
    );
    a.ticket.finish(true, 16, None);
    drop(b);
    assert_eq!(
        router.workers().iter().map(|w| w.in_flight).sum::<usize>(),
        0
    );
}

#[test]
fn a_removed_worker_is_no_longer_listed_until_it_comes_back() {
    let router = Router::new(config(RoutingMode::Kinference)).unwrap();
    assert!(router.upsert_worker("http://discovered", "m"));
    let urls = |r: &Router| r.workers().into_iter().map(|w| w.url).collect::<Vec<_>>();
    assert_eq!(
        urls(&router),
        ["http://w1", "http://w2", "http://discovered"]
    );
    router.remove_worker("http://discovered");
    // Configured workers stay whatever discovery says.
    router.remove_worker("http://w1");
    assert_eq!(urls(&router), ["http://w1", "http://w2"]);
    assert!(router.upsert_worker("http://discovered", "m"));
    assert_eq!(
        urls(&router),
        ["http://w1", "http://w2", "http://discovered"]
    );
}

#[tokio::test]
async fn unknown_model_is_an_error() {
    let router = Router::new(config(RoutingMode::Kinference)).unwrap();
    let err = router
        .pick(RouteRequest {
            model: "other",
            prompt: Prompt::Text("x"),
            debug: false,
            tokens: None,
            salt: None,
            session: None,
            answers: Default::default(),
        })
        .await
        .unwrap_err();
    assert_eq!(err, RouteError::UnknownModel("other".into()));
}

#[test]
fn modes_parse_from_config_names() {
    for mode in [
        RoutingMode::Kinference,
        RoutingMode::LeastOutstanding,
        RoutingMode::Random,
        RoutingMode::RoundRobin,
        RoutingMode::PrefixHash,
    ] {
        assert_eq!(mode.as_str().parse::<RoutingMode>().unwrap(), mode);
    }
}

// ---- The cache-aware router, with the real Qwen2 tokenizer and agent messages applied directly ----

use std::path::PathBuf;

use kinference_api::summary::{self as pb, Summary, summary};
use kinference_api::tokenize::ModelTokenizer;

/// Nothing listens here: the agent task keeps failing to connect, and the tests apply messages.
const DEAD_AGENT: &str = "http://127.0.0.1:9";

fn tokenizer_dir() -> PathBuf {
    let dir = std::env::var_os("KINFERENCE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.assets/qwen2")));
    assert!(
        dir.join("tokenizer.json").exists(),
        "no tokenizer at {}: run `cargo xtask setup`",
        dir.display()
    );
    dir
}

fn kconfig(workers: usize, agents: &[&str]) -> RoutingConfig {
    RoutingConfig {
        workers: (0..workers)
            .map(|i| WorkerConfig {
                url: format!("http://w{i}"),
                model: "m".into(),
                role: Default::default(),
            })
            .collect(),
        models: vec![ModelConfig {
            name: "m".into(),
            tokenizer_dir: Some(tokenizer_dir()),
            serves_messages: false,
            profile: None,
        }],
        agents: agents.iter().map(|a| a.to_string()).collect(),
        mode: RoutingMode::Kinference,
    }
}

fn system_prompt() -> String {
    "You are a meticulous assistant for a logistics company. Answer precisely and cite the policy. "
        .repeat(40)
}

/// Block keys (block size 16) of `text` as a completion prompt.
fn keys_of(text: &str) -> Vec<u64> {
    let tok = ModelTokenizer::from_dir(tokenizer_dir()).unwrap();
    let ids = tok.encode_text(text, true).unwrap();
    KeyHasher::for_model("m").keys(None, &ids, 16)
}

fn load(running: u32, waiting: u32) -> pb::WorkerLoad {
    pb::WorkerLoad {
        running,
        waiting,
        metrics_ok: true,
        ..Default::default()
    }
}

fn worker_state(url: &str, keys: Vec<u64>, load: pb::WorkerLoad) -> pb::WorkerState {
    pb::WorkerState {
        worker_id: url.into(),
        model: "m".into(),
        block_size: 16,
        keys,
        load: Some(load),
        role: String::new(),
        offloaded_keys: Vec::new(),
        data_parallel_rank: None,
    }
}

fn snapshot(epoch: u64, workers: Vec<pb::WorkerState>) -> Summary {
    Summary {
        kind: Some(summary::Kind::Snapshot(pb::Snapshot {
            node: "n1".into(),
            epoch,
            workers,
            node_state: None,
        })),
    }
}

fn delta(workers: Vec<pb::WorkerDelta>) -> Summary {
    Summary {
        kind: Some(summary::Kind::Delta(pb::Delta {
            workers,
            node_state: None,
        })),
    }
}

/// Stops the agent task (nothing listens at [`DEAD_AGENT`]) and marks its stream up, so the test can
/// apply the agent's messages itself, as the stream would.
fn attach_agent(router: &Router) {
    for t in &router.tasks {
        t.abort();
    }
    let agent = router.shared.agent(0);
    let mut st = agent.lock();
    st.connected = true;
    st.since = Instant::now();
}

fn text(prompt: &str) -> RouteRequest<'_> {
    RouteRequest {
        model: "m",
        prompt: Prompt::Text(prompt),
        debug: true,
        tokens: None,
        salt: None,
        session: None,
        answers: Default::default(),
    }
}

#[tokio::test]
async fn routes_a_known_scenario_to_where_the_cache_is() {
    let router = Router::new(kconfig(3, &[DEAD_AGENT])).unwrap();
    attach_agent(&router);
    let system = system_prompt();
    let keys = keys_of(&system);
    assert!(keys.len() > 40, "{}", keys.len());
    agents::apply(
        &router.shared,
        0,
        snapshot(
            1,
            vec![
                worker_state("http://w0", vec![], load(0, 0)),
                worker_state("http://w1", keys[..2].to_vec(), load(0, 0)),
                worker_state("http://w2", keys.clone(), load(1, 0)),
            ],
        ),
    );
    let prompt = format!("{system}Where is parcel 1234?");
    let d = router.pick(text(&prompt)).await.unwrap();
    assert_eq!(d.worker, "http://w2", "{:?}", d.explain);
    assert_eq!(d.reason, "cache_hit");
    let explain = d.explain.clone().unwrap();
    assert!(
        explain.contains(&format!("*http://w2 cached={}", keys.len() * 16)),
        "{explain}"
    );
    assert!(explain.contains("http://w1 cached=32 "), "{explain}");
    assert!(d.prompt_tokens.unwrap() > keys.len() * 16);
    let views = router.workers();
    assert_eq!(
        views
            .iter()
            .find(|w| w.url == "http://w2")
            .unwrap()
            .cached_blocks,
        keys.len()
    );
    assert!(views.iter().all(|w| w.agent_live));
}

#[tokio::test]
async fn speculative_credit_keeps_a_burst_of_one_prefix_together() {
    // No agent at all: the credit is the only cache signal, and the reason says so.
    let router = Router::new(kconfig(3, &[])).unwrap();
    let system = system_prompt();
    let mut tickets = Vec::new();
    for i in 0..4 {
        let prompt = format!("{system}Question {i}?");
        let d = router.pick(text(&prompt)).await.unwrap();
        assert_eq!(d.reason, "degraded_no_agent");
        tickets.push(d);
    }
    // The second request finds the first one's credit (the blocks are not even computed yet). Later
    // ones may replicate the prefix elsewhere once queueing behind it costs more than a miss.
    let first = &tickets[0].worker;
    assert_eq!(&tickets[1].worker, first);
    let explain = tickets[1].explain.as_deref().unwrap();
    assert!(explain.contains(&format!("*{first} cached=")), "{explain}");
    assert!(
        !explain.contains(&format!("*{first} cached=0 ")),
        "{explain}"
    );
}

#[tokio::test]
async fn with_a_live_agent_the_credit_ends_soon_after_the_first_token() {
    // The worker's events never confirm the prefix (it was evicted, or never stored): once the request's
    // prefill is over the credit must not keep drawing the prefix's requests to that worker.
    let tuning = RoutingTuning {
        speculative_after_first_token: Duration::from_millis(20),
        ..RoutingTuning::default()
    };
    let router = Router::with_tuning(kconfig(3, &[DEAD_AGENT]), tuning).unwrap();
    attach_agent(&router);
    let workers = ["http://w0", "http://w1", "http://w2"]
        .iter()
        .map(|w| worker_state(w, vec![], load(0, 0)))
        .collect();
    agents::apply(&router.shared, 0, snapshot(1, workers));
    let system = system_prompt();
    let prompt = |i: usize| format!("{system}Question {i}?");
    let mut first = router.pick(text(&prompt(0))).await.unwrap();
    let credited = |d: &Decision| {
        let explain = d.explain.as_deref().unwrap();
        !explain.contains(&format!("{} cached=0 ", first_worker(explain)))
    };
    fn first_worker(explain: &str) -> &str {
        explain.split("; ").find(|c| c.starts_with('*')).unwrap()[1..]
            .split(' ')
            .next()
            .unwrap()
    }
    let second = router.pick(text(&prompt(1))).await.unwrap();
    assert_eq!(second.worker, first.worker, "{:?}", second.explain);
    assert!(credited(&second), "{:?}", second.explain);
    first.ticket.first_token();
    drop(second);
    tokio::time::sleep(Duration::from_millis(60)).await;
    let third = router.pick(text(&prompt(2))).await.unwrap();
    let explain = third.explain.as_deref().unwrap();
    assert!(
        explain.split("; ").all(|c| c.contains(" cached=0 ")),
        "no worker is credited any more: {explain}"
    );
}

#[tokio::test]
async fn misses_spread_over_idle_workers() {
    let router = Router::new(kconfig(4, &[DEAD_AGENT])).unwrap();
    let mut counts = std::collections::HashMap::new();
    for i in 0..80 {
        // Distinct first tokens: no prompt shares a block with another.
        let prompt = format!("{i} unrelated request number {i} about topic {}", i * 7);
        let d = router.pick(text(&prompt)).await.unwrap();
        // Never connected: the agent's data is missing, and the reason says so.
        assert_eq!(d.reason, "degraded_stale");
        *counts.entry(d.worker.clone()).or_insert(0usize) += 1;
    }
    assert_eq!(counts.len(), 4, "{counts:?}");
    assert!(counts.values().all(|c| *c >= 8), "{counts:?}");
}

#[tokio::test]
async fn load_guard_stops_piling_onto_the_cached_worker() {
    let router = Router::new(kconfig(3, &[DEAD_AGENT])).unwrap();
    attach_agent(&router);
    let system = system_prompt();
    let keys = keys_of(&system);
    agents::apply(
        &router.shared,
        0,
        snapshot(
            1,
            vec![
                worker_state("http://w0", keys.clone(), load(40, 0)),
                worker_state("http://w1", vec![], load(0, 0)),
                worker_state("http://w2", vec![], load(0, 0)),
            ],
        ),
    );
    let prompt = format!("{system}Where is parcel 1234?");
    let d = router.pick(text(&prompt)).await.unwrap();
    assert_ne!(d.worker, "http://w0", "{:?}", d.explain);
    assert_eq!(d.reason, "load_guard");
    // Under the guard's slack the cache wins again.
    agents::apply(
        &router.shared,
        0,
        delta(vec![pb::WorkerDelta {
            worker_id: "http://w0".into(),
            load: Some(load(10, 0)),
            ..Default::default()
        }]),
    );
    let d = router.pick(text(&prompt)).await.unwrap();
    assert_eq!(d.worker, "http://w0", "{:?}", d.explain);
}

#[tokio::test]
async fn deltas_snapshots_and_epochs_update_the_index() {
    let router = Router::new(kconfig(1, &[DEAD_AGENT])).unwrap();
    attach_agent(&router);
    let blocks = |url: &str| {
        router
            .workers()
            .into_iter()
            .find(|w| w.url == url)
            .map(|w| w.cached_blocks)
    };
    let keys: Vec<u64> = (1..=8).collect();
    agents::apply(
        &router.shared,
        0,
        snapshot(
            7,
            vec![worker_state("http://w0", keys[..4].to_vec(), load(0, 0))],
        ),
    );
    assert_eq!(blocks("http://w0"), Some(4));
    agents::apply(
        &router.shared,
        0,
        delta(vec![
            pb::WorkerDelta {
                worker_id: "http://w0".into(),
                added: keys[4..].to_vec(),
                removed: vec![1],
                ..Default::default()
            },
            // A worker the config does not list, discovered through the agent.
            pb::WorkerDelta {
                worker_id: "http://d1".into(),
                model: "m".into(),
                block_size: 16,
                added: vec![100, 101],
                ..Default::default()
            },
        ]),
    );
    assert_eq!(blocks("http://w0"), Some(7));
    assert_eq!(blocks("http://d1"), Some(2));
    assert!(router.shared.index.read().contains(
        100,
        router.shared.workers.read().get("http://d1").unwrap().id
    ));
    agents::apply(
        &router.shared,
        0,
        delta(vec![pb::WorkerDelta {
            worker_id: "http://w0".into(),
            cleared: true,
            added: vec![42],
            ..Default::default()
        }]),
    );
    assert_eq!(blocks("http://w0"), Some(1));
    agents::apply(
        &router.shared,
        0,
        delta(vec![pb::WorkerDelta {
            worker_id: "http://d1".into(),
            gone: true,
            ..Default::default()
        }]),
    );
    // Reported gone: not listed any more (nor a candidate), and its keys are out of the index.
    assert_eq!(blocks("http://d1"), None);
    let d1 = router.shared.workers.read().get("http://d1").unwrap().id;
    assert!(!router.shared.index.read().contains(100, d1));
    // The agent restarted: its new snapshot replaces everything it said before.
    agents::apply(
        &router.shared,
        0,
        snapshot(8, vec![worker_state("http://w0", vec![5, 6], load(0, 0))]),
    );
    assert_eq!(blocks("http://w0"), Some(2));
    assert_eq!(router.shared.index.read().pairs(), 2);
}

#[tokio::test]
async fn first_token_teaches_the_worker_its_rate_and_releases_the_queue() {
    let router = Router::new(kconfig(1, &[])).unwrap();
    let prompt = system_prompt();
    let mut d = router.pick(text(&prompt)).await.unwrap();
    let worker = router
        .shared
        .workers
        .read()
        .get("http://w0")
        .cloned()
        .unwrap();
    assert!(worker.state.lock().backlog.tokens(Instant::now()) > 500.0);
    tokio::time::sleep(Duration::from_millis(30)).await;
    d.ticket.first_token();
    {
        let st = worker.state.lock();
        assert_eq!(st.backlog.tokens(Instant::now()), 0.0);
        assert_eq!(st.rates.samples, 1);
        assert_eq!(st.in_flight, 1);
    }
    d.ticket.finish(true, 16, Some(0));
    assert_eq!(worker.state.lock().in_flight, 0);
}

#[tokio::test]
async fn unhealthy_workers_are_skipped() {
    let router = Router::new(kconfig(2, &[])).unwrap();
    router.set_healthy("http://w0", false);
    for _ in 0..5 {
        assert_eq!(
            router.pick(text("hello there")).await.unwrap().worker,
            "http://w1"
        );
    }
    router.set_healthy("http://w1", false);
    assert_eq!(
        router.pick(text("x")).await.unwrap_err(),
        RouteError::NoHealthyWorker("m".into())
    );
}

#[tokio::test]
async fn baselines_route_by_their_rule() {
    let mut cfg = kconfig(3, &[]);
    cfg.mode = RoutingMode::RoundRobin;
    let router = Router::new(cfg.clone()).unwrap();
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(router.pick(text("p")).await.unwrap().worker);
    }
    seen.sort();
    assert_eq!(seen, vec!["http://w0", "http://w1", "http://w2"]);
    cfg.mode = RoutingMode::PrefixHash;
    let router = Router::new(cfg).unwrap();
    let a = router
        .pick(text(&format!("{}A", system_prompt())))
        .await
        .unwrap();
    let b = router
        .pick(text(&format!("{}B", system_prompt())))
        .await
        .unwrap();
    assert_eq!(a.worker, b.worker);
    assert_eq!(a.reason, "prefix_hash");
}

#[tokio::test]
async fn routing_time_is_exported_by_mode_and_stage() {
    fn exposition(router: &Router) -> String {
        let mut registry = prometheus_client::registry::Registry::default();
        router.register_metrics(&mut registry);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        out
    }
    let router = Router::new(kconfig(2, &[DEAD_AGENT])).unwrap();
    for i in 0..3 {
        router.pick(text(&format!("question {i}"))).await.unwrap();
    }
    let out = exposition(&router);
    for stage in ["tokenize", "decide"] {
        assert!(
            out.contains(&format!(
                "kinference_routing_stage_seconds_count{{mode=\"kinference\",stage=\"{stage}\"}} 3"
            )),
            "{out}"
        );
    }
    // A baseline has no tokenization stage: it decides only.
    let baseline = Router::new(config(RoutingMode::Random)).unwrap();
    baseline.pick(req("hello")).await.unwrap();
    let out = exposition(&baseline);
    assert!(
        out.contains("kinference_routing_stage_seconds_count{mode=\"random\",stage=\"decide\"} 1"),
        "{out}"
    );
    assert!(!out.contains("stage=\"tokenize\""), "{out}");
}

#[tokio::test]
async fn agents_added_and_removed_at_runtime_bring_and_take_their_cache_view() {
    let tuning = RoutingTuning {
        connect_agents: false,
        ..RoutingTuning::default()
    };
    let router = Router::with_tuning(kconfig(2, &[]), tuning).unwrap();
    let w0 = |r: &Router| {
        r.workers()
            .into_iter()
            .find(|w| w.url == "http://w0")
            .unwrap()
    };
    let view = || {
        snapshot(
            1,
            vec![worker_state("http://w0", vec![1, 2, 3], load(0, 0))],
        )
    };
    assert!(router.agent_urls().is_empty());
    assert!(router.add_agent("http://10.0.0.1:7070"));
    assert!(!router.add_agent("http://10.0.0.1:7070"), "added twice");
    router.apply_agent_summary(0, view());
    assert!(w0(&router).agent_live);
    assert_eq!(w0(&router).cached_blocks, 3);

    // The node's agent pod replaced (a new IP): the new one joins, the old one leaves with its view.
    assert!(router.add_agent("http://10.0.0.2:7070"));
    assert!(router.remove_agent("http://10.0.0.1:7070"));
    assert!(
        !router.remove_agent("http://10.0.0.1:7070"),
        "removed twice"
    );
    assert_eq!(router.agent_urls(), ["http://10.0.0.2:7070"]);
    assert!(!w0(&router).agent_live);
    assert_eq!(w0(&router).cached_blocks, 0);
    // A late message of the removed agent changes nothing; the new agent's snapshot restores the view.
    router.apply_agent_summary(0, view());
    assert_eq!(w0(&router).cached_blocks, 0);
    router.apply_agent_summary(1, view());
    assert!(w0(&router).agent_live);
    assert_eq!(w0(&router).cached_blocks, 3);
}

#[tokio::test]
async fn a_prefix_shared_with_a_request_in_flight_survives_a_full_cache() {
    // w0 holds the prompt's prefix with room to spare and draws the first request, which stays in
    // flight (decoding). Then w0's cache fills up (99% held by running requests, ours among them): the prefix the
    // request in flight holds cannot be evicted, so the next request with it still goes to w0. Once the
    // first request ends, the prefix is exposed to the room again and the next one goes to w1.
    let system = system_prompt();
    let keys = keys_of(&system);
    let router = Router::new(kconfig(2, &[DEAD_AGENT])).unwrap();
    attach_agent(&router);
    let apply = |epoch: u64, w0: pb::WorkerLoad| {
        let idle = pb::WorkerLoad {
            num_gpu_blocks: 64,
            ..load(0, 0)
        };
        agents::apply(
            &router.shared,
            0,
            snapshot(
                epoch,
                vec![
                    worker_state("http://w0", keys.clone(), w0),
                    worker_state("http://w1", vec![], idle),
                ],
            ),
        );
    };
    apply(
        1,
        pb::WorkerLoad {
            num_gpu_blocks: 64,
            ..load(0, 0)
        },
    );
    let first = router
        .pick(text(&format!("{system}Where is parcel 1234?")))
        .await
        .unwrap();
    assert_eq!(first.worker, "http://w0", "{:?}", first.explain);
    // It is decoding now (running, not waiting).
    let mut first = first;
    first.ticket.first_token();

    let full = pb::WorkerLoad {
        kv_usage: 0.99,
        num_gpu_blocks: 64,
        ..load(8, 0)
    };
    apply(2, full);
    let second = router
        .pick(text(&format!("{system}Where is parcel 5678?")))
        .await
        .unwrap();
    let explain = second.explain.clone().unwrap();
    assert_eq!(second.worker, "http://w0", "{explain}");
    assert!(
        explain.contains(&format!("free:1 run:{0}->{0} pinned:{0}", keys.len())),
        "{explain}"
    );

    drop(first);
    drop(second);
    apply(3, full);
    let third = router
        .pick(text(&format!("{system}Where is parcel 9012?")))
        .await
        .unwrap();
    assert_eq!(third.worker, "http://w1", "{:?}", third.explain);
}

#[tokio::test]
async fn a_worker_with_no_room_for_the_prefix_loses_it_in_the_estimate() {
    // w0 holds the prompt's prefix but its cache is all held by 8 running requests (63 of 64 blocks):
    // the prefix is evicted before the request runs. With the capacity unknown it still draws the
    // request, and the explanation says why.
    let system = system_prompt();
    let keys = keys_of(&system);
    let prompt = format!("{system}Where is parcel 1234?");
    let route = |num_gpu_blocks: u32| {
        let router = Router::new(kconfig(2, &[DEAD_AGENT])).unwrap();
        attach_agent(&router);
        let full = pb::WorkerLoad {
            kv_usage: 0.99,
            num_gpu_blocks,
            ..load(8, 0)
        };
        let idle = pb::WorkerLoad {
            num_gpu_blocks,
            ..load(0, 0)
        };
        agents::apply(
            &router.shared,
            0,
            snapshot(
                1,
                vec![
                    worker_state("http://w0", keys.clone(), full),
                    worker_state("http://w1", vec![], idle),
                ],
            ),
        );
        router
    };
    let unknown = route(0);
    let d = unknown.pick(text(&prompt)).await.unwrap();
    let explain = d.explain.clone().unwrap();
    assert_eq!(
        (d.worker.as_str(), d.reason),
        ("http://w0", "cache_hit"),
        "{explain}"
    );
    assert!(explain.contains("kv=capacity_unknown"), "{explain}");

    let known = route(64);
    let d = known.pick(text(&prompt)).await.unwrap();
    let explain = d.explain.clone().unwrap();
    assert_eq!(d.worker, "http://w1", "{explain}");
    assert!(
        explain.contains(&format!(
            "kv=capacity:64 in_use:63 queued:0 free:1 run:{}->1 pinned:0",
            keys.len()
        )),
        "{explain}"
    );
}

/// Prompts that share no block: only the session can tie their decisions together.
fn unrelated_prompt(i: usize) -> String {
    let words = [
        "granite", "harbour", "violet", "orbit", "lantern", "meadow", "cipher", "tundra",
    ];
    let w = words[i % words.len()];
    format!("{i} {w} ").repeat(60 + i)
}

#[tokio::test]
async fn a_session_returns_to_its_worker_until_another_is_clearly_faster() {
    let router = Router::new(kconfig(3, &[DEAD_AGENT])).unwrap();
    attach_agent(&router);
    let idle = |url: &str| worker_state(url, vec![], load(0, 0));
    agents::apply(
        &router.shared,
        0,
        snapshot(
            1,
            vec![idle("http://w0"), idle("http://w1"), idle("http://w2")],
        ),
    );
    let session = SessionKey::new("tenant-a", "conversation-1");
    let turn = |i: usize| {
        let prompt = unrelated_prompt(i);
        let router = &router;
        async move {
            let mut r = text(&prompt);
            r.session = session;
            let d = router.pick(r).await.unwrap();
            d.ticket.finish(true, 16, None);
            (d.worker, d.reason)
        }
    };
    let (first, _) = turn(0).await;
    for i in 1..8 {
        let (worker, reason) = turn(i).await;
        assert_eq!(worker, first, "turn {i}: {reason}");
    }
    assert_eq!(router.sessions_remembered(), 1);

    // Another tenant's same name is another session: its turns spread like any cold prompt.
    let mut spread = std::collections::BTreeSet::new();
    for i in 8..40 {
        let prompt = unrelated_prompt(i);
        let mut r = text(&prompt);
        r.session = SessionKey::new("tenant-b", &format!("conversation-{i}"));
        spread.insert(router.pick(r).await.unwrap().worker);
    }
    assert!(spread.len() > 1, "{spread:?}");

    // The session's worker now has a long queue: a clearly faster worker takes the turn.
    agents::apply(
        &router.shared,
        0,
        delta(vec![pb::WorkerDelta {
            worker_id: first.clone(),
            load: Some(load(24, 24)),
            ..Default::default()
        }]),
    );
    let (worker, reason) = turn(40).await;
    assert_ne!(worker, first, "{reason}");
}

#[tokio::test]
async fn sessions_turned_off_are_not_remembered() {
    let router = Router::new(kconfig(2, &[DEAD_AGENT])).unwrap();
    attach_agent(&router);
    router.configure_sessions(&SessionsConfig {
        enabled: false,
        ..SessionsConfig::default()
    });
    let prompt = unrelated_prompt(1);
    let mut r = text(&prompt);
    r.session = SessionKey::new("tenant-a", "conversation-1");
    router.pick(r).await.unwrap();
    assert_eq!(router.sessions_remembered(), 0);
}

/// The estimate from a decision's explanation for `worker` (`est_s=`).
fn estimated(explain: &str, worker: &str) -> f64 {
    let part = explain
        .split("; ")
        .find(|p| p.trim_start_matches('*').starts_with(&format!("{worker} ")))
        .unwrap_or_else(|| panic!("{worker} not in {explain}"));
    let v = part
        .split("est_s=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    v.parse().unwrap()
}

#[tokio::test]
async fn a_prefix_offloaded_to_cpu_counts_between_a_gpu_hit_and_a_miss() {
    let router = Router::new(kconfig(3, &[DEAD_AGENT])).unwrap();
    attach_agent(&router);
    let prompt = format!("{}Where is parcel 1234?", system_prompt());
    let keys = keys_of(&prompt);
    let mut offloaded = worker_state("http://w1", vec![], load(0, 0));
    offloaded.offloaded_keys = keys.clone();
    agents::apply(
        &router.shared,
        0,
        snapshot(
            1,
            vec![
                worker_state("http://w0", keys.clone(), load(0, 0)),
                offloaded,
                worker_state("http://w2", vec![], load(0, 0)),
            ],
        ),
    );
    let d = router.pick(text(&prompt)).await.unwrap();
    let explain = d.explain.clone().unwrap();
    assert_eq!(d.worker, "http://w0", "{explain}");
    let held = d.prompt_tokens.unwrap() - 1;
    assert!(
        explain.contains(&format!("http://w1 cached=0 offloaded={held} ")),
        "{explain}"
    );
    let (gpu, cpu, miss) = (
        estimated(&explain, "http://w0"),
        estimated(&explain, "http://w1"),
        estimated(&explain, "http://w2"),
    );
    assert!(gpu < cpu && cpu < miss, "{explain}");
}

#[tokio::test]
async fn a_delta_moving_a_prefix_to_the_cpu_tier_turns_its_hit_into_a_load() {
    let router = Router::new(kconfig(2, &[DEAD_AGENT])).unwrap();
    attach_agent(&router);
    let prompt = format!("{}Where is parcel 1234?", system_prompt());
    let keys = keys_of(&prompt);
    agents::apply(
        &router.shared,
        0,
        snapshot(
            1,
            vec![
                worker_state("http://w0", keys.clone(), load(0, 0)),
                worker_state("http://w1", vec![], load(0, 0)),
            ],
        ),
    );
    // vLLM evicted the GPU copy; its CPU offloading kept one.
    agents::apply(
        &router.shared,
        0,
        delta(vec![pb::WorkerDelta {
            worker_id: "http://w0".into(),
            removed: keys.clone(),
            offloaded_added: keys.clone(),
            ..Default::default()
        }]),
    );
    let d = router.pick(text(&prompt)).await.unwrap();
    let explain = d.explain.clone().unwrap();
    let held = d.prompt_tokens.unwrap() - 1;
    assert!(
        explain.contains(&format!("*http://w0 cached=0 offloaded={held} ")),
        "{explain}"
    );
    drop(d);
    // And dropped from the CPU tier too: a miss like any other.
    agents::apply(
        &router.shared,
        0,
        delta(vec![pb::WorkerDelta {
            worker_id: "http://w0".into(),
            offloaded_removed: keys.clone(),
            ..Default::default()
        }]),
    );
    assert_eq!(router.shared.offloaded.read().pairs(), 0);
}

/// One data-parallel rank of `url`, as an agent reports it.
fn rank_state(url: &str, rank: u32, keys: Vec<u64>, load: pb::WorkerLoad) -> pb::WorkerState {
    pb::WorkerState {
        data_parallel_rank: Some(rank),
        ..worker_state(url, keys, load)
    }
}

#[tokio::test]
async fn each_rank_of_a_worker_is_its_own_cache_and_is_picked_by_rank() {
    // w0 from the configuration, reported by its agent rank by rank; w1 rank-less.
    let router = Router::new(kconfig(2, &[DEAD_AGENT])).unwrap();
    attach_agent(&router);
    let system = system_prompt();
    let keys = keys_of(&system);
    agents::apply(
        &router.shared,
        0,
        snapshot(
            1,
            vec![
                rank_state("http://w0", 0, vec![], load(0, 0)),
                rank_state("http://w0", 1, keys.clone(), load(0, 0)),
                worker_state("http://w1", keys[..2].to_vec(), load(0, 0)),
            ],
        ),
    );
    let prompt = format!("{system}Where is parcel 1234?");
    let d = router.pick(text(&prompt)).await.unwrap();
    let explain = d.explain.clone().unwrap();
    assert_eq!(
        (d.worker.as_str(), d.dp_rank),
        ("http://w0", Some(1)),
        "{explain}"
    );
    assert!(explain.contains("*http://w0#dp1 cached="), "{explain}");
    assert!(explain.contains("http://w0#dp0 cached=0 "), "{explain}");
    // The configured, rank-less entry of w0 holds no cache: its ranks stand in for it.
    assert!(!explain.contains("http://w0 cached="), "{explain}");

    // A prompt only w1 holds goes there, rank-less: no rank to send.
    let w1_keys = keys_of("A rank-less worker's own prompt. ".repeat(20).as_str());
    agents::apply(
        &router.shared,
        0,
        delta(vec![pb::WorkerDelta {
            worker_id: "http://w1".into(),
            added: w1_keys,
            ..Default::default()
        }]),
    );
    let d = router
        .pick(text(&"A rank-less worker's own prompt. ".repeat(20)))
        .await
        .unwrap();
    assert_eq!(
        (d.worker.as_str(), d.dp_rank),
        ("http://w1", None),
        "{:?}",
        d.explain
    );

    // A delta names its rank: rank 0 gets the prompt, and rank 1 loses it.
    agents::apply(
        &router.shared,
        0,
        delta(vec![
            pb::WorkerDelta {
                worker_id: "http://w0".into(),
                data_parallel_rank: Some(1),
                cleared: true,
                ..Default::default()
            },
            pb::WorkerDelta {
                worker_id: "http://w0".into(),
                data_parallel_rank: Some(0),
                added: keys.clone(),
                ..Default::default()
            },
        ]),
    );
    let d = router.pick(text(&prompt)).await.unwrap();
    assert_eq!(
        (d.worker.as_str(), d.dp_rank),
        ("http://w0", Some(0)),
        "{:?}",
        d.explain
    );
}
