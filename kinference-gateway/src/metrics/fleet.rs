//! What operators and autoscalers read about the workers behind the gateway, per served model and
//! `InferencePool` (label `pool`; empty for workers no pool lists, e.g. without policies), and which
//! routing signals each worker has.
//!
//! Refreshed from the router's state on every scrape of `/metrics` ([`Fleet::refresh`]), so the
//! figures are as fresh as the scrape and cost nothing between scrapes. Every gauge is per gateway
//! replica: with several replicas, queries add the replicas' `requests_in_flight` (each counts only
//! its own requests) and take the maximum of the others (every replica sees the same agents).
//!
//! Routing signals, per worker (`/healthz/workers`) and counted per model
//! (`kinference_gateway_routing_signal`):
//! - `kv_events`: the worker's block keys from a node agent's KV-event stream;
//! - `engine_metrics`: the engine's own queue and KV-cache usage (`vllm:num_requests_waiting`,
//!   `vllm:kv_cache_usage_perc`) scraped by the agent;
//! - `ebpf`: the kernel's view of the worker's connections (other gateways' requests included);
//! - `tokenizer`: the gateway's own tokenizer for the model, or the worker's `/tokenize`.
//!
//! A signal the router could have but has lost (an agent configured but its stream down or stale) is
//! `stale`, and a warning is logged once when a worker's signal degrades; one the deployment does not
//! provide (no agent at all, e.g. `--worker` mode) is `absent`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use kinference_api::metrics::Described;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::routing::pools::WorkerEstimate;
use crate::routing::tokenize::PromptTokens;
use crate::routing::{Prompt, RouteRequest, Router, WorkerView};

#[cfg(test)]
mod tests;

/// The routing signals, in the order they are listed.
pub const SIGNALS: [Signal; 4] = [
    Signal::KvEvents,
    Signal::EngineMetrics,
    Signal::Ebpf,
    Signal::Tokenizer,
];

/// One input of the router's estimate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Signal {
    /// Block keys from the node agent's KV events.
    KvEvents,
    /// The engine's queue and KV-cache usage, scraped by the node agent.
    EngineMetrics,
    /// The kernel's view of the worker's connections (the agent's eBPF programs).
    Ebpf,
    /// The prompt's tokens.
    Tokenizer,
}

impl Signal {
    /// The `signal` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Signal::KvEvents => "kv_events",
            Signal::EngineMetrics => "engine_metrics",
            Signal::Ebpf => "ebpf",
            Signal::Tokenizer => "tokenizer",
        }
    }
}

/// How the router has one signal for one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SignalState {
    /// Current figures.
    Live,
    /// A weaker substitute: the tokenizer is the worker's `/tokenize` (one round trip per request).
    Fallback,
    /// The signal should be there and is not (the agent's stream is down, or its figures are old).
    Stale,
    /// This deployment does not provide it (no node agent).
    Absent,
    /// The gateway cannot tell: the agent is live, but whether its eBPF programs see this worker is
    /// not in the router's per-worker view (`kinference_routing_kernel_view_missing` counts the
    /// estimates made without it).
    Unknown,
}

/// Every state, for the zero-valued series.
const STATES: [SignalState; 5] = [
    SignalState::Live,
    SignalState::Fallback,
    SignalState::Stale,
    SignalState::Absent,
    SignalState::Unknown,
];

impl SignalState {
    /// The `state` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            SignalState::Live => "live",
            SignalState::Fallback => "fallback",
            SignalState::Stale => "stale",
            SignalState::Absent => "absent",
            SignalState::Unknown => "unknown",
        }
    }

    /// Worse than `Live` in a way an operator should hear about.
    fn degraded(self) -> bool {
        matches!(self, SignalState::Stale)
    }
}

/// One worker's signals, in [`SIGNALS`] order.
pub type WorkerSignals = [SignalState; 4];

/// The signals of `worker`: `estimate` is the router's estimate there (`None` when it is not a
/// candidate, e.g. unhealthy), `agents` whether the router follows any node agent, `local_tokenizer`
/// whether the gateway tokenizes the worker's model itself.
pub fn worker_signals(
    worker: &WorkerView,
    estimate: Option<&WorkerEstimate>,
    agents: bool,
    local_tokenizer: bool,
) -> WorkerSignals {
    let from_agent = |live: bool| match (live, agents) {
        (true, _) => SignalState::Live,
        (false, true) => SignalState::Stale,
        (false, false) => SignalState::Absent,
    };
    let kv_events = from_agent(worker.agent_live);
    // The engine's figures reach the estimate only while fresh; an unhealthy worker has no estimate,
    // and then what its agent's stream says is the best there is.
    let engine = match estimate {
        Some(e) => from_agent(e.waiting.is_some() || e.kv_usage.is_some()),
        None => kv_events,
    };
    let ebpf = if worker.agent_live {
        SignalState::Unknown
    } else {
        kv_events
    };
    let tokenizer = if local_tokenizer {
        SignalState::Live
    } else {
        SignalState::Fallback
    };
    [kv_events, engine, ebpf, tokenizer]
}

