//! `scale-bench`: what the gateway costs as the fleet grows (3 -> 24 -> 96 -> 104 simulated workers).
//!
//! Each fleet is `--workers-per-node` time-scaled simulated workers per simulated node, a node's workers
//! in one `vllm-sim` process, one real `kinference-agent` per node, and one gateway per routing mode (the
//! `kinference` gateway watches every agent). The same shared-prefix workload, sized per worker (prefixes
//! and requests grow with the fleet, so every worker sees the same load), runs `--runs` times per policy
//! from cold caches. The table holds the medians over the runs: the gateway's decision time (its own
//! histogram), its CPU seconds per request (`/proc/<pid>/stat`), the agents' summary bytes per second,
//! its resident memory per worker and per cached block, and the routing result against random routing
//! and the oracle. Writes `scale.md`, `scale.json` and `scale.svg`.
//!
//! Build first: `cargo build --release -p kinference-bench -p kinference-agent -p kinference-gateway`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use kinference_bench::harness::http::HttpClient;
use kinference_bench::harness::{self, repo_root};
use kinference_bench::routing::client::{LoadClient, Route};
use kinference_bench::routing::cluster::{self, metric_sum};
use kinference_bench::routing::oracle::Oracle;
use kinference_bench::routing::stats::summarize;
use kinference_bench::routing::workload::{Workload, WorkloadKind, WorkloadShape};
use kinference_bench::scale::fleet::{Fleet, FleetConfig};
use kinference_bench::scale::probe::{self, Histogram};
use kinference_bench::scale::report::{self, Row};
use kinference_bench::stats::median;
use serde_json::json;

/// Scale benchmark: decision time, gateway CPU and memory, agent stream bytes and routing result as
/// the simulated fleet grows.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Fleet sizes (simulated workers), in order.
    #[arg(long, value_delimiter = ',', default_value = "3,24,96,104")]
    fleets: Vec<usize>,
    /// Workers per simulated node: one `kinference-agent` process per node.
    #[arg(long, default_value_t = 8)]
    workers_per_node: usize,
    /// Simulated nodes whose workers run in one `vllm-sim` process. 1: a process per node. Each
    /// process loads the tokenizer once (about 100 MiB), so 1,000 workers fit this machine only
    /// with several nodes per process; every node keeps its own agent process.
    #[arg(long, default_value_t = 1)]
    nodes_per_sim: usize,
    /// Runs per fleet and policy; the table holds their medians.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Policies: `random`, `kinference` (gateways) and `oracle` (client-side, the simulator's exact
    /// view).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "random,kinference,oracle"
    )]
    policies: Vec<String>,
    /// The oracle asks every worker to estimate every request (tokenizing it), serialized: past this
    /// many workers it would measure the 2-core machine, not routing, and is left out.
    #[arg(long, default_value_t = 24)]
    oracle_max_workers: usize,
    /// Distinct shared system prompts per worker.
    #[arg(long, default_value_t = 4)]
    prefixes_per_worker: usize,
    /// Words (about tokens) per shared system prompt.
    #[arg(long, default_value_t = 1000)]
    prefix_words: usize,
    /// Measured requests per worker per run (the warm-up adds `--warmup-per-prefix`, not measured).
    #[arg(long, default_value_t = 16)]
    requests_per_worker: usize,
    /// Unmeasured warm-up requests per shared prefix before each run.
    #[arg(long, default_value_t = 2)]
    warmup_per_prefix: usize,
    /// Completion tokens per request.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Virtual users per worker (at least one in all).
    #[arg(long, default_value_t = 1.0)]
    users_per_worker: f64,
    /// Most virtual users: the client, the gateway and every worker share the machine's cores.
    #[arg(long, default_value_t = 48)]
    max_users: usize,
    /// KV cache blocks per worker (16 tokens each): 512 hold about six of the default prompts, so a
    /// worker that sees every prefix (random routing) evicts.
    #[arg(long, default_value_t = 512)]
    num_blocks: usize,
    /// Simulator time scale (wall = simulated x scale); TTFTs are reported in simulated seconds.
    #[arg(long, default_value_t = 0.2)]
    time_scale: f64,
    /// Simulator latency preset.
    #[arg(long, default_value = "l40s-27b-fp8")]
    preset: String,
    /// Seed of the request sequence.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Where scale.md, scale.json and scale.svg go (default: bench/results/scale).
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Directory of vllm-sim, kinference-agent and kinference-gateway (default: next to this binary,
    /// or KINFERENCE_BIN_DIR).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Tokenizer directory (default: KINFERENCE_TOKENIZER_DIR, or <repo>/.assets/qwen2).
    #[arg(long)]
    tokenizer_dir: Option<PathBuf>,
    /// How long a fleet may take to start, in seconds (default: 120 plus one per worker). On a
    /// contended core, 16 simulator processes took 18 minutes to bind 1,000 workers' sockets.
    #[arg(long)]
    ready_timeout_s: Option<u64>,
    /// Wall-clock limit of one request, in seconds.
    #[arg(long, default_value_t = 120)]
    request_timeout_s: u64,
    /// Runs nothing: redraws scale.svg next to this scale.json from its rows.
    #[arg(long)]
    replot: Option<PathBuf>,
    /// CPUs the gateways run on (a `taskset -c` list, e.g. `1`). Run this binary itself under
    /// `taskset -c 0` to give the gateway a core of its own, apart from the fleet and the client.
    #[arg(long)]
    gateway_cpus: Option<String>,
    /// How often the agents scrape their workers, in milliseconds (default: the agent's, 250). At
    /// 1,000 workers on a 2-core machine, 1000 keeps the scrapes from taking a core of their own.
    #[arg(long)]
    scrape_interval_ms: Option<u64>,
}

