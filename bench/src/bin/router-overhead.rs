//! `router-overhead`: the latency each router adds over a direct call to the same worker, and the CPU it
//! burns per 1,000 requests: the Kinference gateway and the peer routers (vllm-router, smg,
//! sglang-router, LiteLLM) side by side, in one run, in front of one simulated worker.
//!
//! One `vllm-sim` (preset `fast`, scaled time: it answers in about a millisecond), the node agent and a
//! Kinference gateway start once; each peer is installed (cached venv, see `routing-bench --peers`),
//! started, measured and stopped in turn, so idle peers do not share the CPUs with the one measured.
//! For every router, stream mode and concurrency, direct and routed rounds alternate (and swap order
//! every round) on the same trivial chat request; the figures are p50 / p99 of the latency that counts
//! (whole response, or the first body byte when streaming) and the router's user + system CPU seconds
//! (`/proc/PID/stat`, its whole process group) per 1,000 routed requests. For Kinference the agent's
//! CPU is reported beside the gateway's (kv_aware peers ingest KV events in-process).
//!
//! ```text
//! cargo build --release -p kinference-bench -p kinference-agent -p kinference-gateway --bins
//! target/release/router-overhead --peers all
//! ```
//! Writes `router-overhead.json` and `router-overhead.md` into `--out-dir` (default `bench/results`).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use http::Method;
use kinference_bench::harness::http::HttpClient;
use kinference_bench::harness::{self, free_ports, repo_root};
use kinference_bench::routing::client::{Route, latency_that_counts};
use kinference_bench::routing::cluster::{self, Cluster, ClusterConfig, ClusterOptions};
use kinference_bench::routing::peers::{self, PeerContext, PeerRouter, process_cpu_seconds};
use kinference_bench::routing::workload::{Workload, WorkloadKind, WorkloadShape};
use kinference_bench::stats::percentile_ms as percentile;
use serde_json::{Value, json};

/// Added latency and CPU per request of Kinference and the peer routers.
#[derive(Debug, Parser)]
#[command(name = "router-overhead")]
struct Args {
    /// Peers to measure besides Kinference: `all`, `none`, or a list as for `routing-bench --peers`.
    #[arg(long, default_value = "all")]
    peers: String,
    /// Concurrency levels.
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    concurrency: Vec<usize>,
    /// Measured rounds per side and level (direct and routed alternate).
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// Requests per round.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
    /// Words of the system prompt sent with every request: 0 sends only a one-line question; 7000
    /// sends a prompt of the shared-prefix workload's size (about 7,600 tokens), which every request
    /// repeats, as a shared system prompt is.
    #[arg(long, default_value_t = 0)]
    prompt_words: usize,
    /// The simulator's time scale.
    #[arg(long, default_value_t = 0.01)]
    time_scale: f64,
    /// Where the results go (default: bench/results).
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Directory of vllm-sim, kinference-agent and kinference-gateway.
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Tokenizer directory.
    #[arg(long)]
    tokenizer_dir: Option<PathBuf>,
    /// Where the peers' venvs are cached.
    #[arg(long)]
    peers_dir: Option<PathBuf>,
}

/// One measured router, stream mode and concurrency.
#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    router: String,
    stream: bool,
    concurrency: usize,
    direct_p50_ms: f64,
    direct_p99_ms: f64,
    router_p50_ms: f64,
    router_p99_ms: f64,
    added_p50_ms: f64,
    added_p99_ms: f64,
    cpu_s_per_1k: Option<f64>,
    /// Kinference only: the agent's CPU over the same rounds.
    agent_cpu_s_per_1k: Option<f64>,
    errors: usize,
}

/// Sends one request; the latency that counts.
async fn one(
    http: &HttpClient,
    url: &str,
    auth: Option<&str>,
    body: &Bytes,
    stream: bool,
) -> anyhow::Result<Duration> {
    let headers: Vec<(&str, &str)> = auth.map(|a| vec![("authorization", a)]).unwrap_or_default();
    let start = Instant::now();
    let response = http.send(Method::POST, url, &headers, body.clone()).await?;
    if !response.status().is_success() {
        bail!("{url}: status {}", response.status());
    }
    Ok(latency_that_counts(response.into_body(), start, stream).await?)
}

