//! The gateway's Prometheus metrics (served on the admin port's `/metrics`).
//!
//! Names start with `kinference_gateway_`. Requests are labelled by model, worker, status and protocol;
//! latency histograms and token counters by model and worker. A request that fails before a worker
//! was chosen has `worker=""`. A stream that breaks after its 200 headers is counted with the status of
//! the error that ended it; one the client abandoned with 499.
//!
//! Clients choose the `model` they ask for, so that label is bounded: a name the gateway serves (its
//! configured models, plus names a backend really took, up to [`MAX_MODEL_LABELS`]) is kept, anything
//! else folds into `other`. Random model names from an open port cannot grow `/metrics` or memory.
//!
//! [`fleet`]: the gauges per served model for autoscalers (queue depth, KV-cache usage, estimated
//! TTFT) and the routing signals each worker has, read from the router on every scrape.

pub mod fleet;

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Arc;

use kinference_api::metrics::Described;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of the request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Requested model.
    pub model: String,
    /// Worker base URL ("" when none was chosen).
    pub worker: String,
    /// HTTP status (or the status of the error that ended a stream; 499: client went away).
    pub status: u16,
    /// `openai` or `anthropic`.
    pub protocol: &'static str,
}

/// Labels of per-worker series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelWorkerLabels {
    /// Model.
    pub model: String,
    /// Worker base URL.
    pub worker: String,
}

/// Labels of the health gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HealthLabels {
    /// Worker base URL.
    pub worker: String,
}

/// Most distinct `model` label values; past it, new names fold into [`OTHER_MODEL`].
pub const MAX_MODEL_LABELS: usize = 256;

/// The `model` label of a name the gateway does not serve.
pub const OTHER_MODEL: &str = "other";

/// The model names that may appear as a label value.
#[derive(Debug, Default)]
struct ModelLabels {
    known: parking_lot::RwLock<HashSet<String>>,
}

impl ModelLabels {
    /// `model` itself when it is a label value already, or may become one because a backend took the
    /// request (`routed`) and the set has room; [`OTHER_MODEL`] otherwise.
    fn label<'a>(&self, model: &'a str, routed: bool) -> &'a str {
        if model.is_empty() || self.known.read().contains(model) {
            return model;
        }
        if routed {
            let mut known = self.known.write();
            if known.len() < MAX_MODEL_LABELS {
                known.insert(model.to_string());
                return model;
            }
        }
        OTHER_MODEL
    }

    fn add(&self, names: impl IntoIterator<Item = String>) {
        let mut known = self.known.write();
        for name in names {
            if known.len() >= MAX_MODEL_LABELS {
                break;
            }
            known.insert(name);
        }
    }
}

