//! Prefill/decode disaggregation: the two workers of a split request, or the one worker of a
//! request not worth splitting ([`Router::pick_pair`]).
//!
//! - The **prefill worker** is chosen as every request's worker is ([`Router::decide`]), among the
//!   `prefill` workers: the lowest estimated time to first token, from the prompt's cached prefix
//!   there (KV index and speculative credit) and the prefill queue ahead of it.
//! - The **decode worker** is chosen among the workers that take whole requests (`decode`, `both`) by
//!   its decode load and its distance from the prefill worker:
//!
//!   ```text
//!   cost = (sequences running there + 1) x its time per output token / the fastest decode worker's
//!        + prompt blocks it must pull / 256 x (0.25 on the prefill worker's own node, else 1)
//!        + 1000 when its KV cache has no room for the prompt
//!   ```
//!
//!   A decode step costs about the same for one sequence or thirty (the weights are read once), so
//!   what slows a decode worker's streams is the sequences it already runs, scaled by how fast it
//!   turns a step (time per output token, learned from the gateway's own streams there). Pulling the
//!   prompt's KV cache costs little next to that, less from the same node (the agent reporting both
//!   workers is the node's); blocks the decode worker already caches are not pulled. Ties are spread.
//! - A request with fewer than `min_uncached_tokens` prompt tokens left to compute on the decode
//!   worker that caches most of it runs **whole**, on the worker the ordinary estimate picks among
//!   those that take whole requests: a short prompt, or one a decode worker mostly holds already (the
//!   next turn of a conversation it served), costs less to compute in place than to prefill elsewhere,
//!   move and ask for twice.
//!
//! Both tickets are in the in-flight ledger: the prefill worker's like any request's (its backlog, its
//! learned rates), the decode worker's without prefill work; the decode worker is credited the prompt's
//! blocks speculatively, as it caches them once pulled.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

use kinference_api::WorkerRole;
use rand::Rng as _;

use super::metrics::PdLabels;
use super::workers::Worker;
use super::*;

/// Prompt blocks to pull that count as one more sequence running on the decode worker.
const BLOCKS_PER_SEQUENCE: f64 = 256.0;
/// A pull from the prefill worker's own node costs this share of one across nodes.
const SAME_NODE_SHARE: f64 = 0.25;
/// Added to a decode worker whose KV cache has no room for the prompt: chosen only when all are full.
const NO_ROOM: f64 = 1000.0;
/// A worker's time per output token counts at most this many times the fastest one's.
const MAX_TPOT_RATIO: f64 = 8.0;

/// A request to place on a prefill worker and a decode worker.
#[derive(Clone, Copy, Debug)]
pub struct PairRequest<'a> {
    /// The request (its model, prompt and tokens).
    pub route: RouteRequest<'a>,
    /// The workers that may run its prefill (base URLs; `None`: every `prefill` worker of the model).
    pub prefill_within: Option<&'a [String]>,
    /// The workers that may run its decode, or the whole request (`None`: every worker of the
    /// model that takes whole requests).
    pub decode_within: Option<&'a [String]>,
    /// Below this many prompt tokens left to compute on the decode worker that caches most of the
    /// prompt, the request runs whole on one worker.
    pub min_uncached_tokens: usize,
}

/// Where a request to a pool with `prefill` workers runs.
#[derive(Debug)]
pub enum Pair {
    /// Split: the prefill on one worker, the decode on another.
    Split {
        /// The prefill worker.
        prefill: Decision,
        /// The decode worker (its explanation, when asked, covers both picks); boxed, so that a
        /// whole request's answer stays small.
        decode: Box<Decision>,
    },
    /// Whole on one worker, for the reason in `outcome` (`whole`, `untokenized`, `no_prefill`).
    Whole {
        /// The worker.
        decision: Decision,
        /// Why it was not split.
        outcome: &'static str,
    },
}

/// One decode candidate's figures, for the choice and its explanation.
#[derive(Clone, Copy, Debug)]
struct DecodeScore {
    running: usize,
    tpot_s: Option<f64>,
    pull_blocks: usize,
    same_node: Option<bool>,
    kv_free: Option<usize>,
    no_room: bool,
    cost: f64,
}

impl Router {
    /// Whether any healthy worker of `model` is a `prefill` worker (only then is a request split).
    pub fn has_prefill_workers(&self, model: &str) -> bool {
        self.shared
            .workers
            .read()
            .candidates_any_role(model)
            .iter()
            .any(|w| w.state.lock().role == WorkerRole::Prefill)
    }

