//! A fleet of simulated GPU nodes on loopback: `workers_per_node` simulated vLLM workers per node, one
//! real `kinference-agent` process per node watching only its node's workers, and one gateway per
//! routing mode. The workers of `nodes_per_sim` nodes run in one `vllm-sim` process (one tokenizer
//! load per process, not per worker): the simulator stands in for the GPUs, so grouping several
//! nodes' workers in one process changes what the machine pays for the simulation, not what an agent
//! or the gateway sees (each worker keeps its own ports, KV-event socket and topic). The `kinference` gateway watches
//! every agent; the baselines route without them, so the agents' summary bytes are the one cache-aware
//! gateway's stream.
//!
//! Ports come from the harness ([`crate::harness::free_ports`]); every child is a [`Process`], killed
//! when the [`Fleet`] is dropped (also on panic), its log in the fleet's work directory, as in
//! [`crate::routing::cluster`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::http::HttpClient;
use crate::harness::{Process, free_ports, on_cpus, reset_prefix_cache, wait_ready};
use crate::routing::cluster::{
    CacheCounters, ClusterError, GatewayEndpoint, MODEL, Prerequisites, gateway_args, metric_sum,
    prerequisites,
};

/// How to build the fleet.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Directory holding `vllm-sim`, `kinference-agent` and `kinference-gateway`.
    pub bin_dir: PathBuf,
    /// Tokenizer directory for workers and gateways.
    pub tokenizer_dir: PathBuf,
    /// Simulated workers in all.
    pub workers: usize,
    /// Workers per simulated node (one agent process each).
    pub workers_per_node: usize,
    /// Simulated nodes whose workers share one `vllm-sim` process.
    pub nodes_per_sim: usize,
    /// Simulator latency preset.
    pub preset: String,
    /// Simulator time scale (wall time = simulated time x scale).
    pub time_scale: f64,
    /// Extra `vllm-sim` arguments (e.g. `--num-blocks 512`).
    pub worker_args: Vec<String>,
    /// One gateway per routing mode (`kinference`, `random`, ...).
    pub gateway_modes: Vec<String>,
    /// Where config files and logs go.
    pub work_dir: PathBuf,
    /// How long a process may take to become ready.
    pub ready_timeout: Duration,
    /// CPUs the gateways run on (a `taskset -c` list); `None`: wherever the scheduler puts them.
    pub gateway_cpus: Option<String>,
    /// How often each agent scrapes its workers' `/metrics`; `None`: the agent's default (250 ms).
    /// At 1,000 workers the default is 4,000 scrapes a second, each on a new connection, on the
    /// same cores as the workers.
    pub scrape_interval: Option<Duration>,
}

impl FleetConfig {
    /// Number of simulated nodes (agents).
    pub fn nodes(&self) -> usize {
        self.workers.div_ceil(self.workers_per_node.max(1))
    }

    /// Number of `vllm-sim` processes.
    pub fn sim_processes(&self) -> usize {
        self.nodes().div_ceil(self.nodes_per_sim.max(1))
    }
}

/// One simulated node: its agent and its workers.
#[derive(Debug, Clone)]
pub struct Node {
    /// The agent's gRPC endpoint (`127.0.0.1:PORT`).
    pub agent_grpc: String,
    /// The agent's `/metrics` URL.
    pub agent_metrics_url: String,
    /// The agent's process id.
    pub agent_pid: u32,
    /// The `vllm-sim` process id serving the node's workers (and maybe other nodes').
    pub sim_pid: u32,
    /// The node's worker base URLs.
    pub workers: Vec<String>,
}

/// A running fleet; dropping it stops every process.
pub struct Fleet {
    http: HttpClient,
    nodes: Vec<Node>,
    workers: Vec<String>,
    gateways: BTreeMap<String, GatewayEndpoint>,
    work_dir: PathBuf,
    // Dropped last, after the fields above: the agents, the `vllm-sim` processes, then the gateways.
    agent_processes: Vec<Process>,
    sim_processes: Vec<Process>,
    gateway_processes: BTreeMap<String, Process>,
}

