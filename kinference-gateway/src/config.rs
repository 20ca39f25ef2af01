//! The gateway's typed configuration: command-line flags (clap) and the `gateway.yaml` file.
//!
//! Flags hold the process-level knobs (listen addresses, body limit, upstream timeouts, health probing);
//! the YAML file holds the cluster view in local mode (models, workers, agents, routing mode, policies).
//! Unknown or misspelt keys are errors naming the file, the line and the nearest valid key (see
//! [`yaml`]): a typo must not silently fall back to a default.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::Parser;
use serde::Deserialize;

use std::sync::Arc;
use std::time::Duration;

use crate::config_source::{self, ConfigSource};
use crate::policy::source::SourceError;
use crate::policy::stage::PolicyStage;
use crate::pools::Pools;
use crate::routing::{ModelConfig, RoutingConfig, RoutingMode, WorkerConfig};
use crate::yaml;

/// Command-line flags of `kinference-gateway`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kinference-gateway",
    version,
    about = "OpenAI- and Anthropic-compatible gateway that routes LLM requests to vLLM workers"
)]
pub struct Args {
    /// Address of the client-facing API (OpenAI `/v1/chat/completions`, `/v1/completions`,
    /// `/v1/embeddings`, `/v1/responses`, `/v1/models`; vLLM's `/tokenize`, `/detokenize`; Anthropic
    /// `/v1/messages`).
    #[arg(long, env = "KINFERENCE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// Address of the admin port: `/metrics` (Prometheus), `/healthz`, `/readyz` (serving, not
    /// draining), `/healthz/workers` (each worker's probed health).
    #[arg(
        long,
        env = "KINFERENCE_ADMIN_LISTEN",
        default_value = "127.0.0.1:9090"
    )]
    pub admin_listen: SocketAddr,

    /// Path of the gateway YAML file (models, workers, agents, routing mode, policy directory).
    #[arg(long, env = "KINFERENCE_CONFIG", default_value = "gateway.yaml")]
    pub config: PathBuf,

    /// A running OpenAI-compatible worker (vLLM) to route to, e.g. `http://127.0.0.1:8000`; repeat it
    /// for more. Its model is learned from its `/v1/models`. `URL,role=prefill` (or `decode`, `both`)
    /// gives its part in prefill/decode disaggregation (vLLM started with a KV connector). With
    /// `--worker`, a missing `--config` file is not an error (everything else keeps its default).
    #[arg(long = "worker", value_name = "URL[,role=ROLE]")]
    pub workers: Vec<String>,

    /// Tokenizer directory (`tokenizer.json`) of the models learned from `--worker`; without it the
    /// router asks the worker's `POST /tokenize`.
    #[arg(long, value_name = "DIR")]
    pub tokenizer_dir: Option<PathBuf>,

    /// The workers' API key (vLLM's `--api-key`), sent as `Authorization: Bearer` to every worker;
    /// instead of `worker_api_key` in the configuration file (the Helm chart sets it from a Secret).
    #[arg(
        long,
        env = "KINFERENCE_WORKER_API_KEY",
        hide_env_values = true,
        value_name = "KEY"
    )]
    pub worker_api_key: Option<String>,

    /// Seconds between SIGTERM (when `/readyz` turns 503) and closing the listening sockets, so that
    /// load balancers and Service endpoints stop sending new requests first.
    #[arg(long, env = "KINFERENCE_SHUTDOWN_DELAY_SECONDS", default_value_t = 5)]
    pub shutdown_delay_seconds: u64,

    /// Seconds that in-flight requests and streams get to finish once the sockets are closed; what
    /// is still open after that is cut.
    #[arg(long, env = "KINFERENCE_DRAIN_TIMEOUT_SECONDS", default_value_t = 30)]
    pub drain_timeout_seconds: u64,

    /// Put each tenant's cost and monthly spend on `/metrics`
    /// (`kinference_gateway_tenant_cost_total`, `kinference_gateway_tenant_budget_spent`). Off: the
    /// page is open to whoever reaches the admin port (unless `--admin-key-for-metrics`), and spend
    /// is read from `/admin/usage`, behind the admin key.
    #[arg(long, env = "KINFERENCE_METRICS_TENANT_SPEND")]
    pub metrics_tenant_spend: bool,

    #[command(flatten)]
    pub http: HttpSettings,

    #[command(flatten)]
    pub extproc: crate::extproc::ExtProcArgs,

    #[command(flatten)]
    pub overload: crate::overload::OverloadSettings,

    #[command(flatten)]
    pub health: crate::backend::health::HealthSettings,

    #[command(flatten)]
    pub access: crate::access::AccessArgs,

    #[command(flatten)]
    pub agent_tls: AgentTlsArgs,

    #[command(flatten)]
    pub telemetry: crate::telemetry::TelemetryArgs,
}

