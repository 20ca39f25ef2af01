//! What the policy stage asks of the router before a worker is chosen: the estimate of one request on
//! every worker serving a model (recording nothing), and a pick restricted to one pool's workers.
//!
//! Policies compare pools (the cheap model cold against the expensive one warm, a saturated pool
//! against a provider) by the same TTFT estimate [`Router::pick`] minimises: the candidate figures and
//! cached runs come from the same functions as [`Router::decide`]'s.

use std::sync::Arc;
use std::time::Instant;

use super::estimate;
use super::workers::Worker;
use super::{Decision, RouteError, RouteRequest, Router};

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

/// One worker's pressure as the flow control's saturation detector reads it
/// ([`crate::overload::flow::saturation`]): every client's requests from the freshest view, the
/// engine's own queue and cache, the kernel's accept queue and time to first byte, and the estimate.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerPressure {
    /// Worker base URL.
    pub worker: String,
    /// Requests in flight there, every client's (the estimate's queue: ledger plus the others the
    /// freshest view shows).
    pub in_flight: usize,
    /// Of which still before their first token (queued or in prefill).
    pub before_first_token: usize,
    /// Which view sized the other clients' share: `kernel`, `engine` or `ledger`.
    pub signal: &'static str,
    /// `vllm:num_requests_waiting` (not scheduled yet), from a fresh scrape.
    pub engine_waiting: Option<u32>,
    /// `vllm:kv_cache_usage_perc` (0..1), from a fresh scrape.
    pub kv_usage: Option<f32>,
    /// The kernel's accept queue (backlog, its limit), from a fresh kernel view.
    pub accept_backlog: Option<(u32, u32)>,
    /// The kernel's median time to first byte, from a fresh kernel view with a sample.
    pub kernel_ttfb: Option<std::time::Duration>,
    /// Estimated time to first token of a short uncached request sent now, seconds.
    pub est_ttft_s: f64,
    /// The worker's recent time per output token (learned from its streams of two tokens or more),
    /// seconds; `None` before its first.
    pub tpot_s: Option<f64>,
}

impl Router {
    /// The pressure on every healthy worker of `model` among `within` (every worker of the model
    /// when `None`); empty when none is healthy. Records nothing.
    pub fn pressure(&self, model: &str, within: Option<&[String]>) -> Vec<WorkerPressure> {
        let Ok(candidates) = self.candidates(model) else {
            return Vec::new();
        };
        let candidates: Vec<Arc<Worker>> = match within {
            Some(urls) => {
                let named = self.shared.workers.read().named(urls);
                candidates
                    .into_iter()
                    .filter(|w| is_named(&named, w))
                    .collect()
            }
            None => candidates,
        };
        let shared = &self.shared;
        shared
            .candidates_at(&candidates, Instant::now())
            .into_iter()
            .map(|c| {
                let est = estimate::estimate(&c.rates, &c.inputs(1), &shared.tuning.estimator);
                WorkerPressure {
                    worker: c.worker.url.clone(),
                    in_flight: c.queue.running,
                    before_first_token: c.awaiting_first_token + c.queue.others_waiting,
                    signal: c.signal.as_str(),
                    engine_waiting: c.scraped.map(|l| l.waiting),
                    kv_usage: c.scraped.map(|l| l.kv_usage),
                    accept_backlog: c.kernel_fresh.map(|l| l.accept_backlog),
                    kernel_ttfb: c.kernel_fresh.and_then(|l| l.kernel_ttfb),
                    est_ttft_s: est.ttft_s,
                    tpot_s: c.worker.state.read().tpot_s,
                }
            })
            .collect()
    }

    /// The estimate of `req` on every healthy worker serving `req.model`. Without the gateway's own
    /// tokenizer the prompt is tokenized by a worker's `/tokenize`, asked only among `tokenize_via`
    /// (base URLs) when given: a request that may be local-only never reaches a worker outside the
    /// local pools. Nothing is recorded (no ledger entry, no speculative credit, no decision
    /// metric); the tokens are kept in `req.tokens` for the pick.
    pub async fn estimate_workers(
        &self,
        req: RouteRequest<'_>,
        tokenize_via: Option<&[String]>,
    ) -> Result<Vec<WorkerEstimate>, RouteError> {
        let candidates = self.candidates(req.model)?;
        let askable: Vec<Arc<Worker>> = match tokenize_via {
            Some(via) => {
                let via = self.shared.workers.read().named(via);
                candidates
                    .iter()
                    .filter(|w| is_named(&via, w))
                    .cloned()
                    .collect()
            }
            None => candidates.clone(),
        };
        let tokens = self.prompt_tokens(req, &askable).await;
        Ok(self.estimates(req.model, req.salt, &candidates, tokens.as_deref()))
    }

