//! `routing-bench`: reproduces the published cache-aware routing experiment on simulated vLLM workers.
//!
//! Starts `--workers` simulated workers (calibrated preset), one node agent and one gateway per routing
//! mode on loopback, then runs every workload x concurrency x policy on the same request sequence, each
//! run from cold caches, and writes `routing.json`, `routing.md` and `routing.svg`.
//!
//! Build the three binaries first (release: the gateway tokenizes multi-thousand-token prompts on the
//! request path and a debug build would add its own latency to every TTFT):
//! `cargo build --release -p kinference-bench -p kinference-agent -p kinference-gateway`.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use kinference_bench::harness::http::HttpClient;
use kinference_bench::harness::{self, free_ports, repo_root};
use kinference_bench::routing::client::{LoadClient, Route};
use kinference_bench::routing::cluster::{self, Cluster, ClusterConfig, ClusterOptions};
use kinference_bench::routing::experiment::{self, ExperimentConfig, RequestCount, RunRecord};
use kinference_bench::routing::fleet::FleetPlan;
use kinference_bench::routing::oracle::Oracle;
use kinference_bench::routing::pd::{self, PdConfig, PdFleet, PdRouter, PdWorkload};
use kinference_bench::routing::peers::{self, PeerContext, PeerRouter, RunningPeer};
use kinference_bench::routing::policy::Policy;
use kinference_bench::routing::replicas::{ReplicaRecord, ReplicaReport};
use kinference_bench::routing::report::Report;
use kinference_bench::routing::workload::{WorkloadKind, WorkloadShape};
use serde_json::json;