impl Fleet {
    /// Starts the agents and the node processes, waits until every agent and worker answers, then starts
    /// the gateways and waits until they are ready (the `kinference` gateway also until it has a
    /// stream from every agent).
    pub async fn start(config: &FleetConfig, http: HttpClient) -> Result<Self, ClusterError> {
        let Prerequisites {
            sim_bin,
            agent_bin,
            gateway_bin,
            tokenizer_dir,
        } = prerequisites(&config.bin_dir, &config.tokenizer_dir, &config.work_dir)?;

        let mut fleet = Self {
            http,
            nodes: Vec::new(),
            workers: Vec::new(),
            gateways: BTreeMap::new(),
            work_dir: config.work_dir.clone(),
            agent_processes: Vec::new(),
            sim_processes: Vec::new(),
            gateway_processes: BTreeMap::new(),
        };
        // Every port of the fleet is reserved at once: ports reserved node by node could repeat one
        // that an earlier node's process had not bound yet.
        let per_node = config.workers_per_node.max(1);
        let counts: Vec<usize> = (0..config.nodes())
            .map(|node| per_node.min(config.workers - node * per_node))
            .collect();
        let node_ports: usize = counts.iter().map(|c| 3 * c + 2).sum();
        let ports = free_ports(node_ports + 2 * config.gateway_modes.len());
        let (mut node_ports, mut gateway_ports) = ports.split_at(node_ports);
        let mut nodes = counts.iter().enumerate().peekable();
        while nodes.peek().is_some() {
            // One `vllm-sim` process for the next `nodes_per_sim` nodes, started after their agents
            // (which bind the SUB sockets its workers connect to).
            let mut group = Vec::new();
            for (node, &count) in nodes.by_ref().take(config.nodes_per_sim.max(1)) {
                let (mine, rest) = node_ports.split_at(3 * count + 2);
                node_ports = rest;
                group.push(fleet.start_agent(config, node, mine, &agent_bin)?);
            }
            fleet.start_sim(config, &group, &sim_bin, &tokenizer_dir)?;
        }

        // Gateways start once every worker answers: one started beside its workers would eject them
        // on its first failed probe and route around them until they came back.
        let deadline = Instant::now() + config.ready_timeout;
        let http = fleet.http.clone();
        for (node, agent) in fleet.nodes.iter().zip(&mut fleet.agent_processes) {
            wait(&http, agent, &node.agent_metrics_url, deadline, |_| true).await?;
            let sim = fleet
                .sim_processes
                .iter_mut()
                .find(|s| s.pid() == node.sim_pid)
                .expect("every node's simulator was started");
            for w in &node.workers {
                wait(&http, sim, &format!("{w}/health"), deadline, |_| true).await?;
            }
        }

        let agents: Vec<String> = fleet
            .nodes
            .iter()
            .map(|n| format!("http://{}", n.agent_grpc))
            .collect();
        for mode in &config.gateway_modes {
            let (ports, rest) = gateway_ports.split_at(2);
            gateway_ports = rest;
            let yaml = json!({
                "models": [{"name": MODEL, "tokenizer_dir": tokenizer_dir.display().to_string()}],
                "workers": fleet.workers.iter().map(|url| json!({"url": url, "model": MODEL})).collect::<Vec<_>>(),
                "agents": if mode == "kinference" { agents.clone() } else { Vec::new() },
                "routing": mode,
            });
            let path = config.work_dir.join(format!("gateway-{mode}.yaml"));
            write_yaml(&path, &yaml)?;
            let listen = format!("127.0.0.1:{}", ports[0]);
            let admin = format!("127.0.0.1:{}", ports[1]);
            let (program, args) = on_cpus(
                &gateway_bin,
                gateway_args(&listen, &admin, &path),
                config.gateway_cpus.as_deref(),
            );
            let child = Process::spawn_group(
                &format!("kinference-gateway ({mode})"),
                &program,
                &args,
                &[],
                config.work_dir.join(format!("gateway-{mode}.log")),
            )?;
            let pid = child.pid();
            fleet.gateway_processes.insert(mode.clone(), child);
            fleet.gateways.insert(
                mode.clone(),
                GatewayEndpoint {
                    mode: mode.clone(),
                    url: format!("http://{listen}"),
                    admin_url: format!("http://{admin}"),
                    pid,
                },
            );
        }
        for (mode, gateway) in &mut fleet.gateway_processes {
            let url = format!("{}/readyz", fleet.gateways[mode].admin_url);
            wait(&http, gateway, &url, deadline, |_| true).await?;
        }
        // The cache-aware gateway routes on what the agents stream: wait for every stream.
        if let Some(gateway) = fleet.gateway_processes.get_mut("kinference") {
            let url = format!("{}/metrics", fleet.gateways["kinference"].admin_url);
            let agents = fleet.nodes.len();
            let streams = |text: &str| {
                metric_sum(text, "kinference_routing_agent_connected") as usize >= agents
            };
            wait(&http, gateway, &url, deadline, streams).await?;
        }
        Ok(fleet)
    }

