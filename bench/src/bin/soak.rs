//! `soak`: does the gateway hold steady under sustained streaming load, and does its usage journal
//! lose nothing? (Issue 21: a 10-minute soak of 1,000 concurrent streams, resident memory and open
//! files flat within 10%, journal totals equal to the workers' own counters.)
//!
//! Starts `vllm-sim` (one process, `--workers` time-scaled workers on their own ports) and one
//! `kinference-gateway` with two tenants and its usage journal on, then keeps `--clients` streaming
//! chat clients busy for `--duration-s` (each sends its next request when its stream ends). Every
//! `--sample-every-s` (10 s) it samples the gateway's resident memory (`VmRSS` of
//! `/proc/<pid>/status`) and open file descriptors (`/proc/<pid>/fd`), the latter split into client
//! connections (sockets on the gateway's API port), worker connections (sockets to a worker's
//! port) and the gateway's own files (the rest: listeners, the journal, epoll), and prints a
//! progress line. At the end the clients stop, the gateway is stopped with SIGTERM (which flushes
//! the journal) and started again on the same journal, and its `/admin/usage` (every request read
//! back from the journal) is compared with the clients' own counts per tenant and with the
//! workers' counters (`vllm:request_success_total`, `vllm:prompt_tokens_total`,
//! `vllm:generation_tokens_total`) summed over the workers.
//!
//! Verdict: every sample from the baseline (`--baseline-s`, minute 2) to the end within 10% of the
//! baseline's value, for RSS and for client connections plus the gateway's own files, and the
//! journal equal to the workers: nothing lost. By minute 2 the first pass of the workload is over:
//! all clients connected, the upstream pool grown, the KV index and the usage aggregates filled,
//! the first journal rotation and compaction done. All open fds are reported too, but the worker
//! connections follow the throughput, not a leak (the pool keeps up to `--pool-max-idle-per-host`
//! idle connections per worker beside the busy ones, each closed after 60 s unused), so they are
//! left out of the verdict.
//!
//! ```text
//! cargo build --release -p kinference-bench -p kinference-gateway
//! ulimit -n 20000; target/release/soak --duration-s 600 --clients 1000
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kinference_bench::harness::{
    self, Process, free_port, free_ports, repo_root, rss_mib, wait_ready,
};

const MODEL: &str = "qwen2-sim";
/// The tenants the clients are spread over (round robin), with their API keys.
const TENANTS: [(&str, &str); 2] = [
    ("soak-a", "sk-soak-tenant-a-0001"),
    ("soak-b", "sk-soak-tenant-b-0002"),
];
/// Largest allowed change from the baseline, in percent.
const FLAT_WITHIN: f64 = 10.0;

/// Sustained streaming load through one gateway, with its journal checked against the workers.
#[derive(Debug, Parser)]
#[command(name = "soak")]
struct Args {
    /// Directory with `vllm-sim` and `kinference-gateway` (default: this binary's directory).
    #[arg(long, env = "KINFERENCE_BIN_DIR")]
    bin_dir: Option<PathBuf>,
    /// Tokenizer directory for the simulator (default: `<repo>/.assets/qwen2`).
    #[arg(long, env = "KINFERENCE_TOKENIZER_DIR")]
    tokenizer_dir: Option<PathBuf>,
    /// Length of the load, in seconds.
    #[arg(long, default_value_t = 600)]
    duration_s: u64,
    /// Concurrent streaming clients.
    #[arg(long, default_value_t = 1_000)]
    clients: usize,
    /// Simulated workers (one `vllm-sim` process, one port each).
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// The simulator's time scale (wall seconds per model second).
    #[arg(long, default_value_t = 0.05)]
    time_scale: f64,
    /// Journal segment size in MiB before rotation and compaction (small, so that compaction runs
    /// during the soak).
    #[arg(long, default_value_t = 16)]
    segment_mib: u64,
    /// Seconds between two samples of the gateway's memory and files (1 for a close look at
    /// where memory grows).
    #[arg(long, default_value_t = 10)]
    sample_every_s: u64,
    /// The sample the later ones are compared with, in seconds from the start (minute 2: the first
    /// pass of the workload is over; bench/results/soak/soak.md shows the allocator's slower
    /// warm-up after it).
    #[arg(long, default_value_t = 120)]
    baseline_s: u64,
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// How long a process may take to answer its readiness URL.
const READY: Duration = Duration::from_secs(60);

fn client(max_idle: usize) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(max_idle)
        .build(connector)
}

