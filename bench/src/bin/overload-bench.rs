//! `overload-bench`: does the gateway keep serving well-behaved clients while hostile ones hold
//! connections? (Issue 21: 10,000 idle connections plus 200 slow-body clients against one gateway,
//! well-behaved clients' p50 within 2x of an unloaded run.)
//!
//! Starts one `vllm-sim` (preset `fast`, scaled time) and one `kinference-gateway` with its default
//! limits, measures a well-behaved workload (non-streaming chat requests at a fixed concurrency)
//! unloaded, then opens the idle connections (connected, never a byte) and the slow-body clients
//! (a request head and one body byte a second, never the whole body) and measures the same
//! workload again. Prints p50/p99 of both runs, their ratio, the gateway's resident memory before
//! and under load, its open-connection and in-flight gauges, and how long `/metrics` took on the
//! admin port under load.
//!
//! With `--flood N` the hostile load is instead N concurrent large bodies (`--flood-bytes`, 4 MB of
//! `[0,0,...]` in an unknown member: the most a JSON parse can cost per byte) from one tenant, while
//! the well-behaved clients are another tenant; the gateway's resident memory is sampled every 20 ms
//! for its peak (issue 31: 1,000 concurrent 4 MB bodies keep it under the chart's 2 GiB limit with
//! the other tenant served).
//!
//! ```text
//! cargo build --release -p kinference-bench -p kinference-gateway
//! target/release/overload-bench --idle 10000 --slow 200
//! target/release/overload-bench --flood 1000
//! ```
//! Needs a file-descriptor limit above idle + slow (or the flood) (`ulimit -n`), for this process and
//! the gateway.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Parser;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kinference_bench::harness::{self, Process, free_port, repo_root, rss_mib, wait_ready};
use kinference_bench::stats::percentile_duration as percentile;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// Well-behaved latency with hostile connections held open.
#[derive(Debug, Parser)]
#[command(name = "overload-bench")]
struct Args {
    /// Directory with `vllm-sim` and `kinference-gateway` (default: this binary's directory).
    #[arg(long, env = "KINFERENCE_BIN_DIR")]
    bin_dir: Option<PathBuf>,
    /// Tokenizer directory for the simulator (default: `<repo>/.assets/qwen2`).
    #[arg(long, env = "KINFERENCE_TOKENIZER_DIR")]
    tokenizer_dir: Option<PathBuf>,
    /// Idle connections (connected, nothing sent).
    #[arg(long, default_value_t = 10_000)]
    idle: usize,
    /// Slow-body clients (head sent, then one body byte a second).
    #[arg(long, default_value_t = 200)]
    slow: usize,
    /// Concurrency of the well-behaved clients.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Well-behaved requests per run.
    #[arg(long, default_value_t = 800)]
    requests: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
    /// The simulator's time scale (wall seconds per model second).
    #[arg(long, default_value_t = 0.01)]
    time_scale: f64,
    /// Large bodies sent at once by one tenant instead of the idle and slow-body clients (0: off).
    #[arg(long, default_value_t = 0)]
    flood: usize,
    /// Size of each flood body, in bytes (4 MB: under the default 4 MiB body limit).
    #[arg(long, default_value_t = 4_000_000)]
    flood_bytes: usize,
    /// Extra flags for the gateway (e.g. `--body-budget-bytes=...` to compare budgets).
    #[arg(long, allow_hyphen_values = true)]
    gateway_flag: Vec<String>,
}

/// The flood's tenant and the well-behaved clients' tenant, with their keys.
const FLOOD_KEY: &str = "sk-overload-flood-0123456789abcdef";
const STEADY_KEY: &str = "sk-overload-steady-0123456789abcdef";

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build(connector)
}

async fn get(client: &HttpClient, url: &str) -> anyhow::Result<(u16, String)> {
    let request = Request::get(url).body(Full::new(Bytes::new()))?;
    let response = tokio::time::timeout(Duration::from_secs(5), client.request(request)).await??;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// `requests` well-behaved requests at `concurrency` (with `key` as their bearer token, when the
/// gateway has tenants): the latencies, and how many failed.
async fn workload(
    client: &HttpClient,
    url: &str,
    body: &Bytes,
    concurrency: usize,
    requests: usize,
    key: Option<&'static str>,
) -> anyhow::Result<(Vec<Duration>, usize)> {
    let next = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        let (client, url, body, next, failed) = (
            client.clone(),
            url.to_string(),
            body.clone(),
            next.clone(),
            failed.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < requests {
                let mut request = Request::builder()
                    .method(Method::POST)
                    .uri(&url)
                    .header("content-type", "application/json");
                if let Some(key) = key {
                    request = request.header("authorization", format!("Bearer {key}"));
                }
                let request = request.body(Full::new(body.clone()))?;
                let start = Instant::now();
                let response = client.request(request).await?;
                let status = response.status();
                let answer = response.into_body().collect().await?.to_bytes();
                if status.is_success() {
                    out.push(start.elapsed());
                } else if failed.fetch_add(1, Ordering::Relaxed) == 0 {
                    eprintln!(
                        "first failure: {status} {}",
                        String::from_utf8_lossy(&answer)
                    );
                }
            }
            anyhow::Ok(out)
        }));
    }
    let mut all = Vec::with_capacity(requests);
    for task in tasks {
        all.extend(task.await??);
    }
    all.sort_unstable();
    Ok((all, failed.load(Ordering::Relaxed)))
}