/// `requests` requests at `concurrency`: the latencies and the number of failures.
async fn round(
    http: &HttpClient,
    target: &(String, Option<String>),
    body: &Bytes,
    stream: bool,
    concurrency: usize,
    requests: usize,
) -> (Vec<Duration>, usize) {
    let next = Arc::new(AtomicUsize::new(0));
    let users = (0..concurrency).map(|_| {
        let next = next.clone();
        async move {
            let (mut ok, mut failed) = (Vec::new(), 0usize);
            while next.fetch_add(1, Ordering::Relaxed) < requests {
                match one(http, &target.0, target.1.as_deref(), body, stream).await {
                    Ok(d) => ok.push(d),
                    Err(_) => failed += 1,
                }
            }
            (ok, failed)
        }
    });
    let mut all = Vec::with_capacity(requests);
    let mut failed = 0;
    for (ok, f) in futures::future::join_all(users).await {
        all.extend(ok);
        failed += f;
    }
    (all, failed)
}

/// Measures one router against direct calls at every stream mode and level.
#[allow(clippy::too_many_arguments)]
async fn measure(
    name: &str,
    http: &HttpClient,
    direct: &(String, Option<String>),
    routed: &(String, Option<String>),
    pid: Option<u32>,
    agent_pid: Option<u32>,
    args: &Args,
    rows: &mut Vec<Row>,
) {
    for stream in [false, true] {
        let body = Bytes::from(request_body(args, stream).to_string());
        for &c in &args.concurrency {
            // Warm-up: connections, the worker's prefix cache, the router's own state.
            round(http, direct, &body, stream, c, c * 4).await;
            round(http, routed, &body, stream, c, c * 4).await;
            let (mut d, mut r) = (Vec::new(), Vec::new());
            let (mut cpu, mut agent_cpu, mut errors) = (0.0, 0.0, 0usize);
            for i in 0..args.rounds {
                for is_direct in if i % 2 == 0 {
                    [true, false]
                } else {
                    [false, true]
                } {
                    if is_direct {
                        let (lat, e) = round(http, direct, &body, stream, c, args.requests).await;
                        d.extend(lat);
                        errors += e;
                    } else {
                        let before = pid.and_then(process_cpu_seconds);
                        let agent_before = agent_pid.and_then(process_cpu_seconds);
                        let (lat, e) = round(http, routed, &body, stream, c, args.requests).await;
                        cpu += before
                            .zip(pid.and_then(process_cpu_seconds))
                            .map_or(f64::NAN, |(b, a)| a - b);
                        agent_cpu += agent_before
                            .zip(agent_pid.and_then(process_cpu_seconds))
                            .map_or(f64::NAN, |(b, a)| a - b);
                        r.extend(lat);
                        errors += e;
                    }
                }
            }
            d.sort_unstable();
            r.sort_unstable();
            let routed_n = (args.rounds * args.requests) as f64;
            let row = Row {
                router: name.to_string(),
                stream,
                concurrency: c,
                direct_p50_ms: percentile(&d, 50.0),
                direct_p99_ms: percentile(&d, 99.0),
                router_p50_ms: percentile(&r, 50.0),
                router_p99_ms: percentile(&r, 99.0),
                added_p50_ms: percentile(&r, 50.0) - percentile(&d, 50.0),
                added_p99_ms: percentile(&r, 99.0) - percentile(&d, 99.0),
                cpu_s_per_1k: pid.map(|_| cpu * 1000.0 / routed_n),
                agent_cpu_s_per_1k: agent_pid.map(|_| agent_cpu * 1000.0 / routed_n),
                errors,
            };
            eprintln!(
                "{:<26} {:<10} c={:<3} direct p50 {:>7.3} ms p99 {:>7.3} | routed p50 {:>7.3} ms p99 {:>8.3} | added p50 {:>+7.3} p99 {:>+8.3} ms | CPU {} s/1k{} | errors {}",
                row.router,
                if stream { "stream" } else { "non-stream" },
                c,
                row.direct_p50_ms,
                row.direct_p99_ms,
                row.router_p50_ms,
                row.router_p99_ms,
                row.added_p50_ms,
                row.added_p99_ms,
                row.cpu_s_per_1k.map_or("-".into(), |v| format!("{v:.2}")),
                row.agent_cpu_s_per_1k
                    .map_or(String::new(), |v| format!(" (+ agent {v:.2})")),
                row.errors
            );
            rows.push(row);
        }
    }
}

