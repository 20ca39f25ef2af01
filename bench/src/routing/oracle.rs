//! The oracle router: the limit of what any router could do.
//!
//! It asks every simulated worker `POST /sim/estimate` with the request itself (the simulator's exact
//! view of its cache and queue) and sends the request to the worker with the lowest estimated TTFT.
//! Decisions are serialized with the admissions they cause (see [`Oracle::decision_lock`]), so no
//! decision is made on a view that misses a request already routed.

use std::sync::atomic::{AtomicUsize, Ordering};

use serde::Deserialize;
use serde_json::Value;
use tokio::sync::{Mutex, MutexGuard};

use crate::harness::http::{HttpClient, HttpError};

#[cfg(test)]
mod tests;

/// The simulator's answer to `POST /sim/estimate`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Estimate {
    /// Prompt tokens the worker already holds.
    #[serde(default)]
    pub cached_tokens: u64,
    /// Prompt tokens of the request.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// The worker's estimated TTFT for this request, in simulated seconds.
    pub estimated_ttft_s: f64,
    /// Prefill tokens queued ahead.
    #[serde(default)]
    pub queue_prefill_tokens: u64,
    /// Requests running.
    #[serde(default)]
    pub running: u64,
    /// Requests waiting.
    #[serde(default)]
    pub waiting: u64,
}

/// The oracle's pick for one request.
#[derive(Debug, Clone)]
pub struct Choice {
    /// The chosen worker's base URL.
    pub worker: String,
    /// Every candidate's estimate, for the decision log.
    pub explain: String,
}

/// Why the oracle could not pick.
#[derive(Debug, thiserror::Error)]
pub enum OracleError {
    /// No worker answered its estimate.
    #[error("oracle: no worker answered /sim/estimate: {0}")]
    NoEstimate(String),
}

/// The client-side oracle router over a fixed set of simulated workers.
pub struct Oracle {
    http: HttpClient,
    workers: Vec<String>,
    lock: Mutex<()>,
    rotation: AtomicUsize,
}

impl Oracle {
    /// An oracle over `workers` (base URLs).
    pub fn new(http: HttpClient, workers: Vec<String>) -> Self {
        Self {
            http,
            workers,
            lock: Mutex::new(()),
            rotation: AtomicUsize::new(0),
        }
    }

    /// Held from the decision until the chosen worker has answered with its response headers (it has
    /// then admitted the request), so the next decision sees it.
    pub async fn decision_lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().await
    }

    /// Asks every worker for its estimate of `body` and picks the lowest.
    pub async fn pick(&self, body: &Value) -> Result<Choice, OracleError> {
        let answers = futures::future::join_all(self.workers.iter().map(|w| async move {
            let url = format!("{w}/sim/estimate");
            let estimate = self.http.post_json(&url, body).await.and_then(|v| {
                serde_json::from_value::<Estimate>(v)
                    .map_err(|source| HttpError::Json { url, source })
            });
            (w.clone(), estimate)
        }))
        .await;
        let mut estimates = Vec::with_capacity(answers.len());
        let mut errors = Vec::new();
        for (worker, answer) in answers {
            match answer {
                Ok(e) => estimates.push((worker, e)),
                Err(e) => errors.push(e.to_string()),
            }
        }
        let start = self.rotation.fetch_add(1, Ordering::Relaxed);
        let best =
            choose(&estimates, start).ok_or_else(|| OracleError::NoEstimate(errors.join("; ")))?;
        let explain = estimates
            .iter()
            .map(|(w, e)| {
                format!(
                    "{w} ttft={:.3}s cached={}/{} queue={} running={} waiting={}",
                    e.estimated_ttft_s,
                    e.cached_tokens,
                    e.prompt_tokens,
                    e.queue_prefill_tokens,
                    e.running,
                    e.waiting
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        Ok(Choice {
            worker: estimates[best].0.clone(),
            explain,
        })
    }
}

/// Index of the lowest estimated TTFT; ties go to the less busy worker, then rotate from `start` so that
/// equal idle workers share the load.
fn choose(estimates: &[(String, Estimate)], start: usize) -> Option<usize> {
    let n = estimates.len();
    (0..n).map(|k| (start + k) % n).min_by(|&a, &b| {
        let (ea, eb) = (&estimates[a].1, &estimates[b].1);
        ea.estimated_ttft_s
            .total_cmp(&eb.estimated_ttft_s)
            .then((ea.running + ea.waiting).cmp(&(eb.running + eb.waiting)))
    })
}
