//! What the policy stage asks of the router before a worker is chosen: the estimate of one request on
//! every worker serving a model (recording nothing), and a pick restricted to one pool's workers.
//!
//! Policies compare pools (the cheap model cold against the expensive one warm, a saturated pool
//! against a provider) by the same TTFT estimate [`Router::pick`] minimises, so the candidate figures
//! here mirror [`Router::decide`]'s: queued prefill, running requests, the agent's load when live,
//! and the cached prefix from the KV index and speculative credit.

use std::sync::Arc;
use std::time::Instant;

use kinference_api::{BlockKey, KeyHasher};

use super::estimate::{self, Inputs};
use super::kv_index::WorkerId;
use super::workers::{Worker, normalize_url};
use super::{Decision, RouteError, RouteRequest, Router, RoutingMode, baseline};

/// One worker's view of one request, for the policy stage.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerEstimate {
    /// Worker base URL.
    pub worker: String,
    /// Estimated time to first token of this request there, seconds (`None`: prompt not tokenized).
    pub ttft_s: Option<f64>,
    /// Prompt tokens of this request the worker holds in its prefix cache (index or speculative).
    pub cached_tokens: usize,
    /// Requests this gateway has in flight there.
    pub in_flight: usize,
    /// `vllm:num_requests_waiting` from a live agent.
    pub waiting: Option<u32>,
    /// `vllm:kv_cache_usage_perc` (0..1) from a live agent.
    pub kv_usage: Option<f32>,
}

/// Per-candidate figures before the cached run is known.
struct Figures {
    worker: Arc<Worker>,
    block_size: usize,
    live: bool,
    queue_tokens: f64,
    running: usize,
    in_flight: usize,
    waiting: Option<u32>,
    kv_usage: Option<f32>,
    rates: estimate::Rates,
    run: usize,
}

impl Router {
    /// The estimate of `req` on every healthy worker serving `req.model`. Nothing is recorded (no
    /// ledger entry, no speculative credit, no decision metric).
    pub async fn estimate_workers(
        &self,
        req: RouteRequest<'_>,
    ) -> Result<Vec<WorkerEstimate>, RouteError> {
        let candidates = self.candidates(req.model)?;
        let fallback = candidates
            .iter()
            .min_by_key(|w| w.state.lock().in_flight)
            .map(|w| w.url.clone());
        let tokens = self
            .shared
            .tokenizers
            .tokens(req.model, req.prompt, fallback.as_deref())
            .await
            .ok()
            .map(|(tokens, _)| tokens);
        Ok(self.estimates(req.model, &candidates, tokens.as_deref()))
    }

    /// [`Router::pick`] among `workers` (base URLs) only, e.g. one policy pool's workers.
    pub async fn pick_among(
        &self,
        req: RouteRequest<'_>,
        workers: &[String],
    ) -> Result<Decision, RouteError> {
        let candidates: Vec<Arc<Worker>> = self
            .candidates(req.model)?
            .into_iter()
            .filter(|w| workers.iter().any(|u| normalize_url(u) == w.url))
            .collect();
        if candidates.is_empty() {
            return Err(RouteError::NoHealthyWorker(req.model.to_string()));
        }
        let shared = &self.shared;
        if shared.mode != RoutingMode::Kinference {
            let (i, reason) = baseline::pick(
                shared.mode,
                &candidates,
                req.prompt,
                &shared.tuning,
                &shared.round_robin,
            );
            return Ok(self.record_simple(&candidates, i, reason, req.debug));
        }
        let fallback = candidates
            .iter()
            .min_by_key(|w| w.state.lock().in_flight)
            .map(|w| w.url.clone());
        match shared
            .tokenizers
            .tokens(req.model, req.prompt, fallback.as_deref())
            .await
        {
            Ok((tokens, _)) => Ok(self.decide(req.model, &candidates, &tokens, req.debug)),
            Err(_) => {
                let (i, _) = baseline::pick(
                    RoutingMode::LeastOutstanding,
                    &candidates,
                    req.prompt,
                    &shared.tuning,
                    &shared.round_robin,
                );
                Ok(self.record_simple(&candidates, i, "degraded_no_tokens", req.debug))
            }
        }
    }