/// Routing benchmark: Kinference vs. random, round-robin, least-outstanding, prefix-hash and an oracle.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Workloads to run: shared-prefix, unique, multi-turn, and two that stress what a hash cannot
    /// see: bursty (shared-prefix requests in bursts of `--concurrency` every few simulated seconds)
    /// and heterogeneous (shared-prefix requests on a fleet of its own: two fast workers with large
    /// caches and two 2.5x slower with small ones, a fast one slowed to 4x halfway) and restart (the
    /// same fleet, a fast worker killed halfway and started again, cold, 10 simulated seconds later);
    /// run these two apart from the others, `--workers` does not apply to them.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "shared-prefix,unique,multi-turn"
    )]
    workloads: Vec<WorkloadKind>,
    /// Concurrency levels (virtual users).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    concurrency: Vec<usize>,
    /// Policies to compare.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "random,round-robin,least-outstanding,prefix-hash,kinference,oracle"
    )]
    policies: Vec<Policy>,
    /// Requests per run at every concurrency (default: max(--min-requests, --requests-per-user x C)).
    #[arg(long)]
    requests_per_run: Option<usize>,
    /// Lower bound of the requests per run when they scale with concurrency (96: at low concurrency one
    /// extra cache miss in a 24-request run moved the median).
    #[arg(long, default_value_t = 96)]
    min_requests: usize,
    /// Requests per virtual user when the requests per run scale with concurrency (8: with 3, a run at
    /// concurrency 32 was mostly its opening burst and closing drain, and a queue that grows without
    /// bound under a policy had no time to grow; same command, 3 vs 8: Kinference 355 vs 410 rpm, random
    /// 50 vs 39 rpm at shared-prefix c=32).
    #[arg(long, default_value_t = 8)]
    requests_per_user: usize,
    /// Simulator time scale: wall-clock time = simulated time x scale. Results are reported in
    /// simulated time. Only the workers' model time is scaled: the client, the routers and the workers'
    /// HTTP handling run in real time, about 5 ms per request on loopback, which a scale divides into
    /// simulated time (at 0.05 it became 100 ms, twice the model's 54 ms TTFT of a cached prompt, and the
    /// 2-core machine was CPU-bound at concurrency 16). 0.2 keeps that apparatus cost near a model step.
    #[arg(long, default_value_t = 0.2)]
    time_scale: f64,
    /// A small, fast subset: concurrency 2 and 8, four policies, 16 requests per run.
    #[arg(long)]
    quick: bool,
    /// Unmeasured warm-up requests before each run (default: twice the number of shared prefixes for
    /// shared-prefix, none for the others).
    #[arg(long)]
    warmup: Option<usize>,
    /// Seed of the request sequences.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Simulated workers.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Simulator latency preset.
    #[arg(long, default_value = "l40s-27b-fp8")]
    preset: String,
    /// Extra argument for every `vllm-sim` (repeatable), e.g. `--worker-arg=--num-blocks=4096`.
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    worker_args: Vec<String>,
    /// Where routing.json, routing.md and routing.svg go (default: bench/results, or bench/results/quick
    /// with --quick).
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Directory of vllm-sim, kinference-agent and kinference-gateway (default: next to this binary,
    /// or KINFERENCE_BIN_DIR).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Tokenizer directory (default: KINFERENCE_TOKENIZER_DIR, or <repo>/.assets/qwen2).
    #[arg(long)]
    tokenizer_dir: Option<PathBuf>,
    /// Ask the gateways to explain each decision (`x-kinference-debug: 1`) and write every request,
    /// with its worker and decision, to this JSON-lines file.
    #[arg(long)]
    requests_log: Option<PathBuf>,
    /// Name each conversation in `x-session-id` (the gateway's sessions: a conversation's turns go
    /// back to the worker of its previous turn unless another is clearly faster).
    #[arg(long)]
    session_header: bool,
    /// Wall-clock limit of one request, in seconds.
    #[arg(long, default_value_t = 300)]
    request_timeout_s: u64,
    /// Also run peer routers in front of the same workers: `all`, or a comma list of packages
    /// (vllm-router, smg, sglang-router, litellm) or peer policies (vllm-router-kv-aware,
    /// vllm-router-cache-aware, smg-cache-aware, smg-prefix-hash, sglang-router-cache-aware,
    /// litellm-least-busy). Each package is pip-installed (pinned) into its own venv under
    /// --peers-dir on first use. A peer that cannot be installed or started gets "n/a" rows.
    #[arg(long)]
    peers: Option<String>,
    /// Where the peers' venvs are cached (default: KINFERENCE_PEERS_DIR, or
    /// ~/.cache/kinference-bench/peers).
    #[arg(long)]
    peers_dir: Option<PathBuf>,
    /// How long a peer may take to route its first request, in seconds.
    #[arg(long, default_value_t = 180)]
    peer_ready_timeout_s: u64,
    /// A `router-overhead.json` (from `router-overhead`) whose added-latency and CPU rows are copied into
    /// routing.json (`overhead`) and routing.md, so that one report holds every figure of each router.
    #[arg(long)]
    overhead_json: Option<PathBuf>,
    /// Prefill/decode disaggregation instead of the routing matrix: Kinference's P/D gateway against
    /// vllm-router's and smg's P/D modes and Kinference aggregated, on `--pd-prefill` kv_producer and
    /// `--pd-decode` kv_consumer workers (results in bench/results/pd unless --out-dir). Takes the
    /// `--pd-*` flags, --time-scale, --preset, --seed, --worker-arg and the directory flags.
    #[arg(long)]
    pd: bool,
    /// P/D: prefill (kv_producer) workers.
    #[arg(long, default_value_t = 2)]
    pd_prefill: usize,
    /// P/D: decode (kv_consumer) workers.
    #[arg(long, default_value_t = 2)]
    pd_decode: usize,
    /// P/D: workloads (long-prompt-short-answer, short-prompt-long-answer).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "long-prompt-short-answer,short-prompt-long-answer"
    )]
    pd_workloads: Vec<PdWorkload>,
    /// P/D: concurrency levels.
    #[arg(long, value_delimiter = ',', default_value = "8,32")]
    pd_concurrency: Vec<usize>,
    /// P/D: peers to run (vllm-router, smg; `none` for none).
    #[arg(long, value_delimiter = ',', default_value = "vllm-router,smg")]
    pd_peers: Vec<String>,
    /// P/D: the peers' policy on both sides (`round_robin`: load-only, as unique prompts leave a cache
    /// policy nothing to find).
    #[arg(long, default_value = "round_robin")]
    pd_peer_policy: String,
    /// P/D: rounds of the whole matrix; figures are medians over rounds, ratios paired by round.
    #[arg(long, default_value_t = 1)]
    pd_rounds: usize,
    /// P/D: requests per run are max(--pd-min-requests, this x concurrency).
    #[arg(long, default_value_t = 3)]
    pd_requests_per_user: usize,
    /// P/D: see --pd-requests-per-user.
    #[arg(long, default_value_t = 32)]
    pd_min_requests: usize,
    /// The noisy-neighbour benchmark instead of the routing matrix (see
    /// `kinference_bench::routing::noisy`): tenant A floods, B is steady, C latency-critical; arms
    /// with and without the gateway's flow control, and B alone and C alone. Takes the `--nn-*`
    /// flags, --workers, --preset, --time-scale, --worker-arg and the directory flags; results in
    /// bench/results/flow-control unless --out-dir.
    #[arg(long)]
    noisy_neighbour: bool,
    /// Noisy neighbour: seconds of arrivals per arm.
    #[arg(long, default_value_t = 30.0)]
    nn_seconds: f64,
    /// Noisy neighbour: seconds an arm waits for its last answers after the arrivals end (longer
    /// waits are cut).
    #[arg(long, default_value_t = 20.0)]
    nn_drain_seconds: f64,
    /// Noisy neighbour: the fleet's capacity in requests per second for the request shape (default:
    /// measured first, closed loop).
    #[arg(long)]
    nn_capacity_rps: Option<f64>,
    /// Noisy neighbour: A's arrival rate as a multiple of the capacity.
    #[arg(long, default_value_t = 4.0)]
    nn_flood_factor: f64,
    /// Noisy neighbour: B's and C's arrival rates as fractions of the capacity.
    #[arg(long, value_delimiter = ',', default_value = "0.15,0.08")]
    nn_light: Vec<f64>,
    /// Noisy neighbour: prompt words and completion tokens of every request.
    #[arg(long, value_delimiter = ',', default_value = "200,48")]
    nn_shape: Vec<usize>,
    /// Noisy neighbour: the TTFT objective of goodput, seconds (wall).
    #[arg(long, default_value_t = 2.0)]
    nn_slo_s: f64,
    /// Noisy neighbour: seeds of the arrival schedules (one round of every arm each).
    #[arg(long, value_delimiter = ',', default_value = "42")]
    nn_seeds: Vec<u64>,
    /// Noisy neighbour: extra flags of the flow-control gateway (after `--flow-control`).
    #[arg(long = "nn-flow-arg", allow_hyphen_values = true)]
    nn_flow_args: Vec<String>,
    /// Noisy neighbour: flags of a second flow-control gateway (after `--flow-control`), run as the
    /// `flow-control-alt` arm on the same cluster and arrivals (e.g. a fixed reserve against the
    /// default); none: no such arm.
    #[arg(long = "nn-alt-flow-arg", allow_hyphen_values = true)]
    nn_alt_flow_args: Vec<String>,
    /// Noisy neighbour: flow-control gateway replicas; the flow-control arm's requests alternate
    /// between them, so each one's own ledger sees only its share of the workers' load and the
    /// rest reaches it through the agent (the kernel view, the engine scrape).
    #[arg(long, default_value_t = 1)]
    nn_replicas: usize,
    /// Noisy neighbour: extra flags of the node agent (e.g. `--scrape-interval-ms=10000`).
    #[arg(long = "nn-agent-arg", allow_hyphen_values = true)]
    nn_agent_args: Vec<String>,
    /// Noisy neighbour: environment of the node agent, `NAME=VALUE` (e.g.
    /// `KINFERENCE_DISABLE_EBPF=1`, `KINFERENCE_EBPF_OBJECT=target/ebpf/kinference.bpf.o`).
    #[arg(long = "nn-agent-env")]
    nn_agent_env: Vec<String>,
    /// Noisy neighbour: the arms to run, of `b-alone`, `c-alone`, `no-flow-control`,
    /// `flow-control`, `flow-control-alt` (with `--nn-alt-flow-arg` only).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "b-alone,c-alone,no-flow-control,flow-control,flow-control-alt"
    )]
    nn_arms: Vec<String>,
    /// Gateway replicas instead of the routing matrix: for each workload and concurrency, the
    /// `kinference` gateway run as each of these numbers of replicas (e.g. `1,2,4`) on the same
    /// workers and the same request sequence, behind a random front (each request to a replica drawn
    /// from the seed, its session and its turn, as a Service spreads connections). Writes
    /// `replicas-<label>.{json,md}` (bench/results/replicas unless --out-dir). Takes --workloads,
    /// --concurrency, the request-count flags, --seeds and the cluster flags.
    #[arg(long, value_delimiter = ',')]
    replicas: Vec<usize>,
    /// Replicas: a second set of replicas that tell each other what they dispatch
    /// (`replicas.peers`), run beside the first on every workload: N = 2, 4 with and without.
    #[arg(long)]
    share_dispatches: bool,
    /// Replicas: the results' file name part (`before`, `after`, ...).
    #[arg(long, default_value = "run")]
    label: String,
    /// Replicas: seeds of the request sequences and of the front's draws (default: --seed).
    #[arg(long, value_delimiter = ',')]
    seeds: Vec<u64>,
    /// Data-parallel ranks instead of the routing matrix: every worker runs this many ranks
    /// (`vllm-sim --data-parallel-size`), and two clusters side by side take the same request
    /// sequences: one whose agent reports each rank and whose gateway names the rank in
    /// `X-data-parallel-rank` (rank-aware), one whose agent is not told the ranks (rank-blind: one
    /// cache per worker, no header, the worker's own balancer picks the rank). Prints one line per run
    /// and the medians. Takes --workloads, --concurrency, the request-count flags, --seeds and the
    /// cluster flags.
    #[arg(long)]
    dp_ranks: Option<usize>,
}

/// `--out-dir`, else `default` under the repository.
fn out_dir_or(args: &Args, default: &str) -> PathBuf {
    args.out_dir
        .clone()
        .unwrap_or_else(|| repo_root().join(default))
}

/// Runs one benchmark mode; Ctrl-C stops it (and its cluster, dropped with the future) with 130.
async fn until_interrupted(run: impl std::future::Future<Output = ExitCode>) -> ExitCode {
    tokio::select! {
        code = run => code,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("interrupted: stopping the cluster");
            ExitCode::from(130)
        }
    }
}

fn fmt_duration(d: Duration) -> String {
    let s = d.as_secs();
    format!("{}m{:02}s", s / 60, s % 60)
}