    /// Starts node `node`'s agent, which binds the SUB sockets its workers connect to, on `ports`:
    /// three per worker, then the agent's two. Its workers start with the rest of their `vllm-sim`
    /// process's nodes ([`Fleet::start_sim`]).
    fn start_agent(
        &mut self,
        config: &FleetConfig,
        node: usize,
        ports: &[u16],
        agent_bin: &Path,
    ) -> Result<AgentStarted, ClusterError> {
        let count = (ports.len() - 2) / 3;
        let (worker_ports, agent_ports) = ports.split_at(3 * count);
        let first = node * config.workers_per_node.max(1);
        let workers: Vec<WorkerPorts> = worker_ports
            .chunks(3)
            .enumerate()
            .map(|(i, c)| WorkerPorts {
                number: first + i + 1,
                http: c[0],
                kv_events: c[1],
                kv_replay: c[2],
            })
            .collect();
        let agent_grpc = format!("127.0.0.1:{}", agent_ports[0]);
        let agent_metrics = format!("127.0.0.1:{}", agent_ports[1]);

        let agent_yaml = config.work_dir.join(format!("agent-node{node}.yaml"));
        write_yaml(
            &agent_yaml,
            &json!({
                "workers": workers.iter().map(|w| json!({
                    "url": format!("http://127.0.0.1:{}", w.http),
                    "model": MODEL,
                    "kv_events_endpoint": format!("tcp://127.0.0.1:{}", w.kv_events),
                    "kv_events_bind": true,
                    "kv_replay_endpoint": format!("tcp://127.0.0.1:{}", w.kv_replay),
                })).collect::<Vec<_>>()
            }),
        )?;
        let mut args = vec![
            "--grpc-listen".into(),
            agent_grpc.clone(),
            "--metrics-listen".into(),
            agent_metrics.clone(),
            "--workers".into(),
            agent_yaml.display().to_string(),
            "--node".into(),
            format!("sim-node-{node}"),
        ];
        if let Some(interval) = config.scrape_interval {
            args.push("--scrape-interval-ms".into());
            args.push(interval.as_millis().to_string());
        }
        let agent = Process::spawn_group(
            &format!("kinference-agent (node {node})"),
            agent_bin,
            &args,
            &[],
            config.work_dir.join(format!("agent-node{node}.log")),
        )?;
        let agent_pid = agent.pid();
        self.agent_processes.push(agent);
        Ok(AgentStarted {
            agent_grpc,
            agent_metrics_url: format!("http://{agent_metrics}/metrics"),
            agent_pid,
            workers,
        })
    }

    /// Starts one `vllm-sim` process serving the workers of `group` (nodes whose agents are up), and
    /// records the nodes.
    fn start_sim(
        &mut self,
        config: &FleetConfig,
        group: &[AgentStarted],
        sim_bin: &Path,
        tokenizer_dir: &Path,
    ) -> Result<(), ClusterError> {
        let workers: Vec<&WorkerPorts> = group.iter().flat_map(|n| &n.workers).collect();
        let Some(first) = workers.first().map(|w| w.number - 1) else {
            return Ok(());
        };
        let list = |f: &dyn Fn(&WorkerPorts) -> String| {
            workers.iter().map(|w| f(w)).collect::<Vec<_>>().join(",")
        };
        let mut args: Vec<String> = vec![
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            list(&|w| w.http.to_string()),
            "--model".into(),
            MODEL.into(),
            "--tokenizer-dir".into(),
            tokenizer_dir.display().to_string(),
            "--preset".into(),
            config.preset.clone(),
            "--time-scale".into(),
            config.time_scale.to_string(),
            "--seed".into(),
            first.to_string(),
            "--kv-events-endpoint".into(),
            list(&|w| format!("tcp://127.0.0.1:{}", w.kv_events)),
            "--kv-replay-endpoint".into(),
            list(&|w| format!("tcp://127.0.0.1:{}", w.kv_replay)),
            "--kv-topic".into(),
            list(&|w| format!("kv@w{}@{MODEL}", w.number)),
        ];
        args.extend(config.worker_args.iter().cloned());
        let sim = self.sim_processes.len();
        let child = Process::spawn_group(
            &format!(
                "vllm-sim {sim} ({} nodes, {} workers)",
                group.len(),
                workers.len()
            ),
            sim_bin,
            &args,
            &[],
            config.work_dir.join(format!("sim{sim}.log")),
        )?;
        let sim_pid = child.pid();
        self.sim_processes.push(child);
        for node in group {
            let urls: Vec<String> = node
                .workers
                .iter()
                .map(|w| format!("http://127.0.0.1:{}", w.http))
                .collect();
            self.workers.extend(urls.iter().cloned());
            self.nodes.push(Node {
                agent_grpc: node.agent_grpc.clone(),
                agent_metrics_url: node.agent_metrics_url.clone(),
                agent_pid: node.agent_pid,
                sim_pid,
                workers: urls,
            });
        }
        Ok(())
    }

