//! Load figures of the pools' workers when no node agent reports them (local mode): the gateway
//! scrapes each pool endpoint's vLLM `/metrics` itself.
//!
//! Policies match on queue depth and KV-cache usage (`burst.when`, `match.poolState`); a gateway
//! without agents would otherwise never see a pool saturate. Figures from a live agent take precedence
//! (the router's [`crate::routing::pools::WorkerEstimate`]); these are the fallback. A figure older than
//! three scrape intervals is not used.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::RwLock;
use tokio::sync::watch;

use super::model::PolicySet;

#[cfg(test)]
mod tests;

/// One worker's scraped figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scraped {
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:kv_cache_usage_perc` (older vLLM: `vllm:gpu_cache_usage_perc`), 0..1.
    pub kv_usage: Option<f64>,
    /// When it was read.
    pub at: Instant,
}

/// Figures from one `/metrics` text: (waiting, running, KV-cache usage), through the one parser of
/// vLLM's `/metrics` ([`kinference_api::vllm::metrics`]: counts summed over engines, usage the largest,
/// non-finite values skipped). `None` without a waiting count: not a vLLM worker's text.
pub fn parse_metrics(text: &str) -> Option<(u32, u32, Option<f64>)> {
    let load = kinference_api::vllm::metrics::parse(text);
    let waiting = load.waiting?;
    Some((
        waiting.max(0.0) as u32,
        load.running.unwrap_or(0.0).max(0.0) as u32,
        load.kv_usage.map(|k| k.clamp(0.0, 1.0)),
    ))
}

/// The latest figures per worker URL, kept fresh by a background task.
#[derive(Debug, Clone)]
pub struct WorkerLoad {
    figures: Arc<RwLock<HashMap<String, Scraped>>>,
    max_age: Duration,
}

impl WorkerLoad {
    /// Starts scraping the endpoints of the pools of every set `sets` delivers, every `interval`.
    pub fn start(sets: watch::Receiver<Arc<PolicySet>>, interval: Duration) -> Self {
        let load = WorkerLoad {
            figures: Arc::new(RwLock::new(HashMap::new())),
            max_age: interval * 3,
        };
        let figures = Arc::clone(&load.figures);
        tokio::spawn(async move {
            let mut connector = HttpConnector::new();
            connector.set_connect_timeout(Some(Duration::from_secs(1)));
            let client: Client<HttpConnector, Empty<Bytes>> =
                Client::builder(TokioExecutor::new()).build(connector);
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if sets.has_changed().is_err() {
                    return; // the watcher is gone
                }
                let urls = endpoint_urls(&sets.borrow());
                let scrapes = urls.iter().map(|url| scrape(&client, url, interval));
                let results = futures::future::join_all(scrapes).await;
                let mut map = figures.write();
                map.retain(|url, _| urls.contains(url));
                for (url, result) in urls.iter().zip(results) {
                    match result {
                        Some(s) => {
                            map.insert(url.clone(), s);
                        }
                        None => {
                            map.remove(url);
                        }
                    }
                }
            }
        });
        load
    }

    /// Fresh figures of `worker`, if any.
    pub fn get(&self, worker: &str) -> Option<Scraped> {
        self.figures
            .read()
            .get(worker.trim_end_matches('/'))
            .copied()
            .filter(|s| s.at.elapsed() <= self.max_age)
    }
}

/// Every static endpoint of every pool, normalized (no trailing slash), deduplicated.
pub fn endpoint_urls(set: &PolicySet) -> Vec<String> {
    let mut urls: Vec<String> = set
        .pools
        .values()
        .flat_map(|p| p.spec.endpoints.iter())
        .map(|e| e.url.trim_end_matches('/').to_string())
        .collect();
    urls.sort();
    urls.dedup();
    urls
}

/// The largest `/metrics` page read from an endpoint (vLLM's is some 100 KB).
const MAX_METRICS_PAGE: usize = 16 << 20;

async fn scrape(
    client: &Client<HttpConnector, Empty<Bytes>>,
    url: &str,
    timeout: Duration,
) -> Option<Scraped> {
    let request = Request::builder()
        .method(Method::GET)
        .uri(format!("{url}/metrics"))
        .body(Empty::new())
        .ok()?;
    let read = async {
        let response = client.request(request).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        // A Remote pool's endpoint is a third party's: its page is read up to a bound.
        http_body_util::Limited::new(response.into_body(), MAX_METRICS_PAGE)
            .collect()
            .await
            .ok()
            .map(|b| b.to_bytes())
    };
    let body = tokio::time::timeout(timeout.max(Duration::from_millis(200)), read)
        .await
        .ok()??;
    let (waiting, running, kv_usage) = parse_metrics(&String::from_utf8_lossy(&body))?;
    Some(Scraped {
        waiting,
        running,
        kv_usage,
        at: Instant::now(),
    })
}