/// The first sample of `name` in a Prometheus exposition.
fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bin_dir = args.bin_dir.clone().unwrap_or_else(harness::bin_dir);
    let tokenizer = args
        .tokenizer_dir
        .clone()
        .unwrap_or_else(|| repo_root().join(".assets/qwen2"));
    let workdir = std::env::temp_dir().join(format!("overload-bench-{}", std::process::id()));
    std::fs::create_dir_all(&workdir)?;

    let (sim_port, gw_port, admin_port) = (free_port(), free_port(), free_port());
    let worker = format!("http://127.0.0.1:{sim_port}");
    let mut sim = Process::adopt(
        "vllm-sim",
        Command::new(bin_dir.join("vllm-sim"))
            .args(["--host", "127.0.0.1", "--port", &sim_port.to_string()])
            .args(["--model", "qwen2-sim", "--preset", "fast"])
            .args(["--time-scale", &args.time_scale.to_string()])
            .args(["--max-num-seqs", "256"])
            .arg("--tokenizer-dir")
            .arg(&tokenizer)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin_dir.join("vllm-sim").display()))?,
    );
    let config = workdir.join("gateway.yaml");
    let mut yaml = format!(
        "models:\n  - name: qwen2-sim\nworkers:\n  - url: {worker}\n    model: qwen2-sim\nrouting: least-outstanding\n"
    );
    if args.flood > 0 {
        yaml.push_str(&tenants(&workdir)?);
    }
    std::fs::write(&config, yaml)?;
    let mut gateway = Process::adopt(
        "kinference-gateway",
        Command::new(bin_dir.join("kinference-gateway"))
            .args(["--listen", &format!("127.0.0.1:{gw_port}")])
            .args(["--admin-listen", &format!("127.0.0.1:{admin_port}")])
            .arg("--config")
            .arg(&config)
            .args(&args.gateway_flag)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| {
                format!("starting {}", bin_dir.join("kinference-gateway").display())
            })?,
    );
    let client = client();
    let admin = format!("http://127.0.0.1:{admin_port}");
    let probe = harness::http::HttpClient::new();
    let ready = Duration::from_secs(60);
    wait_ready(&probe, &mut sim, &format!("{worker}/health"), ready, |_| {
        true
    })
    .await?;
    wait_ready(
        &probe,
        &mut gateway,
        &format!("{admin}/readyz"),
        ready,
        |_| true,
    )
    .await?;
    // Ready is not the same as having probed the worker up (the gateway may have started first).
    let healthy = |body: &str| body.contains(r#""healthy":1"#);
    let workers = format!("{admin}/healthz/workers");
    wait_ready(
        &probe,
        &mut gateway,
        &workers,
        Duration::from_secs(30),
        healthy,
    )
    .await?;
    let gw_pid = gateway.pid();

    let url = format!("http://127.0.0.1:{gw_port}/v1/chat/completions");
    let body = Bytes::from(
        serde_json::json!({
            "model": "qwen2-sim",
            "messages": [{"role": "user", "content": "Say something about overload."}],
            "max_tokens": args.max_tokens,
        })
        .to_string(),
    );
    // Warm-up, then the unloaded run.
    let key = (args.flood > 0).then_some(STEADY_KEY);
    workload(
        &client,
        &url,
        &body,
        args.concurrency,
        args.concurrency * 8,
        key,
    )
    .await?;
    let rss_idle = rss_mib(gw_pid);
    let (unloaded, unloaded_failed) =
        workload(&client, &url, &body, args.concurrency, args.requests, key).await?;
    if args.flood > 0 {
        let flooded = flood(&args, gw_port, gw_pid, &client, &url, &body).await?;
        let (_, metrics) = get(&client, &format!("{admin}/metrics")).await?;
        print_flood(
            &args,
            &unloaded,
            unloaded_failed,
            rss_idle,
            &flooded,
            &metrics,
        );
        return Ok(());
    }

    // The hostile load: idle connections, then slow bodies trickling a byte a second.
    let opened = Instant::now();
    let mut idle = Vec::with_capacity(args.idle);
    for _ in 0..args.idle {
        idle.push(TcpStream::connect(("127.0.0.1", gw_port)).await?);
    }
    let slow_body = body.len() + 1_000;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {slow_body}\r\n\r\n"
    );
    let mut slow = Vec::with_capacity(args.slow);
    for _ in 0..args.slow {
        let mut s = TcpStream::connect(("127.0.0.1", gw_port)).await?;
        s.write_all(head.as_bytes()).await?;
        slow.push(tokio::spawn(async move {
            loop {
                if s.write_all(b" ").await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }));
    }
    let open_time = opened.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let metrics_started = Instant::now();
    let (_, metrics) = get(&client, &format!("{admin}/metrics")).await?;
    let metrics_time = metrics_started.elapsed();
    let (loaded, loaded_failed) =
        workload(&client, &url, &body, args.concurrency, args.requests, None).await?;
    let rss_loaded = rss_mib(gw_pid);
    let (_, after) = get(&client, &format!("{admin}/metrics")).await?;

    let (u50, u99) = (percentile(&unloaded, 50.0), percentile(&unloaded, 99.0));
    let (l50, l99) = (percentile(&loaded, 50.0), percentile(&loaded, 99.0));
    println!(
        "overload-bench: vllm-sim --preset fast --time-scale {}, {} well-behaved requests at concurrency {}, max_tokens {}; hostile: {} idle connections + {} slow-body clients (opened in {:.1} s)",
        args.time_scale,
        args.requests,
        args.concurrency,
        args.max_tokens,
        args.idle,
        args.slow,
        open_time.as_secs_f64()
    );
    println!();
    println!("| run | p50 | p99 | failed | gateway RSS |");
    println!("|---|---|---|---|---|");
    println!(
        "| unloaded | {:.2} ms | {:.2} ms | {unloaded_failed} | {rss_idle:.0} MiB |",
        ms(u50),
        ms(u99)
    );
    println!(
        "| {} idle + {} slow-body | {:.2} ms | {:.2} ms | {loaded_failed} | {rss_loaded:.0} MiB |",
        args.idle,
        args.slow,
        ms(l50),
        ms(l99)
    );
    println!();
    println!(
        "p50 ratio loaded/unloaded: {:.2}x (target <= 2x); p99 ratio {:.2}x",
        l50.as_secs_f64() / u50.as_secs_f64(),
        l99.as_secs_f64() / u99.as_secs_f64()
    );
    println!(
        "under load: open_connections{{port=\"api\"}} {}, overload_in_flight {} (the slow bodies), admin /metrics answered in {:.1} ms; shed so far {}",
        sample(
            &metrics,
            "kinference_gateway_open_connections{port=\"api\"}"
        ),
        sample(&metrics, "kinference_gateway_overload_in_flight"),
        ms(metrics_time),
        sample(&after, "kinference_gateway_shed_total").max(0.0)
    );
    drop(idle);
    for task in slow {
        task.abort();
    }
    Ok(())
}