    /// Every worker's base URL, node by node.
    pub fn workers(&self) -> &[String] {
        &self.workers
    }

    /// The simulated nodes.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The gateway running `mode`.
    pub fn gateway(&self, mode: &str) -> Option<&GatewayEndpoint> {
        self.gateways.get(mode)
    }

    /// Where the logs and config files are.
    pub fn work_dir(&self) -> &Path {
        &self.work_dir
    }

    /// Whether every child is still running (the name and log of the first one that is not).
    pub fn check_alive(&mut self) -> Result<(), ClusterError> {
        let nodes = self
            .agent_processes
            .iter_mut()
            .chain(&mut self.sim_processes);
        for child in nodes.chain(self.gateway_processes.values_mut()) {
            if let Some(exited) = child.exited() {
                return Err(exited.into());
            }
        }
        Ok(())
    }

    /// Empties every worker's prefix cache at once ([`reset_prefix_cache`], as
    /// [`crate::routing::cluster::Cluster::reset_caches`] does one by one), and waits `settle` for
    /// the `AllBlocksCleared` events to reach the gateway.
    pub async fn reset_caches(&self, settle: Duration) -> Result<(), ClusterError> {
        let resets = self
            .workers
            .iter()
            .map(|w| reset_prefix_cache(&self.http, w, MODEL));
        for result in futures::future::join_all(resets).await {
            result?;
        }
        tokio::time::sleep(settle).await;
        Ok(())
    }

    /// Prefix-cache counters summed over every worker.
    pub async fn cache_counters(&self) -> Result<CacheCounters, ClusterError> {
        let scrapes = self
            .workers
            .iter()
            .map(|w| async move { self.http.get_text(&format!("{w}/metrics")).await });
        let mut total = CacheCounters::default();
        for text in futures::future::join_all(scrapes).await {
            let text = text?;
            total.hits += metric_sum(&text, "vllm:prefix_cache_hits_total");
            total.queries += metric_sum(&text, "vllm:prefix_cache_queries_total");
        }
        Ok(total)
    }

    /// `name` summed over every agent's `/metrics`.
    pub async fn agent_metric_sum(&self, name: &str) -> Result<f64, ClusterError> {
        let mut total = 0.0;
        for node in &self.nodes {
            let text = self.http.get_text(&node.agent_metrics_url).await?;
            total += metric_sum(&text, name);
        }
        Ok(total)
    }
}

/// A node whose agent is up and whose workers are still to start.
struct AgentStarted {
    agent_grpc: String,
    agent_metrics_url: String,
    agent_pid: u32,
    workers: Vec<WorkerPorts>,
}

/// One worker's ports on its node.
struct WorkerPorts {
    /// Its number in the fleet, from 1 (its KV-event topic `kv@wN@MODEL`).
    number: usize,
    http: u16,
    kv_events: u16,
    kv_replay: u16,
}

/// [`wait_ready`] for what is left until `deadline` (one deadline for the whole start).
async fn wait(
    http: &HttpClient,
    process: &mut Process,
    url: &str,
    deadline: Instant,
    ready: impl Fn(&str) -> bool,
) -> Result<String, ClusterError> {
    let left = deadline.saturating_duration_since(Instant::now());
    Ok(wait_ready(http, process, url, left, ready).await?)
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ClusterError {
    let what = what.into();
    move |source| ClusterError::Io { what, source }
}

fn write_yaml(path: &Path, value: &serde_json::Value) -> Result<(), ClusterError> {
    let text = serde_yaml::to_string(value).map_err(|source| ClusterError::Yaml {
        path: path.display().to_string(),
        source,
    })?;
    std::fs::write(path, text).map_err(io(format!("writing {}", path.display())))
}
