//! Data-parallel ranks end to end, with real processes on loopback: a `vllm-sim` worker with two
//! ranks (`--data-parallel-size 2`, one HTTP port, a KV event publisher per rank on ports shifted by
//! the rank), a rank-less worker, a `kinference-agent` following all three publishers over ZeroMQ, and
//! the gateway routing on the agent's summary over gRPC:
//!
//! - a repeated prefix goes back to the rank that holds it, named in `X-data-parallel-rank` (the
//!   worker counts every request that named its rank, and reports the prefix cached: without the
//!   header its balancer would have sent the repeat to the other, idle, rank);
//! - the rank-less worker is sent no rank header.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testkit::{ChildGuard, free_port, tokenizer_dir};

mod support;

/// The model of the two-rank worker.
const RANKED: &str = "qwen2-dp";
/// The model of the rank-less worker.
const PLAIN: &str = "qwen2-plain";

/// Four consecutive free ports, for the events and replay endpoints of two ranks: rank 1's
/// publisher takes the port after rank 0's.
fn free_port_run() -> u16 {
    for _ in 0..50 {
        let p = free_port();
        if (1..4).all(|i| TcpListener::bind(("127.0.0.1", p + i)).is_ok()) {
            // `free_port` hands ports out in order: take the run's other three from it.
            while free_port() < p + 3 {}
            return p;
        }
    }
    panic!("no four consecutive free ports")
}

struct Stack {
    api: u16,
    ranked_http: u16,
    plain_http: u16,
    _children: Vec<ChildGuard>,
    _dir: support::TempDir,
}

