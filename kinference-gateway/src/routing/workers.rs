//! The router's worker table: every worker it may route to, with its in-flight ledger, learned rates
//! and the latest load figures its agent sent.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::estimate::{KernelQueue, Rates};
use super::kv_index::{MAX_WORKERS, WorkerId};

/// Load figures from the worker's agent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Load {
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc` (0..1).
    pub kv_usage: f32,
    /// Whether the scrape behind `running`/`waiting` succeeded.
    pub metrics_ok: bool,
    /// The kernel's view of the worker's port, all clients (eBPF), when the agent has one.
    pub kernel: Option<KernelQueue>,
    /// When the scraped figures were measured (receive time minus their age at send).
    pub measured: Instant,
    /// When the figures arrived (the kernel figures are at most one agent poll old when sent).
    pub received: Instant,
}

impl Load {
    /// Whether the scrape figures are usable at `now`.
    pub fn metrics_fresh(&self, now: Instant, max_age: Duration) -> bool {
        self.metrics_ok && now.saturating_duration_since(self.measured) <= max_age
    }
}

/// Mutable per-worker state.
#[derive(Debug)]
pub struct WorkerState {
    /// Requests this gateway has in flight there.
    pub in_flight: usize,
    /// Of which (estimate-routed ones) the first token has not arrived yet.
    pub awaiting_first_token: usize,
    /// Uncached prompt tokens of this gateway's requests there still waiting for a first token.
    pub pending_prefill_tokens: f64,
    /// Learned rates.
    pub rates: Rates,
    /// EWMA of uncached tokens per request (sizes the agent's `waiting` count in tokens).
    pub avg_uncached: f64,
    /// Tokens per KV block, from the agent.
    pub block_size: Option<usize>,
    /// Index of the agent reporting this worker, if any.
    pub agent: Option<usize>,
    /// Latest load from the agent.
    pub load: Option<Load>,
    /// The worker left (agent-discovered workers only; configured ones stay).
    pub gone: bool,
    /// Set by the gateway's health prober; unhealthy workers are not candidates.
    pub healthy: bool,
}

/// One worker.
#[derive(Debug)]
pub struct Worker {
    /// Index in the table (and in the KV index).
    pub id: WorkerId,
    /// Base URL (no trailing slash).
    pub url: String,
    /// Served model.
    pub model: String,
    /// From the gateway configuration (as opposed to discovered through an agent).
    pub configured: bool,
    /// Ledger, rates and load.
    pub state: Mutex<WorkerState>,
}

/// Every worker the router knows; ids are never reused.
#[derive(Debug, Default)]
pub struct WorkerTable {
    list: Vec<Arc<Worker>>,
    by_url: HashMap<String, WorkerId>,
}

/// Worker URLs compare without a trailing slash.
pub fn normalize_url(url: &str) -> &str {
    url.trim_end_matches('/')
}

impl WorkerTable {
    /// The worker with this URL.
    pub fn get(&self, url: &str) -> Option<&Arc<Worker>> {
        self.by_url
            .get(normalize_url(url))
            .map(|id| &self.list[usize::from(*id)])
    }

    /// The worker with this id.
    pub fn by_id(&self, id: WorkerId) -> Option<&Arc<Worker>> {
        self.list.get(usize::from(id))
    }

    /// Every worker.
    pub fn all(&self) -> &[Arc<Worker>] {
        &self.list
    }

    /// Adds a worker, or returns the existing one with that URL. `None` when the table is full.
    pub fn get_or_add(
        &mut self,
        url: &str,
        model: &str,
        configured: bool,
        rates: &Rates,
    ) -> Option<Arc<Worker>> {
        if let Some(w) = self.get(url) {
            return Some(Arc::clone(w));
        }
        if self.list.len() >= MAX_WORKERS {
            return None;
        }
        let id = self.list.len() as WorkerId;
        let worker = Arc::new(Worker {
            id,
            url: normalize_url(url).to_string(),
            model: model.to_string(),
            configured,
            state: Mutex::new(WorkerState {
                in_flight: 0,
                awaiting_first_token: 0,
                pending_prefill_tokens: 0.0,
                rates: rates.clone(),
                avg_uncached: 512.0,
                block_size: None,
                agent: None,
                load: None,
                gone: false,
                healthy: true,
            }),
        });
        self.by_url.insert(worker.url.clone(), id);
        self.list.push(Arc::clone(&worker));
        Some(worker)
    }

    /// Healthy workers serving `model` that have not left.
    pub fn candidates(&self, model: &str) -> Vec<Arc<Worker>> {
        self.list
            .iter()
            .filter(|w| {
                let st = w.state.lock();
                w.model == model && !st.gone && st.healthy
            })
            .cloned()
            .collect()
    }

    /// Whether any worker ever served `model`.
    pub fn knows_model(&self, model: &str) -> bool {
        self.list.iter().any(|w| w.model == model)
    }
}
