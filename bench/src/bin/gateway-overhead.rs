//! `gateway-overhead`: the latency the gateway adds over a direct connection to the same worker.
//!
//! Starts one `vllm-sim` (preset `fast`, scaled time so it answers in well under a millisecond) and one
//! `kinference-gateway` in front of it, then measures, side by side in one run, the same requests sent
//! directly and through the gateway: non-streaming (whole response) and streaming (time to the first
//! body byte), at each concurrency. Direct and gateway rounds alternate (and swap order every round), so
//! drift on the machine hits both sides alike. Prints p50 and p99 of each side, the added latency and
//! the ratio of medians.
//!
//! ```text
//! cargo build --release -p kinference-bench -p kinference-gateway
//! target/release/gateway-overhead --rounds 10 --requests 400
//! ```

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kinference_bench::harness::{self, Process, free_port, on_cpus, repo_root, wait_ready};
use kinference_bench::routing::client::latency_that_counts;
use kinference_bench::routing::cluster::{gateway_args, metric_sum};
use kinference_bench::stats::percentile_duration as percentile;

/// Measures the gateway's added latency over direct worker access.
#[derive(Debug, Parser)]
#[command(name = "gateway-overhead")]
struct Args {
    /// Directory with `vllm-sim` and `kinference-gateway` (default: this binary's directory).
    #[arg(long, env = "KINFERENCE_BIN_DIR")]
    bin_dir: Option<PathBuf>,
    /// Tokenizer directory for the simulator and the gateway (default: `<repo>/.assets/qwen2`).
    #[arg(long, env = "KINFERENCE_TOKENIZER_DIR")]
    tokenizer_dir: Option<PathBuf>,
    /// The simulator's time scale (wall seconds per model second); small = fast answers.
    #[arg(long, default_value_t = 0.01)]
    time_scale: f64,
    /// The gateway's routing mode.
    #[arg(long, default_value = "kinference")]
    routing: String,
    /// Concurrency levels to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    concurrency: Vec<usize>,
    /// Measured rounds per side (direct and gateway alternate).
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Requests per round.
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
    /// CPUs the gateway runs on (a `taskset -c` list, e.g. `1`); default: wherever the scheduler
    /// puts it. Run this binary itself under `taskset -c 0` to give the gateway a core of its own,
    /// apart from the client and the simulator (which start on this binary's CPUs).
    #[arg(long)]
    gateway_cpus: Option<String>,
    /// Serve under a policy set ([`POLICIES`]: personal data kept local, every request to the one
    /// pool), so that the policy stage's work per request is measured too.
    #[arg(long)]
    policies: bool,
}

/// The policy set of `--policies`: the simulator's model (with the gateway's own tokenizer) and
/// one local pool holding the simulator; a policy that keeps personal data local, so that every
/// prompt is scanned, and one that routes every request to the pool. `{tokenizer}` and `{worker}`
/// are filled in.
const POLICIES: &str = r#"apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {name: qwen2-sim}
spec:
  servedName: qwen2-sim
  tokenizer: {dir: "{tokenizer}"}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {name: local}
spec:
  models: [qwen2-sim]
  gpuClass: sim
  locality: Local
  endpoints: [{url: "{worker}"}]
  prices: {cachedInputPerMillion: 0.01, uncachedInputPerMillion: 0.1, outputPerMillion: 0.4}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePolicy
metadata: {name: data-protection}
spec:
  priority: 0
  rules:
    - name: pii-stays-local
      match: {tags: [pii]}
      action:
        requireLocal: {message: personal data must not leave our infrastructure}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePolicy
metadata: {name: placement}
spec:
  priority: 10
  rules:
    - name: every-request-to-the-local-pool
      match: {models: [qwen2-sim]}
      action:
        route:
          targets:
            - pool: local
"#;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build(connector)
}

/// Sends one request; returns the latency that counts (first body byte for streams, whole body
/// otherwise) and the worker that answered, if the gateway said.
async fn one(
    client: &HttpClient,
    url: &str,
    body: &Bytes,
    stream: bool,
) -> anyhow::Result<Duration> {
    let request = Request::builder()
        .method(Method::POST)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))?;
    let start = Instant::now();
    let response = client.request(request).await?;
    if !response.status().is_success() {
        bail!("{url}: status {}", response.status());
    }
    Ok(latency_that_counts(response.into_body(), start, stream).await?)
}