/// One model's workers, summed up for the gauges.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolFigures {
    /// Workers the router would send requests to now.
    pub healthy: usize,
    /// The others.
    pub unhealthy: usize,
    /// Requests this gateway has in flight on the model's workers (waiting there or running).
    pub in_flight: usize,
    /// `vllm:num_requests_waiting` summed over the workers whose agent reports it.
    pub waiting: Option<u64>,
    /// Mean `vllm:kv_cache_usage_perc` (0..1) over the workers whose agent reports it.
    pub kv_usage: Option<f64>,
    /// Median estimated time to first token of an empty prompt over the healthy workers: the queue
    /// and fixed overhead a new request meets, before its own prefill.
    pub ttft_s: Option<f64>,
}

/// Sums up one model's `workers` with the router's `estimates` for an empty prompt there.
pub fn pool_figures(workers: &[&WorkerView], estimates: &[WorkerEstimate]) -> PoolFigures {
    let waiting: Vec<u64> = estimates
        .iter()
        .filter_map(|e| e.waiting.map(u64::from))
        .collect();
    let usage: Vec<f64> = estimates
        .iter()
        .filter_map(|e| e.kv_usage.map(f64::from))
        .filter(|u| u.is_finite())
        .collect();
    let mut ttft: Vec<f64> = estimates
        .iter()
        .filter_map(|e| e.ttft_s)
        .filter(|t| t.is_finite())
        .collect();
    ttft.sort_by(f64::total_cmp);
    let healthy = workers.iter().filter(|w| w.healthy).count();
    PoolFigures {
        healthy,
        unhealthy: workers.len() - healthy,
        in_flight: workers.iter().map(|w| w.in_flight).sum(),
        waiting: (!waiting.is_empty()).then(|| waiting.iter().sum()),
        kv_usage: (!usage.is_empty()).then(|| usage.iter().sum::<f64>() / usage.len() as f64),
        ttft_s: median(&ttft),
    }
}

/// The median of sorted `values` (the mean of the middle two for an even count).
fn median(sorted: &[f64]) -> Option<f64> {
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// What the router says about one worker, for `/healthz/workers`.
#[derive(Clone, Debug)]
pub struct WorkerReport {
    /// The router's view.
    pub view: WorkerView,
    /// Its routing signals.
    pub signals: WorkerSignals,
}

impl WorkerReport {
    /// `{"kv_events": "live", ...}`.
    pub fn signals_json(&self) -> serde_json::Value {
        SIGNALS
            .iter()
            .zip(self.signals)
            .map(|(signal, state)| (signal.as_str().to_string(), state.as_str().into()))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
}

/// One `InferencePool` as the pool gauges see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolMembers {
    /// The pool's name (the `pool` label).
    pub name: String,
    /// The served names of its models.
    pub models: Vec<String>,
    /// Its worker URLs; `None`: every worker serving its models.
    pub workers: Option<Vec<String>>,
}

/// One series of the pool gauges: a served model's workers in one `InferencePool`, or (pool empty)
/// those of its workers no pool lists.
#[derive(Clone, Debug)]
pub struct PoolSeries {
    /// Served model name.
    pub model: String,
    /// `InferencePool` name; empty for workers outside every pool (and without policies).
    pub pool: String,
    /// The figures over those workers.
    pub figures: PoolFigures,
}

/// The router's state now: every worker with its signals, every pool's figures.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Every worker, in the router's order.
    pub workers: Vec<WorkerReport>,
    /// Per served model and pool.
    pub pools: Vec<PoolSeries>,
}