impl Args {
    fn shape(&self, workers: usize) -> WorkloadShape {
        WorkloadShape {
            shared_prefixes: self.prefixes_per_worker.max(1) * workers,
            prefix_words: self.prefix_words,
            question_words: (20, 60),
            max_tokens: self.max_tokens,
            ..WorkloadShape::default()
        }
    }

    fn users(&self, workers: usize) -> usize {
        ((self.users_per_worker * workers as f64).round() as usize).clamp(1, self.max_users.max(1))
    }
}

/// What one measured run gave.
#[derive(Debug, Clone, Default)]
struct RunMeasure {
    requests: usize,
    errors: usize,
    decision: Option<Histogram>,
    cpu_s: Option<f64>,
    agent_bytes: Option<f64>,
    wall_s: f64,
    rss_bytes: Option<u64>,
    index_pairs: Option<f64>,
    index_bytes: Option<f64>,
    hit_rate: Option<f64>,
    ttft_p50_s: f64,
    ttft_p90_s: f64,
}

/// The gateway-side state a run is measured against.
struct Snapshot {
    proc: Option<probe::ProcSample>,
    decision: Option<Histogram>,
    agent_bytes: Option<f64>,
    metrics: String,
}

const DECISION: &str = "kinference_routing_stage_seconds";
const SUMMARY_BYTES: &str = "kinference_agent_summary_bytes_total";

async fn snapshot(fleet: &Fleet, http: &HttpClient, mode: Option<&str>) -> Snapshot {
    let gateway = mode.and_then(|m| fleet.gateway(m));
    let metrics = match gateway {
        Some(g) => http
            .get_text(&format!("{}/metrics", g.admin_url))
            .await
            .unwrap_or_default(),
        None => String::new(),
    };
    Snapshot {
        proc: gateway.and_then(|g| probe::sample(g.pid)),
        decision: mode.and_then(|m| {
            Histogram::parse(&metrics, DECISION, &[("mode", m), ("stage", "decide")])
        }),
        agent_bytes: fleet.agent_metric_sum(SUMMARY_BYTES).await.ok(),
        metrics,
    }
}

fn finite(v: f64) -> Option<f64> {
    v.is_finite().then_some(v)
}