/// `requests` requests at `concurrency`; the latencies.
async fn round(
    client: &HttpClient,
    url: &str,
    body: &Bytes,
    stream: bool,
    concurrency: usize,
    requests: usize,
) -> anyhow::Result<Vec<Duration>> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        let (client, url, body, next) =
            (client.clone(), url.to_string(), body.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::with_capacity(requests / concurrency + 1);
            while next.fetch_add(1, Ordering::Relaxed) < requests {
                out.push(one(&client, &url, &body, stream).await?);
            }
            anyhow::Ok(out)
        }));
    }
    let mut all = Vec::with_capacity(requests);
    for task in tasks {
        all.extend(task.await??);
    }
    Ok(all)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bin_dir = args.bin_dir.clone().unwrap_or_else(harness::bin_dir);
    let tokenizer = args
        .tokenizer_dir
        .clone()
        .unwrap_or_else(|| repo_root().join(".assets/qwen2"));
    if !tokenizer.join("tokenizer.json").exists() {
        bail!(
            "no tokenizer in {}: run `cargo xtask setup`",
            tokenizer.display()
        );
    }
    let workdir = std::env::temp_dir().join(format!("gateway-overhead-{}", std::process::id()));
    std::fs::create_dir_all(&workdir)?;

    let (sim_port, gw_port, admin_port) = (free_port(), free_port(), free_port());
    let worker = format!("http://127.0.0.1:{sim_port}");
    let mut sim = Process::adopt(
        "vllm-sim",
        Command::new(bin_dir.join("vllm-sim"))
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &sim_port.to_string(),
                "--model",
                "qwen2-sim",
            ])
            .arg("--tokenizer-dir")
            .arg(&tokenizer)
            .args([
                "--preset",
                "fast",
                "--time-scale",
                &args.time_scale.to_string(),
            ])
            .args(["--max-num-seqs", "256"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin_dir.join("vllm-sim").display()))?,
    );
    // The gateway probes its worker once before serving: start it only once the worker answers, or
    // that first probe ejects it and the first requests get 503 until the next probe.
    let client = client();
    let probe = harness::http::HttpClient::new();
    let ready = Duration::from_secs(60);
    wait_ready(&probe, &mut sim, &format!("{worker}/health"), ready, |_| {
        true
    })
    .await?;
    let config = workdir.join("gateway.yaml");
    let mut yaml = format!(
        "models:\n  - name: qwen2-sim\n    tokenizer_dir: {}\nworkers:\n  - url: {worker}\n    model: qwen2-sim\nrouting: {}\n",
        tokenizer.display(),
        args.routing
    );
    if args.policies {
        let dir = workdir.join("policies");
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("all.yaml"),
            POLICIES
                .replace("{tokenizer}", &tokenizer.display().to_string())
                .replace("{worker}", &worker),
        )?;
        yaml.push_str(&format!("policy_dir: {}\n", dir.display()));
    }
    std::fs::write(&config, yaml)?;
    let (program, program_args) = on_cpus(
        &bin_dir.join("kinference-gateway"),
        gateway_args(
            &format!("127.0.0.1:{gw_port}"),
            &format!("127.0.0.1:{admin_port}"),
            &config,
        ),
        args.gateway_cpus.as_deref(),
    );
    let mut gateway = Process::adopt(
        "kinference-gateway",
        Command::new(program)
            .args(program_args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| {
                format!("starting {}", bin_dir.join("kinference-gateway").display())
            })?,
    );

    let readyz = format!("http://127.0.0.1:{admin_port}/readyz");
    wait_ready(&probe, &mut gateway, &readyz, ready, |_| true).await?;

    let direct_url = format!("{worker}/v1/chat/completions");
    let gateway_url = format!("http://127.0.0.1:{gw_port}/v1/chat/completions");
    println!(
        "gateway-overhead: vllm-sim --preset fast --time-scale {}, routing {}, {} rounds x {} requests per side, max_tokens {}, gateway on CPUs {}, {}",
        args.time_scale,
        args.routing,
        args.rounds,
        args.requests,
        args.max_tokens,
        args.gateway_cpus.as_deref().unwrap_or("any"),
        if args.policies {
            "under a policy set (personal data local, one pool)"
        } else {
            "no policies"
        }
    );
    println!(
        "{:<11} {:>4} | {:>10} {:>10} | {:>10} {:>10} | {:>10} {:>10} | {:>9}",
        "mode",
        "conc",
        "direct p50",
        "gw p50",
        "direct p99",
        "gw p99",
        "added p50",
        "added p99",
        "p50 ratio"
    );
    for stream in [false, true] {
        let body = Bytes::from(
            serde_json::json!({
                "model": "qwen2-sim",
                "messages": [{"role": "user", "content": "Say something about latency."}],
                "max_tokens": args.max_tokens,
                "stream": stream,
            })
            .to_string(),
        );
        for &concurrency in &args.concurrency {
            // Warm-up: connections, caches, the simulator's prefix cache.
            round(
                &client,
                &direct_url,
                &body,
                stream,
                concurrency,
                concurrency * 4,
            )
            .await?;
            round(
                &client,
                &gateway_url,
                &body,
                stream,
                concurrency,
                concurrency * 4,
            )
            .await?;
            let (mut direct, mut via) = (Vec::new(), Vec::new());
            // The simulator's own time to first token for each side's requests (from its
            // histogram's sum and count), to tell the simulator's pace from the gateway's.
            let sim_metrics = format!("{worker}/metrics");
            let (mut sim_direct, mut sim_via) = (SimTtft::default(), SimTtft::default());
            for r in 0..args.rounds {
                let order = if r % 2 == 0 {
                    [true, false]
                } else {
                    [false, true]
                };
                for is_direct in order {
                    let url = if is_direct { &direct_url } else { &gateway_url };
                    let before = SimTtft::read(&client, &sim_metrics).await?;
                    let lat =
                        round(&client, url, &body, stream, concurrency, args.requests).await?;
                    let during = SimTtft::read(&client, &sim_metrics).await?.since(before);
                    if is_direct {
                        direct.extend(lat);
                        sim_direct.add(during);
                    } else {
                        via.extend(lat);
                        sim_via.add(during);
                    }
                }
            }
            direct.sort_unstable();
            via.sort_unstable();
            let (d50, d99) = (percentile(&direct, 50.0), percentile(&direct, 99.0));
            let (g50, g99) = (percentile(&via, 50.0), percentile(&via, 99.0));
            println!(
                "{:<11} {:>4} | {:>7.3} ms {:>7.3} ms | {:>7.3} ms {:>7.3} ms | {:>+7.3} ms {:>+7.3} ms | {:>8.2}x",
                if stream { "stream-ttfb" } else { "non-stream" },
                concurrency,
                ms(d50),
                ms(g50),
                ms(d99),
                ms(g99),
                ms(g50) - ms(d50),
                ms(g99) - ms(d99),
                ms(g50) / ms(d50).max(1e-9),
            );
            println!(
                "{:<11} {:>4} | the simulator's own TTFT, mean: direct {:.3} ms, via the gateway {:.3} ms",
                "",
                concurrency,
                sim_direct.mean_ms(),
                sim_via.mean_ms(),
            );
        }
    }
    if args.policies {
        // The figures above are the policy stage's only if the policy routed the requests.
        let routed =
            policy_routed(&client, &format!("http://127.0.0.1:{admin_port}/metrics")).await?;
        println!("requests routed by the policy rule: {routed}");
        if routed == 0 {
            bail!("--policies: no request was routed by the policy set");
        }
    }
    let _ = std::fs::remove_dir_all(&workdir);
    Ok(())
}