async fn get(client: &HttpClient, url: &str) -> anyhow::Result<(u16, String)> {
    let request = Request::get(url).body(Full::new(Bytes::new()))?;
    let response = tokio::time::timeout(Duration::from_secs(10), client.request(request)).await??;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// What the clients of one tenant saw.
#[derive(Debug, Default)]
struct Counts {
    /// Streams that ended with `[DONE]`.
    ok: AtomicU64,
    /// Anything else: an error status, a broken stream, a connection error.
    failed: AtomicU64,
}

/// One client: streams requests back to back until `stop`.
async fn run_client(
    client: HttpClient,
    url: String,
    key: &'static str,
    body: Bytes,
    counts: Arc<Counts>,
    stop: Arc<AtomicBool>,
) {
    let mut first_error = true;
    while !stop.load(Ordering::Relaxed) {
        let request = Request::builder()
            .method(Method::POST)
            .uri(&url)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {key}"))
            .body(Full::new(body.clone()));
        let outcome = async {
            let response = client.request(request?).await?;
            let status = response.status();
            let answer = response.into_body().collect().await?.to_bytes();
            let done = answer.windows(12).any(|w| w == b"data: [DONE]");
            if status.is_success() && done {
                anyhow::Ok(())
            } else {
                bail!("{status}: {}", String::from_utf8_lossy(&answer))
            }
        }
        .await;
        match outcome {
            Ok(()) => {
                counts.ok.fetch_add(1, Ordering::Relaxed);
            }
            Err(error) => {
                counts.failed.fetch_add(1, Ordering::Relaxed);
                if first_error {
                    first_error = false;
                    eprintln!("soak: a stream failed: {error:#}");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The gateway's open file descriptors, by what they hold.
#[derive(Debug, Default, Clone, Copy)]
struct Fds {
    /// Accepted client connections.
    clients: usize,
    /// Connections to the workers (busy and pooled).
    upstream: usize,
    /// Everything else: listeners, the journal, epoll and event fds, the admin port's connections.
    own: usize,
}

impl Fds {
    fn total(self) -> usize {
        self.clients + self.upstream + self.own
    }

    /// Client connections plus the gateway's own files: what a descriptor leak would move, with
    /// the worker pool's throughput-driven size left out.
    fn without_pool(self) -> usize {
        self.clients + self.own
    }
}

/// Open file descriptors of `pid` (Linux): its sockets are told apart by their ports in the
/// process's `/proc/<pid>/net/tcp{,6}` (local `api_port`: a client; peer in `worker_ports`: a worker).
/// Each socket is counted once: under connection churn the kernel's table can list a row twice
/// while it is read.
fn open_fds(pid: u32, api_port: u16, worker_ports: &[u16]) -> Fds {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Fds::default();
    };
    let mut total = 0;
    let mut sockets = std::collections::HashSet::new();
    for entry in dir.filter_map(Result::ok) {
        total += 1;
        if let Ok(link) = std::fs::read_link(entry.path()) {
            let link = link.to_string_lossy();
            if let Some(inode) = link
                .strip_prefix("socket:[")
                .and_then(|l| l.strip_suffix(']'))
            {
                sockets.insert(inode.to_string());
            }
        }
    }
    let mut fds = Fds::default();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            // sl local_address rem_address st tx_queue:rx_queue tr:when retrnsmt uid timeout inode
            let fields: Vec<&str> = line.split_whitespace().collect();
            let port = |addr: &str| {
                addr.rsplit(':')
                    .next()
                    .and_then(|p| u16::from_str_radix(p, 16).ok())
            };
            let (Some(local), Some(peer), Some(state), Some(inode)) = (
                fields.get(1).and_then(|a| port(a)),
                fields.get(2).and_then(|a| port(a)),
                fields.get(3),
                fields.get(9),
            ) else {
                continue;
            };
            const LISTEN: &str = "0A";
            // `remove`: a socket counts once, however often the table lists it.
            if *state == LISTEN || !sockets.remove(*inode) {
                continue;
            }
            if local == api_port {
                fds.clients += 1;
            } else if worker_ports.contains(&peer) {
                fds.upstream += 1;
            }
        }
    }
    fds.own = total - fds.clients - fds.upstream;
    fds
}

/// The sum of every sample of `name` (any labels) in a Prometheus exposition.
fn sum_of(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One sample of the gateway.
struct Sample {
    at: Duration,
    rss_mib: f64,
    fds: Fds,
    streams: u64,
    failed: u64,
}

/// Writes the tenants, their keys and `gateway.yaml` into `dir`; returns the config's path.
fn write_config(
    dir: &Path,
    workers: &[String],
    journal: &Path,
    segment_mib: u64,
) -> anyhow::Result<PathBuf> {
    let mut tenants = String::new();
    for (name, key) in TENANTS {
        let secret = dir.join("secrets").join(name);
        std::fs::create_dir_all(&secret)?;
        std::fs::write(secret.join("api-key"), key)?;
        tenants.push_str(&format!(
            "---\napiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {{name: {name}}}\nspec:\n  apiKeys:\n    - secretRef: {{name: {name}, key: api-key}}\n"
        ));
    }
    std::fs::write(dir.join("tenants.yaml"), tenants)?;
    let mut config = format!("models:\n  - name: {MODEL}\nworkers:\n");
    for url in workers {
        config.push_str(&format!("  - url: {url}\n    model: {MODEL}\n"));
    }
    config.push_str(&format!(
        "tenancy:\n  tenants_dir: {}\n  secrets_dir: {}\n  usage_journal: {}\n  journal:\n    segment_max_bytes: {}\n",
        dir.join("tenants.yaml").display(),
        dir.join("secrets").display(),
        journal.display(),
        segment_mib << 20,
    ));
    let path = dir.join("gateway.yaml");
    std::fs::write(&path, config)?;
    Ok(path)
}

/// Starts the gateway on `config` and waits until it sees `workers` healthy workers.
async fn start_gateway(
    bin_dir: &Path,
    config: &Path,
    workers: usize,
    probe: &harness::http::HttpClient,
) -> anyhow::Result<(Process, String, String)> {
    let (api, admin) = (free_port(), free_port());
    let mut gateway = Process::adopt(
        "kinference-gateway",
        Command::new(bin_dir.join("kinference-gateway"))
            .args(["--listen", &format!("127.0.0.1:{api}")])
            .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
            .args(["--shutdown-delay-seconds", "0"])
            .arg("--config")
            .arg(config)
            .env_remove("KINFERENCE_ADMIN_KEY")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| {
                format!("starting {}", bin_dir.join("kinference-gateway").display())
            })?,
    );
    let admin = format!("http://127.0.0.1:{admin}");
    wait_ready(
        probe,
        &mut gateway,
        &format!("{admin}/readyz"),
        READY,
        |_| true,
    )
    .await?;
    let healthy = format!("\"healthy\":{workers}");
    let url = format!("{admin}/healthz/workers");
    wait_ready(probe, &mut gateway, &url, READY, |b| b.contains(&healthy)).await?;
    Ok((gateway, format!("http://127.0.0.1:{api}"), admin))
}

/// Stops the gateway with SIGTERM (it flushes the journal) and waits for it to exit.
fn stop_gateway(mut gateway: Process) -> anyhow::Result<()> {
    let pid = gateway.pid().to_string();
    let status = Command::new("kill").args(["-TERM", &pid]).status()?;
    if !status.success() {
        bail!("kill -TERM {pid}: {status}");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while gateway.try_wait()?.is_none() {
        if Instant::now() > deadline {
            bail!("the gateway did not exit within 60 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Relative change from `base` to `end`, in percent.
fn change(base: f64, end: f64) -> f64 {
    (end - base) / base * 100.0
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bin_dir = args.bin_dir.clone().unwrap_or_else(harness::bin_dir);
    let tokenizer = args
        .tokenizer_dir
        .clone()
        .unwrap_or_else(|| repo_root().join(".assets/qwen2"));
    let workdir = std::env::temp_dir().join(format!("soak-{}", std::process::id()));
    std::fs::create_dir_all(&workdir)?;
    let http = client(args.clients + 64);

    let ports = free_ports(args.workers);
    let workers: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let port_list = ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut sim = Process::adopt(
        "vllm-sim",
        Command::new(bin_dir.join("vllm-sim"))
            .args(["--host", "127.0.0.1", "--port", &port_list])
            .args(["--model", MODEL, "--preset", "fast"])
            .args(["--time-scale", &args.time_scale.to_string()])
            .args(["--max-num-seqs", "1024"])
            .arg("--tokenizer-dir")
            .arg(&tokenizer)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin_dir.join("vllm-sim").display()))?,
    );
    let probe = harness::http::HttpClient::new();
    for url in &workers {
        wait_ready(&probe, &mut sim, &format!("{url}/health"), READY, |_| true).await?;
    }
    let journal = workdir.join("usage.jsonl");
    let config = write_config(&workdir, &workers, &journal, args.segment_mib)?;
    let (gateway, api, _) = start_gateway(&bin_dir, &config, args.workers, &probe).await?;
    let pid = gateway.pid();
    let api_port = api
        .parse::<http::Uri>()?
        .port_u16()
        .context("the gateway's API port")?;
    println!(
        "soak: {} streaming clients for {} s through one gateway (pid {pid}, journal {}) to {} vllm-sim workers (--preset fast --time-scale {}), max_tokens {}",
        args.clients,
        args.duration_s,
        journal.display(),
        args.workers,
        args.time_scale,
        args.max_tokens
    );

    // The load.
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Vec<Arc<Counts>> = TENANTS.iter().map(|_| Arc::default()).collect();
    let url = format!("{api}/v1/chat/completions");
    let mut tasks = Vec::with_capacity(args.clients);
    for i in 0..args.clients {
        let tenant = i % TENANTS.len();
        let body = Bytes::from(
            serde_json::json!({
                "model": MODEL,
                "messages": [{"role": "user", "content": format!("Client {} asks about soak tests, part {}.", i, i % 7)}],
                "max_tokens": args.max_tokens,
                "stream": true,
                "stream_options": {"include_usage": true},
            })
            .to_string(),
        );
        tasks.push(tokio::spawn(run_client(
            http.clone(),
            url.clone(),
            TENANTS[tenant].1,
            body,
            Arc::clone(&counts[tenant]),
            Arc::clone(&stop),
        )));
    }
    let totals = |counts: &[Arc<Counts>]| {
        counts.iter().fold((0, 0), |(ok, failed), c| {
            (
                ok + c.ok.load(Ordering::Relaxed),
                failed + c.failed.load(Ordering::Relaxed),
            )
        })
    };
    let started = Instant::now();
    let duration = Duration::from_secs(args.duration_s);
    let mut samples = Vec::new();
    let mut next = started;
    while next <= started + duration {
        tokio::time::sleep_until(next.into()).await;
        let (streams, failed) = totals(&counts);
        let sample = Sample {
            at: started.elapsed(),
            rss_mib: rss_mib(pid),
            fds: open_fds(pid, api_port, &ports),
            streams,
            failed,
        };
        println!(
            "soak: t={:>4.0} s  rss {:>7.1} MiB  fds {:>5} (clients {}, workers {}, own {})  streams {:>8}  failed {}",
            sample.at.as_secs_f64(),
            sample.rss_mib,
            sample.fds.total(),
            sample.fds.clients,
            sample.fds.upstream,
            sample.fds.own,
            sample.streams,
            sample.failed
        );
        samples.push(sample);
        next += Duration::from_secs(args.sample_every_s.max(1));
    }
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await?;
    }
    let (streams, failed) = totals(&counts);
    let elapsed = started.elapsed();

    // Nothing lost: the journal read back after a restart against the clients and the workers.
    stop_gateway(gateway)?;
    let (_gateway, _, admin_after) = start_gateway(&bin_dir, &config, args.workers, &probe).await?;
    // From a day back (a report covers at most 62 days): the soak ran minutes ago.
    let day_ago = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs()
        - 86_400;
    let (status, report) = get(
        &http,
        &format!("{admin_after}/admin/usage?from={day_ago}&limit=1000"),
    )
    .await?;
    if status != 200 {
        bail!("/admin/usage answered {status}: {report}");
    }
    let report: serde_json::Value = serde_json::from_str(&report)?;
    let mut journal_by_tenant: BTreeMap<String, [u64; 3]> = BTreeMap::new();
    for row in report["usage"].as_array().context("usage rows")? {
        let tenant = row["tenant"].as_str().unwrap_or_default().to_string();
        let t = journal_by_tenant.entry(tenant).or_default();
        let n = |k: &str| row[k].as_u64().unwrap_or(0);
        t[0] += n("requests");
        t[1] += n("input_uncached_tokens") + n("input_cached_tokens");
        t[2] += n("output_tokens");
    }
    let mut worker_totals = [0f64; 3];
    for url in &workers {
        let (_, metrics) = get(&http, &format!("{url}/metrics")).await?;
        worker_totals[0] += sum_of(&metrics, "vllm:request_success_total");
        worker_totals[1] += sum_of(&metrics, "vllm:prompt_tokens_total");
        worker_totals[2] += sum_of(&metrics, "vllm:generation_tokens_total");
    }
    let journal_sum = journal_by_tenant
        .values()
        .fold([0u64; 3], |a, t| [a[0] + t[0], a[1] + t[1], a[2] + t[2]]);
    let journal_files = std::fs::read_dir(&workdir)?
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("usage.jsonl"))
        .map(|e| {
            let len = e.metadata().map_or(0, |m| m.len());
            format!("{} ({} KiB)", e.file_name().to_string_lossy(), len / 1024)
        })
        .collect::<Vec<_>>();

    // The report.
    println!();
    println!(
        "{streams} streams in {:.0} s ({:.0}/s), {failed} failed",
        elapsed.as_secs_f64(),
        streams as f64 / elapsed.as_secs_f64()
    );
    println!();
    println!(
        "| t (s) | gateway RSS (MiB) | open fds | client conns | worker conns | own fds | streams done | failed |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for s in &samples {
        println!(
            "| {:.0} | {:.1} | {} | {} | {} | {} | {} | {} |",
            s.at.as_secs_f64(),
            s.rss_mib,
            s.fds.total(),
            s.fds.clients,
            s.fds.upstream,
            s.fds.own,
            s.streams,
            s.failed
        );
    }
    println!();
    println!(
        "| tenant | clients' streams ok | journal requests | journal prompt tokens | journal output tokens |"
    );
    println!("|---|---:|---:|---:|---:|");
    for (i, (name, _)) in TENANTS.iter().enumerate() {
        let t = journal_by_tenant.get(*name).copied().unwrap_or_default();
        println!(
            "| {name} | {} | {} | {} | {} |",
            counts[i].ok.load(Ordering::Relaxed),
            t[0],
            t[1],
            t[2]
        );
    }
    println!(
        "| workers (sum of {}) | | {} | {} | {} |",
        args.workers, worker_totals[0], worker_totals[1], worker_totals[2]
    );
    println!();
    println!("journal files after the run: {}", journal_files.join(", "));

    let window: Vec<&Sample> = match samples
        .iter()
        .position(|s| s.at >= Duration::from_secs(args.baseline_s))
    {
        Some(first) => samples[first..].iter().collect(),
        None => samples.iter().collect(),
    };
    let rss = Drift::of(window.iter().map(|s| s.rss_mib)).context("no sample")?;
    let fds = Drift::of(window.iter().map(|s| s.fds.total() as f64)).context("no sample")?;
    let without_pool =
        Drift::of(window.iter().map(|s| s.fds.without_pool() as f64)).context("no sample")?;
    let equal = journal_sum
        .iter()
        .zip(worker_totals)
        .all(|(j, w)| *j as f64 == w);
    let (from, to) = (window[0].at, window[window.len() - 1].at);
    println!();
    println!(
        "from t={:.0} s to t={:.0} s (largest change from the first value of any sample, and at the end):",
        from.as_secs_f64(),
        to.as_secs_f64()
    );
    println!("  RSS (MiB):                          {rss}");
    println!("  open fds:                           {fds}");
    println!("  client conns + own fds (no pool):   {without_pool}");
    println!(
        "journal {:?} vs workers {:?} (requests, prompt tokens, output tokens): {}",
        journal_sum,
        worker_totals,
        if equal {
            "equal, nothing lost"
        } else {
            "DIFFERENT"
        }
    );
    let _ = std::fs::remove_dir_all(&workdir);
    // Worker connections follow the throughput, not a leak: the fd verdict leaves them out.
    if !(rss.flat() && without_pool.flat() && equal) {
        bail!("soak failed");
    }
    Ok(())
}

/// How far a series of samples moved from its first value.
struct Drift {
    base: f64,
    end: f64,
    /// The change of the sample farthest from `base`, in percent (signed).
    worst_pct: f64,
}

impl Drift {
    /// The drift of `values` from the first of them; `None` for no values.
    fn of(mut values: impl Iterator<Item = f64>) -> Option<Drift> {
        let base = values.next()?;
        let mut drift = Drift {
            base,
            end: base,
            worst_pct: 0.0,
        };
        for v in values {
            let pct = change(base, v);
            if pct.abs() > drift.worst_pct.abs() {
                drift.worst_pct = pct;
            }
            drift.end = v;
        }
        Some(drift)
    }

    /// Every sample within [`FLAT_WITHIN`] percent of the first.
    fn flat(&self) -> bool {
        self.worst_pct.abs() <= FLAT_WITHIN
    }
}

impl std::fmt::Display for Drift {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} -> {:.1} ({:+.1}% at the end, {:+.1}% at most): {}",
            self.base,
            self.end,
            change(self.base, self.end),
            self.worst_pct,
            if self.flat() {
                format!("flat (within {FLAT_WITHIN}%)")
            } else {
                "NOT flat".to_string()
            }
        )
    }
}