/// The median of the values present; `None` when there are none.
fn median_of(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let mut v: Vec<f64> = values.flatten().filter(|v| v.is_finite()).collect();
    (!v.is_empty()).then(|| median(&mut v))
}

/// The gateway's memory before any request: on this fleet, and on the smallest fleet measured
/// (`(workers, bytes)`), to price an added worker.
#[derive(Debug, Clone, Copy)]
struct IdleRss {
    bytes: u64,
    smallest: Option<(usize, u64)>,
}

fn row_of(
    workers: usize,
    agents: usize,
    policy: &str,
    runs: &[RunMeasure],
    idle: Option<IdleRss>,
) -> Row {
    let us = |f: fn(&Histogram) -> f64| {
        median_of(runs.iter().map(|r| r.decision.as_ref().map(|h| 1e6 * f(h))))
    };
    // The bucket that holds the median p99 (every run has the same bounds).
    let p99 = us(|h| h.quantile(0.99));
    let bucket = p99.and_then(|p99| {
        let bounds = &runs.iter().find_map(|r| r.decision.as_ref())?.buckets;
        let upper = bounds.iter().position(|(le, _)| 1e6 * le >= p99)?;
        let lower = upper.checked_sub(1).map_or(0.0, |i| bounds[i].0);
        Some((1e6 * lower, 1e6 * bounds[upper].0))
    });
    let rss = median_of(runs.iter().map(|r| r.rss_bytes.map(|b| b as f64)));
    let pairs = median_of(runs.iter().map(|r| r.index_pairs));
    Row {
        workers,
        agents,
        policy: policy.to_string(),
        runs: runs.len(),
        requests: runs.first().map_or(0, |r| r.requests),
        errors: runs.iter().map(|r| r.errors).sum(),
        decision_p50_us: us(|h| h.quantile(0.5)),
        decision_p99_us: p99,
        decision_p99_bucket_us: bucket,
        decision_mean_us: us(Histogram::mean),
        gateway_cpu_ms_per_request: median_of(
            runs.iter()
                .map(|r| r.cpu_s.map(|c| 1e3 * c / r.requests.max(1) as f64)),
        ),
        // The agents stream to the `kinference` gateway whichever policy routes the run: their bytes
        // belong to its row.
        agent_bytes_per_s: median_of(
            runs.iter()
                .map(|r| r.agent_bytes.map(|b| b / r.wall_s.max(1e-9))),
        )
        .filter(|_| policy == "kinference"),
        gateway_rss_mib: rss.map(|b| b / (1024.0 * 1024.0)),
        gateway_idle_rss_mib: idle.map(|i| i.bytes as f64 / (1024.0 * 1024.0)),
        idle_rss_kib_per_added_worker: idle.and_then(|i| {
            let (first, bytes) = i.smallest?;
            (workers > first)
                .then(|| (i.bytes as f64 - bytes as f64) / 1024.0 / (workers - first) as f64)
        }),
        rss_bytes_per_cached_block: rss
            .zip(idle)
            .zip(pairs)
            .filter(|(_, p)| *p > 0.0)
            .map(|((r, idle), p)| (r - idle.bytes as f64) / p),
        index_bytes_per_cached_block: median_of(runs.iter().map(|r| {
            r.index_bytes
                .zip(r.index_pairs)
                .filter(|(_, p)| *p > 0.0)
                .map(|(b, p)| b / p)
        })),
        cached_blocks: pairs,
        hit_rate: median_of(runs.iter().map(|r| r.hit_rate)),
        ttft_p50_s: median_of(runs.iter().map(|r| finite(r.ttft_p50_s))).unwrap_or(f64::NAN),
        ttft_p90_s: median_of(runs.iter().map(|r| finite(r.ttft_p90_s))).unwrap_or(f64::NAN),
    }
}

