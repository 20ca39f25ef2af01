use std::path::PathBuf;

use kinference_api::summary::{self as pb, Summary, summary};
use kinference_api::tokenize::ModelTokenizer;
use kinference_api::{KeyHasher, WorkerRole};

use super::*;

/// Nothing listens at these: the tests apply the agents' messages themselves.
const AGENT_A: &str = "http://127.0.0.1:9";
const AGENT_B: &str = "http://127.0.0.2:9";

fn tokenizer_dir() -> PathBuf {
    std::env::var_os("KINFERENCE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.assets/qwen2")))
}

/// w0, w1: prefill; w2, w3: decode; each agent reports the workers `apply` gives it.
fn router(agents: &[&str]) -> Router {
    let role = |i: usize| {
        if i < 2 {
            WorkerRole::Prefill
        } else {
            WorkerRole::Decode
        }
    };
    let router = Router::new(RoutingConfig {
        workers: (0..4)
            .map(|i| WorkerConfig {
                url: format!("http://w{i}"),
                model: "m".into(),
                role: role(i),
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
    })
    .unwrap();
    for t in &router.tasks {
        t.abort();
    }
    for a in 0..agents.len() {
        let agent = router.shared.agent(a);
        let mut st = agent.lock();
        st.connected = true;
        st.since = Instant::now();
    }
    router
}

fn system_prompt() -> String {
    "You are a meticulous assistant for a logistics company. Answer precisely and cite the policy. "
        .repeat(40)
}

fn keys_of(text: &str) -> Vec<u64> {
    let tok = ModelTokenizer::from_dir(tokenizer_dir()).unwrap();
    let ids = tok.encode_text(text, true).unwrap();
    KeyHasher::for_model("m").keys(None, &ids, 16)
}

fn worker(url: &str, keys: Vec<u64>, running: u32) -> pb::WorkerState {
    pb::WorkerState {
        worker_id: url.into(),
        model: "m".into(),
        block_size: 16,
        keys,
        load: Some(pb::WorkerLoad {
            running,
            metrics_ok: true,
            ..Default::default()
        }),
        role: String::new(),
        offloaded_keys: Vec::new(),
        data_parallel_rank: None,
    }
}

fn snapshot(router: &Router, agent: usize, workers: Vec<pb::WorkerState>) {
    agents::apply(
        &router.shared,
        agent,
        Summary {
            kind: Some(summary::Kind::Snapshot(pb::Snapshot {
                node: format!("n{agent}"),
                epoch: 1,
                workers,
                node_state: None,
            })),
        },
    );
}

fn pair_request(prompt: &str, min_uncached_tokens: usize) -> PairRequest<'_> {
    PairRequest {
        route: RouteRequest {
            model: "m",
            prompt: Prompt::Text(prompt),
            debug: true,
            tokens: None,
            salt: None,
            session: None,
            answers: Default::default(),
        },
        prefill_within: None,
        decode_within: None,
        min_uncached_tokens,
    }
}

fn split(pair: Pair) -> (Decision, Decision) {
    match pair {
        Pair::Split { prefill, decode } => (prefill, *decode),
        Pair::Whole { decision, outcome } => {
            panic!("not split ({outcome}): {:?}", decision.explain)
        }
    }
}

#[tokio::test]
async fn the_prefill_goes_where_the_prompt_is_cached_the_decode_where_load_is_low() {
    let router = router(&[AGENT_A]);
    let system = system_prompt();
    let keys = keys_of(&system);
    snapshot(
        &router,
        0,
        vec![
            worker("http://w0", vec![], 0),
            worker("http://w1", keys.clone(), 0),
            worker("http://w2", vec![], 6),
            worker("http://w3", vec![], 0),
        ],
    );
    let prompt = format!("{system}Where is parcel 1234?");
    let (prefill, decode) = split(router.pick_pair(pair_request(&prompt, 512)).await.unwrap());
    assert_eq!(prefill.worker, "http://w1", "{:?}", prefill.explain);
    assert_eq!(prefill.reason, "cache_hit");
    assert_eq!(decode.worker, "http://w3");
    assert_eq!(decode.reason, "pd_decode");
    let explain = decode.explain.clone().unwrap();
    assert!(explain.starts_with("pd=split: "), "{explain}");
    assert!(explain.contains("prefill: http://w0 cached=0"), "{explain}");
    assert!(explain.contains("*http://w1 cached="), "{explain}");
    assert!(explain.contains("decode: http://w2 running=6"), "{explain}");
    assert!(explain.contains("*http://w3 running=0"), "{explain}");
    // Both are in the ledger until their tickets end.
    let in_flight = |r: &Router, url: &str| {
        r.workers()
            .into_iter()
            .find(|w| w.url == url)
            .unwrap()
            .in_flight
    };
    assert_eq!(
        (
            in_flight(&router, "http://w1"),
            in_flight(&router, "http://w3")
        ),
        (1, 1)
    );
    drop((prefill, decode));
    assert_eq!(in_flight(&router, "http://w3"), 0);
}

#[tokio::test]
async fn a_prompt_a_decode_worker_mostly_holds_runs_whole_there() {
    let router = router(&[AGENT_A]);
    let system = system_prompt();
    snapshot(
        &router,
        0,
        vec![
            worker("http://w0", vec![], 0),
            worker("http://w1", vec![], 0),
            worker("http://w2", vec![], 0),
            worker("http://w3", keys_of(&system), 1),
        ],
    );
    let prompt = format!("{system}Where is parcel 1234?");
    match router.pick_pair(pair_request(&prompt, 512)).await.unwrap() {
        Pair::Whole { decision, outcome } => {
            assert_eq!((decision.worker.as_str(), outcome), ("http://w3", "whole"));
            assert!(decision.explain.unwrap().starts_with("pd=whole: "));
        }
        Pair::Split { .. } => panic!("a cached prompt was split"),
    }
    // With a threshold of 0 every request splits.
    assert!(matches!(
        router.pick_pair(pair_request(&prompt, 0)).await.unwrap(),
        Pair::Split { .. }
    ));
}

#[tokio::test]
async fn whole_requests_never_go_to_prefill_workers() {
    let router = router(&[AGENT_A]);
    snapshot(
        &router,
        0,
        (0..4)
            .map(|i| worker(&format!("http://w{i}"), vec![], if i < 2 { 0 } else { 9 }))
            .collect(),
    );
    for _ in 0..8 {
        let pair = router
            .pick_pair(pair_request("Where is parcel 1234?", 512))
            .await
            .unwrap();
        let Pair::Whole { decision, .. } = pair else {
            panic!("a short prompt was split");
        };
        assert!(["http://w2", "http://w3"].contains(&decision.worker.as_str()));
        let d = router.pick(pair_request("hi", 0).route).await.unwrap();
        assert!(["http://w2", "http://w3"].contains(&d.worker.as_str()));
    }
}

#[tokio::test]
async fn the_decode_worker_on_the_prefill_workers_node_is_preferred() {
    let router = router(&[AGENT_A, AGENT_B]);
    let system = system_prompt();
    // Node A: prefill w0 and decode w2; node B: prefill w1 and decode w3, equally loaded.
    snapshot(
        &router,
        0,
        vec![
            worker("http://w0", keys_of(&system), 0),
            worker("http://w2", vec![], 2),
        ],
    );
    snapshot(
        &router,
        1,
        vec![
            worker("http://w1", vec![], 0),
            worker("http://w3", vec![], 2),
        ],
    );
    let prompt = format!("{system}Where is parcel 1234?");
    let (prefill, decode) = split(router.pick_pair(pair_request(&prompt, 512)).await.unwrap());
    assert_eq!(prefill.worker, "http://w0");
    assert_eq!(decode.worker, "http://w2", "{:?}", decode.explain);
    assert!(
        decode
            .explain
            .unwrap()
            .contains("*http://w2 running=2 tpot_ms=unknown pull_blocks=")
    );
}

#[tokio::test]
async fn after_a_split_the_decode_worker_is_credited_the_prompt() {
    let router = router(&[AGENT_A]);
    snapshot(
        &router,
        0,
        (0..4)
            .map(|i| worker(&format!("http://w{i}"), vec![], 0))
            .collect(),
    );
    let prompt = format!("{}Where is parcel 1234?", system_prompt());
    let (_prefill, decode) = split(router.pick_pair(pair_request(&prompt, 512)).await.unwrap());
    // The next turn of the conversation finds its prefix on the decode worker: whole there.
    let next = format!("{prompt} And parcel 5678?");
    match router.pick_pair(pair_request(&next, 512)).await.unwrap() {
        Pair::Whole { decision, .. } => assert_eq!(decision.worker, decode.worker),
        Pair::Split { .. } => panic!("the follow-up was split again"),
    }
}

#[tokio::test]
async fn roles_from_an_agent_win_over_a_pool_role_and_pin_the_worker() {
    let router = router(&[AGENT_A]);
    assert!(router.upsert_worker("http://w9", "m"));
    router.set_pool_role("http://w9", WorkerRole::Prefill);
    let role = |r: &Router| {
        r.roles()
            .into_iter()
            .find(|(u, _)| u == "http://w9")
            .unwrap()
            .1
    };
    assert_eq!(role(&router), WorkerRole::Prefill);
    let mut w = worker("http://w9", vec![], 0);
    w.role = "decode".into();
    snapshot(&router, 0, vec![w]);
    assert_eq!(role(&router), WorkerRole::Decode);
    router.set_pool_role("http://w9", WorkerRole::Prefill);
    assert_eq!(role(&router), WorkerRole::Decode, "its own role wins");
    assert!(router.has_prefill_workers("m"));
}