/// Reads the router's state through its public views: the worker list and, per model, the estimate
/// of an empty prompt (which records nothing and tokenizes nothing), summed up per pool of
/// `pools`. The series stay bounded by the configuration: one per (model, pool) a pool names, and
/// one per model for its workers outside every pool.
pub async fn snapshot(router: &Router, pools: &[PoolMembers]) -> Snapshot {
    let views = router.workers();
    let agents = !router.agent_urls().is_empty();
    let mut models: Vec<&str> = views.iter().map(|w| w.model.as_str()).collect();
    models.sort_unstable();
    models.dedup();
    let mut estimates: HashMap<String, WorkerEstimate> = HashMap::new();
    let mut series = Vec::new();
    let mut local_tokenizer = HashMap::new();
    for &model in &models {
        let empty = PromptTokens::default();
        empty.set(model, Some(Arc::from([])));
        let request = RouteRequest {
            model,
            prompt: Prompt::Text(""),
            debug: false,
            tokens: Some(&empty),
            salt: None,
            session: None,
            answers: Default::default(),
        };
        // No healthy worker: no estimates; the worker list still says why.
        let model_estimates = router
            .estimate_workers(request, None)
            .await
            .unwrap_or_default();
        let workers: Vec<&WorkerView> = views.iter().filter(|w| w.model == model).collect();
        series.extend(pool_series(model, &workers, &model_estimates, pools));
        estimates.extend(model_estimates.into_iter().map(|e| (e.worker.clone(), e)));
        local_tokenizer.insert(model, router.tokenizer(model).is_some());
    }
    let workers = views
        .iter()
        .map(|view| WorkerReport {
            view: view.clone(),
            signals: worker_signals(
                view,
                estimates.get(&view.url),
                agents,
                local_tokenizer.get(view.model.as_str()) == Some(&true),
            ),
        })
        .collect();
    Snapshot {
        workers,
        pools: series,
    }
}

/// The series of `model`'s `workers`: one per pool serving it, over the pool's workers, and one
/// (pool empty) over the workers no such pool lists, when there are any or no pool serves it.
fn pool_series(
    model: &str,
    workers: &[&WorkerView],
    estimates: &[WorkerEstimate],
    pools: &[PoolMembers],
) -> Vec<PoolSeries> {
    let figures = |keep: &dyn Fn(&str) -> bool| {
        let members: Vec<&WorkerView> = workers.iter().copied().filter(|w| keep(&w.url)).collect();
        let estimates: Vec<WorkerEstimate> = estimates
            .iter()
            .filter(|e| keep(&e.worker))
            .cloned()
            .collect();
        pool_figures(&members, &estimates)
    };
    let mut series = Vec::new();
    let serving: Vec<&PoolMembers> = pools
        .iter()
        .filter(|p| p.models.iter().any(|m| m == model))
        .collect();
    for pool in &serving {
        let member = |url: &str| {
            pool.workers
                .as_ref()
                .is_none_or(|w| w.iter().any(|m| m == url))
        };
        series.push(PoolSeries {
            model: model.to_string(),
            pool: pool.name.clone(),
            figures: figures(&member),
        });
    }
    let pooled = |url: &str| {
        serving.iter().any(|p| {
            p.workers
                .as_ref()
                .is_none_or(|w| w.iter().any(|m| m == url))
        })
    };
    if serving.is_empty() || workers.iter().any(|w| !pooled(&w.url)) {
        series.push(PoolSeries {
            model: model.to_string(),
            pool: String::new(),
            figures: figures(&|url| !pooled(url)),
        });
    }
    series
}

/// `{model, pool}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    model: String,
    pool: String,
}

/// `{model, pool, state}` of the worker count.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerStateLabels {
    model: String,
    pool: String,
    /// `healthy` or `unhealthy`.
    state: &'static str,
}

/// `{model, signal, state}` of the routing signals.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SignalLabels {
    model: String,
    signal: &'static str,
    state: &'static str,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// The fleet gauges (`kinference_gateway_pool_*`, `kinference_gateway_routing_signal`).
#[derive(Clone, Debug, Default)]
pub struct Fleet {
    workers: Family<WorkerStateLabels, Gauge>,
    in_flight: Family<PoolLabels, Gauge>,
    waiting: Family<PoolLabels, Gauge>,
    kv_usage: Family<PoolLabels, FloatGauge>,
    ttft: Family<PoolLabels, FloatGauge>,
    signals: Family<SignalLabels, Gauge>,
    /// Each worker's signals at the last refresh, to log a signal once when it degrades.
    last: Arc<parking_lot::Mutex<HashMap<String, WorkerSignals>>>,
    /// Serialises refreshes (two scrapes at once would interleave clears and sets).
    refreshing: Arc<tokio::sync::Mutex<()>>,
    /// Held while the gauges are cleared and set, and while the registry is encoded
    /// ([`Fleet::settled`]): a scrape never sees a half-set fleet.
    setting: Arc<parking_lot::Mutex<()>>,
}

