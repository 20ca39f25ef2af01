//! The agent against the simulator (`vllm-sim`, a vLLM stand-in with real tokenization, prefix cache and
//! KV events): after a completion, the watcher's keys for the worker are exactly the simulator's cached
//! blocks, and include every full block of the prompt as the gateway would key it.
//!
//! Needs `target/debug/vllm-sim` (`cargo build -p kinference-bench --bin vllm-sim`; `KINFERENCE_BIN_DIR`
//! overrides the folder; skipped with a message when it is not built) and the Qwen2 tokenizer
//! (`cargo xtask setup`; `KINFERENCE_TOKENIZER_DIR` overrides).

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kinference_api::KeyHasher;
use support::*;

/// One healthy `vllm-sim` worker (block size 16) whose KV events reach a real agent, and a gateway-side
/// watcher of that agent. The simulator connects its PUB (no `*` in the endpoint), as vLLM does: the
/// agent binds.
struct SimWorker {
    url: String,
    agent: Agent,
    watch: Watch,
    /// The simulator's command line, to start it again ([`SimWorker::restart`]).
    command: Vec<std::ffi::OsString>,
    sim: testkit::ChildGuard,
}

impl SimWorker {
    /// Starts the agent, then the simulator with `flags` added to the common ones, and waits until the
    /// simulator is healthy. `None` (after `testkit::require`'s message) when `vllm-sim` is not built.
    async fn start(flags: &[&str]) -> Option<Self> {
        let bin = testkit::bin_dir().join("vllm-sim");
        if !testkit::require(
            bin.is_file(),
            "vllm-sim",
            format_args!(
                "{} is not built (run `cargo build -p kinference-bench --bin vllm-sim`, or set KINFERENCE_BIN_DIR)",
                bin.display()
            ),
        ) {
            return None;
        }
        let (events, replay) = (
            format!("tcp://127.0.0.1:{}", free_port()),
            format!("tcp://127.0.0.1:{}", free_port()),
        );
        let port = free_port();
        let url = format!("http://127.0.0.1:{port}");
        let agent = Agent::start(&worker_yaml(&url, &events, true, &replay), free_port()).await;
        let port = port.to_string();
        let tokenizer = testkit::tokenizer_dir();
        let mut command: Vec<std::ffi::OsString> = vec![bin.into()];
        command.extend(
            ["--host", "127.0.0.1", "--port", &port]
                .into_iter()
                .chain(["--model", MODEL, "--block-size", "16"])
                .chain(["--tokenizer-dir"])
                .map(Into::into),
        );
        command.push(tokenizer.into());
        command.extend(
            [
                "--kv-events-endpoint",
                &events,
                "--kv-replay-endpoint",
                &replay,
            ]
            .into_iter()
            .chain(flags.iter().copied())
            .map(Into::into),
        );
        let sim = Self::spawn(&command, &url).await;
        let watch = Watch::connect(&agent.grpc).await;
        Some(Self {
            url,
            agent,
            watch,
            command,
            sim,
        })
    }