fn progress_line(p: &experiment::Progress, r: &RunRecord) -> String {
    let s = &r.summary;
    format!(
        "[{:>3}/{}] {:<13} c={:<2} {:<17} median TTFT {:>7.2}s  p90 {:>7.2}s  e2e {:>7.2}s  goodput {:>6.1}/min  cached {:>3.0}%  n={} err={}  ({:.1}s wall)  elapsed {}  ETA {}",
        p.done,
        p.total,
        r.workload.as_str(),
        r.concurrency,
        r.policy.as_str(),
        s.median_ttft_s,
        s.p90_ttft_s,
        s.median_e2e_s,
        s.goodput_rpm,
        100.0 * s.cached_token_share,
        s.n,
        s.errors,
        r.wall_s,
        fmt_duration(p.elapsed),
        fmt_duration(p.eta),
    )
}

fn write_requests_log(file: &mut std::fs::File, r: &RunRecord) -> std::io::Result<()> {
    for o in &r.outcomes {
        let line = json!({
            "workload": r.workload,
            "policy": r.policy,
            "concurrency": r.concurrency,
            "request": o,
        });
        writeln!(file, "{line}")?;
    }
    Ok(())
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
    let mut args = Args::parse();
    if args.quick {
        args.concurrency = vec![2, 8];
        args.policies = vec![
            Policy::Random,
            Policy::LeastOutstanding,
            Policy::Kinference,
            Policy::Oracle,
        ];
        args.requests_per_run.get_or_insert(16);
    }
    if args.noisy_neighbour {
        let out_dir = out_dir_or(&args, "bench/results/flow-control");
        return until_interrupted(run_noisy(args, out_dir)).await;
    }
    if args.pd {
        let out_dir = out_dir_or(&args, "bench/results/pd");
        return until_interrupted(run_pd(args, out_dir)).await;
    }
    if !args.replicas.is_empty() {
        let out_dir = out_dir_or(&args, "bench/results/replicas");
        return until_interrupted(run_replicas(args, out_dir)).await;
    }
    if let Some(ranks) = args.dp_ranks {
        return until_interrupted(run_dp_ranks(args, ranks)).await;
    }
    let out_dir = args.out_dir.clone().unwrap_or_else(|| {
        let dir = repo_root().join("bench/results");
        if args.quick { dir.join("quick") } else { dir }
    });
    until_interrupted(run(args, out_dir)).await
}

/// Installs and starts the peers, registering each with the cluster (a route, or why it cannot run).
async fn start_peers(
    cluster: &mut Cluster,
    http: &HttpClient,
    wanted: &[Policy],
    args: &Args,
) -> Vec<RunningPeer> {
    let cache = args
        .peers_dir
        .clone()
        .unwrap_or_else(peers::default_cache_dir);
    let metrics = http
        .get_text(&format!("{}/metrics", cluster.workers()[0]))
        .await
        .unwrap_or_default();
    let block_size = peers::block_size_from_metrics(&metrics).unwrap_or(16);
    let mut venvs = std::collections::BTreeMap::new();
    let mut running = Vec::new();
    for &policy in wanted {
        let Some((router, _)) = PeerRouter::of(policy) else {
            continue;
        };
        let venv = venvs
            .entry(router)
            .or_insert_with(|| {
                peers::install(router, &cache, &mut |line| {
                    eprintln!("routing-bench: peer {line}")
                })
                .map_err(|e| e.to_string())
            })
            .clone();
        let venv = match venv {
            Ok(v) => v,
            Err(e) => {
                eprintln!("routing-bench: {policy} cannot run: {e}");
                cluster.set_peer(policy, Err(format!("install failed: {e}")));
                continue;
            }
        };
        let ports = free_ports(2);
        let ctx = PeerContext {
            workers: cluster.worker_endpoints().to_vec(),
            model: cluster::MODEL.to_string(),
            block_size,
            port: ports[0],
            metrics_port: ports[1],
            work_dir: cluster.work_dir().to_path_buf(),
        };
        eprintln!(
            "routing-bench: starting peer {policy} ({}) on port {}",
            router.requirement(),
            ports[0]
        );
        match peers::start(
            policy,
            &venv,
            &ctx,
            http,
            Duration::from_secs(args.peer_ready_timeout_s),
        )
        .await
        {
            Ok(peer) => {
                cluster.set_peer(policy, Ok(peer.route.clone()));
                running.push(peer);
            }
            Err(e) => {
                eprintln!("routing-bench: {policy} cannot run: {e}");
                let first = e.to_string().lines().next().unwrap_or_default().to_string();
                cluster.set_peer(policy, Err(format!("did not start: {first}")));
            }
        }
    }
    running
}