#[allow(clippy::too_many_arguments)]
async fn measure_run(
    fleet: &Fleet,
    http: &HttpClient,
    client: &LoadClient,
    route: &Route,
    mode: Option<&str>,
    warmup: &Workload,
    workload: &Workload,
    users: usize,
    time_scale: f64,
) -> Result<RunMeasure, cluster::ClusterError> {
    fleet.reset_caches(Duration::from_millis(500)).await?;
    if !warmup.is_empty() {
        client.run(route, warmup, users).await;
    }
    let before = snapshot(fleet, http, mode).await;
    let counters_before = fleet.cache_counters().await.ok();
    let result = client.run(route, workload, users).await;
    let after = snapshot(fleet, http, mode).await;
    let counters_after = fleet.cache_counters().await.ok();
    let summary = summarize(
        &result.outcomes,
        result.wall,
        time_scale,
        WorkloadKind::SharedPrefix.ttft_slo_s(),
    );
    let gauge = |name: &str| {
        mode.filter(|m| *m == "kinference")
            .map(|_| metric_sum(&after.metrics, name))
    };
    Ok(RunMeasure {
        requests: summary.n,
        errors: summary.errors,
        decision: after
            .decision
            .as_ref()
            .map(|a| before.decision.as_ref().map_or(a.clone(), |b| a.since(b))),
        cpu_s: after.proc.zip(before.proc).map(|(a, b)| a.cpu_s - b.cpu_s),
        agent_bytes: after
            .agent_bytes
            .zip(before.agent_bytes)
            .map(|(a, b)| a - b),
        wall_s: result.wall.as_secs_f64(),
        rss_bytes: after.proc.map(|p| p.rss_bytes),
        index_pairs: gauge("kinference_routing_index_pairs"),
        index_bytes: gauge("kinference_routing_index_bytes"),
        hit_rate: counters_before
            .zip(counters_after)
            .map(|(b, a)| a.hit_share_since(&b)),
        ttft_p50_s: summary.median_ttft_s,
        ttft_p90_s: summary.p90_ttft_s,
    })
}