/// `tenancy:` lines for the flood's two tenants (their keys written under `dir`).
fn tenants(dir: &std::path::Path) -> anyhow::Result<String> {
    let mut objects = Vec::new();
    for (name, key) in [("flood", FLOOD_KEY), ("steady", STEADY_KEY)] {
        let secret = dir.join("secrets").join(name);
        std::fs::create_dir_all(&secret)?;
        std::fs::write(secret.join("api-key"), key)?;
        objects.push(format!(
            "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {{name: {name}}}\nspec:\n  apiKeys: [{{secretRef: {{name: {name}, key: api-key}}}}]\n"
        ));
    }
    std::fs::write(dir.join("tenants.yaml"), objects.join("---\n"))?;
    Ok(format!(
        "tenancy:\n  tenants_dir: {}\n  secrets_dir: {}\n  usage_journal: {}\n",
        dir.join("tenants.yaml").display(),
        dir.join("secrets").display(),
        dir.join("usage.jsonl").display()
    ))
}

/// What the flood did.
struct Flooded {
    /// The well-behaved run during the flood.
    loaded: Vec<Duration>,
    loaded_failed: usize,
    /// The flood's answers by status (0: the connection failed).
    statuses: std::collections::BTreeMap<u16, usize>,
    /// The gateway's resident memory at its peak during the flood, in MiB.
    peak_mib: f64,
    took: Duration,
}

