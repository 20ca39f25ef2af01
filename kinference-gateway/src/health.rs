//! Worker health: a background prober of each worker's `/health`.
//!
//! The router skips unhealthy workers. Besides the prober, the pipeline marks a worker unhealthy at
//! once when it refuses a connection; the next successful probe brings it back.

use std::sync::Arc;

use crate::gateway::Gateway;

/// Probes every worker every `health_interval`, forever. Call [`probe_all`] once before serving so
/// that `/readyz` and routing reflect reality from the first request on.
pub async fn run_prober(gw: Arc<Gateway>) {
    let period = gw.settings.health_interval();
    let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        probe_all(&gw).await;
    }
}

/// Probes every worker once, concurrently (bounded by the probe timeout).
pub async fn probe_all(gw: &Gateway) {
    let workers = gw.router.workers();
    let probes = workers.iter().map(|w| probe_one(gw, &w.url, w.healthy));
    futures::future::join_all(probes).await;
}

async fn probe_one(gw: &Gateway, worker: &str, was_healthy: bool) {
    let result = gw
        .upstream
        .probe(worker, "/health", gw.settings.health_timeout())
        .await;
    let healthy = matches!(result, Ok(status) if status.is_success());
    if healthy != was_healthy {
        match &result {
            Ok(status) if healthy => tracing::info!(%worker, %status, "worker healthy"),
            Ok(status) => tracing::warn!(%worker, %status, "worker unhealthy"),
            Err(error) => tracing::warn!(%worker, %error, "worker unhealthy"),
        }
    }
    gw.set_health(worker, healthy);
}