fn progress(workers: usize, run: usize, runs: usize, policy: &str, m: &RunMeasure) -> String {
    let us = |q: f64| {
        m.decision
            .as_ref()
            .map_or("-".into(), |h| format!("{:.1}", 1e6 * h.quantile(q)))
    };
    format!(
        "scale-bench: {workers:>3} workers  run {}/{runs}  {policy:<10}  decision p50 {} us p99 {} us  gateway CPU {} ms/req  agents {} KB/s  hit {}  TTFT p50 {:.2}s p90 {:.2}s  n={} err={}  ({:.1}s wall)",
        run + 1,
        us(0.5),
        us(0.99),
        m.cpu_s.map_or("-".into(), |c| format!(
            "{:.2}",
            1e3 * c / m.requests.max(1) as f64
        )),
        if policy == "kinference" {
            m.agent_bytes.map_or("-".into(), |b| {
                format!("{:.1}", b / 1024.0 / m.wall_s.max(1e-9))
            })
        } else {
            "-".into()
        },
        m.hit_rate
            .map_or("-".into(), |h| format!("{:.1}%", 100.0 * h)),
        m.ttft_p50_s,
        m.ttft_p90_s,
        m.requests,
        m.errors,
        m.wall_s,
    )
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn write_results(
    out_dir: &std::path::Path,
    command: &str,
    setup: &serde_json::Value,
    rows: &[Row],
    notes: &[String],
) -> std::io::Result<()> {
    std::fs::create_dir_all(out_dir)?;
    let cpus = setup["cpus"].as_u64().unwrap_or(0);
    let largest = rows
        .iter()
        .map(|r| (r.workers, r.agents))
        .max()
        .unwrap_or_default();
    let per_sim = setup["nodes_per_sim"].as_u64().unwrap_or(1).max(1) as usize;
    let fleet = format!(
        "up to {} simulator processes serving {} workers, {} agents",
        largest.1.div_ceil(per_sim),
        largest.0,
        largest.1
    );
    let sharing = match setup["gateway_cpus"].as_str() {
        Some(gateway_cpus) => format!(
            "Every process of a fleet but the gateways ({fleet} and the load client) shares {cpus} \
             core(s); the gateways run on CPU(s) \
             {gateway_cpus}, apart from them (`--gateway-cpus`), and the fleet runs slower than on the \
             whole machine"
        ),
        None => format!(
            "Every process of a fleet ({fleet}, two gateways and the load client) shares {cpus} core(s)"
        ),
    };
    let mut md = format!(
        "# Scale: the gateway as the fleet grows\n\n```sh\n{command}\n```\n\n\
         Setup: {}\n\n",
        serde_json::to_string(setup).unwrap_or_default()
    );
    md.push_str(&format!(
        "Each fleet: {} simulated workers per simulated node, the workers of {} node(s) in one `vllm-sim` \
         process, one real `kinference-agent` process per node, one `kinference` gateway watching every agent and one `random` \
         gateway (no agents); the oracle is client-side. The same shared-prefix workload per worker at every \
         size, each run from cold caches after an unmeasured warm-up; figures are medians over the runs. \
         Decision p50/p99 are estimated from the gateway's own `kinference_routing_stage_seconds{{stage=\"decide\"}}` \
         histogram (linear within a bucket, as Prometheus' `histogram_quantile`; the bucket column says how \
         coarse), the mean is exact (sum / count). CPU and RSS are the gateway process's (`/proc/<pid>`); \
         agent->gateway bytes are every agent's `kinference_agent_summary_bytes_total` over the run; RSS per \
         cached block is the growth from the idle gateway to the end of the run over the (block, worker) pairs \
         in its index; TTFT is in simulated seconds.\n\n",
        setup["workers_per_node"],
        setup["nodes_per_sim"].as_u64().unwrap_or(1)
    ));
    md.push_str(&report::table(rows));
    md.push_str(&format!(
        "\n## What this machine limits\n\n\
         {sharing}, so every figure here includes contention the gateway would not see on its own node: the decision histogram times wall-clock, so a decision descheduled mid-way \
         counts whole, which inflates the p99 most at the largest fleets, where the most processes compete; \
         TTFT includes the loopback apparatus' own milliseconds (divided by the time scale into simulated \
         time); the oracle asks every worker per request and is left out past `--oracle-max-workers`. Quote \
         ratios between rows of one run, not absolute times.\n"
    ));
    if !notes.is_empty() {
        md.push_str("\n## Notes from this run\n\n");
        for n in notes {
            md.push_str(&format!("- {n}\n"));
        }
    }
    std::fs::write(out_dir.join("scale.md"), md)?;
    std::fs::write(
        out_dir.join("scale.json"),
        serde_json::to_string_pretty(&json!({"command": command, "setup": setup, "rows": rows}))?
            + "\n",
    )?;
    std::fs::write(out_dir.join("scale.svg"), report::svg(rows))
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    tokio::select! {
        code = run(args) => code,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("interrupted: stopping the fleet");
            ExitCode::from(130)
        }
    }
}

/// Redraws the plot of a recorded `scale.json` beside it.
/// The CPUs this process may run on (`Cpus_allowed_list` of `/proc/self/status`).
fn own_cpus() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .map(|cpus| cpus.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn replot(json: &std::path::Path) -> anyhow::Result<()> {
    let results: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(json)?)?;
    let rows: Vec<Row> = serde_json::from_value(results["rows"].clone())?;
    let svg = json.with_file_name("scale.svg");
    std::fs::write(&svg, report::svg(&rows))?;
    eprintln!("scale-bench: wrote {}", svg.display());
    Ok(())
}

