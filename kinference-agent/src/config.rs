//! The agent's configuration: command-line flags and the local workers file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;

use crate::zmq_guard::{GuardConfig, Limits};

/// Command-line flags of `kinference-agent`.
#[derive(Clone, Debug, Parser)]
#[command(
    name = "kinference-agent",
    version,
    about = "Kinference node agent: KV-cache and load summaries of local vLLM workers"
)]
pub struct Args {
    /// Address of the gRPC summary server (`kinference.v1.NodeAgent/Watch`).
    #[arg(
        long,
        env = "KINFERENCE_AGENT_GRPC_LISTEN",
        default_value = "127.0.0.1:7070"
    )]
    pub grpc_listen: SocketAddr,

    /// Address of the Prometheus `/metrics` endpoint.
    #[arg(
        long,
        env = "KINFERENCE_AGENT_METRICS_LISTEN",
        default_value = "127.0.0.1:9091"
    )]
    pub metrics_listen: SocketAddr,

    /// Local workers file (YAML, `workers: [...]`); re-read when it changes.
    #[arg(long, env = "KINFERENCE_AGENT_WORKERS")]
    pub workers: PathBuf,

    /// Node name reported in snapshots (default: the host name).
    #[arg(long, env = "KINFERENCE_NODE_NAME")]
    pub node: Option<String>,

    /// How often each worker's `/metrics` is scraped, in milliseconds.
    #[arg(long, default_value_t = 250)]
    pub scrape_interval_ms: u64,

    /// How long events are coalesced into one delta message, in milliseconds.
    #[arg(long, default_value_t = 5)]
    pub coalesce_ms: u64,

    /// Messages queued per watching gateway before it is considered behind (it then gets a fresh snapshot).
    #[arg(long, default_value_t = 256)]
    pub watcher_queue: usize,

    /// Most engine blocks tracked per worker; beyond it new blocks are dropped (logged and counted).
    #[arg(long, default_value_t = 4_000_000)]
    pub max_blocks_per_worker: usize,

    /// How often the workers file is checked for changes, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub workers_poll_ms: u64,

    /// How often the eBPF maps are read and the kernel's per-worker figures copied into the summaries, in
    /// milliseconds (a gateway hears of a new request within about this long).
    #[arg(long, default_value_t = 25)]
    pub kernel_poll_ms: u64,

    /// A streamed response without a send for this long counts as finished in the kernel's in-flight count
    /// (HTTP/1.1 keeps connections open; the next request or a close also ends it), in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub kernel_idle_gap_ms: u64,

    /// How often the GPUs are sampled through NVML, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub gpu_interval_ms: u64,

    /// Largest ZeroMQ frame a KV-event or replay peer may send, in bytes; a larger one closes that
    /// connection (counted in `kinference_agent_rejected_total`). A 1M-token prefill's batch is ~5 MiB.
    #[arg(long, env = "KINFERENCE_AGENT_ZMQ_MAX_FRAME_BYTES", default_value_t = 16 << 20)]
    pub zmq_max_frame_bytes: u64,

    /// Largest ZeroMQ message (all its frames) a KV-event or replay peer may send, in bytes.
    #[arg(long, env = "KINFERENCE_AGENT_ZMQ_MAX_MESSAGE_BYTES", default_value_t = 16 << 20)]
    pub zmq_max_message_bytes: u64,

    /// Established connections per guarded ZeroMQ socket (each worker's KV-event and replay socket); a
    /// newcomer past it drops the connection silent longest.
    #[arg(long, default_value_t = 64)]
    pub zmq_max_connections: usize,

    /// Connections still in their ZeroMQ handshake per socket; a new one drops the oldest, so idle
    /// connections cannot lock a publisher out.
    #[arg(long, default_value_t = 16)]
    pub zmq_max_pending: usize,

    /// Time a ZeroMQ peer has to send its greeting and READY, in milliseconds.
    #[arg(
        long,
        env = "KINFERENCE_AGENT_ZMQ_HANDSHAKE_TIMEOUT_MS",
        default_value_t = 5000
    )]
    pub zmq_handshake_timeout_ms: u64,

    /// An established KV-event or replay connection whose peer sent nothing for this long is closed, in
    /// milliseconds (vLLM's publisher reconnects by itself, the agent's own sockets redial, and a
    /// sequence gap is replayed).
    #[arg(
        long,
        env = "KINFERENCE_AGENT_ZMQ_IDLE_TIMEOUT_MS",
        default_value_t = 300_000
    )]
    pub zmq_idle_timeout_ms: u64,

    /// Bytes of unfinished messages (by their frames' declared sizes) all peers of one guarded ZeroMQ
    /// socket together may make it hold; a frame past it drops the peer whose unfinished message is
    /// the oldest. At least `--zmq-max-message-bytes`. Each worker has two guarded sockets (KV events,
    /// replay): a node's worst case is about workers x 2 x this.
    #[arg(
        long,
        env = "KINFERENCE_AGENT_ZMQ_MAX_BUFFERED_BYTES",
        default_value_t = 32 << 20
    )]
    pub zmq_max_buffered_bytes: u64,

    /// Concurrent connections on the gRPC port; more are closed at once (and counted).
    #[arg(long, default_value_t = 256)]
    pub grpc_max_connections: usize,

    /// mTLS on the gRPC port: this agent's certificate (PEM). With `--grpc-tls-key` and
    /// `--grpc-tls-client-ca`, only gateways presenting a certificate of that CA may connect. The
    /// files are read again every 5 s: renewed certificates apply without a restart.
    #[arg(long, env = "KINFERENCE_AGENT_GRPC_TLS_CERT", requires_all = ["grpc_tls_key", "grpc_tls_client_ca"])]
    pub grpc_tls_cert: Option<std::path::PathBuf>,

    /// mTLS on the gRPC port: this agent's private key (PEM).
    #[arg(
        long,
        env = "KINFERENCE_AGENT_GRPC_TLS_KEY",
        requires = "grpc_tls_cert"
    )]
    pub grpc_tls_key: Option<std::path::PathBuf>,

    /// mTLS on the gRPC port: the CA that signs the gateways' client certificates (PEM).
    #[arg(
        long,
        env = "KINFERENCE_AGENT_GRPC_TLS_CLIENT_CA",
        requires = "grpc_tls_cert"
    )]
    pub grpc_tls_client_ca: Option<std::path::PathBuf>,

    /// mTLS on the gRPC port: the roles admitted, as DNS names a client certificate must carry one of
    /// in its subject alternative names (comma-separated). The default admits gateways only: another
    /// agent's certificate of the same CA is refused.
    #[arg(
        long,
        env = "KINFERENCE_AGENT_GRPC_TLS_CLIENT_NAMES",
        value_delimiter = ',',
        default_value = "kinference-gateway"
    )]
    pub grpc_tls_client_names: Vec<String>,

    /// Largest gRPC message the agent sends (a snapshot of every worker's keys), in bytes. Requests are
    /// bounded at 64 KiB (a `WatchRequest` is a few bytes).
    #[arg(long, default_value_t = 256 << 20)]
    pub grpc_max_message_bytes: usize,

    /// Concurrent connections on the metrics port; more are closed at once (and counted).
    #[arg(long, default_value_t = 64)]
    pub metrics_max_connections: usize,
}