async fn run(args: Args, out_dir: PathBuf) -> ExitCode {
    let wanted_peers = match args.peers.as_deref().map(peers::parse_peers).transpose() {
        Ok(p) => p.unwrap_or_default(),
        Err(e) => {
            eprintln!("routing-bench: --peers: {e}");
            return ExitCode::FAILURE;
        }
    };
    let command = format!(
        "cargo build --release -p kinference-bench -p kinference-agent -p kinference-gateway\ntarget/release/routing-bench {}",
        std::env::args().skip(1).collect::<Vec<_>>().join(" ")
    );
    let requests = match args.requests_per_run {
        Some(n) => RequestCount::Fixed(n),
        None => RequestCount::Scaled {
            min: args.min_requests,
            per_user: args.requests_per_user,
        },
    };
    // The workloads of a mixed fleet share one cluster only when they run on the same workers.
    let fleets: Vec<FleetPlan> = args
        .workloads
        .iter()
        .filter_map(|&kind| FleetPlan::for_workload(kind))
        .collect();
    let fleet = match fleets.first() {
        Some(first)
            if fleets.len() < args.workloads.len()
                || fleets.iter().any(|f| f.workers != first.workers) =>
        {
            eprintln!(
                "routing-bench: the heterogeneous and restart workloads run on a fleet of their own: run them in a command of their own"
            );
            return ExitCode::FAILURE;
        }
        first => first.cloned(),
    };
    let mut policies = args.policies.clone();
    policies.extend(wanted_peers.iter().filter(|p| !args.policies.contains(p)));
    let config = ExperimentConfig {
        workloads: args.workloads.clone(),
        concurrency: args.concurrency.clone(),
        policies,
        requests,
        warmup: args.warmup,
        seed: args.seed,
        time_scale: args.time_scale,
        shape: WorkloadShape::default(),
        settle: Duration::from_millis(300),
    };
    let mut modes: Vec<String> = config
        .policies
        .iter()
        .filter_map(|p| p.gateway_mode())
        .map(str::to_string)
        .collect();
    modes.dedup();
    let cluster_config = ClusterConfig {
        bin_dir: args.bin_dir.clone().unwrap_or_else(harness::bin_dir),
        tokenizer_dir: args
            .tokenizer_dir
            .clone()
            .unwrap_or_else(cluster::default_tokenizer_dir),
        workers: fleet.as_ref().map_or(args.workers, |f| f.workers.len()),
        preset: args.preset.clone(),
        time_scale: args.time_scale,
        worker_args: args.worker_args.clone(),
        gateway_modes: modes,
        work_dir: std::env::temp_dir()
            .join(format!("kinference-routing-bench-{}", std::process::id())),
        ready_timeout: Duration::from_secs(60),
    };
    let setup = json!({
        "workers": cluster_config.workers,
        "fleet": fleet,
        "preset": args.preset,
        "time_scale": args.time_scale,
        "worker_args": args.worker_args,
        "requests_per_run": match requests {
            RequestCount::Fixed(n) => format!("{n}"),
            RequestCount::Scaled { min, per_user } => format!(
                "max({min}, {per_user} x concurrency); multi-turn at least {} conversations per user",
                ExperimentConfig::MULTI_TURN_SESSIONS_PER_USER
            ),
        },
        "seed": args.seed,
        "session_header": args.session_header,
        "build": if cfg!(debug_assertions) { "debug" } else { "release" },
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "git_commit": git_commit(),
    });
    let mut setup = setup;
    if !wanted_peers.is_empty() {
        setup["peers"] = json!(
            wanted_peers
                .iter()
                .filter_map(|p| Some((p.as_str(), PeerRouter::of(*p)?)))
                .map(|(p, (router, policy))| json!({
                    "row": p, "package": router.requirement(), "policy": policy,
                }))
                .collect::<Vec<_>>()
        );
    }

    eprintln!(
        "routing-bench: {} runs ({} workloads x {} concurrency levels x {} policies), time scale {}, logs in {}",
        config.runs(),
        config.workloads.len(),
        config.concurrency.len(),
        config.policies.len(),
        config.time_scale,
        cluster_config.work_dir.display()
    );
    let http = HttpClient::new();
    // vllm-router's kv_aware connects to each worker's PUB socket, so with it the workers bind and
    // the agent connects too (both subscribers then see the same events).
    let options = ClusterOptions {
        workers_bind_kv_events: wanted_peers.contains(&Policy::VllmRouterKvAware),
        per_worker_args: fleet
            .as_ref()
            .map(FleetPlan::worker_args)
            .unwrap_or_default(),
        ..ClusterOptions::default()
    };
    let mut cluster = match Cluster::start_with(&cluster_config, http.clone(), &options).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("routing-bench: cannot start the cluster: {e}");
            return ExitCode::FAILURE;
        }
    };
    let _peers = start_peers(&mut cluster, &http, &wanted_peers, &args).await;
    let oracle = Arc::new(Oracle::new(http.clone(), cluster.workers().to_vec()));
    let client = LoadClient::new(
        http,
        cluster::MODEL,
        args.requests_log.is_some(),
        Duration::from_secs(args.request_timeout_s),
    )
    .with_session_header(args.session_header);
    let mut log = match args
        .requests_log
        .as_ref()
        .map(std::fs::File::create)
        .transpose()
    {
        Ok(f) => f,
        Err(e) => {
            eprintln!("routing-bench: cannot create the requests log: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut done: Vec<RunRecord> = Vec::new();
    let result = experiment::run_matrix(&mut cluster, &client, &oracle, &config, |p, r| {
        eprintln!("{}", progress_line(p, r));
        if let Some(file) = log.as_mut()
            && let Err(e) = write_requests_log(file, r)
        {
            eprintln!("routing-bench: requests log: {e}");
        }
        // Results so far are written after every run, so an interrupted benchmark still leaves them.
        done.push(r.clone());
        let report = Report {
            command: command.clone(),
            setup: setup.clone(),
            config: &config,
            records: &done,
        };
        if let Err(e) = report.write_all(&out_dir) {
            eprintln!("routing-bench: {e}");
        }
    })
    .await;
    let records = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!(
                "routing-bench: {e} (worker/agent/gateway logs in {})",
                cluster.work_dir().display()
            );
            return ExitCode::FAILURE;
        }
    };
    let report = Report {
        command,
        setup,
        config: &config,
        records: &records,
    };
    if let Err(e) = report.write_all(&out_dir) {
        eprintln!("routing-bench: {e}");
        return ExitCode::FAILURE;
    }
    if let Some(path) = &args.overhead_json
        && let Err(e) = append_overhead(path, &out_dir)
    {
        eprintln!("routing-bench: --overhead-json: {e}");
    }
    eprintln!("\nTargets:");
    for t in report.targets() {
        eprintln!(
            "  [{}] {}: {:.3} (required {}) {}",
            if t.met { "met" } else { "NOT MET" },
            t.name,
            t.measured,
            t.required,
            t.detail
        );
    }
    eprintln!("Results in {}", out_dir.display());
    ExitCode::SUCCESS
}

/// Copies `router-overhead`'s rows into routing.json (`overhead`) and a table at the end of routing.md.
fn append_overhead(path: &std::path::Path, out_dir: &std::path::Path) -> anyhow::Result<()> {
    let overhead: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let json_path = out_dir.join("routing.json");
    let mut results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path)?)?;
    results["overhead"] = overhead.clone();
    std::fs::write(&json_path, serde_json::to_string_pretty(&results)? + "\n")?;
    let mut md = std::fs::read_to_string(out_dir.join("routing.md"))?;
    md.push_str(
        "\n## Added latency over a direct call and CPU per 1,000 requests (`router-overhead`)\n\n\
         One simulated worker, trivial prompt, wall-clock ms; CPU = the router's process group \
         (Kinference: gateway, + agent).\n\n\
         | router | mode | conc | added p50 (ms) | added p99 (ms) | CPU s / 1k req |\n|---|---|---|---|---|---|\n",
    );
    for r in overhead["rows"].as_array().into_iter().flatten() {
        let cpu = r["cpu_s_per_1k"]
            .as_f64()
            .map_or("-".into(), |v| format!("{v:.2}"));
        let agent = r["agent_cpu_s_per_1k"]
            .as_f64()
            .map_or(String::new(), |v| format!(" (+{v:.2})"));
        md.push_str(&format!(
            "| {} | {} | {} | {:+.3} | {:+.3} | {cpu}{agent} |\n",
            r["router"].as_str().unwrap_or_default(),
            if r["stream"].as_bool().unwrap_or(false) {
                "stream (TTFB)"
            } else {
                "non-stream"
            },
            r["concurrency"],
            r["added_p50_ms"].as_f64().unwrap_or(f64::NAN),
            r["added_p99_ms"].as_f64().unwrap_or(f64::NAN),
        ));
    }
    std::fs::write(out_dir.join("routing.md"), md)?;
    Ok(())
}