fn latency_histogram() -> Histogram {
    // 0.5 ms .. ~65 s
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

fn itl_histogram() -> Histogram {
    // 0.1 ms .. ~3.3 s
    Histogram::new(exponential_buckets(0.0001, 2.0, 16))
}

/// All gateway metrics; cheap to clone (every family is reference-counted inside).
#[derive(Clone, Debug)]
pub struct Metrics {
    requests: Family<RequestLabels, Counter>,
    ttft: Family<ModelWorkerLabels, Histogram, fn() -> Histogram>,
    itl: Family<ModelWorkerLabels, Histogram, fn() -> Histogram>,
    e2e: Family<ModelWorkerLabels, Histogram, fn() -> Histogram>,
    input_tokens: Family<ModelWorkerLabels, Counter>,
    output_tokens: Family<ModelWorkerLabels, Counter>,
    cached_input_tokens: Family<ModelWorkerLabels, Counter>,
    in_flight: Gauge<i64, std::sync::atomic::AtomicI64>,
    retries: Counter,
    worker_healthy: Family<HealthLabels, Gauge>,
    fleet: fleet::Fleet,
    models: Arc<ModelLabels>,
    registry: Arc<parking_lot::Mutex<Registry>>,
}

impl Metrics {
    /// Creates the metrics and registers them in a fresh registry.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let metrics = Metrics {
            requests: Family::default(),
            ttft: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            itl: Family::new_with_constructor(itl_histogram as fn() -> Histogram),
            e2e: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            input_tokens: Family::default(),
            output_tokens: Family::default(),
            cached_input_tokens: Family::default(),
            in_flight: Gauge::default(),
            retries: Counter::default(),
            worker_healthy: Family::default(),
            fleet: fleet::Fleet::default(),
            models: Arc::default(),
            registry: Arc::new(parking_lot::Mutex::new(Registry::default())),
        };
        let sub = registry.sub_registry_with_prefix("kinference_gateway");
        sub.register(
            "requests",
            "Requests by model, worker, status and protocol",
            Described(metrics.requests.clone()),
        );
        sub.register(
            "time_to_first_token_seconds",
            "Time from request arrival to the first generated token (streams)",
            Described(metrics.ttft.clone()),
        );
        sub.register(
            "inter_token_latency_seconds",
            "Time between two streamed chunks carrying text",
            Described(metrics.itl.clone()),
        );
        sub.register(
            "e2e_request_latency_seconds",
            "Time from request arrival to the end of the response",
            Described(metrics.e2e.clone()),
        );
        sub.register(
            "input_tokens",
            "Prompt tokens reported by workers",
            Described(metrics.input_tokens.clone()),
        );
        sub.register(
            "output_tokens",
            "Generated tokens reported by workers",
            Described(metrics.output_tokens.clone()),
        );
        sub.register(
            "cached_input_tokens",
            "Prompt tokens served from the worker's prefix cache",
            Described(metrics.cached_input_tokens.clone()),
        );
        sub.register(
            "requests_in_flight",
            "Requests being served (until the last byte of the response)",
            Described(metrics.in_flight.clone()),
        );
        sub.register(
            "upstream_retries",
            "Requests retried on another worker after the first failed before answering (refused or broken connection, 503)",
            Described(metrics.retries.clone()),
        );
        sub.register(
            "worker_healthy",
            "1 when the worker's last health probe or request succeeded",
            Described(metrics.worker_healthy.clone()),
        );
        metrics.fleet.register(&mut registry);
        *metrics.registry.lock() = registry;
        metrics
    }

    /// Runs `f` on the registry, e.g. for the router to register its own metrics.
    pub fn with_registry<R>(&self, f: impl FnOnce(&mut Registry) -> R) -> R {
        f(&mut self.registry.lock())
    }

    /// The text exposition (OpenMetrics).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _fleet = self.fleet.settled();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry.lock());
        out
    }

    /// Brings the fleet gauges up to date with `router` and the `pools` (before each scrape) and
    /// returns what they were set from (for `/healthz/workers`).
    pub async fn refresh_fleet(
        &self,
        router: &crate::routing::Router,
        pools: &[fleet::PoolMembers],
    ) -> fleet::Snapshot {
        self.fleet.refresh(router, pools).await
    }

    /// Names the gateway serves (configured models, aliases, classes): kept as `model` label values
    /// even for requests that fail before a backend takes them.
    pub fn serve_models(&self, names: impl IntoIterator<Item = String>) {
        self.models.add(names);
    }

    /// `labels` with its model bounded (see the module doc).
    fn bounded<'a>(&self, labels: &'a ModelWorkerLabels) -> Cow<'a, ModelWorkerLabels> {
        let model = self.models.label(&labels.model, !labels.worker.is_empty());
        if model == labels.model {
            Cow::Borrowed(labels)
        } else {
            Cow::Owned(ModelWorkerLabels {
                model: model.to_string(),
                worker: labels.worker.clone(),
            })
        }
    }

    /// Counts a finished request.
    pub fn request(&self, mut labels: RequestLabels) {
        let model = self.models.label(&labels.model, !labels.worker.is_empty());
        if model != labels.model {
            labels.model = model.to_string();
        }
        self.requests.get_or_create(&labels).inc();
    }

    /// Records time to first token.
    pub fn ttft(&self, labels: &ModelWorkerLabels, seconds: f64) {
        self.ttft
            .get_or_create(&self.bounded(labels))
            .observe(seconds);
    }

    /// Records one inter-token gap.
    pub fn itl(&self, labels: &ModelWorkerLabels, seconds: f64) {
        self.itl
            .get_or_create(&self.bounded(labels))
            .observe(seconds);
    }

    /// Records end-to-end latency.
    pub fn e2e(&self, labels: &ModelWorkerLabels, seconds: f64) {
        self.e2e
            .get_or_create(&self.bounded(labels))
            .observe(seconds);
    }

    /// Adds token counts reported by the worker.
    pub fn tokens(&self, labels: &ModelWorkerLabels, input: u64, output: u64, cached: u64) {
        let labels = &*self.bounded(labels);
        self.input_tokens.get_or_create(labels).inc_by(input);
        self.output_tokens.get_or_create(labels).inc_by(output);
        if cached > 0 {
            self.cached_input_tokens
                .get_or_create(labels)
                .inc_by(cached);
        }
    }

    /// Counts a retry on another worker.
    pub fn retry(&self) {
        self.retries.inc();
    }

    /// Sets a worker's health gauge.
    pub fn worker_health(&self, worker: &str, healthy: bool) {
        self.worker_healthy
            .get_or_create(&HealthLabels {
                worker: worker.to_string(),
            })
            .set(i64::from(healthy));
    }

    /// Drops a worker's health gauge (discovery removed it: no series of a worker long gone).
    pub fn forget_worker(&self, worker: &str) {
        self.worker_healthy.remove(&HealthLabels {
            worker: worker.to_string(),
        });
    }

    /// Marks a request in flight until the returned guard is dropped (also on errors and aborted
    /// streams, so the gauge cannot leak).
    pub fn in_flight(&self) -> InFlightGuard {
        self.in_flight.inc();
        InFlightGuard {
            gauge: self.in_flight.clone(),
        }
    }

    /// Current value of the in-flight gauge.
    pub fn in_flight_now(&self) -> i64 {
        self.in_flight.get()
    }
}

#[cfg(test)]
mod tests;

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Decrements the in-flight gauge when dropped.
#[derive(Debug)]
pub struct InFlightGuard {
    gauge: Gauge<i64, std::sync::atomic::AtomicI64>,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}