impl Args {
    pub fn scrape_interval(&self) -> Duration {
        Duration::from_millis(self.scrape_interval_ms.max(10))
    }
    pub fn coalesce(&self) -> Duration {
        Duration::from_millis(self.coalesce_ms)
    }
    pub fn kernel_poll(&self) -> Duration {
        Duration::from_millis(self.kernel_poll_ms.max(5))
    }
    pub fn kernel_idle_gap(&self) -> Duration {
        Duration::from_millis(self.kernel_idle_gap_ms.max(1))
    }
    pub fn gpu_interval(&self) -> Duration {
        Duration::from_millis(self.gpu_interval_ms.max(100))
    }
    /// The ZeroMQ guard's limits (see [`crate::zmq_guard`]).
    pub fn zmq_guard(&self) -> GuardConfig {
        GuardConfig {
            limits: Limits {
                max_frame: self.zmq_max_frame_bytes,
                max_message: self.zmq_max_message_bytes,
                ..Limits::default()
            },
            max_connections: self.zmq_max_connections.max(1),
            max_pending: self.zmq_max_pending.max(1),
            handshake_timeout: Duration::from_millis(self.zmq_handshake_timeout_ms.max(10)),
            idle_timeout: Duration::from_millis(self.zmq_idle_timeout_ms),
            max_buffered: self.zmq_max_buffered_bytes,
        }
    }
    /// The node name: `--node`, else the host name, else `"local"`.
    pub fn node_name(&self) -> String {
        self.node
            .clone()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .or_else(|| {
                std::fs::read_to_string("/etc/hostname")
                    .ok()
                    .map(|s| s.trim().to_string())
            })
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "local".to_string())
    }
}

