//! Choosing a worker: the cluster-wide KV index and the time-to-first-token estimate.
//!
//! The gateway calls [`Router::pick`] once per request, before forwarding. The router tokenizes the
//! prompt, computes its block keys, estimates the time to first token on every candidate worker and
//! records the choice in its in-flight ledger. The returned [`InFlight`] ticket releases the ledger entry
//! when the request ends (also when it is dropped on an error or an aborted stream).
//!
//! This first version implements the public API with a least-outstanding-requests picker for every
//! [`RoutingMode`]; the KV index, agent subscriptions and TTFT estimate land behind the same API.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use prometheus_client::registry::Registry;
use serde::Deserialize;

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
    #[error("unknown routing mode {0:?} (kinference, least-outstanding, random, round-robin, prefix-hash)")]
    UnknownMode(String),
    /// The same worker URL appears twice.
    #[error("worker {0} is configured twice")]
    DuplicateWorker(String),
    /// More workers than the index can name.
    #[error("too many workers ({0}); at most 65535")]
    TooManyWorkers(usize),
}

/// Why no worker was picked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No worker serves this model.
    #[error("model {0:?} is not served here")]
    UnknownModel(String),
    /// Workers serve this model but none can take a request now.
    #[error("no healthy worker serves model {0:?}")]
    NoHealthyWorker(String),
}

/// The prompt of a request, as the client sent it.
#[derive(Clone, Copy, Debug)]
pub enum Prompt<'a> {
    /// `/v1/completions`: the prompt text.
    Text(&'a str),
    /// `/v1/chat/completions` (and translated Anthropic requests): the OpenAI `messages` array.
    Chat(&'a serde_json::Value),
}

/// One request to route.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// Requested (served) model name.
    pub model: &'a str,
    /// The prompt.
    pub prompt: Prompt<'a>,
    /// Fill [`Decision::explain`].
    pub debug: bool,
}

/// The router's choice for one request.
#[derive(Debug)]
pub struct Decision {
    /// Worker base URL.
    pub worker: String,
    /// Why this worker: `cache_hit`, `least_loaded`, `tie_spread`, `load_guard`, `degraded_*`, or the
    /// baseline mode's name.
    pub reason: &'static str,
    /// Per-candidate estimates, for the `x-kinference-decision` header (only when asked).
    pub explain: Option<String>,
    /// The gateway's own prompt token count, when it tokenized.
    pub prompt_tokens: Option<usize>,
    /// Ledger entry; see [`InFlight`].
    pub ticket: InFlight,
}

/// A worker as the router sees it, for `/readyz`, `/v1/models` and metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerView {
    /// Worker base URL.
    pub url: String,
    /// Served model name.
    pub model: String,
    /// Whether the router would send it requests now.
    pub healthy: bool,
    /// Requests this gateway has in flight there.
    pub in_flight: usize,
}

struct WorkerSlot {
    url: String,
    model: String,
    in_flight: AtomicUsize,
    /// Set by the gateway's health prober (and on refused connections); unhealthy workers are skipped.
    healthy: AtomicBool,
}

struct Shared {
    mode: RoutingMode,
    workers: Vec<WorkerSlot>,
}

/// Picks a worker for each request. Cheap to share: wrap it in an `Arc`.
pub struct Router {
    shared: Arc<Shared>,
}

impl fmt::Debug for Router {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Router")
            .field("mode", &self.shared.mode)
            .field("workers", &self.shared.workers.len())
            .finish()
    }
}

impl Router {
    /// Builds a router from the gateway configuration.
    pub fn new(config: RoutingConfig) -> Result<Self, BuildError> {
        if config.workers.len() > usize::from(u16::MAX) {
            return Err(BuildError::TooManyWorkers(config.workers.len()));
        }
        let mut workers: Vec<WorkerSlot> = Vec::with_capacity(config.workers.len());
        for w in config.workers {
            if workers.iter().any(|s| s.url == w.url) {
                return Err(BuildError::DuplicateWorker(w.url));
            }
            workers.push(WorkerSlot {
                url: w.url,
                model: w.model,
                in_flight: AtomicUsize::new(0),
                healthy: AtomicBool::new(true),
            });
        }
        Ok(Self { shared: Arc::new(Shared { mode: config.mode, workers }) })
    }

    /// Picks a worker for `req` and records it in the in-flight ledger.
    pub async fn pick(&self, req: RouteRequest<'_>) -> Result<Decision, RouteError> {
        let shared = &self.shared;
        let (idx, slot) = shared
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.model == req.model && w.healthy.load(Ordering::Relaxed))
            .min_by_key(|(_, w)| w.in_flight.load(Ordering::Relaxed))
            .ok_or_else(|| {
                if shared.workers.iter().any(|w| w.model == req.model) {
                    RouteError::NoHealthyWorker(req.model.to_string())
                } else {
                    RouteError::UnknownModel(req.model.to_string())
                }
            })?;
        slot.in_flight.fetch_add(1, Ordering::Relaxed);
        let explain = req.debug.then(|| {
            shared
                .workers
                .iter()
                .filter(|w| w.model == req.model)
                .map(|w| format!("{} in_flight={}", w.url, w.in_flight.load(Ordering::Relaxed)))
                .collect::<Vec<_>>()
                .join("; ")
        });
        Ok(Decision {
            worker: slot.url.clone(),
            reason: "least_loaded",
            explain,
            prompt_tokens: None,
            ticket: InFlight {
                shared: Arc::clone(shared),
                worker: idx,
                started: Instant::now(),
                first_token: None,
                done: false,
            },
        })
    }

    /// Every known worker.
    pub fn workers(&self) -> Vec<WorkerView> {
        self.shared
            .workers
            .iter()
            .map(|w| WorkerView {
                url: w.url.clone(),
                model: w.model.clone(),
                healthy: w.healthy.load(Ordering::Relaxed),
                in_flight: w.in_flight.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// Marks a worker healthy or not (gateway-http's health prober and refused connections call it).
    pub fn set_healthy(&self, worker: &str, healthy: bool) {
        if let Some(slot) = self.shared.workers.iter().find(|w| w.url == worker) {
            slot.healthy.store(healthy, Ordering::Relaxed);
        }
    }

    /// Registers the router's metrics (decisions by reason, index size, agent state).
    pub fn register_metrics(&self, _registry: &mut Registry) {}
}

/// A routed request's entry in the in-flight ledger.
///
/// Call [`InFlight::first_token`] when the first token arrives and [`InFlight::finish`] at the end.
/// Dropping it without `finish` counts as a failed request. Either way the worker's in-flight count is
/// released exactly once.
pub struct InFlight {
    shared: Arc<Shared>,
    worker: usize,
    started: Instant,
    first_token: Option<Instant>,
    done: bool,
}

impl fmt::Debug for InFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight")
            .field("worker", &self.shared.workers[self.worker].url)
            .field("started", &self.started)
            .field("first_token", &self.first_token)
            .finish()
    }
}

impl InFlight {
    /// The first token (or first response byte) arrived; feeds the worker's learned rates.
    pub fn first_token(&mut self) {
        if self.first_token.is_none() {
            self.first_token = Some(Instant::now());
        }
    }

    /// The request ended; `cached_tokens` is what the worker reported (`prompt_tokens_details`).
    pub fn finish(mut self, ok: bool, output_tokens: usize, cached_tokens: Option<usize>) {
        let _ = (ok, output_tokens, cached_tokens);
        self.release();
    }

    fn release(&mut self) {
        if !self.done {
            self.done = true;
            self.shared.workers[self.worker].in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests;
