//! Scrapes each local worker's vLLM `/metrics` for its load and block size (parsed by
//! [`kinference_api::vllm::metrics`]). A failed scrape marks the figures stale (`metrics_ok = false`), logs
//! and counts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio_util::sync::CancellationToken;

use crate::metrics::{self, AgentMetrics};
use crate::registry::{Registry, WorkerSlot};
#[cfg(doc)]
use crate::worker_state::WorkerState;

pub use kinference_api::vllm::metrics::{VllmLoad, parse};

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("bad metrics url: {0}")]
    Url(#[from] http::uri::InvalidUri),
    #[error("request failed: {0}")]
    Request(#[from] hyper_util::client::legacy::Error),
    #[error("status {0}")]
    Status(http::StatusCode),
    #[error("reading body: {0}")]
    Body(String),
    #[error("timed out")]
    Timeout,
}

/// An HTTP client for scrapes (plain HTTP: workers are scraped over the node's loopback or pod network).
pub type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// A client suited to scraping: one connection per scrape, closed after it. A kept-alive scrape
/// connection would look like one more request in flight on the worker's port to the kernel-level view
/// (eBPF ends a response only at the next request, at close, or after an idle gap longer than the scrape
/// interval), biasing every worker's `kernel_in_flight` by one.
pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http()
}

/// Fetches and parses one worker's metrics.
pub async fn scrape_once(
    client: &HttpClient,
    base_url: &str,
    timeout: Duration,
) -> Result<VllmLoad, ScrapeError> {
    let uri: http::Uri = format!("{}/metrics", base_url.trim_end_matches('/')).parse()?;
    let fetch = async {
        let resp = client.get(uri).await?;
        if !resp.status().is_success() {
            return Err(ScrapeError::Status(resp.status()));
        }
        let body = Limited::new(resp.into_body(), 16 << 20)
            .collect()
            .await
            .map_err(|e| ScrapeError::Body(e.to_string()))?
            .to_bytes();
        Ok(parse(&String::from_utf8_lossy(&body)))
    };
    tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| ScrapeError::Timeout)?
}

/// A process start time that moves by less than this is the same process: the Python client derives it
/// from the kernel's boot time, which can read a second apart from one scrape to the next. A vLLM
/// restart takes far longer (the model loads again).
const RESTART_MIN_S: f64 = 1.5;

/// The longest a failing worker waits between scrapes ([`failing_gap`]).
pub const FAILING_MAX_GAP: Duration = Duration::from_secs(2);

/// Time between scrapes after `failures` failed ones in a row: `interval` while the worker answers,
/// then doubling up to [`FAILING_MAX_GAP`] (never below `interval`). A worker that is not up yet
/// (a fleet starting) or gone gains nothing from 4 connection attempts a second: at 1,000 simulated
/// workers behind 125 agents on one core those attempts competed with the workers' own start.
pub fn failing_gap(interval: Duration, failures: u32) -> Duration {
    let doubled = interval.saturating_mul(1u32 << failures.min(16));
    doubled.min(FAILING_MAX_GAP).max(interval)
}

/// Scrapes one worker every `interval` until cancelled, updating its slot; backs off while its
/// scrapes fail ([`failing_gap`]). A new process start time
/// means the worker restarted: its block state is cleared at once ([`WorkerState::restarted`]), not at
/// its first KV event, which comes only once it serves a request.
pub async fn run(
    slot: Arc<WorkerSlot>,
    registry: Arc<Registry>,
    metrics: AgentMetrics,
    client: HttpClient,
    interval: Duration,
    cancel: CancellationToken,
) {
    let label = metrics::worker(&slot.spec.url);
    let timeout = interval.max(Duration::from_millis(200)) * 4;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut was_ok = true;
    let mut failures = 0u32;
    let mut restart_warned = None;
    loop {
        let extra = failing_gap(interval, failures).saturating_sub(interval);
        if !extra.is_zero() {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(extra) => {}
            }
            ticker.reset();
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let result = tokio::select! {
            _ = cancel.cancelled() => return,
            r = scrape_once(&client, &slot.spec.url, timeout) => r,
        };
        let mut restarted = None;
        let mut changed = {
            let mut load = slot.load.lock();
            let before = (
                load.running,
                load.waiting,
                load.kv_usage,
                load.metrics_ok,
                load.block_size,
                load.num_gpu_blocks,
                load.engines.clone(),
            );
            match &result {
                Ok(v) => {
                    restarted = match (load.process_start_s, v.process_start_s) {
                        (Some(before), Some(now)) if (now - before).abs() >= RESTART_MIN_S => {
                            Some(now)
                        }
                        _ => None,
                    };
                    load.process_start_s = v.process_start_s.or(load.process_start_s);
                    load.running = v.running.map_or(0, |x| x.max(0.0) as u32);
                    load.waiting = v.waiting.map_or(0, |x| x.max(0.0) as u32);
                    load.kv_usage = v.kv_usage.unwrap_or(0.0) as f32;
                    load.block_size = v.block_size.or(load.block_size);
                    load.num_gpu_blocks = v.num_gpu_blocks.or(load.num_gpu_blocks);
                    load.engines.clone_from(&v.engines);
                    load.scraped_at = Some(Instant::now());
                    load.metrics_ok = true;
                }
                Err(_) => load.metrics_ok = false,
            }
            before
                != (
                    load.running,
                    load.waiting,
                    load.kv_usage,
                    load.metrics_ok,
                    load.block_size,
                    load.num_gpu_blocks,
                    load.engines.clone(),
                )
        };
        // Every rank's engine restarts with the worker's process.
        if let Some(started) = restarted
            && slot
                .ranks()
                .iter()
                .fold(false, |any, kv| kv.lock().restarted(started) | any)
        {
            metrics.kv_engine_restarts.get_or_create(&label).inc();
            metrics.kv_blocks.get_or_create(&label).set(0);
            // At most one warning a minute: a worker whose start time keeps moving is counted, not
            // allowed to flood the log.
            if restart_warned.is_none_or(|t: Instant| t.elapsed() >= Duration::from_secs(60)) {
                restart_warned = Some(Instant::now());
                tracing::warn!(worker = %slot.spec.url, started, "worker process restarted (its start time changed): its cache is empty, state cleared");
            } else {
                tracing::debug!(worker = %slot.spec.url, started, "worker process restarted again");
            }
            changed = true;
        }
        match result {
            Ok(_) => {
                metrics.scrape_ok.get_or_create(&label).set(1);
                if !was_ok {
                    tracing::info!(worker = %slot.spec.url, "worker metrics scrape recovered");
                }
                was_ok = true;
                failures = 0;
            }
            Err(error) => {
                failures = failures.saturating_add(1);
                metrics.scrape_failures.get_or_create(&label).inc();
                metrics.scrape_ok.get_or_create(&label).set(0);
                if was_ok {
                    tracing::warn!(worker = %slot.spec.url, %error, "worker metrics scrape failed; load marked stale");
                } else {
                    tracing::debug!(worker = %slot.spec.url, %error, "worker metrics scrape still failing");
                }
                was_ok = false;
            }
        }
        if changed {
            registry.notify();
        }
    }
}

#[cfg(test)]
mod tests;