/// The chat request every round sends: a one-line question, after a system prompt of
/// `--prompt-words` words (the shared-prefix workload's text) when that is not 0.
fn request_body(args: &Args, stream: bool) -> Value {
    let question = json!({"role": "user", "content": "Say something about latency."});
    let messages = if args.prompt_words == 0 {
        json!([question])
    } else {
        let shape = WorkloadShape {
            shared_prefixes: 1,
            prefix_words: args.prompt_words,
            ..WorkloadShape::default()
        };
        let workload = Workload::generate(WorkloadKind::SharedPrefix, &shape, 7, 1);
        let first = workload.requests().next().expect("one request");
        json!([first.messages[0], question])
    };
    json!({
        "model": cluster::MODEL,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "stream": stream,
    })
}

fn markdown(
    command: &str,
    prompt_words: usize,
    rows: &[Row],
    unavailable: &[(String, String)],
) -> String {
    let prompt = if prompt_words == 0 {
        "a one-line chat prompt".to_string()
    } else {
        format!("a chat prompt with a {prompt_words}-word system prompt, the same in every request")
    };
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Router overhead: added latency over a direct call, and CPU per 1,000 requests\n\nCommand:\n\n```\n{command}\n```\n\nOne simulated worker (preset `fast`), {prompt}; direct and routed rounds alternate. \
         `added` = routed percentile - direct percentile. CPU = user + system seconds of the router's process group per 1,000 routed requests \
         (Kinference: the gateway; the agent's share is in parentheses). Wall-clock milliseconds.\n"
    );
    let _ = writeln!(
        md,
        "| router | mode | conc | direct p50 | routed p50 | added p50 | direct p99 | routed p99 | added p99 | CPU s / 1k req | errors |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.3} | {:.3} | {:+.3} | {:.3} | {:.3} | {:+.3} | {}{} | {} |",
            r.router,
            if r.stream {
                "stream (TTFB)"
            } else {
                "non-stream"
            },
            r.concurrency,
            r.direct_p50_ms,
            r.router_p50_ms,
            r.added_p50_ms,
            r.direct_p99_ms,
            r.router_p99_ms,
            r.added_p99_ms,
            r.cpu_s_per_1k.map_or("-".into(), |v| format!("{v:.2}")),
            r.agent_cpu_s_per_1k
                .map_or(String::new(), |v| format!(" (+{v:.2})")),
            r.errors
        );
    }
    if !unavailable.is_empty() {
        let _ = writeln!(
            md,
            "\n## Routers that could not run\n\n| router | why |\n|---|---|"
        );
        for (name, why) in unavailable {
            let _ = writeln!(
                md,
                "| {name} | {} |",
                why.lines().next().unwrap_or_default().replace('|', "\\|")
            );
        }
    }
    md
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let command = format!(
        "cargo build --release -p kinference-bench -p kinference-agent -p kinference-gateway --bins\ntarget/release/router-overhead {}",
        std::env::args().skip(1).collect::<Vec<_>>().join(" ")
    );
    let wanted = if args.peers == "none" {
        Vec::new()
    } else {
        peers::parse_peers(&args.peers).map_err(anyhow::Error::msg)?
    };
    let config = ClusterConfig {
        bin_dir: args.bin_dir.clone().unwrap_or_else(harness::bin_dir),
        tokenizer_dir: args
            .tokenizer_dir
            .clone()
            .unwrap_or_else(cluster::default_tokenizer_dir),
        workers: 1,
        preset: "fast".into(),
        time_scale: args.time_scale,
        worker_args: vec!["--max-num-seqs".into(), "256".into()],
        gateway_modes: vec!["kinference".into()],
        work_dir: std::env::temp_dir().join(format!("router-overhead-{}", std::process::id())),
        ready_timeout: Duration::from_secs(60),
    };
    let http = HttpClient::new();
    let options = ClusterOptions {
        workers_bind_kv_events: true,
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start_with(&config, http.clone(), &options)
        .await
        .context("starting the cluster")?;
    let worker = cluster.workers()[0].clone();
    let direct = (format!("{worker}/v1/chat/completions"), None);
    let gateway = cluster
        .gateway("kinference")
        .context("kinference gateway")?;
    let mut rows = Vec::new();
    eprintln!(
        "router-overhead: 1 worker (fast, time scale {}), {} rounds x {} requests per side; logs in {}",
        args.time_scale,
        args.rounds,
        args.requests,
        cluster.work_dir().display()
    );
    measure(
        "kinference",
        &http,
        &direct,
        &(format!("{}/v1/chat/completions", gateway.url), None),
        Some(gateway.pid),
        cluster.agent_pid(),
        &args,
        &mut rows,
    )
    .await;

    let cache = args
        .peers_dir
        .clone()
        .unwrap_or_else(peers::default_cache_dir);
    let metrics = http
        .get_text(&format!("{worker}/metrics"))
        .await
        .unwrap_or_default();
    let block_size = peers::block_size_from_metrics(&metrics).unwrap_or(16);
    let mut unavailable = Vec::new();
    for policy in wanted {
        let Some((router, _)) = PeerRouter::of(policy) else {
            continue;
        };
        let venv = match peers::install(router, &cache, &mut |l| {
            eprintln!("router-overhead: peer {l}")
        }) {
            Ok(v) => v,
            Err(e) => {
                unavailable.push((policy.to_string(), format!("install failed: {e}")));
                continue;
            }
        };
        let ports = free_ports(2);
        let ctx = PeerContext {
            workers: cluster.worker_endpoints().to_vec(),
            model: cluster::MODEL.into(),
            block_size,
            port: ports[0],
            metrics_port: ports[1],
            work_dir: cluster.work_dir().to_path_buf(),
        };
        let peer = match peers::start(policy, &venv, &ctx, &http, Duration::from_secs(180)).await {
            Ok(p) => p,
            Err(e) => {
                eprintln!("router-overhead: {policy} cannot run: {e}");
                unavailable.push((policy.to_string(), format!("did not start: {e}")));
                continue;
            }
        };
        let target = match &peer.route {
            Route::Authorized { base, api_key } => (
                format!("{base}/v1/chat/completions"),
                Some(format!("Bearer {api_key}")),
            ),
            Route::Endpoint(base) => (format!("{base}/v1/chat/completions"), None),
            Route::Oracle(_) | Route::Front { .. } => continue,
        };
        measure(
            policy.as_str(),
            &http,
            &direct,
            &target,
            Some(peer.pgid()),
            None,
            &args,
            &mut rows,
        )
        .await;
        drop(peer);
        // Let the stopped router's sockets close before the next one starts.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let out_dir = args
        .out_dir
        .clone()
        .unwrap_or_else(|| repo_root().join("bench/results"));
    std::fs::create_dir_all(&out_dir)?;
    let unavailable_json: Vec<Value> = unavailable
        .iter()
        .map(|(r, w)| json!({"router": r, "why": w}))
        .collect();
    std::fs::write(
        out_dir.join("router-overhead.json"),
        serde_json::to_string_pretty(&json!({
            "command": command,
            "times": "wall-clock milliseconds",
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            "rows": rows,
            "unavailable": unavailable_json,
        }))? + "\n",
    )?;
    std::fs::write(
        out_dir.join("router-overhead.md"),
        markdown(&command, args.prompt_words, &rows, &unavailable),
    )?;
    eprintln!("Results in {}", out_dir.display());
    Ok(())
}