impl Fleet {
    /// Registers the gauges under `kinference_gateway_`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("kinference_gateway");
        r.register(
            "pool_workers",
            "Workers per served model and pool, healthy (routable) or not",
            Described(self.workers.clone()),
        );
        r.register(
            "pool_requests_in_flight",
            "Requests this gateway replica has on the pool's workers of the model, waiting there or running (sum over replicas: the queue depth)",
            Described(self.in_flight.clone()),
        );
        r.register(
            "pool_requests_waiting",
            "vllm:num_requests_waiting summed over the pool's workers of the model whose node agent reports it (the same on every replica)",
            Described(self.waiting.clone()),
        );
        r.register(
            "pool_kv_cache_usage_ratio",
            "Mean KV-cache usage (0..1) of the pool's workers of the model whose node agent reports it",
            Described(self.kv_usage.clone()),
        );
        r.register(
            "pool_estimated_ttft_seconds",
            "Median over the pool's healthy workers of the model of the router's estimated time to first token for an empty prompt (queue and overhead)",
            Described(self.ttft.clone()),
        );
        r.register(
            "routing_signal",
            "Workers per model by routing signal (kv_events, engine_metrics, ebpf, tokenizer) and its state (live, fallback, stale, absent, unknown)",
            Described(self.signals.clone()),
        );
    }

    /// Waits until no refresh is setting the gauges and keeps it so while the guard lives (held
    /// while `/metrics` is encoded).
    pub fn settled(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.setting.lock()
    }

    /// Brings the gauges up to date with the router's state; returns the snapshot it read.
    pub async fn refresh(&self, router: &Router, pools: &[PoolMembers]) -> Snapshot {
        let _one_at_a_time = self.refreshing.lock().await;
        let snapshot = snapshot(router, pools).await;
        self.set(&snapshot);
        snapshot
    }

    /// Sets every gauge from `snapshot`; series of models no longer served, and figures no longer
    /// known, disappear instead of keeping their last value.
    fn set(&self, snapshot: &Snapshot) {
        let _settled = self.setting.lock();
        self.workers.clear();
        self.in_flight.clear();
        self.waiting.clear();
        self.kv_usage.clear();
        self.ttft.clear();
        self.signals.clear();
        for series in &snapshot.pools {
            let pool = &series.figures;
            let label = PoolLabels {
                model: series.model.clone(),
                pool: series.pool.clone(),
            };
            for (state, n) in [("healthy", pool.healthy), ("unhealthy", pool.unhealthy)] {
                self.workers
                    .get_or_create(&WorkerStateLabels {
                        model: series.model.clone(),
                        pool: series.pool.clone(),
                        state,
                    })
                    .set(n as i64);
            }
            self.in_flight
                .get_or_create(&label)
                .set(pool.in_flight as i64);
            if let Some(waiting) = pool.waiting {
                self.waiting
                    .get_or_create(&label)
                    .set(i64::try_from(waiting).unwrap_or(i64::MAX));
            }
            if let Some(usage) = pool.kv_usage {
                self.kv_usage.get_or_create(&label).set(usage);
            }
            if let Some(ttft) = pool.ttft_s {
                self.ttft.get_or_create(&label).set(ttft);
            }
        }
        let mut models: Vec<&str> = snapshot.pools.iter().map(|p| p.model.as_str()).collect();
        models.dedup();
        for model in models {
            for (i, signal) in SIGNALS.iter().enumerate() {
                for state in STATES {
                    let n = snapshot
                        .workers
                        .iter()
                        .filter(|w| w.view.model == model && w.signals[i] == state)
                        .count();
                    self.signals
                        .get_or_create(&SignalLabels {
                            model: model.to_string(),
                            signal: signal.as_str(),
                            state: state.as_str(),
                        })
                        .set(n as i64);
                }
            }
        }
        self.log_degraded(snapshot);
    }

    /// Warns once for each worker signal that was not degraded at the last refresh and is now (one
    /// degraded from the first refresh, e.g. an agent that never connected, is in the start-up log).
    fn log_degraded(&self, snapshot: &Snapshot) {
        let mut last = self.last.lock();
        for w in &snapshot.workers {
            let before = last.get(&w.view.url);
            for (i, signal) in SIGNALS.iter().enumerate() {
                let state = w.signals[i];
                if state.degraded() && before.is_some_and(|b| !b[i].degraded()) {
                    tracing::warn!(worker = %w.view.url, model = %w.view.model,
                        signal = signal.as_str(), state = state.as_str(),
                        "routing signal lost: estimating without it");
                }
            }
        }
        *last = snapshot
            .workers
            .iter()
            .map(|w| (w.view.url.clone(), w.signals))
            .collect();
    }
}