/// Mutual TLS to the node agents' gRPC stream (the agents' `--grpc-tls-*`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct AgentTlsArgs {
    /// mTLS to the agents: the CA of their certificates (PEM). With `--agent-tls-cert` and
    /// `--agent-tls-key` (this gateway's client certificate), agents are dialled over TLS.
    #[arg(long, env = "KINFERENCE_AGENT_TLS_CA", requires_all = ["agent_tls_cert", "agent_tls_key"])]
    pub agent_tls_ca: Option<PathBuf>,

    /// mTLS to the agents: this gateway's client certificate (PEM).
    #[arg(long, env = "KINFERENCE_AGENT_TLS_CERT", requires = "agent_tls_ca")]
    pub agent_tls_cert: Option<PathBuf>,

    /// mTLS to the agents: this gateway's private key (PEM).
    #[arg(long, env = "KINFERENCE_AGENT_TLS_KEY", requires = "agent_tls_ca")]
    pub agent_tls_key: Option<PathBuf>,

    /// mTLS to the agents: the DNS name their certificates carry (agents are dialled by pod IP).
    #[arg(
        long,
        env = "KINFERENCE_AGENT_TLS_SERVER_NAME",
        default_value = "kinference-agent"
    )]
    pub agent_tls_server_name: String,
}

impl AgentTlsArgs {
    /// The client endpoint when the files are given (read again every 5 s for renewals); a file
    /// that cannot be read or parsed is a start-up error.
    pub fn load(
        &self,
        metrics: &kinference_api::tls::TlsMetrics,
    ) -> Result<Option<kinference_api::tls::ClientTls>, kinference_api::tls::TlsError> {
        let (Some(ca), Some(cert), Some(key)) = (
            &self.agent_tls_ca,
            &self.agent_tls_cert,
            &self.agent_tls_key,
        ) else {
            return Ok(None);
        };
        let files = kinference_api::tls::ClientTlsFiles {
            ca: ca.clone(),
            cert: cert.clone(),
            key: key.clone(),
            server_name: self.agent_tls_server_name.clone(),
        };
        kinference_api::tls::ClientTls::load("agent-client", &files, metrics).map(Some)
    }
}

pub use crate::backend::worker::HttpSettings;

#[cfg(test)]
mod reference;
pub mod workers_flag;

