//! A worker killed and started again under a running cluster (`Cluster::restart_worker`, the
//! `restart` workload's event): the gateway keeps answering through it, ejects the worker while it
//! is down and takes it back once it answers, and the agent notices that its old cache is gone (from
//! the worker's process start time in its metrics, or its KV event sequence starting over, counted
//! once).

use std::time::{Duration, Instant};

use kinference_bench::harness::http::HttpClient;
use kinference_bench::routing::cluster::{Cluster, ClusterConfig};
use serde_json::json;
use testkit::{bin_dir, require, tokenizer_dir};

const MODEL: &str = "qwen2-sim";

fn words(n: usize, seed: usize) -> String {
    const VOCAB: [&str; 8] = [
        " river", " stone", " light", " table", " music", " garden", " paper", " window",
    ];
    (0..n)
        .map(|i| VOCAB[(i * 7 + seed) % VOCAB.len()])
        .collect()
}

/// The value of `name{labels...}` in a Prometheus text page, where every given label matches.
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
        let matches = metric == name
            && labels
                .iter()
                .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
        matches.then(|| value.parse().ok()).flatten()
    })
}

async fn wait_for(what: &str, timeout: Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_is_routed_around_then_taken_back_with_its_old_cache_forgotten() {
    let bins = bin_dir();
    let present = ["vllm-sim", "kinference-agent", "kinference-gateway"]
        .iter()
        .all(|b| bins.join(b).exists());
    if !require(
        present,
        "worker restart",
        "build the binaries first: cargo build --workspace --bins",
    ) {
        return;
    }
    let work_dir =
        std::env::temp_dir().join(format!("kinference-worker-restart-{}", std::process::id()));
    std::fs::create_dir_all(&work_dir).expect("work dir");
    let config = ClusterConfig {
        bin_dir: bins,
        tokenizer_dir: tokenizer_dir(),
        workers: 2,
        preset: "fast".into(),
        time_scale: 1.0,
        worker_args: vec![],
        gateway_modes: vec!["kinference".into()],
        work_dir: work_dir.clone(),
        ready_timeout: Duration::from_secs(60),
    };
    let http = HttpClient::new();
    let cluster = Cluster::start(&config, http.clone())
        .await
        .expect("cluster");
    let w0 = cluster.workers()[0].clone();
    let gateway = cluster.gateway("kinference").expect("gateway").clone();
    let agent_metrics = cluster.agent_metrics_url().to_string();

    // Worker 0 caches a long prompt; the agent sees its blocks.
    let long = json!({"model": MODEL, "prompt": words(400, 1), "max_tokens": 2});
    http.post_json(&format!("{w0}/v1/completions"), &long)
        .await
        .expect("warm-up on worker 0");
    let blocks_of_w0 = async || {
        let text = http.get_text(&agent_metrics).await.unwrap_or_default();
        metric(&text, "kinference_agent_kv_blocks", &[("worker", &w0)]).unwrap_or(0.0)
    };
    wait_for(
        "the agent to see worker 0's blocks",
        Duration::from_secs(20),
        async || blocks_of_w0().await >= 20.0,
    )
    .await;
    let cached_before = blocks_of_w0().await;

    // Kill it, bring it back after 5 s, and keep sending through the gateway meanwhile.
    let down = Duration::from_secs(5);
    let restart = cluster.restart_worker(0, down);
    let traffic = async {
        let (mut ok, mut failed, mut saw_ejected) = (0, Vec::new(), false);
        let started = Instant::now();
        let mut i = 0;
        while started.elapsed() < down + Duration::from_secs(1) {
            i += 1;
            let body = json!({
                "model": MODEL,
                "messages": [{"role": "user", "content": words(40, i)}],
                "max_tokens": 4,
            });
            match http
                .post_json(&format!("{}/v1/chat/completions", gateway.url), &body)
                .await
            {
                Ok(_) => ok += 1,
                Err(e) => failed.push(e.to_string()),
            }
            let text = http
                .get_text(&format!("{}/metrics", gateway.admin_url))
                .await
                .unwrap_or_default();
            let healthy = metric(
                &text,
                "kinference_gateway_worker_health",
                &[("worker", &w0), ("state", "healthy")],
            );
            saw_ejected |= healthy == Some(0.0);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        (ok, failed, saw_ejected)
    };
    let (restarted, (ok, failed, saw_ejected)) = tokio::join!(restart, traffic);
    restarted.expect("worker 0 started again");
    // Nothing was running when the worker died: every request is answered (a refused one is
    // retried on the other worker).
    assert!(failed.is_empty(), "{ok} answered, failed: {failed:?}");
    assert!(ok >= 10, "only {ok} requests in {down:?}");
    assert!(saw_ejected, "the gateway never ejected the dead worker");

    // The gateway takes it back once its probes pass.
    wait_for(
        "the gateway to take worker 0 back",
        Duration::from_secs(30),
        async || {
            let text = http
                .get_text(&format!("{}/metrics", gateway.admin_url))
                .await
                .unwrap_or_default();
            metric(
                &text,
                "kinference_gateway_worker_health",
                &[("worker", &w0), ("state", "healthy")],
            ) == Some(1.0)
        },
    )
    .await;

    let restarts_of_w0 = async || {
        let text = http.get_text(&agent_metrics).await.unwrap_or_default();
        metric(
            &text,
            "kinference_agent_kv_engine_restarts_total",
            &[("worker", &w0)],
        )
    };
    // A short completion straight to worker 0 (its KV events come later in the new sequence).
    let short_to_w0 = async |prompt: String| {
        let short = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
        let _ = http
            .post_json(&format!("{w0}/v1/completions"), &short)
            .await;
    };

    // The agent counts a restart and drops the old blocks (the new cache holds at most these short
    // prompts'). Its metrics show the restart without a request; should its KV events come first,
    // those published before the restarted worker's connection to the agent is up are dropped, as
    // ZMQ does, so each try sends one more request, whose events come later in the new sequence.
    let mut tries = 0;
    wait_for(
        "the agent to count the restart",
        Duration::from_secs(30),
        async || {
            tries += 1;
            short_to_w0(format!("try {tries}:{}", words(40, 2))).await;
            restarts_of_w0().await == Some(1.0)
        },
    )
    .await;
    let cached_after = blocks_of_w0().await;
    assert!(
        cached_after < cached_before,
        "old blocks still counted: {cached_after} >= {cached_before}"
    );
    // Once the new engine's blocks arrive (its event sequence started over), the restart is still
    // counted once, whichever signal showed it first.
    let mut tries = 0;
    wait_for(
        "the new engine's blocks",
        Duration::from_secs(30),
        async || {
            tries += 1;
            short_to_w0(format!("again {tries}:{}", words(40, 3))).await;
            blocks_of_w0().await > 0.0
        },
    )
    .await;
    assert_eq!(restarts_of_w0().await, Some(1.0));
    drop(cluster);
    let _ = std::fs::remove_dir_all(&work_dir);
}
