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

impl Router {
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