/// The `gateway.yaml` file (local mode).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Served models.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// Static workers (vLLM-compatible OpenAI servers).
    #[serde(default)]
    pub workers: Vec<WorkerConfig>,
    /// gRPC endpoints of node agents (cache and load view for routing).
    #[serde(default)]
    pub agents: Vec<String>,
    /// How a worker is picked.
    #[serde(default)]
    pub routing: RoutingMode,
    /// Directory of policy YAML files (optional). With it, every request goes through the policy
    /// stage, and the pools' static endpoints join `workers`.
    #[serde(default)]
    pub policy_dir: Option<PathBuf>,
    /// How often the policy directory is checked for changes, in milliseconds (default 1000).
    #[serde(default)]
    pub policy_reload_interval_ms: Option<u64>,
    /// How often the gateway scrapes the policy pools' workers' `/metrics` for queue depth and
    /// KV-cache usage when no agent reports them, in milliseconds (default 500).
    #[serde(default)]
    pub policy_load_interval_ms: Option<u64>,
    /// In-cluster discovery of workers and agents (the Helm chart writes it); see [`crate::discovery`].
    #[serde(default)]
    pub kubernetes: Option<crate::discovery::KubernetesConfig>,
    /// API keys, rate limits, budgets and the usage store; see [`crate::tenancy`]. Absent: no
    /// tenants (the gateway is open), usage journaled beside this file.
    #[serde(default)]
    pub tenancy: crate::tenancy::TenancyConfig,
    /// Cluster mode for the five CRDs: watch them in these namespaces (instead of `policy_dir`),
    /// write their status, read tenant keys and provider credentials from Secrets; see
    /// [`crate::config_source`].
    #[serde(default)]
    pub crds: Option<crate::config_source::kube::KubeSourceConfig>,
    /// The request classifiers under policies: `external` (an HTTP classifier asked before every
    /// plan; a timeout or error keeps the request local); see [`crate::policy::classify`].
    #[serde(default)]
    pub classifier: crate::policy::classify::ClassifierConfig,
    /// The workers' API key (vLLM's `--api-key`), sent as `Authorization: Bearer` to every worker.
    #[serde(default)]
    pub worker_api_key: Option<crate::backend::worker::credentials::WorkerApiKey>,
    /// Headers sent with every request to a worker, name to value.
    #[serde(default)]
    pub worker_headers: BTreeMap<String, String>,
    /// Prefill/decode disaggregation where a model has `prefill` workers (`workers[].role`,
    /// `--worker URL,role=prefill`, the pod label `kinference.ai/role`, an `InferencePool`'s `role`).
    #[serde(default)]
    pub disaggregation: DisaggregationConfig,
    /// The other gateway replicas of this fleet: each tells the others what it dispatches, so that
    /// their estimates count it (see [`crate::routing::replicas`]).
    #[serde(default)]
    pub replicas: crate::routing::replicas::ReplicasConfig,
    /// How the workers listed here and the discovered pods no `InferencePool` speaks for order their
    /// waiting requests: `priority` where they run vLLM with `--scheduling-policy priority`, so each
    /// request is sent its band as `priority` (high -1, medium 0, low 1); default `fcfs`.
    #[serde(default)]
    pub scheduling_policy: SchedulingPolicyConfig,
    /// Conversations back to the worker of their previous turn (`x-session-id`, `user`,
    /// `safety_identifier`, `metadata.user_id`), and stored answers (`previous_response_id`) to the
    /// worker holding them; see [`crate::routing::sessions`].
    #[serde(default)]
    pub sessions: crate::routing::sessions::SessionsConfig,
}

/// `scheduling_policy:` of `gateway.yaml` (vLLM's `--scheduling-policy`).
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SchedulingPolicyConfig {
    /// First come, first served (vLLM's default): no `priority` is sent.
    #[default]
    Fcfs,
    /// By the request's `priority`, lower first.
    Priority,
}

/// `disaggregation:` of `gateway.yaml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DisaggregationConfig {
    /// A request with fewer prompt tokens than this left to compute on the decode worker caching
    /// most of it runs whole on one worker (an `InferencePool`'s `disaggregation.minUncachedTokens`
    /// wins for its requests); 0 splits every request. Default 512.
    #[serde(default = "default_min_uncached_tokens")]
    pub min_uncached_tokens: usize,
}

fn default_min_uncached_tokens() -> usize {
    512
}

const _: () = assert!(crate::routing::DEFAULT_PD_MIN_UNCACHED_TOKENS == 512);

impl Default for DisaggregationConfig {
    fn default() -> Self {
        Self {
            min_uncached_tokens: default_min_uncached_tokens(),
        }
    }
}

/// Errors loading the configuration file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not valid YAML for [`GatewayConfig`] (an unknown key included).
    #[error("{}", yaml::describe(path, 1, source))]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_yaml::Error,
    },
    /// The file parses but is inconsistent.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

impl GatewayConfig {
    /// Reads and validates a YAML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let config = Self::from_yaml(&text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })?;
        config.validate().map_err(|message| ConfigError::Invalid {
            path: path.to_owned(),
            message,
        })?;
        Ok(config)
    }

    /// Parses YAML text (no validation).
    pub fn from_yaml(text: &str) -> Result<Self, serde_yaml::Error> {
        serde_yaml::from_str(text)
    }

    /// Checks that workers have usable URLs and serve declared models (when models are declared),
    /// and that an external classifier has a usable URL.
    pub fn validate(&self) -> Result<(), String> {
        self.classifier.validate()?;
        for worker in &self.workers {
            let uri: http::Uri = worker
                .url
                .parse()
                .map_err(|e| format!("worker url `{}`: {e}", worker.url))?;
            if uri.scheme_str() != Some("http") || uri.authority().is_none() {
                return Err(format!(
                    "worker url `{}` must look like http://host:port",
                    worker.url
                ));
            }
            if !self.models.is_empty() && !self.models.iter().any(|m| m.name == worker.model) {
                return Err(format!(
                    "worker `{}` serves model `{}`, which is not under `models`",
                    worker.url, worker.model
                ));
            }
        }
        Ok(())
    }

    /// The part of the file the router is built from.
    pub fn routing_config(&self) -> RoutingConfig {
        RoutingConfig {
            workers: self.workers.clone(),
            models: self.models.clone(),
            agents: self.agents.clone(),
            mode: self.routing,
        }
    }

    /// Names of all served models: the declared ones, plus any that only workers mention.
    /// The models whose workers serve Anthropic's `/v1/messages` themselves (`serves_messages`).
    pub fn messages_models(&self) -> Vec<String> {
        self.models
            .iter()
            .filter(|m| m.serves_messages)
            .map(|m| m.name.clone())
            .collect()
    }

    pub fn model_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.models.iter().map(|m| m.name.clone()).collect();
        for worker in &self.workers {
            if !names.contains(&worker.model) {
                names.push(worker.model.clone());
            }
        }
        names
    }
}