/// `--pd`: the P/D fleet, the two Kinference gateways (with and without roles), the peers' P/D modes,
/// then every workload x concurrency x router side by side; writes pd.json and pd.md after every run.
/// The noisy-neighbour benchmark: one cluster, two gateways over the same workers (`kinference`
/// without flow control, `kinference#2` with it), every arm per seed in turn, the fleet idle between
/// arms.
async fn run_noisy(args: Args, out_dir: PathBuf) -> ExitCode {
    use kinference_bench::routing::noisy::{self, ArmResult, TenantLoad};
    let work_dir = std::env::temp_dir().join(format!("kinference-nn-bench-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&work_dir) {
        eprintln!("routing-bench: {}: {e}", work_dir.display());
        return ExitCode::FAILURE;
    }
    let tenancy = match noisy::write_tenants(&work_dir) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("routing-bench: writing the tenants: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut flow_args = vec!["--flow-control".to_string()];
    flow_args.extend(args.nn_flow_args.iter().cloned());
    let mut alt_flow_args = vec!["--flow-control".to_string()];
    alt_flow_args.extend(args.nn_alt_flow_args.iter().cloned());
    let config = ClusterConfig {
        bin_dir: args.bin_dir.clone().unwrap_or_else(harness::bin_dir),
        tokenizer_dir: args
            .tokenizer_dir
            .clone()
            .unwrap_or_else(cluster::default_tokenizer_dir),
        workers: args.workers,
        preset: args.preset.clone(),
        time_scale: args.time_scale,
        worker_args: args.worker_args.clone(),
        gateway_modes: vec!["kinference".into()],
        work_dir: work_dir.clone(),
        ready_timeout: Duration::from_secs(60),
    };
    // `kinference` without flow control, `kinference#2`.. with it, then the alternative flow
    // configuration's as many replicas.
    let replicas = args.nn_replicas.max(1);
    let flow_names: Vec<String> = (2..replicas + 2)
        .map(|r| format!("kinference#{r}"))
        .collect();
    let alt_replicas = if args.nn_alt_flow_args.is_empty() {
        0
    } else {
        replicas
    };
    let alt_names: Vec<String> = (replicas + 2..replicas + 2 + alt_replicas)
        .map(|r| format!("kinference#{r}"))
        .collect();
    let options = ClusterOptions {
        agent_args: args.nn_agent_args.clone(),
        agent_env: args
            .nn_agent_env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        gateway_replicas: replicas + alt_replicas + 1,
        gateway_yaml: [("tenancy".to_string(), tenancy)].into_iter().collect(),
        gateway_args: flow_names
            .iter()
            .map(|name| (name.clone(), flow_args.clone()))
            .chain(
                alt_names
                    .iter()
                    .map(|name| (name.clone(), alt_flow_args.clone())),
            )
            .collect(),
        ..ClusterOptions::default()
    };
    let http = HttpClient::new();
    let cluster = match Cluster::start_with(&config, http.clone(), &options).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("routing-bench: starting the cluster: {e}");
            return ExitCode::FAILURE;
        }
    };
    let off = cluster.gateway("kinference").map(|g| g.url.clone());
    let on: Option<Vec<String>> = flow_names
        .iter()
        .map(|name| cluster.gateway(name).map(|g| g.url.clone()))
        .collect();
    let alt: Option<Vec<String>> = alt_names
        .iter()
        .map(|name| cluster.gateway(name).map(|g| g.url.clone()))
        .collect();
    let (Some(off), Some(on), Some(alt)) = (off, on, alt) else {
        eprintln!("routing-bench: the gateways did not start");
        return ExitCode::FAILURE;
    };
    let off = vec![off];
    let (words, max_tokens) = (
        args.nn_shape.first().copied().unwrap_or(200),
        args.nn_shape.get(1).copied().unwrap_or(48) as u32,
    );
    let load = |tenant: &'static str, rate_rps: f64| TenantLoad {
        tenant,
        key: noisy::TENANTS
            .iter()
            .find(|(t, _, _)| *t == tenant)
            .map_or("", |(_, k, _)| k),
        rate_rps,
        prompt_words: words,
        max_tokens,
    };
    let model = cluster::MODEL;
    let capacity = match args.nn_capacity_rps {
        Some(c) => c,
        None => {
            let users = 64 * args.workers;
            let c = noisy::capacity(
                &http,
                &off[0],
                model,
                &load("a", 0.0),
                users,
                Duration::from_secs(15),
            )
            .await;
            eprintln!("capacity: {c:.2} requests/s ({users} closed-loop users, 15 s)");
            noisy::wait_idle(&http, cluster.workers(), Duration::from_secs(60)).await;
            c
        }
    };
    let light =
        |i: usize, default: f64| args.nn_light.get(i).copied().unwrap_or(default) * capacity;
    let (a_rps, b_rps, c_rps) = (
        args.nn_flood_factor * capacity,
        light(0, 0.15),
        light(1, 0.08),
    );
    let duration = Duration::from_secs_f64(args.nn_seconds);
    let drain = Duration::from_secs_f64(args.nn_drain_seconds);
    let all = || vec![load("a", a_rps), load("b", b_rps), load("c", c_rps)];
    let arms: [(&'static str, &[String], Vec<TenantLoad>); 5] = [
        ("b-alone", &off, vec![load("b", b_rps)]),
        ("c-alone", &off, vec![load("c", c_rps)]),
        ("no-flow-control", &off, all()),
        ("flow-control", &on, all()),
        ("flow-control-alt", &alt, all()),
    ];
    let mut results = Vec::new();
    for &seed in &args.nn_seeds {
        for (arm, bases, loads) in &arms {
            if !args.nn_arms.iter().any(|a| a == arm) || bases.is_empty() {
                continue;
            }
            let started = std::time::Instant::now();
            let outcomes = noisy::run_arm(&http, bases, model, loads, duration, drain, seed).await;
            let rows = noisy::figures(&outcomes, args.nn_slo_s, duration);
            for t in &rows {
                eprintln!(
                    "seed {seed} {arm:<16} {}: sent {:>4} served {:>4} 429 {:>4} 503 {:>4} cut {:>4} TTFT p50 {:>6.2}s p90 {:>6.2}s goodput {:>6.1}/min",
                    t.tenant,
                    t.sent,
                    t.served,
                    t.shed_429,
                    t.shed_503,
                    t.cut,
                    t.ttft_p50_s.unwrap_or(f64::NAN),
                    t.ttft_p90_s.unwrap_or(f64::NAN),
                    t.goodput_rpm
                );
            }
            eprintln!("  ({:.0} s wall)", started.elapsed().as_secs_f64());
            results.push(ArmResult { arm, seed, rows });
            noisy::wait_idle(&http, cluster.workers(), Duration::from_secs(60)).await;
        }
    }
    let mut flow_metrics = String::new();
    for name in flow_names.iter().chain(&alt_names) {
        let text = http
            .get_text(&format!(
                "{}/metrics",
                cluster.gateway(name).map_or("", |g| g.admin_url.as_str())
            ))
            .await
            .unwrap_or_default();
        flow_metrics.push_str(&format!("# {name}\n"));
        for line in text.lines().filter(|l| {
            l.starts_with("kinference_gateway_flow_")
                && !l.ends_with(" 0")
                && !l.contains("_bucket{")
        }) {
            flow_metrics.push_str(line);
            flow_metrics.push('\n');
        }
    }
    let header = format!(
        "Noisy neighbour: {} vllm-sim workers (--preset {} --time-scale {} {}), capacity {capacity:.2} req/s ({}); A {a_rps:.2} req/s (x{}), B {b_rps:.2}, C {c_rps:.2}; {words} prompt words, {max_tokens} tokens out; {} s of arrivals per arm, {} s drain; goodput = served with TTFT <= {} s; flow gateway flags {flow_args:?}{}. Times are wall-clock seconds on a shared 2-core machine.\n\n`{}`",
        args.workers,
        args.preset,
        args.time_scale,
        args.worker_args.join(" "),
        if args.nn_capacity_rps.is_some() {
            "given"
        } else {
            "measured"
        },
        args.nn_flood_factor,
        args.nn_seconds,
        args.nn_drain_seconds,
        args.nn_slo_s,
        if alt_names.is_empty() {
            String::new()
        } else {
            format!(", alternative flow gateway (arm `flow-control-alt`) flags {alt_flow_args:?}")
        },
        std::iter::once("routing-bench".to_string())
            .chain(std::env::args().skip(1))
            .collect::<Vec<_>>()
            .join(" "),
    );
    let mut md = noisy::markdown(&results, &header);
    md.push_str(&format!("\nFlow-control gateway metrics at the end (non-zero, no buckets):\n\n```\n{flow_metrics}```\n"));
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(&out_dir)?;
        std::fs::write(out_dir.join("noisy-neighbour.md"), &md)?;
        std::fs::write(
            out_dir.join("noisy-neighbour.json"),
            serde_json::to_string_pretty(&json!({"capacity_rps": capacity, "results": results}))
                .unwrap_or_default(),
        )
    };
    if let Err(e) = write() {
        eprintln!(
            "routing-bench: writing results to {}: {e}",
            out_dir.display()
        );
        return ExitCode::FAILURE;
    }
    println!("{md}");
    ExitCode::SUCCESS
}

