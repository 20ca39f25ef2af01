//! The gateway's typed configuration: command-line flags (clap) and the `gateway.yaml` file.
//!
//! Flags hold the process-level knobs (listen addresses, body limit, upstream timeouts, health probing);
//! the YAML file holds the cluster view in local mode (models, workers, agents, routing mode, policies).
//! Other engineers add fields to [`GatewayConfig`]; unknown keys are ignored so that a file written for a
//! newer gateway (or shared with the agent's worker list) still loads.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;

use crate::routing::{ModelConfig, RoutingConfig, RoutingMode, WorkerConfig};

/// Command-line flags of `kinference-gateway`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kinference-gateway",
    version,
    about = "OpenAI- and Anthropic-compatible gateway that routes LLM requests to vLLM workers"
)]
pub struct Args {
    /// Address of the client-facing API (OpenAI `/v1/chat/completions`, `/v1/completions`, `/v1/models`;
    /// Anthropic `/v1/messages`).
    #[arg(long, env = "KINFERENCE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// Address of the admin port: `/metrics` (Prometheus), `/healthz`, `/readyz`.
    #[arg(
        long,
        env = "KINFERENCE_ADMIN_LISTEN",
        default_value = "127.0.0.1:9090"
    )]
    pub admin_listen: SocketAddr,

    /// Path of the gateway YAML file (models, workers, agents, routing mode, policy directory).
    #[arg(long, env = "KINFERENCE_CONFIG", default_value = "gateway.yaml")]
    pub config: PathBuf,

    #[command(flatten)]
    pub http: HttpSettings,

    #[command(flatten)]
    pub extproc: crate::extproc::ExtProcArgs,
}

/// Limits and timeouts of the HTTP path (client side and upstream side).
#[derive(Debug, Clone, clap::Args)]
pub struct HttpSettings {
    /// Largest accepted request body in bytes; larger bodies get 413.
    #[arg(long, env = "KINFERENCE_BODY_LIMIT_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub body_limit_bytes: usize,

    /// Timeout for opening a TCP connection to a worker, in milliseconds. A worker that does not
    /// accept within it is treated like one that refuses (marked unhealthy, request retried once).
    #[arg(long, env = "KINFERENCE_CONNECT_TIMEOUT_MS", default_value_t = 2_000)]
    pub connect_timeout_ms: u64,

    /// Timeout for the worker's response headers, in milliseconds. For a non-streaming request vLLM
    /// sends headers only when generation is complete, so this bounds the whole generation; 504 after it.
    #[arg(
        long,
        env = "KINFERENCE_FIRST_BYTE_TIMEOUT_MS",
        default_value_t = 600_000
    )]
    pub first_byte_timeout_ms: u64,

    /// Longest silence allowed between two body chunks from a worker, in milliseconds; a stream that
    /// stalls longer ends with an error event.
    #[arg(long, env = "KINFERENCE_IDLE_TIMEOUT_MS", default_value_t = 120_000)]
    pub idle_timeout_ms: u64,

    /// Interval between two `/health` probes of each worker, in milliseconds.
    #[arg(long, env = "KINFERENCE_HEALTH_INTERVAL_MS", default_value_t = 2_000)]
    pub health_interval_ms: u64,

    /// Timeout of one `/health` probe, in milliseconds.
    #[arg(long, env = "KINFERENCE_HEALTH_TIMEOUT_MS", default_value_t = 1_000)]
    pub health_timeout_ms: u64,

    /// Idle pooled connections kept per worker (connection reuse keeps the added latency low).
    #[arg(long, env = "KINFERENCE_POOL_MAX_IDLE_PER_HOST", default_value_t = 256)]
    pub pool_max_idle_per_host: usize,
}

impl HttpSettings {
    /// Connect timeout as a [`Duration`].
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    /// First-byte (response header) timeout as a [`Duration`].
    pub fn first_byte_timeout(&self) -> Duration {
        Duration::from_millis(self.first_byte_timeout_ms)
    }
    /// Idle timeout between body chunks as a [`Duration`].
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }
    /// Health probe interval as a [`Duration`].
    pub fn health_interval(&self) -> Duration {
        Duration::from_millis(self.health_interval_ms)
    }
    /// Health probe timeout as a [`Duration`].
    pub fn health_timeout(&self) -> Duration {
        Duration::from_millis(self.health_timeout_ms)
    }
}

impl Default for HttpSettings {
    fn default() -> Self {
        // Same values as the clap defaults: parse an empty command line.
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            http: HttpSettings,
        }
        Only::parse_from(["kinference-gateway"]).http
    }
}

/// The `gateway.yaml` file (local mode).
#[derive(Debug, Clone, Default, Deserialize)]
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
    /// The file is not valid YAML for [`GatewayConfig`].
    #[error("parsing {path}: {source}")]
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

    /// Checks that workers have usable URLs and serve declared models (when models are declared).
    pub fn validate(&self) -> Result<(), String> {
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