/// The simulator's `vllm:time_to_first_token_seconds` histogram: sum and count.
#[derive(Clone, Copy, Debug, Default)]
struct SimTtft {
    sum_s: f64,
    count: f64,
}

impl SimTtft {
    async fn read(client: &HttpClient, metrics_url: &str) -> anyhow::Result<Self> {
        let text = get_text(client, metrics_url).await?;
        Ok(Self {
            sum_s: metric_sum(&text, "vllm:time_to_first_token_seconds_sum"),
            count: metric_sum(&text, "vllm:time_to_first_token_seconds_count"),
        })
    }

    fn since(self, before: Self) -> Self {
        Self {
            sum_s: self.sum_s - before.sum_s,
            count: self.count - before.count,
        }
    }

    fn add(&mut self, other: Self) {
        self.sum_s += other.sum_s;
        self.count += other.count;
    }

    fn mean_ms(self) -> f64 {
        1e3 * self.sum_s / self.count.max(1.0)
    }
}

/// Requests the `--policies` set's rule routed, from the gateway's `policy_decisions` counter.
async fn policy_routed(client: &HttpClient, metrics_url: &str) -> anyhow::Result<u64> {
    let text = get_text(client, metrics_url).await?;
    Ok(text
        .lines()
        .filter(|l| {
            l.contains("policy_decisions")
                && l.contains("every-request-to-the-local-pool")
                && l.contains("outcome=\"route\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64)
}

/// The body of a GET of `url`, as text (a metrics page).
async fn get_text(client: &HttpClient, url: &str) -> anyhow::Result<String> {
    let request = Request::get(url).body(Full::new(Bytes::new()))?;
    let body = client.request(request).await?.into_body().collect().await?;
    Ok(String::from_utf8_lossy(&body.to_bytes()).into_owned())
}