async fn run_pd(args: Args, out_dir: PathBuf) -> ExitCode {
    let fleet = PdFleet {
        prefill: args.pd_prefill,
        decode: args.pd_decode,
    };
    if fleet.prefill == 0 || fleet.decode == 0 {
        eprintln!("routing-bench: --pd needs at least one prefill and one decode worker");
        return ExitCode::FAILURE;
    }
    let mut wanted_peers = Vec::new();
    for name in args.pd_peers.iter().filter(|n| *n != "none") {
        match PdRouter::ALL
            .into_iter()
            .find(|r| r.peer().is_some_and(|p| p.name() == name))
        {
            Some(r) => wanted_peers.push(r),
            None => {
                eprintln!("routing-bench: --pd-peers: unknown {name:?} (vllm-router, smg or none)");
                return ExitCode::FAILURE;
            }
        }
    }
    let mut routers = vec![PdRouter::KinferencePd, PdRouter::KinferenceAggregated];
    routers.extend(&wanted_peers);
    let config = PdConfig {
        workloads: args.pd_workloads.clone(),
        concurrency: args.pd_concurrency.clone(),
        routers,
        min_requests: args.pd_min_requests,
        requests_per_user: args.pd_requests_per_user,
        rounds: args.pd_rounds,
        seed: args.seed,
        time_scale: args.time_scale,
    };
    let command = format!(
        "cargo build --release -p kinference-bench -p kinference-agent -p kinference-gateway --bins\ntarget/release/routing-bench {}",
        std::env::args().skip(1).collect::<Vec<_>>().join(" ")
    );
    let cluster_config = ClusterConfig {
        bin_dir: args.bin_dir.clone().unwrap_or_else(harness::bin_dir),
        tokenizer_dir: args
            .tokenizer_dir
            .clone()
            .unwrap_or_else(cluster::default_tokenizer_dir),
        workers: fleet.workers(),
        preset: args.preset.clone(),
        time_scale: args.time_scale,
        worker_args: args.worker_args.clone(),
        gateway_modes: [PdRouter::KinferencePd, PdRouter::KinferenceAggregated]
            .iter()
            .filter_map(|r| r.gateway_mode())
            .map(str::to_string)
            .collect(),
        work_dir: std::env::temp_dir().join(format!("kinference-pd-bench-{}", std::process::id())),
        ready_timeout: Duration::from_secs(60),
    };
    let options = ClusterOptions {
        per_worker_args: fleet.worker_args(),
        worker_roles: fleet.gateway_roles(),
        ..ClusterOptions::default()
    };
    eprintln!(
        "routing-bench --pd: {} prefill + {} decode workers, {} runs per round, {} round(s), logs in {}",
        fleet.prefill,
        fleet.decode,
        config.workloads.len() * config.concurrency.len() * config.routers.len(),
        config.rounds,
        cluster_config.work_dir.display()
    );
    let http = HttpClient::new();
    let mut cluster = match Cluster::start_with(&cluster_config, http.clone(), &options).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("routing-bench: cannot start the cluster: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut routes = pd::Routes::new();
    for router in [PdRouter::KinferencePd, PdRouter::KinferenceAggregated] {
        let route = router
            .gateway_mode()
            .and_then(|m| cluster.gateway(m))
            .map(|g| Route::Endpoint(g.url.clone()))
            .ok_or_else(|| "no gateway".to_string());
        routes.insert(router, route);
    }
    // Peers: installed (pinned) on first use, started in front of the same workers in their P/D mode.
    let cache = args
        .peers_dir
        .clone()
        .unwrap_or_else(peers::default_cache_dir);
    let mut running = Vec::new();
    let mut peer_setup = Vec::new();
    for router in wanted_peers {
        let Some(package) = router.peer() else {
            continue;
        };
        peer_setup.push(json!({"row": router.as_str(), "package": package.requirement(), "policy": args.pd_peer_policy}));
        let venv = match peers::install(package, &cache, &mut |line| {
            eprintln!("routing-bench: peer {line}")
        }) {
            Ok(v) => v,
            Err(e) => {
                routes.insert(router, Err(format!("install failed: {e}")));
                continue;
            }
        };
        let ports = free_ports(2);
        let ctx = PeerContext {
            workers: cluster.worker_endpoints().to_vec(),
            model: cluster::MODEL.to_string(),
            block_size: 16,
            port: ports[0],
            metrics_port: ports[1],
            work_dir: cluster.work_dir().to_path_buf(),
        };
        let (prefill, decode) = fleet.split(cluster.workers());
        let Some(plan) = pd::peer_plan(package, &ctx, prefill, decode, &args.pd_peer_policy) else {
            continue;
        };
        eprintln!(
            "routing-bench: starting {} ({}) on port {}",
            router.as_str(),
            package.requirement(),
            ports[0]
        );
        match peers::launch(
            router.as_str(),
            &plan,
            &venv,
            &ctx,
            &http,
            Duration::from_secs(args.peer_ready_timeout_s),
        )
        .await
        {
            Ok(peer) => {
                routes.insert(router, Ok(peer.route.clone()));
                running.push(peer);
            }
            Err(e) => {
                eprintln!("routing-bench: {} cannot run: {e}", router.as_str());
                let first = e.to_string().lines().next().unwrap_or_default().to_string();
                routes.insert(router, Err(format!("did not start: {first}")));
            }
        }
    }
    let setup = json!({
        "fleet": fleet,
        "preset": args.preset,
        "time_scale": args.time_scale,
        "worker_args": args.worker_args,
        "peers": peer_setup,
        "build": if cfg!(debug_assertions) { "debug" } else { "release" },
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "git_commit": git_commit(),
    });
    // The decision header of Kinference's rows (the peers ignore the request header).
    let client = LoadClient::new(
        http.clone(),
        cluster::MODEL,
        true,
        Duration::from_secs(args.request_timeout_s),
    );
    let mut done: Vec<pd::PdRecord> = Vec::new();
    let total = config.rounds.max(1)
        * config.workloads.len()
        * config.concurrency.len()
        * config.routers.len();
    let result = pd::run_matrix(&mut cluster, &client, &http, &routes, &config, |r| {
        done.push(r.clone());
        match &r.summary {
            Some(s) => eprintln!(
                "[{:>2}/{total}] round {} {:<24} c={:<2} {:<21} TTFT p50 {:>6.2}s p90 {:>6.2}s  TPOT p50 {:>4.0}ms p90 {:>4.0}ms  goodput {:>6.1}/min  pulls/req {:.2}  err {}  ({:.1}s wall)",
                done.len(), r.round, r.workload.as_str(), r.concurrency, r.router.as_str(),
                s.median_ttft_s, s.p90_ttft_s, s.median_tpot_s * 1e3, s.p90_tpot_s * 1e3,
                s.goodput_rpm, s.kv_pulls_per_request, s.errors, r.wall_s
            ),
            None => eprintln!(
                "[{:>2}/{total}] {} {} c={} n/a: {}",
                done.len(), r.router.as_str(), r.workload.as_str(), r.concurrency,
                r.unavailable.as_deref().unwrap_or_default()
            ),
        }
        let report = pd::Report {
            command: command.clone(),
            setup: setup.clone(),
            config: &config,
            records: &done,
            notes: pd_notes(&done),
        };
        if let Err(e) = report.write_all(&out_dir) {
            eprintln!("routing-bench: {e}");
        }
    })
    .await;
    drop(running);
    if let Err(e) = result {
        eprintln!(
            "routing-bench: {e} (logs in {})",
            cluster.work_dir().display()
        );
        return ExitCode::FAILURE;
    }
    eprintln!("\nTargets:");
    for t in pd::targets(&pd::rows(&done), pd::AGGREGATED_TOLERANCE) {
        eprintln!(
            "  [{}] {}: {:.2} (required {:.2})",
            if t.met { "met" } else { "NOT MET" },
            t.name,
            t.measured,
            t.required
        );
    }
    eprintln!("Results in {}", out_dir.display());
    ExitCode::SUCCESS
}

/// `--replicas`: one cluster with the most replicas asked for, then every workload x concurrency x
/// seed x N on the same sequence, N replicas (the first N) behind a random front; writes the report
/// after every run.
async fn run_replicas(args: Args, out_dir: PathBuf) -> ExitCode {
    let most = args.replicas.iter().copied().max().unwrap_or(1);
    if args.replicas.contains(&0) {
        eprintln!("routing-bench: --replicas: every count must be at least 1");
        return ExitCode::FAILURE;
    }
    let fleets: Vec<FleetPlan> = args
        .workloads
        .iter()
        .filter_map(|&kind| FleetPlan::for_workload(kind))
        .collect();
    if !fleets.is_empty() && fleets.len() < args.workloads.len() {
        eprintln!(
            "routing-bench: the heterogeneous and restart workloads run on a fleet of their own: run them in a command of their own"
        );
        return ExitCode::FAILURE;
    }
    let fleet = fleets.first().cloned();
    let seeds = if args.seeds.is_empty() {
        vec![args.seed]
    } else {
        args.seeds.clone()
    };
    let requests = match args.requests_per_run {
        Some(n) => RequestCount::Fixed(n),
        None => RequestCount::Scaled {
            min: args.min_requests,
            per_user: args.requests_per_user,
        },
    };
    let command = format!(
        "cargo build --release -p kinference-bench -p kinference-agent -p kinference-gateway --bins
target/release/routing-bench {}",
        std::env::args().skip(1).collect::<Vec<_>>().join(" ")
    );
    let cluster_config = ClusterConfig {
        bin_dir: args.bin_dir.clone().unwrap_or_else(harness::bin_dir),
        tokenizer_dir: args
            .tokenizer_dir
            .clone()
            .unwrap_or_else(cluster::default_tokenizer_dir),
        workers: fleet.as_ref().map_or(args.workers, |f| f.workers.len()),
        preset: args.preset.clone(),
        time_scale: args.time_scale,
        worker_args: args.worker_args.clone(),
        gateway_modes: std::iter::once(Policy::Kinference.as_str().to_string())
            .chain(
                args.share_dispatches
                    .then(|| format!("{}{}", Policy::Kinference.as_str(), cluster::SHARED_SUFFIX)),
            )
            .collect(),
        work_dir: std::env::temp_dir()
            .join(format!("kinference-replicas-bench-{}", std::process::id())),
        ready_timeout: Duration::from_secs(60),
    };
    let options = ClusterOptions {
        gateway_replicas: most,
        per_worker_args: fleet
            .as_ref()
            .map(FleetPlan::worker_args)
            .unwrap_or_default(),
        ..ClusterOptions::default()
    };
    let setup = json!({
        "workers": cluster_config.workers,
        "fleet": fleet,
        "preset": args.preset,
        "time_scale": args.time_scale,
        "requests": requests,
        "arms": if args.share_dispatches { "replicas alone and replicas sharing dispatches, side by side" } else { "replicas alone" },
        "build": if cfg!(debug_assertions) { "debug" } else { "release" },
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "git_commit": git_commit(),
    });
    eprintln!(
        "routing-bench --replicas: {} workloads x {} concurrency levels x {} seeds x N in {:?}, logs in {}",
        args.workloads.len(),
        args.concurrency.len(),
        seeds.len(),
        args.replicas,
        cluster_config.work_dir.display()
    );
    let http = HttpClient::new();
    let mut cluster = match Cluster::start_with(&cluster_config, http.clone(), &options).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("routing-bench: cannot start the cluster: {e}");
            return ExitCode::FAILURE;
        }
    };
    let replica_urls = |mode: &str| -> Vec<String> {
        (1..=most)
            .map(|r| match r {
                1 => mode.to_string(),
                r => format!("{mode}#{r}"),
            })
            .filter_map(|name| cluster.gateway(&name).map(|g| g.url.clone()))
            .collect()
    };
    // The arms: replicas that see each other through the agent alone, and (--share-dispatches)
    // replicas that tell each other what they send; one replica runs once, alone.
    let mut arms = vec![(false, replica_urls(Policy::Kinference.as_str()))];
    if args.share_dispatches {
        let mode = format!("{}{}", Policy::Kinference.as_str(), cluster::SHARED_SUFFIX);
        arms.push((true, replica_urls(&mode)));
    }
    let client = LoadClient::new(
        http,
        cluster::MODEL,
        false,
        Duration::from_secs(args.request_timeout_s),
    );
    let mut records: Vec<ReplicaRecord> = Vec::new();
    let runs_per_sequence = args
        .replicas
        .iter()
        .map(|&n| if n == 1 { 1 } else { arms.len() })
        .sum::<usize>();
    let total = args.workloads.len() * args.concurrency.len() * seeds.len() * runs_per_sequence;
    for &seed in &seeds {
        let config = ExperimentConfig {
            workloads: args.workloads.clone(),
            concurrency: args.concurrency.clone(),
            policies: vec![Policy::Kinference],
            requests,
            warmup: args.warmup,
            seed,
            time_scale: args.time_scale,
            shape: WorkloadShape::default(),
            settle: Duration::from_millis(300),
        };
        for &kind in &args.workloads {
            for &concurrency in &args.concurrency {
                let (warmup, workload) = config.sequences(kind, concurrency);
                let runs = args.replicas.iter().flat_map(|&n| {
                    arms.iter()
                        .filter(move |(shared, _)| n > 1 || !shared)
                        .map(move |(shared, bases)| (n, *shared, bases))
                });
                for (n, shared, bases) in runs {
                    if let Err(e) = cluster.check_alive() {
                        eprintln!("routing-bench: {e}");
                        return ExitCode::FAILURE;
                    }
                    let route = Route::Front {
                        bases: bases[..n.min(bases.len())].to_vec(),
                        seed,
                    };
                    let r = match experiment::run_on(
                        &cluster,
                        &client,
                        &route,
                        &warmup,
                        &workload,
                        Policy::Kinference,
                        concurrency,
                        &config,
                    )
                    .await
                    {
                        Ok(r) => r,
                        Err(e) => {
                            eprintln!(
                                "routing-bench: {e} (logs in {})",
                                cluster.work_dir().display()
                            );
                            return ExitCode::FAILURE;
                        }
                    };
                    let s = &r.summary;
                    eprintln!(
                        "[{:>2}/{total}] {:<13} c={:<2} seed {seed} N={n} shared={shared:<5} TTFT p50 {:>6.2}s p90 {:>6.2}s goodput {:>6.1}/min hit {:>5.1}% n={} err={} ({:.0}s wall)",
                        records.len() + 1,
                        kind.as_str(),
                        concurrency,
                        s.median_ttft_s,
                        s.p90_ttft_s,
                        s.goodput_rpm,
                        100.0 * r.cache_hit_share.unwrap_or(f64::NAN),
                        s.n,
                        s.errors,
                        r.wall_s,
                    );
                    records.push(ReplicaRecord {
                        workload: kind,
                        concurrency,
                        replicas: n,
                        seed,
                        share_dispatches: shared,
                        summary: r.summary,
                        cache_hit_share: r.cache_hit_share,
                        wall_s: r.wall_s,
                    });
                    let report = ReplicaReport {
                        command: command.clone(),
                        setup: setup.clone(),
                        records: &records,
                    };
                    if let Err(e) = report.write_all(&out_dir, &args.label) {
                        eprintln!("routing-bench: {e}");
                    }
                }
            }
        }
    }
    eprintln!("Results in {}", out_dir.display());
    ExitCode::SUCCESS
}