    /// [`Router::pick`] among `workers` (base URLs) only, e.g. one policy pool's workers.
    pub async fn pick_among(
        &self,
        req: RouteRequest<'_>,
        workers: &[String],
    ) -> Result<Decision, RouteError> {
        self.pick_except(req, Some(workers), &[]).await
    }

    /// [`Router::pick`] among `within` (base URLs; every worker of the model when `None`), passing
    /// over the workers in `avoid`: the retry after a worker failed a request before answering.
    pub async fn pick_except(
        &self,
        req: RouteRequest<'_>,
        within: Option<&[String]>,
        avoid: &[String],
    ) -> Result<Decision, RouteError> {
        let (within, avoid) = {
            let table = self.shared.workers.read();
            (within.map(|urls| table.named(urls)), table.named(avoid))
        };
        let candidates: Vec<Arc<Worker>> = self
            .candidates(req.model)?
            .into_iter()
            .filter(|w| {
                within.as_ref().is_none_or(|pool| is_named(pool, w)) && !is_named(&avoid, w)
            })
            .collect();
        if candidates.is_empty() {
            return Err(RouteError::NoHealthyWorker(req.model.to_string()));
        }
        Ok(self.pick_from(req, &candidates).await)
    }

    /// The least loaded worker of `model` among `within` (every worker of the model when `None`),
    /// passing over those in `avoid`: the endpoints with no prompt cache to exploit (embeddings,
    /// tokenizing).
    pub fn pick_least_loaded_except(
        &self,
        model: &str,
        within: Option<&[String]>,
        avoid: &[String],
        debug: bool,
    ) -> Result<Decision, RouteError> {
        let (within, avoid) = {
            let table = self.shared.workers.read();
            (within.map(|urls| table.named(urls)), table.named(avoid))
        };
        let candidates: Vec<Arc<Worker>> = self
            .candidates(model)?
            .into_iter()
            .filter(|w| {
                within.as_ref().is_none_or(|pool| is_named(pool, w)) && !is_named(&avoid, w)
            })
            .collect();
        if candidates.is_empty() {
            return Err(RouteError::NoHealthyWorker(model.to_string()));
        }
        Ok(self.least_loaded_of(&candidates, debug))
    }

    /// The estimates of [`Router::decide`] (same candidate figures, same cached runs), recording nothing.
    fn estimates(
        &self,
        model: &str,
        salt: Option<&str>,
        workers: &[Arc<Worker>],
        tokens: Option<&[u32]>,
    ) -> Vec<WorkerEstimate> {
        let shared = &self.shared;
        let now = Instant::now();
        let mut cands = shared.candidates_at(workers, now);
        if let Some(tokens) = tokens {
            shared.cached_runs(model, salt, tokens, &mut cands, now);
        }
        let prompt_tokens = tokens.map_or(0, <[u32]>::len);
        cands
            .into_iter()
            .map(|c| {
                let inputs = c.inputs(prompt_tokens);
                let ttft_s = tokens.map(|_| {
                    estimate::estimate(&c.rates, &inputs, &shared.tuning.estimator).ttft_s
                });
                WorkerEstimate {
                    worker: c.worker.url.clone(),
                    ttft_s,
                    cached_tokens: inputs.cached_tokens,
                    in_flight: c.in_flight,
                    waiting: c.scraped.map(|l| l.waiting),
                    kv_usage: c.scraped.map(|l| l.kv_usage),
                }
            })
            .collect()
    }
}

/// Whether `w` is among the workers [`super::workers::WorkerTable::named`] marked (a worker added
/// since is not).
fn is_named(named: &[bool], w: &Worker) -> bool {
    named.get(usize::from(w.id)).copied().unwrap_or(false)
}

#[cfg(test)]
mod tests;
