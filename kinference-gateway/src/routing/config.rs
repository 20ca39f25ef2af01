//! The router's configuration: workers, models (with their tokenizers), the routing mode, and the
//! estimator's tuning; errors building the router from it.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

use super::estimate::EstimatorConfig;

/// What the router needs from the gateway configuration (gateway-http fills it from `gateway.yaml`).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    /// Statically configured workers (local mode).
    #[serde(default)]
    pub workers: Vec<WorkerConfig>,
    /// Served models and where their tokenizers are.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// gRPC endpoints of node agents, e.g. `http://127.0.0.1:7070`.
    #[serde(default)]
    pub agents: Vec<String>,
    /// How to pick a worker.
    #[serde(default)]
    pub mode: RoutingMode,
}

/// One statically configured worker.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Worker base URL; also the worker's id everywhere (agent summaries, response headers).
    pub url: String,
    /// Served model name (what clients put in `model`).
    pub model: String,
    /// Its part in prefill/decode disaggregation (`prefill`, `decode`, default `both`).
    #[serde(default)]
    pub role: kinference_api::WorkerRole,
}

/// One served model.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Served model name.
    pub name: String,
    /// Directory with `tokenizer.json` and `tokenizer_config.json`; without it the router asks a
    /// worker's `POST /tokenize`.
    #[serde(default)]
    pub tokenizer_dir: Option<PathBuf>,
    /// The model's workers serve Anthropic's `POST /v1/messages` themselves (recent vLLM does):
    /// Anthropic requests pass through to them unchanged instead of being translated to the chat API.
    #[serde(default)]
    pub serves_messages: bool,
    /// The engine profile the TTFT estimate starts from, which also prices a prefill's attention:
    /// `cpu-qwen2-small` or `l40s-27b-fp8` (`src/routing/estimate/profiles.rs`); without one, the
    /// default priors and no attention term.
    #[serde(default)]
    pub profile: Option<String>,
}

/// The routing strategy. Everything but `kinference` is a baseline for the benchmark.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum RoutingMode {
    /// Lowest estimated time to first token (KV cache contents, queues, learned rates).
    #[default]
    Kinference,
    /// Fewest requests in flight from this gateway.
    LeastOutstanding,
    /// Uniformly random (what a Kubernetes Service does).
    Random,
    /// Each worker in turn.
    RoundRobin,
    /// Hash of the prompt's leading characters (approximate prefix affinity, as simple routers do).
    PrefixHash,
}

impl RoutingMode {
    /// The name used in configuration and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            RoutingMode::Kinference => "kinference",
            RoutingMode::LeastOutstanding => "least-outstanding",
            RoutingMode::Random => "random",
            RoutingMode::RoundRobin => "round-robin",
            RoutingMode::PrefixHash => "prefix-hash",
        }
    }
}

impl fmt::Display for RoutingMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RoutingMode {
    type Err = BuildError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "kinference" => RoutingMode::Kinference,
            "least-outstanding" => RoutingMode::LeastOutstanding,
            "random" => RoutingMode::Random,
            "round-robin" => RoutingMode::RoundRobin,
            "prefix-hash" => RoutingMode::PrefixHash,
            other => return Err(BuildError::UnknownMode(other.to_string())),
        })
    }
}

/// Why a router could not be built from its configuration.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The routing mode name is not one of the known modes.
    #[error(
        "unknown routing mode {0:?} (kinference, least-outstanding, random, round-robin, prefix-hash)"
    )]
    UnknownMode(String),
    /// The same worker URL appears twice.
    #[error("worker {0} is configured twice")]
    DuplicateWorker(String),
    /// More workers than the index can name.
    #[error("too many workers ({0}); at most 65533")]
    TooManyWorkers(usize),
    /// A configured tokenizer could not be loaded.
    #[error("tokenizer of model {model}: {error}")]
    Tokenizer {
        /// The model.
        model: String,
        /// What failed.
        error: kinference_api::tokenize::TokenizeError,
    },
    /// A model names an engine profile that does not exist.
    #[error("model {model}: unknown engine profile {name:?} (known: {known})")]
    UnknownProfile {
        /// The model.
        model: String,
        /// The name given.
        name: String,
        /// The profiles there are.
        known: String,
    },
    /// Agents are configured but the router was built outside a tokio runtime.
    #[error("the router must be built inside a tokio runtime to watch agents")]
    NoRuntime,
}

/// Tuning knobs; the defaults suit a local cluster and the simulator.
#[derive(Clone, Debug)]
pub struct RoutingTuning {
    /// Block size assumed for workers whose agent has not said (vLLM's default).
    pub default_block_size: usize,
    /// How long a routed prompt credits its worker while an agent reports it.
    pub speculative_ttl: Duration,
    /// The same without a live agent (the credit is then the only cache signal).
    pub speculative_ttl_no_agent: Duration,
    /// With a live agent, how long the credit outlives the request's first token (the events of its
    /// blocks reach the index within about this long).
    pub speculative_after_first_token: Duration,
    /// A disconnected agent's data is dropped after this long.
    pub stale_after: Duration,
    /// Load figures older than this are ignored.
    pub load_max_age: Duration,
    /// KV index cap, (block, worker) pairs.
    pub index_max_pairs: usize,
    /// Speculative credit cap, keys.
    pub speculative_max_keys: usize,
    /// Characters of the prompt the `prefix-hash` baseline hashes.
    pub prefix_hash_chars: usize,
    /// Start a Watch stream per configured agent. Off: the caller feeds summaries through
    /// [`super::Router::apply_agent_summary`].
    pub connect_agents: bool,
    /// Estimate and choice.
    pub estimator: EstimatorConfig,
    /// Read the candidates' figures from the decision rows ([`super::rows`]; the default). Off: lock
    /// every candidate worker and read its state, the straightforward way the rows are checked and
    /// benchmarked against.
    pub decision_rows: bool,
}

impl Default for RoutingTuning {
    fn default() -> Self {
        Self {
            default_block_size: 16,
            speculative_ttl: Duration::from_secs(3),
            speculative_ttl_no_agent: Duration::from_secs(120),
            speculative_after_first_token: Duration::from_millis(250),
            stale_after: Duration::from_secs(10),
            load_max_age: Duration::from_secs(5),
            index_max_pairs: 32 * 1024 * 1024,
            speculative_max_keys: 4 * 1024 * 1024,
            prefix_hash_chars: 256,
            connect_agents: true,
            estimator: EstimatorConfig::default(),
            decision_rows: true,
        }
    }
}