/// One `--dp-ranks` run: hit share, median TTFT, p90 TTFT.
type DpRun = (f64, f64, f64);

/// `--dp-ranks`: rank-aware against rank-blind routing on workers of `ranks` data-parallel ranks, the
/// two clusters side by side on the same request sequences.
async fn run_dp_ranks(args: Args, ranks: usize) -> ExitCode {
    let seeds = if args.seeds.is_empty() {
        vec![args.seed]
    } else {
        args.seeds.clone()
    };
    let requests = match args.requests_per_run {
        Some(n) => RequestCount::Fixed(n),
        None => RequestCount::Scaled {
            min: args.min_requests,
            per_user: args.requests_per_user,
        },
    };
    let http = HttpClient::new();
    let mut arms = Vec::new();
    for (name, blind) in [("rank-aware", false), ("rank-blind", true)] {
        let cluster_config = ClusterConfig {
            bin_dir: args.bin_dir.clone().unwrap_or_else(harness::bin_dir),
            tokenizer_dir: args
                .tokenizer_dir
                .clone()
                .unwrap_or_else(cluster::default_tokenizer_dir),
            workers: args.workers,
            preset: args.preset.clone(),
            time_scale: args.time_scale,
            worker_args: args.worker_args.clone(),
            gateway_modes: vec![Policy::Kinference.as_str().to_string()],
            work_dir: std::env::temp_dir()
                .join(format!("kinference-dp-bench-{}-{name}", std::process::id())),
            ready_timeout: Duration::from_secs(60),
        };
        let options = ClusterOptions {
            data_parallel_size: ranks,
            agent_rank_blind: blind,
            ..ClusterOptions::default()
        };
        match Cluster::start_with(&cluster_config, http.clone(), &options).await {
            Ok(c) => arms.push((name, c)),
            Err(e) => {
                eprintln!("routing-bench: cannot start the {name} cluster: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    eprintln!(
        "routing-bench --dp-ranks {ranks}: {} workers x {ranks} ranks, rank-aware and rank-blind side by side ({} build)",
        args.workers,
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
    );
    let client = LoadClient::new(
        http,
        cluster::MODEL,
        false,
        Duration::from_secs(args.request_timeout_s),
    );
    // (arm, workload, concurrency) -> per-seed runs.
    let mut results: std::collections::BTreeMap<(&str, String, usize), Vec<DpRun>> =
        Default::default();
    for &seed in &seeds {
        let config = ExperimentConfig {
            workloads: args.workloads.clone(),
            concurrency: args.concurrency.clone(),
            policies: vec![Policy::Kinference],
            requests,
            warmup: args.warmup,
            seed,
            time_scale: args.time_scale,
            shape: WorkloadShape::default(),
            settle: Duration::from_millis(300),
        };
        for &kind in &args.workloads {
            for &concurrency in &args.concurrency {
                let (warmup, workload) = config.sequences(kind, concurrency);
                for (name, cluster) in arms.iter_mut() {
                    if let Err(e) = cluster.check_alive() {
                        eprintln!("routing-bench: {e}");
                        return ExitCode::FAILURE;
                    }
                    let Some(gateway) = cluster.gateway(Policy::Kinference.as_str()) else {
                        eprintln!("routing-bench: the {name} cluster has no gateway");
                        return ExitCode::FAILURE;
                    };
                    let route = Route::Endpoint(gateway.url.clone());
                    let r = match experiment::run_on(
                        cluster,
                        &client,
                        &route,
                        &warmup,
                        &workload,
                        Policy::Kinference,
                        concurrency,
                        &config,
                    )
                    .await
                    {
                        Ok(r) => r,
                        Err(e) => {
                            eprintln!(
                                "routing-bench: {e} (logs in {})",
                                cluster.work_dir().display()
                            );
                            return ExitCode::FAILURE;
                        }
                    };
                    let s = &r.summary;
                    let hit = r.cache_hit_share.unwrap_or(f64::NAN);
                    println!(
                        "{name:<10} {:<13} c={concurrency:<2} seed {seed} hit {:>5.1}%  TTFT p50 {:>6.2}s p90 {:>6.2}s  n={} err={} ({:.0}s wall)",
                        kind.as_str(),
                        100.0 * hit,
                        s.median_ttft_s,
                        s.p90_ttft_s,
                        s.n,
                        s.errors,
                        r.wall_s,
                    );
                    results
                        .entry((*name, kind.as_str().to_string(), concurrency))
                        .or_default()
                        .push((hit, s.median_ttft_s, s.p90_ttft_s));
                }
            }
        }
    }
    let median = |mut v: Vec<f64>| -> f64 {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    println!(
        "\n| arm | workload | c | seeds | hit rate (median) | TTFT p50 (median, s) | TTFT p90 (median, s) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for ((name, workload, c), runs) in &results {
        println!(
            "| {name} | {workload} | {c} | {} | {:.1}% | {:.2} | {:.2} |",
            runs.len(),
            100.0 * median(runs.iter().map(|r| r.0).collect()),
            median(runs.iter().map(|r| r.1).collect()),
            median(runs.iter().map(|r| r.2).collect()),
        );
    }
    ExitCode::SUCCESS
}

/// What the report says under the table about a P/D row whose runs moved no KV cache: its split
/// computed every prompt twice (the decode worker did not get the prefill worker's KV).
fn pd_notes(records: &[pd::PdRecord]) -> std::collections::BTreeMap<PdRouter, String> {
    let mut notes = std::collections::BTreeMap::new();
    for r in records {
        let Some(s) = &r.summary else { continue };
        if r.router.peer().is_some() && r.workload.split_pays() && s.kv_pulls_per_request < 0.01 {
            notes.insert(
                r.router,
                "no KV moved (0 pulls): the decode workers computed every prompt again after the prefill worker's".to_string(),
            );
        }
    }
    notes
}

fn git_commit() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(repo_root())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}
