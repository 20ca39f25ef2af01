//! Worker health: a background prober of each worker's `/health`, beside the worker client it uses.
//!
//! The router skips unhealthy workers. Besides the prober, the pipeline marks a worker unhealthy at
//! once when it refuses a connection; the next successful probe brings it back.

use std::sync::Arc;
use std::time::Duration;

use super::worker::Upstream;
use crate::metrics::Metrics;
use crate::routing::Router;

/// Records a worker's health with the router (which then skips it or not) and in the metrics.
pub fn set_health(router: &Router, metrics: &Metrics, worker: &str, healthy: bool) {
    router.set_healthy(worker, healthy);
    metrics.worker_health(worker, healthy);
}

/// What probing needs: the router's workers, the worker client, the metrics, the probe timings.
#[derive(Debug, Clone)]
pub struct Prober {
    /// Whose workers are probed, and told the outcome.
    pub router: Arc<Router>,
    /// The worker client.
    pub upstream: Upstream,
    /// `kinference_gateway_worker_healthy`.
    pub metrics: Metrics,
    /// Time between two rounds.
    pub interval: Duration,
    /// Timeout of one probe.
    pub timeout: Duration,
}

impl Prober {
    /// Probes every worker every `interval`, forever. Call [`Prober::probe_all`] once before
    /// serving so that `/readyz` and routing reflect reality from the first request on.
    pub async fn run(self) {
        let period = self.interval;
        let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            self.probe_all().await;
        }
    }

    /// Probes every worker once, concurrently (bounded by the probe timeout).
    pub async fn probe_all(&self) {
        let workers = self.router.workers();
        let probes = workers.iter().map(|w| self.probe_one(&w.url, w.healthy));
        futures::future::join_all(probes).await;
    }

    async fn probe_one(&self, worker: &str, was_healthy: bool) {
        let result = self.upstream.probe(worker, "/health", self.timeout).await;
        let healthy = matches!(result, Ok(status) if status.is_success());
        if healthy != was_healthy {
            match &result {
                Ok(status) if healthy => tracing::info!(%worker, %status, "worker healthy"),
                Ok(status) => tracing::warn!(%worker, %status, "worker unhealthy"),
                Err(error) => tracing::warn!(%worker, %error, "worker unhealthy"),
            }
        }
        set_health(&self.router, &self.metrics, worker, healthy);
    }
}
