//! A local Kinference cluster of real processes on loopback: simulated vLLM workers, one node agent and
//! one gateway per routing mode.
//!
//! Ports come from the harness ([`crate::harness::free_ports`]). Workers publish their KV events in vLLM's connect
//! mode to SUB sockets the agent binds, exactly as a vLLM pod does towards a node-local agent. Every child
//! is a [`Process`], killed when the [`Cluster`] is dropped (also on panic), its output in a log file
//! under the cluster's work directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;

use super::client::Route;
use super::policy::Policy;
use crate::harness::http::{HttpClient, HttpError};
use crate::harness::{HarnessError, Process, free_ports, reset_prefix_cache, wait_ready};

#[cfg(test)]
mod tests;

/// The served model name every process uses.
pub const MODEL: &str = "qwen2-sim";

/// Errors starting or driving the cluster.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A binary is missing.
    #[error(
        "binary {name} not found in {dir} (build it: `cargo build --release -p kinference-bench -p kinference-agent -p kinference-gateway`, or set KINFERENCE_BIN_DIR)"
    )]
    MissingBinary {
        /// The binary.
        name: String,
        /// Where it was looked for.
        dir: String,
    },
    /// The tokenizer files are missing.
    #[error(
        "tokenizer not found at {0} (run `cargo xtask setup`, or set KINFERENCE_TOKENIZER_DIR)"
    )]
    MissingTokenizer(String),
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// A process exited, did not become ready, or a worker kept its cache.
    #[error(transparent)]
    Harness(#[from] HarnessError),
    /// A worker index past the fleet.
    #[error("no worker {0} in the cluster")]
    NoWorker(usize),
    /// A request to a worker failed.
    #[error(transparent)]
    Http(#[from] HttpError),
    /// A config file could not be written.
    #[error("writing {path}: {source}")]
    Yaml {
        /// The file.
        path: String,
        /// Why.
        source: serde_yaml::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ClusterError {
    let what = what.into();
    move |source| ClusterError::Io { what, source }
}

/// How to build the cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Directory holding `vllm-sim`, `kinference-agent` and `kinference-gateway`.
    pub bin_dir: PathBuf,
    /// Tokenizer directory (tokenizer.json + tokenizer_config.json) for workers and gateways.
    pub tokenizer_dir: PathBuf,
    /// Number of simulated workers.
    pub workers: usize,
    /// Simulator latency preset.
    pub preset: String,
    /// Simulator time scale (wall time = simulated time x scale).
    pub time_scale: f64,
    /// Extra `vllm-sim` arguments (e.g. `--num-blocks`).
    pub worker_args: Vec<String>,
    /// One gateway per routing mode (`kinference`, `random`, ...).
    pub gateway_modes: Vec<String>,
    /// Where config files and logs go.
    pub work_dir: PathBuf,
    /// How long a process may take to become ready.
    pub ready_timeout: Duration,
}

/// Optional extras of a cluster, for benchmarks that need more than [`ClusterConfig`] says
/// ([`Cluster::start_with`]).
#[derive(Debug, Clone, Default)]
pub struct ClusterOptions {
    /// Environment of the agent process (e.g. `KINFERENCE_DISABLE_EBPF=1`).
    pub agent_env: Vec<(String, String)>,
    /// Extra agent flags (e.g. `--kernel-poll-ms 25`).
    pub agent_args: Vec<String>,
    /// Gateway replicas per routing mode (0 or 1: one). Replica `r > 1` of mode `m` is named `m#r`
    /// ([`Cluster::gateway`]); all replicas of a mode share the workers and the agent.
    pub gateway_replicas: usize,
    /// Workers **bind** their KV-event PUB sockets (`tcp://*:PORT`, vLLM's bind mode) with vLLM's
    /// default empty topic and the agent connects, so that other subscribers (a peer router's
    /// `kv_aware`) can connect too. Off: the workers connect to SUB sockets the agent binds, with topic
    /// `kv@wN@MODEL` (the default, node-local deployment).
    pub workers_bind_kv_events: bool,
    /// Extra `vllm-sim` arguments of each worker (entry `i` for worker `i`, after
    /// [`ClusterConfig::worker_args`]): a mixed fleet of different speeds and cache sizes.
    pub per_worker_args: Vec<Vec<String>>,
    /// Each worker's part in prefill/decode disaggregation (`prefill`, `decode`, `both`; entry `i` for
    /// worker `i`, `workers[].role` in every gateway's config; empty: every worker `both`). A gateway
    /// mode ending in [`AGGREGATED_SUFFIX`] leaves the roles out: every worker takes whole requests.
    pub worker_roles: Vec<String>,
    /// Top-level keys added to every gateway's configuration (e.g. `tenancy`).
    pub gateway_yaml: serde_json::Map<String, serde_json::Value>,
    /// Extra flags of one gateway, by its name ([`Cluster::gateway`]; e.g. `--flow-control` on
    /// replica `kinference#2` only).
    pub gateway_args: BTreeMap<String, Vec<String>>,
    /// Data-parallel ranks of every worker (`vllm-sim --data-parallel-size`; 0 or 1: none).
    pub data_parallel_size: usize,
    /// The agent is not told the workers' ranks: it follows rank 0's publisher and reports each
    /// worker rank-less, so the gateways send no rank header (the workers balance themselves) — what
    /// Kinference did before it knew ranks.
    pub agent_rank_blind: bool,
}

/// A gateway mode `M-shared` is routing mode `M` whose replicas tell each other what they dispatch
/// (`replicas.peers` in each one's `gateway.yaml`: the other replicas' admin URLs); the replicas of
/// mode `M` see each other only through the agent's load figures.
pub const SHARED_SUFFIX: &str = "-shared";

/// A gateway mode `M-aggregated` is routing mode `M` with the workers' roles left out (whole requests on
/// every worker): the baseline the P/D benchmark compares disaggregation with, on the same workers.
pub const AGGREGATED_SUFFIX: &str = "-aggregated";

/// Where a worker serves and publishes, as a subscriber on loopback connects to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEndpoints {
    /// HTTP base URL.
    pub url: String,
    /// KV-event PUB endpoint (`tcp://127.0.0.1:PORT`).
    pub kv_events: String,
    /// Replay ROUTER endpoint (`tcp://127.0.0.1:PORT`).
    pub kv_replay: String,
}

/// Default tokenizer directory: `KINFERENCE_TOKENIZER_DIR`, else `<repo>/.assets/qwen2`.
pub fn default_tokenizer_dir() -> PathBuf {
    std::env::var_os("KINFERENCE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::harness::repo_root().join(".assets/qwen2"))
}

/// What starting a simulated fleet needs before any process starts: the binaries, the tokenizer.
pub(crate) struct Prerequisites {
    pub sim_bin: PathBuf,
    pub agent_bin: PathBuf,
    pub gateway_bin: PathBuf,
    /// The tokenizer directory, absolute (the processes run elsewhere).
    pub tokenizer_dir: PathBuf,
}

/// Finds `vllm-sim`, `kinference-agent` and `kinference-gateway` in `bin_dir` and `tokenizer.json` in
/// `tokenizer_dir`, naming what is missing, and creates `work_dir`.
pub(crate) fn prerequisites(
    bin_dir: &Path,
    tokenizer_dir: &Path,
    work_dir: &Path,
) -> Result<Prerequisites, ClusterError> {
    let bin = |name: &str| -> Result<PathBuf, ClusterError> {
        let path = bin_dir.join(name);
        if path.is_file() {
            Ok(path)
        } else {
            Err(ClusterError::MissingBinary {
                name: name.to_string(),
                dir: bin_dir.display().to_string(),
            })
        }
    };
    let (sim_bin, agent_bin, gateway_bin) = (
        bin("vllm-sim")?,
        bin("kinference-agent")?,
        bin("kinference-gateway")?,
    );
    if !tokenizer_dir.join("tokenizer.json").is_file() {
        return Err(ClusterError::MissingTokenizer(
            tokenizer_dir.display().to_string(),
        ));
    }
    let tokenizer_dir = std::fs::canonicalize(tokenizer_dir)
        .map_err(io(format!("resolving {}", tokenizer_dir.display())))?;
    std::fs::create_dir_all(work_dir).map_err(io(format!("creating {}", work_dir.display())))?;
    Ok(Prerequisites {
        sim_bin,
        agent_bin,
        gateway_bin,
        tokenizer_dir,
    })
}

/// The gateway's arguments to serve the API on `listen` and the admin port on `admin` (both
/// `host:port`) with the configuration file `config`.
pub fn gateway_args(listen: &str, admin: &str, config: &Path) -> Vec<String> {
    vec![
        "--listen".into(),
        listen.into(),
        "--admin-listen".into(),
        admin.into(),
        "--config".into(),
        config.display().to_string(),
    ]
}

/// A simulated worker's process and how it was started, so that it can be started again.
struct WorkerProcess {
    guard: Process,
    name: String,
    program: PathBuf,
    args: Vec<String>,
    restarts: usize,
}

/// One gateway process.
#[derive(Debug, Clone)]
pub struct GatewayEndpoint {
    /// Its routing mode.
    pub mode: String,
    /// OpenAI base URL.
    pub url: String,
    /// Admin base URL (`/metrics`, `/readyz`).
    pub admin_url: String,
    /// Its process id (for CPU accounting).
    pub pid: u32,
}

/// A running local cluster; dropping it stops every process.
pub struct Cluster {
    http: HttpClient,
    workers: Vec<String>,
    worker_endpoints: Vec<WorkerEndpoints>,
    /// Peer routers started next to the cluster, or why one could not be.
    peers: BTreeMap<Policy, Result<Route, String>>,
    gateways: BTreeMap<String, GatewayEndpoint>,
    agent_metrics_url: String,
    work_dir: PathBuf,
    ready_timeout: Duration,
    /// The workers' processes, in worker order (locked while one restarts).
    worker_processes: Vec<tokio::sync::Mutex<WorkerProcess>>,
    // Dropped last, after the fields above: the agent and the gateways.
    children: Vec<Process>,
}

/// Prefix-cache counters summed over the workers (tokens), from their `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheCounters {
    /// `vllm:prefix_cache_hits_total`.
    pub hits: f64,
    /// `vllm:prefix_cache_queries_total`.
    pub queries: f64,
}

impl CacheCounters {
    /// Hits / queries of the counts since `earlier`.
    pub fn hit_share_since(&self, earlier: &CacheCounters) -> f64 {
        let queries = self.queries - earlier.queries;
        if queries > 0.0 {
            (self.hits - earlier.hits) / queries
        } else {
            0.0
        }
    }
}

impl Cluster {
    /// Starts the agent, the workers and the gateways and waits until all are ready.
    pub async fn start(config: &ClusterConfig, http: HttpClient) -> Result<Self, ClusterError> {
        Self::start_with(config, http, &ClusterOptions::default()).await
    }

    /// [`Cluster::start`] with extra options.
    pub async fn start_with(
        config: &ClusterConfig,
        http: HttpClient,
        options: &ClusterOptions,
    ) -> Result<Self, ClusterError> {
        let Prerequisites {
            sim_bin,
            agent_bin,
            gateway_bin,
            tokenizer_dir,
        } = prerequisites(&config.bin_dir, &config.tokenizer_dir, &config.work_dir)?;

        let n = config.workers;
        let replicas = options.gateway_replicas.max(1);
        let gateway_names: Vec<(String, String)> = config
            .gateway_modes
            .iter()
            .flat_map(|mode| {
                (1..=replicas).map(move |r| {
                    let name = if r == 1 {
                        mode.clone()
                    } else {
                        format!("{mode}#{r}")
                    };
                    (mode.clone(), name)
                })
            })
            .collect();
        // A worker of several ranks publishes rank r on its endpoints' ports + r: one port each.
        let ranks = options.data_parallel_size.max(1);
        let per_worker = 1 + 2 * ranks;
        let ports = free_ports(per_worker * n + 2 + 2 * gateway_names.len());
        let (worker_ports, rest) = ports.split_at(per_worker * n);
        let (agent_ports, gateway_ports) = rest.split_at(2);
        let workers: Vec<WorkerPorts> = worker_ports
            .chunks(per_worker)
            .map(|c| WorkerPorts {
                http: c[0],
                kv_events: c[1],
                kv_replay: c[1 + ranks],
            })
            .collect();
        let worker_urls: Vec<String> = workers
            .iter()
            .map(|w| format!("http://127.0.0.1:{}", w.http))
            .collect();
        let agent_grpc = format!("127.0.0.1:{}", agent_ports[0]);
        let agent_metrics = format!("127.0.0.1:{}", agent_ports[1]);

        let mut cluster = Self {
            http,
            workers: worker_urls.clone(),
            worker_endpoints: workers
                .iter()
                .map(|w| WorkerEndpoints {
                    url: format!("http://127.0.0.1:{}", w.http),
                    kv_events: format!("tcp://127.0.0.1:{}", w.kv_events),
                    kv_replay: format!("tcp://127.0.0.1:{}", w.kv_replay),
                })
                .collect(),
            peers: BTreeMap::new(),
            gateways: BTreeMap::new(),
            agent_metrics_url: format!("http://{agent_metrics}/metrics"),
            work_dir: config.work_dir.clone(),
            ready_timeout: config.ready_timeout,
            worker_processes: Vec::new(),
            children: Vec::new(),
        };

        // The agent first: it binds the SUB sockets the workers connect to.
        let agent_yaml = config.work_dir.join("agent-workers.yaml");
        write_yaml(
            &agent_yaml,
            &agent_workers_yaml(
                &workers,
                !options.workers_bind_kv_events,
                (!options.agent_rank_blind).then_some(ranks),
            ),
        )?;
        let mut agent_args: Vec<String> = vec![
            "--grpc-listen".into(),
            agent_grpc.clone(),
            "--metrics-listen".into(),
            agent_metrics.clone(),
            "--workers".into(),
            agent_yaml.display().to_string(),
            "--node".into(),
            "bench-node".into(),
        ];
        agent_args.extend(options.agent_args.iter().cloned());
        let agent = Process::spawn(
            "kinference-agent",
            &agent_bin,
            &agent_args,
            &options.agent_env,
            config.work_dir.join("agent.log"),
        )?;
        cluster.children.push(agent);

        for (i, w) in workers.iter().enumerate() {
            let mut args: Vec<String> = [
                "--host",
                "127.0.0.1",
                "--port",
                &w.http.to_string(),
                "--model",
                MODEL,
                "--tokenizer-dir",
                &tokenizer_dir.display().to_string(),
                "--preset",
                &config.preset,
                "--time-scale",
                &config.time_scale.to_string(),
                "--seed",
                &i.to_string(),
                "--kv-events-endpoint",
                &if options.workers_bind_kv_events {
                    format!("tcp://*:{}", w.kv_events)
                } else {
                    format!("tcp://127.0.0.1:{}", w.kv_events)
                },
                "--kv-replay-endpoint",
                &format!("tcp://127.0.0.1:{}", w.kv_replay),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            // In bind mode, vLLM's default topic (empty): vllm-router's static event sources apply only
            // messages whose topic equals theirs exactly, and they have no flag to set it.
            if !options.workers_bind_kv_events {
                args.extend(["--kv-topic".into(), format!("kv@w{}@{MODEL}", i + 1)]);
            }
            if ranks > 1 {
                args.extend(["--data-parallel-size".into(), ranks.to_string()]);
            }
            args.extend(config.worker_args.iter().cloned());
            args.extend(
                options
                    .per_worker_args
                    .get(i)
                    .into_iter()
                    .flatten()
                    .cloned(),
            );
            let name = format!("vllm-sim w{}", i + 1);
            let guard = Process::spawn(
                &name,
                &sim_bin,
                &args,
                &[],
                config.work_dir.join(format!("worker-{}.log", i + 1)),
            )?;
            cluster
                .worker_processes
                .push(tokio::sync::Mutex::new(WorkerProcess {
                    guard,
                    name,
                    program: sim_bin.clone(),
                    args,
                    restarts: 0,
                }));
        }

        let gateway_yaml_base = gateway_yaml(&worker_urls, &tokenizer_dir, &agent_grpc);
        let mut gateway_yaml_roles = gateway_yaml_base.clone();
        for (worker, role) in gateway_yaml_roles["workers"]
            .as_array_mut()
            .into_iter()
            .flatten()
            .zip(&options.worker_roles)
        {
            worker["role"] = json!(role);
        }
        // Their worker-health URLs, in the order they start (the order of `children` after the agent).
        let mut gateway_ready = Vec::with_capacity(gateway_names.len());
        let admin_of: Vec<String> = gateway_ports
            .chunks(2)
            .map(|p| format!("http://127.0.0.1:{}", p[1]))
            .collect();
        for (g, ((mode, name), ports)) in gateway_names
            .iter()
            .zip(gateway_ports.chunks(2))
            .enumerate()
        {
            let file = name.replace('#', "-");
            let shared = mode.strip_suffix(SHARED_SUFFIX);
            let (base, routing) = match mode.strip_suffix(AGGREGATED_SUFFIX) {
                Some(routing) => (&gateway_yaml_base, routing),
                None => (&gateway_yaml_roles, shared.unwrap_or(mode)),
            };
            let mut yaml = base.clone();
            yaml["routing"] = json!(routing);
            for (key, value) in &options.gateway_yaml {
                yaml[key] = value.clone();
            }
            if shared.is_some() && replicas > 1 {
                let peers: Vec<&String> = gateway_names
                    .iter()
                    .zip(&admin_of)
                    .enumerate()
                    .filter(|(other, ((m, _), _))| *other != g && m == mode)
                    .map(|(_, (_, url))| url)
                    .collect();
                yaml["replicas"] = json!({ "peers": peers });
            }
            let path = config.work_dir.join(format!("gateway-{file}.yaml"));
            write_yaml(&path, &yaml)?;
            let listen = format!("127.0.0.1:{}", ports[0]);
            let admin = format!("127.0.0.1:{}", ports[1]);
            let mut args = gateway_args(&listen, &admin, &path);
            args.extend(
                options
                    .gateway_args
                    .get(name)
                    .into_iter()
                    .flatten()
                    .cloned(),
            );
            let child = Process::spawn(
                &format!("kinference-gateway ({name})"),
                &gateway_bin,
                &args,
                &[],
                config.work_dir.join(format!("gateway-{file}.log")),
            )?;
            let pid = child.pid();
            cluster.children.push(child);
            gateway_ready.push(format!("http://{admin}/healthz/workers"));
            cluster.gateways.insert(
                name.clone(),
                GatewayEndpoint {
                    mode: mode.clone(),
                    url: format!("http://{listen}"),
                    admin_url: format!("http://{admin}"),
                    pid,
                },
            );
        }

        // Readiness, in the order the processes were started: the agent, the workers, the gateways.
        let http = cluster.http.clone();
        let timeout = config.ready_timeout;
        let answers = |_: &str| true;
        wait_ready(
            &http,
            &mut cluster.children[0],
            &cluster.agent_metrics_url,
            timeout,
            answers,
        )
        .await?;
        for (process, url) in cluster.worker_processes.iter_mut().zip(&worker_urls) {
            let guard = &mut process.get_mut().guard;
            wait_ready(&http, guard, &format!("{url}/health"), timeout, answers).await?;
        }
        // A gateway is ready once every worker is in its rotation: one probed before the worker
        // listened stays out for a probe interval, and a run started then would find fewer workers.
        let every_worker = |body: &str| {
            serde_json::from_str::<serde_json::Value>(body)
                .is_ok_and(|v| v["healthy"].as_u64() == Some(n as u64))
        };
        for (child, url) in cluster.children[1..].iter_mut().zip(&gateway_ready) {
            wait_ready(&http, child, url, timeout, every_worker).await?;
        }
        Ok(cluster)
    }

    /// Base URLs of the workers.
    pub fn workers(&self) -> &[String] {
        &self.workers
    }

    /// Each worker's HTTP, KV-event and replay endpoints.
    pub fn worker_endpoints(&self) -> &[WorkerEndpoints] {
        &self.worker_endpoints
    }

    /// Registers a peer router for `policy`: where to send its requests, or why it cannot run.
    pub fn set_peer(&mut self, policy: Policy, route: Result<Route, String>) {
        self.peers.insert(policy, route);
    }

    /// The peer router registered for `policy`.
    pub fn peer(&self, policy: Policy) -> Option<&Result<Route, String>> {
        self.peers.get(&policy)
    }

    /// The gateway running `mode` (replica `r > 1`: `mode#r`, see [`ClusterOptions::gateway_replicas`]).
    pub fn gateway(&self, mode: &str) -> Option<&GatewayEndpoint> {
        self.gateways.get(mode)
    }

    /// Every gateway, by name.
    pub fn gateways(&self) -> impl Iterator<Item = &GatewayEndpoint> {
        self.gateways.values()
    }

    /// The agent's process id (the first child).
    pub fn agent_pid(&self) -> Option<u32> {
        self.children.first().map(Process::pid)
    }

    /// The agent's metrics URL.
    pub fn agent_metrics_url(&self) -> &str {
        &self.agent_metrics_url
    }

    /// Where the logs and config files are.
    pub fn work_dir(&self) -> &Path {
        &self.work_dir
    }

    /// Empties every worker's prefix cache ([`reset_prefix_cache`]), so the next run starts cold,
    /// then gives the resulting `AllBlocksCleared` events `settle` to reach the gateways' indexes.
    pub async fn reset_caches(&self, settle: Duration) -> Result<(), ClusterError> {
        for w in &self.workers {
            reset_prefix_cache(&self.http, w, MODEL).await?;
        }
        tokio::time::sleep(settle).await;
        Ok(())
    }

    /// Makes worker `index` (from 0) `factor` times slower than its preset from its next engine step
    /// (`POST /sim/slowdown`).
    pub async fn set_slowdown(&self, index: usize, factor: f64) -> Result<(), ClusterError> {
        let Some(worker) = self.workers.get(index) else {
            return Err(ClusterError::NoWorker(index));
        };
        self.http
            .post_json(
                &format!("{worker}/sim/slowdown"),
                &json!({ "factor": factor }),
            )
            .await?;
        Ok(())
    }

    /// Kills worker `index` (from 0) as a crash would (SIGKILL: what it was running fails), waits
    /// `down`, starts it again with the same arguments and ports, and waits until it answers
    /// `/health`. It comes back with an empty cache, its KV event sequence starting over, and the
    /// preset's speed it was started with.
    pub async fn restart_worker(&self, index: usize, down: Duration) -> Result<(), ClusterError> {
        let (Some(process), Some(url)) =
            (self.worker_processes.get(index), self.workers.get(index))
        else {
            return Err(ClusterError::NoWorker(index));
        };
        let mut process = process.lock().await;
        process.guard.stop();
        tracing::info!(worker = %url, ?down, "worker killed");
        tokio::time::sleep(down).await;
        process.restarts += 1;
        let log = self.work_dir.join(format!(
            "worker-{}.restart-{}.log",
            index + 1,
            process.restarts
        ));
        process.guard = Process::spawn(&process.name, &process.program, &process.args, &[], log)?;
        wait_ready(
            &self.http,
            &mut process.guard,
            &format!("{url}/health"),
            self.ready_timeout,
            |_| true,
        )
        .await?;
        tracing::info!(worker = %url, "worker back");
        Ok(())
    }

    /// Prefix-cache counters summed over the workers.
    pub async fn cache_counters(&self) -> Result<CacheCounters, ClusterError> {
        let mut total = CacheCounters::default();
        for w in &self.workers {
            let text = self.http.get_text(&format!("{w}/metrics")).await?;
            total.hits += metric_sum(&text, "vllm:prefix_cache_hits_total");
            total.queries += metric_sum(&text, "vllm:prefix_cache_queries_total");
        }
        Ok(total)
    }

    /// Whether every child is still running (the name and log of the first one that is not).
    pub fn check_alive(&mut self) -> Result<(), ClusterError> {
        let workers = self
            .worker_processes
            .iter_mut()
            .map(|p| &mut p.get_mut().guard);
        for child in self.children.iter_mut().chain(workers) {
            if let Some(exited) = child.exited() {
                return Err(exited.into());
            }
        }
        Ok(())
    }
}

struct WorkerPorts {
    http: u16,
    kv_events: u16,
    kv_replay: u16,
}

/// The agent's workers file; `ranks`: each worker's data-parallel ranks, when the agent is told them.
fn agent_workers_yaml(
    workers: &[WorkerPorts],
    agent_binds: bool,
    ranks: Option<usize>,
) -> serde_json::Value {
    json!({
        "workers": workers.iter().map(|w| {
            let mut spec = json!({
                "url": format!("http://127.0.0.1:{}", w.http),
                "model": MODEL,
                "kv_events_endpoint": format!("tcp://127.0.0.1:{}", w.kv_events),
                "kv_events_bind": agent_binds,
                "kv_replay_endpoint": format!("tcp://127.0.0.1:{}", w.kv_replay),
            });
            if let Some(n) = ranks.filter(|n| *n > 1) {
                spec["data_parallel_size"] = json!(n);
            }
            spec
        }).collect::<Vec<_>>()
    })
}

fn gateway_yaml(workers: &[String], tokenizer_dir: &Path, agent_grpc: &str) -> serde_json::Value {
    json!({
        "models": [{"name": MODEL, "tokenizer_dir": tokenizer_dir.display().to_string()}],
        "workers": workers.iter().map(|url| json!({"url": url, "model": MODEL})).collect::<Vec<_>>(),
        "agents": [format!("http://{agent_grpc}")],
        "routing": "kinference",
    })
}

fn write_yaml(path: &Path, value: &serde_json::Value) -> Result<(), ClusterError> {
    let text = serde_yaml::to_string(value).map_err(|source| ClusterError::Yaml {
        path: path.display().to_string(),
        source,
    })?;
    std::fs::write(path, text).map_err(io(format!("writing {}", path.display())))
}

/// Sum of every sample of metric `name` (all label sets) in a Prometheus text exposition.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            // The name must end here: `foo_total{..} 1` or `foo_total 1`, not `foo_total_created 1`.
            let rest = if let Some(labels) = rest.strip_prefix('{') {
                &labels[labels.find('}')? + 1..]
            } else if rest.starts_with(' ') {
                rest
            } else {
                return None;
            };
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum()
}