    /// Counts a disaggregation outcome (`kinference_routing_pd_total{outcome}`); the forward stage
    /// counts those it sees (`fallback`, `no_transfer_params`).
    pub fn count_pd(&self, outcome: &str) {
        self.shared
            .metrics
            .pd
            .get_or_create(&PdLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// The prefill worker and the decode worker of `req`, or the one worker it runs whole on (see
    /// the module docs), both recorded in the in-flight ledger. Outside the `kinference` routing mode,
    /// and for a model without healthy `prefill` workers, the request runs whole.
    pub async fn pick_pair(&self, req: PairRequest<'_>) -> Result<Pair, RouteError> {
        let model = req.route.model;
        let (prefill, decode) = {
            let table = self.shared.workers.read();
            let all = table.candidates_any_role(model);
            if all.is_empty() {
                return Err(if table.knows_model(model) {
                    RouteError::NoHealthyWorker(model.to_string())
                } else {
                    RouteError::UnknownModel(model.to_string())
                });
            }
            let prefill_within = req.prefill_within.map(|urls| table.named(urls));
            let decode_within = req.decode_within.map(|urls| table.named(urls));
            let within = |named: &Option<Vec<bool>>, w: &Worker| {
                named
                    .as_ref()
                    .is_none_or(|n| n.get(usize::from(w.id)).copied().unwrap_or(false))
            };
            let (mut prefill, mut decode) = (Vec::new(), Vec::new());
            for w in all {
                if w.state.lock().role == WorkerRole::Prefill {
                    if within(&prefill_within, &w) {
                        prefill.push(w);
                    }
                } else if within(&decode_within, &w) {
                    decode.push(w);
                }
            }
            (prefill, decode)
        };
        if decode.is_empty() {
            return Err(RouteError::NoHealthyWorker(model.to_string()));
        }
        if prefill.is_empty() || self.shared.mode != RoutingMode::Kinference {
            let decision = self.pick_from(req.route, &decode).await;
            return Ok(Pair::Whole {
                decision,
                outcome: "no_prefill",
            });
        }
        let askable: Vec<Arc<Worker>> = decode.iter().chain(&prefill).cloned().collect();
        let Some(tokens) = self.prompt_tokens(req.route, &askable).await else {
            self.count_pd("untokenized");
            let decision = self.pick_from(req.route, &decode).await;
            return Ok(Pair::Whole {
                decision,
                outcome: "untokenized",
            });
        };
        let started = Instant::now();
        let pair = self.decide_pair(&req, &prefill, &decode, &tokens);
        self.shared
            .stages
            .decide
            .observe(started.elapsed().as_secs_f64());
        Ok(pair)
    }

    /// The decision of [`Router::pick_pair`] for `req`'s tokenized prompt (synchronous, like
    /// [`Router::decide`]).
    fn decide_pair(
        &self,
        req: &PairRequest<'_>,
        prefill: &[Arc<Worker>],
        decode: &[Arc<Worker>],
        tokens: &[u32],
    ) -> Pair {
        let (model, salt, debug) = (req.route.model, req.route.salt, req.route.debug);
        let min_uncached_tokens = req.min_uncached_tokens;
        let shared = &self.shared;
        let now = Instant::now();
        let prompt = tokens.len();
        let mut cands = shared.candidates_at(decode, now);
        let keys_by_size = shared.cached_runs(model, salt, tokens, &mut cands, now);
        let best_cached = cands
            .iter()
            .map(|c| c.inputs(prompt).cached_tokens)
            .max()
            .unwrap_or(0);
        let uncached = prompt.saturating_sub(best_cached);
        if uncached < min_uncached_tokens {
            self.count_pd("whole");
            let continues = super::Continues {
                session: req.route.session,
                pinned: false,
            };
            let mut decision = self.decide(model, salt, continues, decode, tokens, debug);
            decision.explain = decision.explain.map(|e| {
                format!(
                    "pd=whole: {uncached} prompt tokens left to compute on the decode worker caching most < min_uncached_tokens {min_uncached_tokens}; {e}"
                )
            });
            return Pair::Whole {
                decision,
                outcome: "whole",
            };
        }
        let prefill_decision = self.decide(
            model,
            salt,
            super::Continues::default(),
            prefill,
            tokens,
            debug,
        );
        let prefill_node = shared
            .workers
            .read()
            .get(&prefill_decision.worker)
            .and_then(|w| w.state.read().agent);
        let live_agents = shared.fresh_agents(now);
        let tpots: Vec<Option<f64>> = cands.iter().map(|c| c.worker.state.read().tpot_s).collect();
        let fastest = tpots
            .iter()
            .flatten()
            .copied()
            .fold(f64::INFINITY, f64::min);
        let scores: Vec<DecodeScore> = cands
            .iter()
            .zip(&tpots)
            .map(|(c, &tpot_s)| {
                let prompt_blocks = prompt / c.block_size;
                let pull_blocks = prompt_blocks.saturating_sub(c.surviving_run());
                let node = c.worker.state.read().agent;
                // Known only when both workers' agents are live: the same agent is the same node.
                let same_node = match (prefill_node, node) {
                    (Some(p), Some(d))
                        if live_agents.get(p).copied().unwrap_or(false)
                            && live_agents.get(d).copied().unwrap_or(false) =>
                    {
                        Some(p == d)
                    }
                    _ => None,
                };
                let kv_free = c.kv_room.map(|r| r.free());
                let no_room = kv_free.is_some_and(|free| free < pull_blocks + 1);
                let ratio = match tpot_s {
                    Some(t) if fastest.is_finite() && fastest > 0.0 => {
                        (t / fastest).clamp(1.0, MAX_TPOT_RATIO)
                    }
                    _ => 1.0,
                };
                let pull_share = if same_node == Some(true) {
                    SAME_NODE_SHARE
                } else {
                    1.0
                };
                let running = c.queue.running;
                let cost = (running + 1) as f64 * ratio
                    + pull_blocks as f64 / BLOCKS_PER_SEQUENCE * pull_share
                    + if no_room { NO_ROOM } else { 0.0 };
                DecodeScore {
                    running,
                    tpot_s,
                    pull_blocks,
                    same_node,
                    kv_free,
                    no_room,
                    cost,
                }
            })
            .collect();
        let best = scores.iter().map(|s| s.cost).fold(f64::INFINITY, f64::min);
        let ties: Vec<usize> = (0..scores.len())
            .filter(|&i| scores[i].cost <= best + 1e-9)
            .collect();
        let pick = ties[rand::rng().random_range(0..ties.len())];
        let chosen = &cands[pick];
        let keys = keys_by_size
            .iter()
            .find(|(bs, _)| *bs == chosen.block_size)
            .map(|(_, keys)| Arc::clone(keys));
        {
            let mut st = chosen.worker.state.lock();
            st.in_flight += 1;
            st.awaiting_first_token += 1;
            st.log.started(now);
        }
        if let Some(keys) = &keys {
            let ttl = if chosen.live {
                shared.tuning.speculative_ttl
            } else {
                shared.tuning.speculative_ttl_no_agent
            };
            let mut spec = shared.spec.lock();
            spec.credit(Arc::clone(keys), chosen.worker.id, now, now + ttl);
            shared
                .metrics
                .speculative_keys
                .set(spec.total_keys() as i64);
        }
        self.count("pd_decode", 0);
        self.count_pd("split");
        let explain = debug.then(|| {
            let mut s = format!(
                "pd=split: {uncached} prompt tokens left to compute on the decode worker caching most >= min_uncached_tokens {min_uncached_tokens}; prefill: {}; decode:",
                prefill_decision.explain.as_deref().unwrap_or("")
            );
            for (i, (c, d)) in cands.iter().zip(&scores).enumerate() {
                let _ = write!(
                    s,
                    "{} {}{} running={} tpot_ms={} pull_blocks={} node={} kv_free={}{} cost={:.3}",
                    if i > 0 { ";" } else { "" },
                    if i == pick { "*" } else { "" },
                    c.worker.url,
                    d.running,
                    d.tpot_s
                        .map_or_else(|| "unknown".to_string(), |t| format!("{:.1}", t * 1e3)),
                    d.pull_blocks,
                    match d.same_node {
                        Some(true) => "same",
                        Some(false) => "other",
                        None => "unknown",
                    },
                    d.kv_free
                        .map_or_else(|| "unknown".to_string(), |f| f.to_string()),
                    if d.no_room { "(no room)" } else { "" },
                    d.cost,
                );
            }
            s
        });
        let decode_decision = Decision {
            worker: chosen.worker.url.clone(),
            dp_rank: chosen.worker.dp_rank,
            reason: "pd_decode",
            explain,
            prompt_tokens: Some(prompt),
            // No prefill work there (the backlog), no rate to learn from its first token (a pull).
            ticket: InFlight::new(
                Arc::clone(shared),
                Arc::clone(chosen.worker),
                None,
                None,
                keys.filter(|_| chosen.live),
                None,
            ),
        };
        Pair::Split {
            prefill: prefill_decision,
            decode: Box::new(decode_decision),
        }
    }
}

#[cfg(test)]
mod tests;