async fn run(args: Args) -> ExitCode {
    if let Some(json) = &args.replot {
        return match replot(json) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("scale-bench: --replot {}: {e}", json.display());
                ExitCode::FAILURE
            }
        };
    }
    if let Some(p) = args
        .policies
        .iter()
        .find(|p| !["random", "kinference", "oracle"].contains(&p.as_str()))
    {
        eprintln!("scale-bench: unknown policy {p:?} (expected random, kinference or oracle)");
        return ExitCode::from(2);
    }
    if args.fleets.is_empty() || args.fleets.contains(&0) || args.runs == 0 {
        eprintln!("scale-bench: --fleets needs sizes > 0 and --runs at least 1");
        return ExitCode::from(2);
    }
    let out_dir = args
        .out_dir
        .clone()
        .unwrap_or_else(|| repo_root().join("bench/results/scale"));
    // With `--gateway-cpus`, this process runs on the other CPUs: the command says so.
    let pinned = match &args.gateway_cpus {
        Some(_) => format!("taskset -c {} ", own_cpus()),
        None => String::new(),
    };
    let command = format!(
        "cargo build --release -p kinference-bench -p kinference-agent -p kinference-gateway\n{pinned}target/release/scale-bench {}",
        std::env::args().skip(1).collect::<Vec<_>>().join(" ")
    );
    // The CPUs this process (and the fleet it starts) may use; with `--gateway-cpus`, fewer than
    // the machine's.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let setup = json!({
        "workers_per_node": args.workers_per_node,
        "runs": args.runs,
        "prefixes_per_worker": args.prefixes_per_worker,
        "prefix_words": args.prefix_words,
        "requests_per_worker": args.requests_per_worker,
        "warmup": format!("{} per prefix", args.warmup_per_prefix),
        "nodes_per_sim": args.nodes_per_sim.max(1),
        "users_per_worker": args.users_per_worker,
        "max_users": args.max_users,
        "num_blocks": args.num_blocks,
        "preset": args.preset,
        "time_scale": args.time_scale,
        "seed": args.seed,
        "build": if cfg!(debug_assertions) { "debug" } else { "release" },
        "cpus": cpus,
        "gateway_cpus": args.gateway_cpus,
    });
    let modes: Vec<String> = args
        .policies
        .iter()
        .filter(|p| *p != "oracle")
        .cloned()
        .collect();
    let http = HttpClient::new();
    let client = LoadClient::new(
        http.clone(),
        cluster::MODEL,
        false,
        Duration::from_secs(args.request_timeout_s),
    );
    let started = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let mut smallest: Option<(usize, u64)> = None;
    if let Some(cpus) = &args.gateway_cpus {
        notes.push(format!(
            "CPUs: the gateways on {cpus}; the client and the fleet on {}",
            own_cpus()
        ));
    }
    for (f, &workers) in args.fleets.iter().enumerate() {
        let config = FleetConfig {
            bin_dir: args.bin_dir.clone().unwrap_or_else(harness::bin_dir),
            tokenizer_dir: args
                .tokenizer_dir
                .clone()
                .unwrap_or_else(cluster::default_tokenizer_dir),
            workers,
            workers_per_node: args.workers_per_node.max(1),
            nodes_per_sim: args.nodes_per_sim.max(1),
            preset: args.preset.clone(),
            time_scale: args.time_scale,
            worker_args: vec!["--num-blocks".into(), args.num_blocks.to_string()],
            gateway_modes: modes.clone(),
            work_dir: std::env::temp_dir().join(format!(
                "kinference-scale-bench-{}-{workers}",
                std::process::id()
            )),
            ready_timeout: Duration::from_secs(
                args.ready_timeout_s.unwrap_or(120 + workers as u64),
            ),
            gateway_cpus: args.gateway_cpus.clone(),
            scrape_interval: args.scrape_interval_ms.map(Duration::from_millis),
        };
        eprintln!(
            "scale-bench: fleet {}/{}: starting {workers} workers on {} nodes, {} vllm-sim processes (logs in {}), elapsed {:.0}s",
            f + 1,
            args.fleets.len(),
            config.nodes(),
            config.sim_processes(),
            config.work_dir.display(),
            started.elapsed().as_secs_f64()
        );
        let mut fleet = match Fleet::start(&config, http.clone()).await {
            Ok(fleet) => fleet,
            Err(e) => {
                eprintln!("scale-bench: cannot start the fleet: {e}");
                return ExitCode::FAILURE;
            }
        };
        let idle = fleet
            .gateway("kinference")
            .and_then(|g| probe::sample(g.pid))
            .map(|p| {
                if smallest.is_none_or(|(w, _)| workers < w) {
                    smallest = Some((workers, p.rss_bytes));
                }
                IdleRss {
                    bytes: p.rss_bytes,
                    smallest,
                }
            });
        let shape = args.shape(workers);
        let warmup_n = args.warmup_per_prefix * shape.shared_prefixes;
        let measured_n = args.requests_per_worker.max(1) * workers;
        let (warmup, workload) = Workload::generate(
            WorkloadKind::SharedPrefix,
            &shape,
            args.seed,
            warmup_n + measured_n,
        )
        .split_at_requests(warmup_n);
        let users = args.users(workers);
        eprintln!(
            "scale-bench: {workers} workers ready in {:.0}s: {} prefixes of {} words, {warmup_n} warm-up + {measured_n} measured requests per run, {users} users",
            started.elapsed().as_secs_f64(),
            shape.shared_prefixes,
            shape.prefix_words
        );
        let oracle = Arc::new(Oracle::new(http.clone(), fleet.workers().to_vec()));
        let mut measured: Vec<(String, Vec<RunMeasure>)> = Vec::new();
        for run in 0..args.runs {
            for policy in &args.policies {
                if policy == "oracle" && workers > args.oracle_max_workers {
                    continue;
                }
                if let Err(e) = fleet.check_alive() {
                    eprintln!("scale-bench: {e}");
                    return ExitCode::FAILURE;
                }
                let (route, mode) = match policy.as_str() {
                    "oracle" => (Route::Oracle(Arc::clone(&oracle)), None),
                    mode => match fleet.gateway(mode) {
                        Some(g) => (Route::Endpoint(g.url.clone()), Some(mode)),
                        None => {
                            eprintln!("scale-bench: no gateway runs {mode}");
                            return ExitCode::FAILURE;
                        }
                    },
                };
                let m = match measure_run(
                    &fleet,
                    &http,
                    &client,
                    &route,
                    mode,
                    &warmup,
                    &workload,
                    users,
                    args.time_scale,
                )
                .await
                {
                    Ok(m) => m,
                    Err(e) => {
                        eprintln!("scale-bench: {e} (logs in {})", fleet.work_dir().display());
                        return ExitCode::FAILURE;
                    }
                };
                eprintln!("{}", progress(workers, run, args.runs, policy, &m));
                match measured.iter_mut().find(|(p, _)| p == policy) {
                    Some((_, runs)) => runs.push(m),
                    None => measured.push((policy.clone(), vec![m])),
                }
            }
        }
        for (policy, runs) in &measured {
            rows.push(row_of(
                workers,
                config.nodes(),
                policy,
                runs,
                idle.filter(|_| policy == "kinference"),
            ));
        }
        if workers > args.oracle_max_workers && args.policies.iter().any(|p| p == "oracle") {
            notes.push(format!(
                "{workers} workers: no oracle row (more than --oracle-max-workers {})",
                args.oracle_max_workers
            ));
        }
        notes.push(format!(
            "{workers} workers: {} agent processes, {} vllm-sim processes; load average at the end of the fleet {}",
            config.nodes(),
            config.sim_processes(),
            load_average()
        ));
        drop(fleet);
        if let Err(e) = write_results(&out_dir, &command, &setup, &rows, &notes) {
            eprintln!("scale-bench: writing results: {e}");
            return ExitCode::FAILURE;
        }
    }
    eprintln!();
    eprint!("{}", report::table(&rows));
    if let Some(r) = rows
        .iter()
        .filter(|r| r.policy == "kinference")
        .max_by_key(|r| r.workers)
        && let Some(p99) = r.decision_p99_us
    {
        eprintln!(
            "\nDecision p99 at {} workers: {p99:.1} us (target < 50 us): {}",
            r.workers,
            if p99 < 50.0 {
                "met".to_string()
            } else {
                format!("missed by {:.1} us", p99 - 50.0)
            }
        );
    }
    eprintln!(
        "Results in {} ({:.0}s)",
        out_dir.display(),
        started.elapsed().as_secs_f64()
    );
    ExitCode::SUCCESS
}