#[cfg(test)]
mod tests;

/// Local mode's one configuration source: the policy directory, loaded now (an error only when it
/// cannot be read) and re-read every `policy_reload_interval_ms` (default 1000) when a file changed.
/// The gateway starts it once and hands it to tenancy (its snapshots: the pools' prices, the
/// tenants too when `tenancy.tenants_dir` is the same directory) and to the policy stage
/// ([`with_policy_stage`]), as it hands both the cluster's source in cluster mode. `None` without a
/// policy directory.
pub fn local_source(config: &GatewayConfig) -> Result<Option<ConfigSource>, SourceError> {
    let every = Duration::from_millis(config.policy_reload_interval_ms.unwrap_or(1000));
    config
        .policy_dir
        .clone()
        .map(|dir| config_source::files::start(dir, every))
        .transpose()
}

/// Starts the policy stage over `source` (local mode's, [`local_source`]; subscribe whoever else
/// reads it first: from here on it runs on its own, for as long as anyone reads what it publishes),
/// and the pools' run-time part over it. Returns the configuration to build the router from:
/// `config` plus the pools' static endpoints (as workers) and their models (with tokenizer
/// directories); without a source, `config` unchanged and no stage.
pub fn with_policy_stage(
    config: GatewayConfig,
    http: &HttpSettings,
    source: Option<ConfigSource>,
) -> (GatewayConfig, Option<Arc<Pools>>) {
    let Some(source) = source else {
        return (config, None);
    };
    let stage = PolicyStage::start(source.into_policy_sets(), load_interval(&config));
    stage.classifier().configure(&config.classifier);
    let pools = Pools::new(stage, http.connect_timeout(), None);
    (with_pool_endpoints(config, &pools), Some(pools))
}

/// How often the pools' workers' `/metrics` are scraped (`policy_load_interval_ms`, default 500).
fn load_interval(config: &GatewayConfig) -> Duration {
    Duration::from_millis(config.policy_load_interval_ms.unwrap_or(500))
}

/// `config` plus the pools' static endpoints (as workers) and their models.
fn with_pool_endpoints(mut config: GatewayConfig, pools: &Pools) -> GatewayConfig {
    let (workers, models) = pools.routing_additions();
    for m in models {
        if !config.models.iter().any(|c| c.name == m.name) {
            config.models.push(m);
        }
    }
    for w in workers {
        if !config
            .workers
            .iter()
            .any(|c| c.url.trim_end_matches('/') == w.url)
        {
            config.workers.push(w);
        }
    }
    config
}

/// Starts the policy stage over the cluster's sets, and the pools' run-time part (keys from
/// Secrets); returns the configuration to build the router from (`config` plus the pools' static
/// endpoints and models, as in local mode).
pub fn with_cluster_policy_stage(
    config: GatewayConfig,
    http: &HttpSettings,
    cluster: &mut crate::config_source::cluster::Cluster,
) -> (GatewayConfig, Arc<Pools>) {
    let sets = cluster.source.policy_sets();
    let stage = PolicyStage::start(sets, load_interval(&config));
    stage.classifier().configure(&config.classifier);
    let pools = Pools::new(stage, http.connect_timeout(), Some(cluster.credentials()));
    pools.set_pool_credentials(cluster.pool_credentials());
    (with_pool_endpoints(config, &pools), pools)
}