async fn start() -> Option<Stack> {
    let sim = support::vllm_sim_binary()?;
    let agent_bin = support::agent_binary();
    let dir = support::TempDir::new("dp-ranks");
    let (agent_grpc, agent_metrics) = (free_port(), free_port());
    let run = free_port_run();
    let (ranked_events, ranked_replay) = (run, run + 2);
    let (ranked_http, plain_http) = (free_port(), free_port());
    let (plain_events, plain_replay) = (free_port(), free_port());
    // The agent binds the SUB sockets the workers connect to (rank 1's on the ports after rank 0's).
    let workers_yaml = format!(
        "workers:\n  - {{url: \"http://127.0.0.1:{ranked_http}\", model: {RANKED}, data_parallel_size: 2, kv_events_endpoint: \"tcp://127.0.0.1:{ranked_events}\", kv_events_bind: true, kv_replay_endpoint: \"tcp://127.0.0.1:{ranked_replay}\"}}\n  - {{url: \"http://127.0.0.1:{plain_http}\", model: {PLAIN}, kv_events_endpoint: \"tcp://127.0.0.1:{plain_events}\", kv_events_bind: true, kv_replay_endpoint: \"tcp://127.0.0.1:{plain_replay}\"}}\n"
    );
    let agent_yaml = dir.0.join("agent-workers.yaml");
    std::fs::write(&agent_yaml, workers_yaml).unwrap();
    let mut children = vec![ChildGuard(
        Command::new(&agent_bin)
            .args(["--grpc-listen", &format!("127.0.0.1:{agent_grpc}")])
            .args(["--metrics-listen", &format!("127.0.0.1:{agent_metrics}")])
            .arg("--workers")
            .arg(&agent_yaml)
            .args(["--node", "dp-node"])
            .env("KINFERENCE_DISABLE_EBPF", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting kinference-agent"),
    )];
    support::wait_until_ok(agent_metrics, "/metrics").await;
    let sims = [
        (ranked_http, RANKED, ranked_events, ranked_replay, "2"),
        (plain_http, PLAIN, plain_events, plain_replay, "1"),
    ];
    for (http, model, events, replay, ranks) in sims {
        children.push(ChildGuard(
            Command::new(&sim)
                .args(["--host", "127.0.0.1", "--port", &http.to_string()])
                .args(["--model", model, "--preset", "fast"])
                .args(["--data-parallel-size", ranks])
                .arg("--tokenizer-dir")
                .arg(tokenizer_dir())
                .args(["--kv-events-endpoint", &format!("tcp://127.0.0.1:{events}")])
                .args(["--kv-replay-endpoint", &format!("tcp://127.0.0.1:{replay}")])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start vllm-sim"),
        ));
    }
    for http in [ranked_http, plain_http] {
        support::wait_until_ok(http, "/health").await;
    }
    let config = dir.0.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - {{name: {RANKED}, tokenizer_dir: \"{tok}\"}}\n  - {{name: {PLAIN}, tokenizer_dir: \"{tok}\"}}\nworkers:\n  - {{url: \"http://127.0.0.1:{ranked_http}\", model: {RANKED}}}\n  - {{url: \"http://127.0.0.1:{plain_http}\", model: {PLAIN}}}\nagents: [\"http://127.0.0.1:{agent_grpc}\"]\nrouting: kinference\n",
            tok = tokenizer_dir().display(),
        ),
    )
    .unwrap();
    let (api, admin) = (free_port(), free_port());
    let mut gateway = ChildGuard(
        support::gateway_command(&config, api, admin)
            .spawn()
            .expect("starting kinference-gateway"),
    );
    support::wait_until_ready(&mut gateway, admin).await;
    support::wait_for("the agent connected", || async {
        support::metrics_text(admin)
            .await
            .lines()
            .filter(|l| l.starts_with("kinference_routing_agent_connected"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
            >= 1.0
    })
    .await;
    children.push(gateway);
    Some(Stack {
        api,
        ranked_http,
        plain_http,
        _children: children,
        _dir: dir,
    })
}

/// One answer: the cached prompt tokens the worker reported, and the router's explanation.
#[derive(Debug)]
struct Served {
    cached: u64,
    decision: String,
}

impl Served {
    /// The cache the router picked (`http://...#dp1`), from the starred candidate.
    fn picked(&self) -> &str {
        self.decision
            .split(['*'])
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .unwrap_or_default()
    }
}

async fn complete(api: u16, model: &str, text: &str) -> Served {
    let body = json!({"model": model, "prompt": text, "max_tokens": 2});
    let (status, head, text) = support::call(
        "127.0.0.1",
        api,
        "POST",
        "/v1/completions",
        &[("x-kinference-debug", "1")],
        &body.to_string(),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    Served {
        cached: v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        decision: head
            .lines()
            .find_map(|l| l.strip_prefix("x-kinference-decision: "))
            .unwrap_or_default()
            .to_string(),
    }
}

/// The worker's data-parallel counters (`/sim/state`'s `data_parallel`).
async fn dp_state(http: u16) -> Value {
    let (status, _, body) = support::call("127.0.0.1", http, "GET", "/sim/state", &[], "").await;
    assert_eq!(status, 200);
    serde_json::from_str::<Value>(&body).unwrap()["data_parallel"].clone()
}

fn prompt(topic: &str) -> String {
    let mut text = format!("A long shared preamble about {topic}. ");
    for i in 0..40 {
        text.push_str(&format!(
            "Rule {i} of the {topic} handbook is unremarkable. "
        ));
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prefix_returns_to_its_rank_and_a_rank_less_worker_gets_no_header() {
    let Some(stack) = start().await else {
        return;
    };
    let text = prompt("routing");
    let first = complete(stack.api, RANKED, &text).await;
    assert_eq!(first.cached, 0, "{first:?}");
    assert!(
        first.picked().contains("#dp"),
        "a rank is picked: {first:?}"
    );

    // Once the agent's events are in, the prefix is a routed hit on a rank that holds it (before,
    // the router's own credit keeps it there, or a repeat fills the other rank too).
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut requests = 1;
    let settled = loop {
        let again = complete(stack.api, RANKED, &text).await;
        requests += 1;
        if again
            .decision
            .contains(&format!("*{} cached=0 ", again.picked()))
        {
            assert!(
                Instant::now() < deadline,
                "the rank's blocks never reached the router: {again:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        assert!(
            again.cached > 0,
            "the rank named in the header served it from its cache: {again:?}"
        );
        break again;
    };
    let rank = settled.picked().to_string();
    assert!(
        rank.ends_with("#dp0") || rank.ends_with("#dp1"),
        "{settled:?}"
    );
    // Every repeat goes back to that rank and finds its prefix there. Without the header the
    // worker's balancer would alternate between its two idle ranks.
    for _ in 0..3 {
        let again = complete(stack.api, RANKED, &text).await;
        requests += 1;
        assert_eq!(again.picked(), rank, "{again:?}");
        assert!(again.cached > 0, "{again:?}");
    }
    let ranked = dp_state(stack.ranked_http).await;
    assert_eq!(ranked["size"], 2);
    // Its metrics label each rank's load by `engine`, as vLLM does: what the agent tells apart.
    let (status, _, metrics) =
        support::call("127.0.0.1", stack.ranked_http, "GET", "/metrics", &[], "").await;
    assert_eq!(status, 200);
    for engine in ["0", "1"] {
        let series = format!("vllm:num_requests_running{{engine=\"{engine}\"");
        assert!(metrics.contains(&series), "{series} missing");
    }
    assert_eq!(
        ranked["rank_header_requests"].as_u64(),
        Some(requests),
        "every request named its rank: {ranked}"
    );

    // The rank-less worker: served, never sent a rank.
    for i in 0..3 {
        complete(stack.api, PLAIN, &prompt(&format!("plain {i}"))).await;
    }
    let plain = dp_state(stack.plain_http).await;
    assert_eq!(plain["served_by_rank"][0].as_u64(), Some(3), "{plain}");
    assert_eq!(plain["rank_header_requests"].as_u64(), Some(0), "{plain}");
}