/// `args.flood` bodies of `args.flood_bytes` bytes sent at once by tenant `flood` (each on its own
/// connection, the same bytes shared), while the well-behaved clients run as tenant `steady`; the
/// gateway's RSS sampled every 20 ms.
async fn flood(
    args: &Args,
    gw_port: u16,
    gw_pid: u32,
    client: &HttpClient,
    url: &str,
    body: &Bytes,
) -> anyhow::Result<Flooded> {
    let opening = br#"{"model":"qwen2-sim","max_tokens":1,"messages":[{"role":"user","content":"hi"}],"padding":["#;
    let zeros = (args.flood_bytes.saturating_sub(opening.len() + 2) / 2).max(1);
    let mut big = Vec::with_capacity(zeros * 2 + opening.len() + 2);
    big.extend_from_slice(opening);
    for i in 0..zeros {
        big.extend_from_slice(if i + 1 == zeros { b"0" } else { b"0," });
    }
    big.extend_from_slice(b"]}");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {FLOOD_KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        big.len()
    );
    let big = Bytes::from(big);
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let peak = {
        let sampling = Arc::clone(&sampling);
        tokio::spawn(async move {
            let mut peak = 0.0f64;
            while sampling.load(Ordering::Relaxed) {
                peak = peak.max(rss_mib(gw_pid));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            peak
        })
    };
    let started = Instant::now();
    let mut senders = Vec::with_capacity(args.flood);
    for _ in 0..args.flood {
        let (big, head) = (big.clone(), head.clone());
        senders.push(tokio::spawn(async move {
            use tokio::io::AsyncReadExt as _;
            let answer = async {
                let mut s = TcpStream::connect(("127.0.0.1", gw_port)).await?;
                s.write_all(head.as_bytes()).await?;
                // The gateway may answer (and close) before the whole body is in.
                let _ = s.write_all(&big).await;
                let mut head = vec![0u8; 64];
                let n = s.read(&mut head).await?;
                let status = std::str::from_utf8(&head[..n])
                    .ok()
                    .and_then(|h| h.split_whitespace().nth(1))
                    .and_then(|c| c.parse().ok())
                    .unwrap_or(0);
                anyhow::Ok(status)
            };
            answer.await.unwrap_or(0u16)
        }));
    }
    let (loaded, loaded_failed) = workload(
        client,
        url,
        body,
        args.concurrency,
        args.requests,
        Some(STEADY_KEY),
    )
    .await?;
    let mut statuses = std::collections::BTreeMap::new();
    for s in senders {
        *statuses.entry(s.await?).or_insert(0) += 1;
    }
    let took = started.elapsed();
    sampling.store(false, Ordering::Relaxed);
    Ok(Flooded {
        loaded,
        loaded_failed,
        statuses,
        peak_mib: peak.await?,
        took,
    })
}

fn print_flood(
    args: &Args,
    unloaded: &[Duration],
    unloaded_failed: usize,
    rss_idle: f64,
    f: &Flooded,
    metrics: &str,
) {
    let (u50, u99) = (percentile(unloaded, 50.0), percentile(unloaded, 99.0));
    let (l50, l99) = (percentile(&f.loaded, 50.0), percentile(&f.loaded, 99.0));
    println!(
        "overload-bench --flood: vllm-sim --preset fast --time-scale {}, {} well-behaved requests (tenant `steady`) at concurrency {}, max_tokens {}; hostile: {} concurrent {}-byte bodies of [0,0,...] from tenant `flood` (all answered in {:.1} s); gateway flags {:?}",
        args.time_scale,
        args.requests,
        args.concurrency,
        args.max_tokens,
        args.flood,
        args.flood_bytes,
        f.took.as_secs_f64(),
        args.gateway_flag,
    );
    println!();
    println!("| run | p50 | p99 | failed | gateway RSS |");
    println!("|---|---|---|---|---|");
    println!(
        "| unloaded | {:.2} ms | {:.2} ms | {unloaded_failed} | {rss_idle:.0} MiB |",
        ms(u50),
        ms(u99)
    );
    println!(
        "| during the flood | {:.2} ms | {:.2} ms | {} | peak {:.0} MiB (chart limit 2048) |",
        ms(l50),
        ms(l99),
        f.loaded_failed,
        f.peak_mib
    );
    println!();
    println!(
        "flood answers by status: {:?}; shed for the body budget: {}; p50 ratio during/unloaded {:.2}x",
        f.statuses,
        sample(
            metrics,
            "kinference_gateway_shed_total{reason=\"body_budget\""
        ),
        l50.as_secs_f64() / u50.as_secs_f64(),
    );
}