    fn estimates(
        &self,
        model: &str,
        workers: &[Arc<Worker>],
        tokens: Option<&[u32]>,
    ) -> Vec<WorkerEstimate> {
        let shared = &self.shared;
        let tuning = &shared.tuning;
        let now = Instant::now();
        let fresh = shared.fresh_agents(now);
        let mut cands: Vec<Figures> = workers
            .iter()
            .map(|w| {
                let st = w.state.lock();
                let live = st
                    .agent
                    .is_some_and(|a| fresh.get(a).copied().unwrap_or(false));
                let load = st
                    .load
                    .filter(|l| live && l.metrics_fresh(now, tuning.load_max_age));
                let mut queue_tokens = st.pending_prefill_tokens;
                let mut running = st.in_flight;
                if let Some(l) = load {
                    queue_tokens = queue_tokens.max(f64::from(l.waiting) * st.avg_uncached);
                    running = running.max((l.running + l.waiting) as usize);
                }
                if let Some(k) = st.load.filter(|_| live).and_then(|l| l.kernel) {
                    running = running.max(k.in_flight as usize);
                }
                Figures {
                    worker: Arc::clone(w),
                    block_size: st.block_size.unwrap_or(tuning.default_block_size).max(1),
                    live,
                    queue_tokens,
                    running,
                    in_flight: st.in_flight,
                    waiting: load.map(|l| l.waiting),
                    kv_usage: load.map(|l| l.kv_usage),
                    rates: st.rates.clone(),
                    run: 0,
                }
            })
            .collect();
        if let Some(tokens) = tokens {
            let hasher = KeyHasher::for_model(model);
            let mut sizes: Vec<usize> = cands.iter().map(|c| c.block_size).collect();
            sizes.sort_unstable();
            sizes.dedup();
            let keys_by_size: Vec<(usize, Vec<BlockKey>)> = sizes
                .into_iter()
                .map(|bs| (bs, hasher.keys(None, tokens, bs)))
                .collect();
            let index = shared.index.read();
            let spec = shared.spec.lock();
            let mut runs = Vec::new();
            for (bs, keys) in &keys_by_size {
                let group: Vec<usize> = (0..cands.len())
                    .filter(|i| cands[*i].block_size == *bs && cands[*i].live)
                    .collect();
                let ids: Vec<WorkerId> = group.iter().map(|i| cands[*i].worker.id).collect();
                index.leading_runs_bisect(keys, &ids, &mut runs);
                for (i, run) in group.iter().zip(runs.iter()) {
                    cands[*i].run = *run;
                }
                spec.runs(keys, now, |w, run| {
                    if let Some(c) = cands
                        .iter_mut()
                        .find(|c| c.worker.id == w && c.block_size == *bs)
                    {
                        c.run = c.run.max(run);
                    }
                });
            }
        }
        let prompt_tokens = tokens.map_or(0, <[u32]>::len);
        cands
            .into_iter()
            .map(|c| {
                let cached = (c.run * c.block_size).min(prompt_tokens.saturating_sub(1));
                let ttft_s = tokens.map(|_| {
                    let inputs = Inputs {
                        prompt_tokens,
                        cached_tokens: cached,
                        queue_tokens: c.queue_tokens,
                        running: c.running,
                    };
                    estimate::estimate(&c.rates, &inputs, &tuning.estimator).ttft_s
                });
                WorkerEstimate {
                    worker: c.worker.url.clone(),
                    ttft_s,
                    cached_tokens: cached,
                    in_flight: c.in_flight,
                    waiting: c.waiting,
                    kv_usage: c.kv_usage,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
