//! The LoRA adapters each worker has loaded, learned from its `GET /v1/models`, which lists every
//! adapter after the base model with the base model as `parent` (vLLM's `ModelCard`). The router sends
//! a request naming an adapter only to workers that list it ([`Router::set_adapters`]).
//!
//! vLLM loads and unloads adapters at run time (`/v1/load_lora_adapter`), so the list is read again
//! every health interval. A worker that does not answer keeps the adapters it listed last: one missed
//! read says nothing about what it has loaded, and its health probes decide whether it is picked.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::worker::Upstream;
use crate::routing::Router;

/// Reads every worker's adapters and tells the router.
#[derive(Debug, Clone)]
pub struct AdapterWatch {
    /// Told each worker's adapters.
    pub router: Arc<Router>,
    /// The worker client (with the workers' API key).
    pub upstream: Upstream,
    /// Time between two reads of a worker's list.
    pub interval: Duration,
    /// Timeout of one read.
    pub timeout: Duration,
}

impl AdapterWatch {
    /// Reads every worker's adapters every `interval`, forever. Call [`AdapterWatch::learn_all`] once
    /// before serving, so that the first request for an adapter finds its workers.
    pub async fn run(self) {
        loop {
            tokio::time::sleep(self.interval).await;
            self.learn_all().await;
        }
    }

    /// Reads every worker's adapters once, concurrently (bounded by the timeout).
    pub async fn learn_all(&self) {
        let workers = self.router.workers();
        let reads = workers.iter().map(|w| self.learn_one(&w.url, &w.model));
        futures::future::join_all(reads).await;
    }

    async fn learn_one(&self, worker: &str, model: &str) {
        let listed = match self.upstream.get(worker, "/v1/models", self.timeout).await {
            Ok((status, body)) if status.is_success() => adapters_in(&body, model),
            Ok((status, _)) => Err(format!("status {status}")),
            Err(e) => Err(e),
        };
        match listed {
            Ok(adapters) => {
                if self.router.set_adapters(worker, adapters.clone()) {
                    tracing::info!(worker, model, ?adapters, "worker's LoRA adapters");
                }
            }
            Err(error) => {
                tracing::debug!(worker, %error, "GET /v1/models failed; keeping the adapters known")
            }
        }
    }
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelCard>,
}

#[derive(Deserialize)]
struct ModelCard {
    id: String,
    #[serde(default)]
    parent: Option<String>,
}

/// The adapters of `model` in a `/v1/models` body: the entries whose `parent` is `model`, sorted.
pub fn adapters_in(body: &[u8], model: &str) -> Result<Vec<String>, String> {
    let list: ModelList =
        serde_json::from_slice(body).map_err(|e| format!("not a model list: {e}"))?;
    let mut adapters: Vec<String> = list
        .data
        .into_iter()
        .filter(|card| card.parent.as_deref() == Some(model) && card.id != model)
        .map(|card| card.id)
        .collect();
    adapters.sort();
    adapters.dedup();
    Ok(adapters)
}

#[cfg(test)]
mod tests;
