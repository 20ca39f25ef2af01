//! The gateway's Prometheus metrics (served on the admin port's `/metrics`).
//!
//! Names start with `kinference_gateway_`. Requests are labelled by model, worker, status and protocol;
//! latency histograms and token counters by model and worker. A request that fails before a worker
//! was chosen has `worker=""`. A stream that breaks after its 200 headers is counted with the status of
//! the error that ended it; one the client abandoned with 499.

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
pub struct WorkerLabels {
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
    ttft: Family<WorkerLabels, Histogram, fn() -> Histogram>,
    itl: Family<WorkerLabels, Histogram, fn() -> Histogram>,
    e2e: Family<WorkerLabels, Histogram, fn() -> Histogram>,
    input_tokens: Family<WorkerLabels, Counter>,
    output_tokens: Family<WorkerLabels, Counter>,
    cached_input_tokens: Family<WorkerLabels, Counter>,
    in_flight: Gauge<i64, std::sync::atomic::AtomicI64>,
    retries: Counter,
    worker_healthy: Family<HealthLabels, Gauge>,
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
            "Requests retried on another worker after a refused connection",
            Described(metrics.retries.clone()),
        );
        sub.register(
            "worker_healthy",
            "1 when the worker's last health probe or request succeeded",
            Described(metrics.worker_healthy.clone()),
        );
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
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry.lock());
        out
    }

    /// Counts a finished request.
    pub fn request(&self, labels: RequestLabels) {
        self.requests.get_or_create(&labels).inc();
    }

    /// Records time to first token.
    pub fn ttft(&self, labels: &WorkerLabels, seconds: f64) {
        self.ttft.get_or_create(labels).observe(seconds);
    }

    /// Records one inter-token gap.
    pub fn itl(&self, labels: &WorkerLabels, seconds: f64) {
        self.itl.get_or_create(labels).observe(seconds);
    }

    /// Records end-to-end latency.
    pub fn e2e(&self, labels: &WorkerLabels, seconds: f64) {
        self.e2e.get_or_create(labels).observe(seconds);
    }

    /// Adds token counts reported by the worker.
    pub fn tokens(&self, labels: &WorkerLabels, input: u64, output: u64, cached: u64) {
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