    /// Starts the simulator and waits until it is healthy.
    async fn spawn(command: &[std::ffi::OsString], url: &str) -> testkit::ChildGuard {
        let sim = testkit::ChildGuard(
            Command::new(&command[0])
                .args(&command[1..])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("vllm-sim starts"),
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while !try_http_get(&format!("{url}/health"))
            .await
            .is_ok_and(|r| r.starts_with("HTTP/1.1 200"))
        {
            assert!(Instant::now() < deadline, "vllm-sim did not become healthy");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        sim
    }

    /// Kills the simulator and starts it again on the same ports after `down`, with an empty cache and
    /// a new KV event sequence, as a crashed worker comes back.
    async fn restart(&mut self, down: Duration) {
        let _ = self.sim.0.kill();
        let _ = self.sim.0.wait();
        tokio::time::sleep(down).await;
        self.sim = Self::spawn(&self.command, &self.url).await;
    }

    /// A completion of `prompt` by `model` (the base model or an adapter), asserted to succeed.
    async fn complete(&self, model: &str, prompt: &str, max_tokens: u32) {
        let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": max_tokens});
        let resp = http_post(&format!("{}/v1/completions", self.url), &body.to_string()).await;
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    }

    /// The simulator's own tokenization of `prompt` (`POST /tokenize`).
    async fn tokenize(&self, model: &str, prompt: &str) -> Vec<u32> {
        let body = serde_json::json!({"model": model, "prompt": prompt});
        let tokens =
            json_body(&http_post(&format!("{}/tokenize", self.url), &body.to_string()).await);
        tokens["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect()
    }

    /// The agent's keys for this worker as the watcher sees them now.
    fn view(&self) -> std::collections::HashSet<u64> {
        self.watch.view.get(&self.url).cloned().unwrap_or_default()
    }
}

async fn http_post(url: &str, body: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").expect("http url");
    let (host, path) = rest.split_once('/').expect("path");
    let mut s = tokio::net::TcpStream::connect(host).await.expect("connect");
    let req = format!(
        "POST /{path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    out
}

fn json_body(resp: &str) -> serde_json::Value {
    let body = resp.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {resp}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_follows_the_simulators_cache_exactly() {
    let Some(mut sim) = SimWorker::start(&["--kv-topic", "kv@w1@qwen2-sim"]).await else {
        return;
    };
    let prompt = "You are a careful assistant. ".repeat(20) + "What is the capital of France?";
    sim.complete(MODEL, &prompt, 8).await;
    let prompt_keys =
        KeyHasher::for_model(MODEL).keys(None, &sim.tokenize(MODEL, &prompt).await, 16);
    assert!(prompt_keys.len() >= 5);

    // Wait until the agent's view has as many keys as the simulator has cached blocks.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let state = json_body(&http_get(&format!("{}/sim/state", sim.url)).await);
        let cached = state["block_hashes"]
            .as_array()
            .expect("block_hashes")
            .len();
        let view = sim.view();
        if cached > 0 && view.len() == cached && prompt_keys.iter().all(|k| view.contains(k)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "agent view {} keys (prompt keys held: {}/{}), simulator {} blocks",
            view.len(),
            prompt_keys.iter().filter(|k| view.contains(k)).count(),
            prompt_keys.len(),
            cached
        );
        sim.watch.step(Duration::from_millis(200)).await;
    }
    assert_eq!(sim.watch.block_size.get(&sim.url), Some(&16));
    // The simulator's capacity (its default --num-blocks), from its cache_config_info as vLLM writes it.
    while !sim.watch.capacity.contains_key(&sim.url) && Instant::now() < deadline {
        sim.watch.step(Duration::from_millis(200)).await;
    }
    assert_eq!(sim.watch.capacity.get(&sim.url), Some(&4096));
    assert_eq!(
        sim.agent
            .metric("kinference_agent_kv_decode_errors_total")
            .await,
        0.0
    );
}

/// A request to a LoRA adapter (`vllm-sim --lora-modules`, as vLLM's): the simulator publishes its blocks
/// with `lora_name` and the name as each block's extra key, and the agent keys them under the adapter's
/// name, exactly as the gateway keys a prompt sent to the adapter, never as the base model's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapters_blocks_are_reported_under_the_adapters_name() {
    let Some(mut sim) = SimWorker::start(&["--lora-modules", "sql-lora=/adapters/sql-lora"]).await
    else {
        return;
    };
    let prompt = "Translate to SQL: every order over 100 euros. ".repeat(12);
    sim.complete("sql-lora", &prompt, 4).await;
    let tokens = sim.tokenize("sql-lora", &prompt).await;
    let adapter_keys = KeyHasher::for_model("sql-lora").keys(None, &tokens, 16);
    let base_keys = KeyHasher::for_model(MODEL).keys(None, &tokens, 16);
    assert!(adapter_keys.len() >= 5);

    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let view = sim.view();
        if adapter_keys.iter().all(|k| view.contains(k)) {
            assert!(
                base_keys.iter().all(|k| !view.contains(k)),
                "an adapter block reported as the base model's"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "agent view {} keys, adapter keys held {}/{}",
            view.len(),
            adapter_keys.iter().filter(|k| view.contains(k)).count(),
            adapter_keys.len()
        );
        sim.watch.step(Duration::from_millis(200)).await;
    }
    assert_eq!(
        sim.agent
            .metric("kinference_agent_kv_decode_errors_total")
            .await,
        0.0
    );
}

/// A worker that restarts (a new process on the same ports, its cache empty): the agent learns it from
/// the worker's metrics (its process start time moved) and drops the old blocks before the new engine
/// sends any KV event, which it does only once it serves a request. When the new event sequence then
/// starts over, that is the same restart: counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_is_forgotten_before_its_first_kv_event() {
    let Some(mut sim) = SimWorker::start(&[]).await else {
        return;
    };
    let restarts = async |sim: &SimWorker| {
        sim.agent
            .metric("kinference_agent_kv_engine_restarts_total")
            .await
    };
    let prompt = "You are a careful assistant. ".repeat(20) + "What is the capital of France?";
    // Events published before the simulator's connection to the agent is up are lost, as ZMQ does
    // (on a busy machine that can take seconds): each try sends one more request, whose events make
    // the agent fetch any it missed.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut tries = 0;
    while sim.view().len() < 5 {
        assert!(Instant::now() < deadline, "the agent never saw the blocks");
        tries += 1;
        sim.complete(MODEL, &format!("{prompt} ({tries})"), 4).await;
        sim.watch.step(Duration::from_millis(500)).await;
    }

    // The agent must have read the worker's start time before the restart: a restart before its first
    // scrape shows only in the event sequence.
    let deadline = Instant::now() + Duration::from_secs(15);
    while sim.agent.metric("kinference_agent_scrape_ok").await < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the agent never scraped the worker"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Down for 2 s (more than the start time's jitter), then back with nothing sent to it.
    sim.restart(Duration::from_secs(2)).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    while !sim.view().is_empty() || restarts(&sim).await != 1.0 {
        assert!(
            Instant::now() < deadline,
            "{} old keys still held, {} restarts counted; the agent's log:\n{}",
            sim.view().len(),
            restarts(&sim).await,
            sim.agent.log()
        );
        sim.watch.step(Duration::from_millis(200)).await;
    }

    // Its first request: the new blocks arrive in a new sequence, and the restart is not counted again.
    // Events published before the new engine's connection to the agent is up are lost, as ZMQ does, so
    // each try sends one more request.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut tries = 0;
    while sim.view().is_empty() {
        assert!(
            Instant::now() < deadline,
            "no block of the new engine arrived"
        );
        tries += 1;
        sim.complete(MODEL, &format!("try {tries}: {prompt}"), 2)
            .await;
        sim.watch.step(Duration::from_millis(500)).await;
    }
    assert_eq!(restarts(&sim).await, 1.0);
}