/// One local vLLM worker, as the workers file (or a later discovery source) describes it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    /// Worker base URL; also its stable id.
    pub url: String,
    /// Served model name.
    pub model: String,
    /// The worker's KV events endpoint (ZMQ PUB).
    pub kv_events_endpoint: Option<String>,
    /// `true`: the agent binds a SUB here and vLLM connects (vLLM's connect mode, endpoint without `*`).
    /// `false`: the agent connects to a worker that binds.
    #[serde(default = "default_true")]
    pub kv_events_bind: bool,
    /// The worker's replay endpoint (ZMQ ROUTER, always bound by vLLM).
    pub kv_replay_endpoint: Option<String>,
    /// Only messages with this topic are applied (default: all).
    #[serde(default)]
    pub kv_topic: Option<String>,
    /// The worker's part in prefill/decode disaggregation, reported to the gateways with its state
    /// (unset: the gateways keep the role their own configuration gives it).
    #[serde(default)]
    pub role: Option<kinference_api::WorkerRole>,
    /// vLLM's `--data-parallel-size`: the worker runs this many engines (ranks) behind its one HTTP
    /// endpoint, each with its own KV cache and its own event publisher on the endpoints shifted by the
    /// rank, as vLLM shifts them (see [`WorkerSpec::rank_endpoint`]). Unset or 1: one rank-less cache.
    #[serde(default)]
    pub data_parallel_size: Option<u32>,
}

fn default_true() -> bool {
    true
}

impl WorkerSpec {
    /// How many caches the worker has: its data-parallel ranks, at least one.
    pub fn ranks(&self) -> usize {
        self.data_parallel_size.unwrap_or(1).max(1) as usize
    }

    /// Whether the worker reports its caches per data-parallel rank (more than one rank).
    pub fn ranked(&self) -> bool {
        self.ranks() > 1
    }

    /// `endpoint` as rank `rank`'s publisher binds or connects it: vLLM adds the rank to a TCP port
    /// (port 0 is left alone) and appends `_dp<rank>` to an `ipc://` or `inproc://` path. Rank 0 and
    /// rank-less workers keep `endpoint` as it is.
    pub fn rank_endpoint(endpoint: &str, rank: usize) -> String {
        if rank == 0 {
            return endpoint.to_string();
        }
        if let Some(rest) = endpoint.strip_prefix("tcp://")
            && let Some((host, port)) = rest.rsplit_once(':')
            && let Ok(port) = port.parse::<u32>()
        {
            return match port {
                0 => endpoint.to_string(),
                p => format!("tcp://{host}:{}", p + rank as u32),
            };
        }
        format!("{endpoint}_dp{rank}")
    }
}

/// The local workers file.
#[derive(Clone, Debug, Deserialize, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WorkersFile {
    #[serde(default)]
    pub workers: Vec<WorkerSpec>,
}

/// Why the workers file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Parse {
        path: PathBuf,
        source: serde_yaml::Error,
    },
    #[error("{path}: worker {url} is listed twice")]
    Duplicate { path: PathBuf, url: String },
    #[error(
        "{path}: worker {url} has data_parallel_size {size}; at most {MAX_DATA_PARALLEL_SIZE} ranks are followed"
    )]
    TooManyRanks {
        path: PathBuf,
        url: String,
        size: u32,
    },
}

/// The most data-parallel ranks one worker entry may name: each rank is a subscriber (and a TCP port
/// past the worker's own), so a typo must not open thousands of them.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 256;

impl WorkersFile {
    /// Reads and validates a workers file.
    pub fn load(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        Self::parse(&text).map_err(|e| match e {
            ParseError::Yaml(source) => ConfigError::Parse {
                path: path.into(),
                source,
            },
            ParseError::Duplicate(url) => ConfigError::Duplicate {
                path: path.into(),
                url,
            },
            ParseError::TooManyRanks(url, size) => ConfigError::TooManyRanks {
                path: path.into(),
                url,
                size,
            },
        })
    }

    fn parse(text: &str) -> Result<Self, ParseError> {
        let mut file: WorkersFile = if text.trim().is_empty() {
            Self::default()
        } else {
            serde_yaml::from_str(text).map_err(ParseError::Yaml)?
        };
        let mut seen = std::collections::HashSet::new();
        for w in &mut file.workers {
            w.url = w.url.trim_end_matches('/').to_string();
            if !seen.insert(w.url.clone()) {
                return Err(ParseError::Duplicate(w.url.clone()));
            }
            if let Some(size) = w.data_parallel_size.filter(|&n| n > MAX_DATA_PARALLEL_SIZE) {
                return Err(ParseError::TooManyRanks(w.url.clone(), size));
            }
        }
        Ok(file)
    }
}

enum ParseError {
    Yaml(serde_yaml::Error),
    Duplicate(String),
    TooManyRanks(String, u32),
}

#[cfg(test)]
mod tests;
