//! The simulated vLLM engine: the scheduler of [`core`] driven in real time, a latency model per step
//! ([`latency`]), token streams to the HTTP handlers, vLLM metrics and KV events.
//!
//! The loop: plan a step under the lock, sleep for its cost (model seconds x `--time-scale`, against a
//! running deadline so short steps do not drift with timer granularity), publish the step's KV events,
//! then apply the step and hand out the sampled tokens. Timings reported to clients and metrics are wall
//! time, so they already include the time scale.

pub mod core;
pub mod latency;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

pub use self::core::{
    CoreConfig, CoreCounts, EngineCore, Forecast, ReqId, StepPlan, prompt_hashes,
};
pub use latency::{LatencyModel, Preset};

use crate::sim::cache::{CachedBlock, LoraAdapter};
use crate::sim::kv_events::KvPublisher;
use crate::sim::metrics::{FinishReason, Gauges, Metrics};

/// How far behind schedule the loop may run and still catch up (beyond it, the engine was idle).
const CATCH_UP: Duration = Duration::from_millis(3);

/// A slowdown factor that is not a finite number above zero.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("slowdown factor must be a finite number above 0, got {0}")]
pub struct InvalidSlowdown(pub f64);

/// One generated token, as a handler receives it.
#[derive(Debug, Clone, Copy)]
pub struct TokenOut {
    pub token: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    pub prompt_tokens: usize,
    /// 0 for the first token.
    pub index: usize,
    pub finish: Option<FinishReason>,
}

/// A submitted request: its token stream. Dropping it aborts the request (client went away).
#[derive(Debug)]
pub struct Generation {
    pub id: ReqId,
    pub tokens: mpsc::UnboundedReceiver<TokenOut>,
}

/// `/sim/estimate` answer (wall seconds).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Estimate {
    pub cached_tokens: usize,
    pub prompt_tokens: usize,
    pub estimated_ttft_s: f64,
    pub queue_prefill_tokens: usize,
    pub running: usize,
    pub waiting: usize,
}

/// `/sim/state` answer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StateSnapshot {
    #[serde(flatten)]
    pub counts: CoreCounts,
    pub block_size: usize,
    pub cached_blocks: Vec<CachedBlock>,
    /// The event hashes of every cached block, sorted.
    pub block_hashes: Vec<u64>,
    pub steps: u64,
}

struct Client {
    tx: mpsc::UnboundedSender<TokenOut>,
    arrival: Instant,
    last_token: Option<Instant>,
}

struct Shared {
    core: EngineCore,
    clients: HashMap<ReqId, Client>,
    inflight: Option<(StepPlan, Instant)>,
    steps: u64,
}

/// The engine, shared by the HTTP handlers and its own loop task.
pub struct Engine {
    shared: Mutex<Shared>,
    wake: Notify,
    time_scale: f64,
    /// How many times slower than its preset this worker runs (an `f64`'s bits; changed at run time by
    /// `POST /sim/slowdown`, as when a GPU throttles or a noisy neighbour moves in).
    slowdown: AtomicU64,
    block_size: usize,
    metrics: Arc<Metrics>,
    publisher: Option<KvPublisher>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("time_scale", &self.time_scale)
            .field("slowdown", &self.slowdown())
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Builds the engine; call [`Engine::run`] to start stepping.
    pub fn new(
        cfg: CoreConfig,
        time_scale: f64,
        metrics: Arc<Metrics>,
        publisher: Option<KvPublisher>,
    ) -> Arc<Self> {
        let block_size = cfg.block_size;
        Arc::new(Self {
            shared: Mutex::new(Shared {
                core: EngineCore::new(cfg),
                clients: HashMap::new(),
                inflight: None,
                steps: 0,
            }),
            wake: Notify::new(),
            time_scale: time_scale.max(0.0),
            slowdown: AtomicU64::new(1.0f64.to_bits()),
            block_size,
            metrics,
            publisher,
        })
    }

    /// How many times slower than its preset the engine runs (1: the preset's speed).
    pub fn slowdown(&self) -> f64 {
        f64::from_bits(self.slowdown.load(Ordering::Relaxed))
    }

    /// Makes every step from the next one on `factor` times as long as the preset says (2: half the
    /// speed). The step in flight keeps its length. `factor` must be finite and positive.
    pub fn set_slowdown(&self, factor: f64) -> Result<(), InvalidSlowdown> {
        if !(factor.is_finite() && factor > 0.0) {
            return Err(InvalidSlowdown(factor));
        }
        self.slowdown.store(factor.to_bits(), Ordering::Relaxed);
        Ok(())
    }

    /// Wall seconds per model second of the preset: the time scale times the slowdown.
    fn wall_per_model_s(&self) -> f64 {
        self.time_scale * self.slowdown()
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Queues a request of `prompt` tokens for `max_tokens` output tokens.
    pub fn submit(&self, prompt: Vec<u32>, max_tokens: usize) -> Generation {
        self.submit_with(prompt, max_tokens, None, None)
    }

    /// [`Engine::submit`] for a request to a LoRA adapter (`None`: the base model), with a
    /// `cache_salt` (`None`: unsalted).
    pub fn submit_with(
        &self,
        prompt: Vec<u32>,
        max_tokens: usize,
        lora: Option<Arc<LoraAdapter>>,
        salt: Option<Arc<str>>,
    ) -> Generation {
        self.admit(prompt, max_tokens, lora, salt, false)
    }

    /// [`Engine::submit_with`] for a request whose prompt's KV cache was pulled from a prefill worker
    /// (prefill/decode disaggregation): it computes only the prompt's last token.
    pub fn submit_remote(
        &self,
        prompt: Vec<u32>,
        max_tokens: usize,
        lora: Option<Arc<LoraAdapter>>,
        salt: Option<Arc<str>>,
    ) -> Generation {
        self.admit(prompt, max_tokens, lora, salt, true)
    }

    /// Admits a request: its block hashes (outside the lock: the only per-token work of admission),
    /// then the engine's request (`pulled`: its prompt's KV cache came from a prefill worker).
    fn admit(
        &self,
        prompt: Vec<u32>,
        max_tokens: usize,
        lora: Option<Arc<LoraAdapter>>,
        salt: Option<Arc<str>>,
        pulled: bool,
    ) -> Generation {
        let root = lora.as_ref().map(|l| l.root());
        let hashes =
            crate::sim::cache::hash_blocks_salted(root, &prompt, self.block_size, salt.as_deref());
        let (tx, rx) = mpsc::unbounded_channel();
        let id = {
            let mut s = self.shared.lock();
            let id = if pulled {
                s.core.add_remote(prompt, hashes, max_tokens, lora, salt)
            } else {
                s.core.add_with(prompt, hashes, max_tokens, lora, salt)
            };
            s.clients.insert(
                id,
                Client {
                    tx,
                    arrival: Instant::now(),
                    last_token: None,
                },
            );
            id
        };
        self.wake.notify_one();
        Generation { id, tokens: rx }
    }

    /// Prompt tokens of `prompt` (for `lora`, under `salt`) in the prefix cache now.
    pub fn cached_tokens(
        &self,
        prompt: &[u32],
        lora: Option<&LoraAdapter>,
        salt: Option<&str>,
    ) -> usize {
        let hashes = crate::sim::cache::hash_blocks_salted(
            lora.map(|l| l.root()),
            prompt,
            self.block_size,
            salt,
        );
        self.shared
            .lock()
            .core
            .cached_tokens_for(&hashes, prompt.len())
    }

    /// The cache hit and TTFT a prompt would get if sent now (nothing is queued).
    pub fn estimate(&self, prompt: &[u32]) -> Estimate {
        let hashes = prompt_hashes(prompt, self.block_size);
        let s = self.shared.lock();
        let now = Instant::now();
        let (plan, remaining) = match &s.inflight {
            Some((plan, end)) => (Some(plan), end.saturating_duration_since(now)),
            None => (None, Duration::ZERO),
        };
        let f = s.core.forecast(plan, &hashes, prompt.len());
        Estimate {
            cached_tokens: f.cached_tokens,
            prompt_tokens: f.prompt_tokens,
            estimated_ttft_s: remaining.as_secs_f64() + f.ttft_s * self.wall_per_model_s(),
            queue_prefill_tokens: f.queue_prefill_tokens,
            running: f.running,
            waiting: f.waiting,
        }
    }

    /// Scheduler gauges for `/metrics`.
    pub fn gauges(&self) -> Gauges {
        let c = self.shared.lock().core.counts();
        Gauges {
            running: c.running,
            waiting: c.waiting,
            kv_cache_usage: c.kv_cache_usage,
        }
    }

    /// Cache contents and counters for `/sim/state`.
    pub fn snapshot(&self) -> StateSnapshot {
        let s = self.shared.lock();
        let cached_blocks = s.core.pool().cached_blocks();
        let mut block_hashes: Vec<u64> = cached_blocks.iter().map(|b| b.hash).collect();
        block_hashes.sort_unstable();
        StateSnapshot {
            counts: s.core.counts(),
            block_size: self.block_size,
            cached_blocks,
            block_hashes,
            steps: s.steps,
        }
    }

    /// `POST /reset_prefix_cache`: false while requests hold blocks (vLLM refuses then too).
    pub fn reset_prefix_cache(&self) -> bool {
        self.shared.lock().core.reset_prefix_cache()
    }

    /// Steps until `shutdown` is cancelled.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut deadline = Instant::now();
        loop {
            let plan = {
                let mut s = self.shared.lock();
                self.reap_aborted(&mut s);
                let plan = s.core.schedule();
                if let Some(p) = &plan {
                    let now = Instant::now();
                    // A step starts when the previous one ends (so steps shorter than the timer's
                    // resolution catch up instead of drifting), or now if the engine was idle.
                    let start = if now.saturating_duration_since(deadline) < CATCH_UP {
                        deadline
                    } else {
                        now
                    };
                    deadline =
                        start + Duration::from_secs_f64(p.duration_s * self.wall_per_model_s());
                    s.inflight = Some((p.clone(), deadline));
                    s.steps += 1;
                }
                plan
            };
            let Some(plan) = plan else {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = self.wake.notified() => continue,
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep_until(deadline.into()) => {}
            }
            if let Some(p) = &self.publisher {
                p.publish(plan.events.clone());
            }
            self.finish_step(&plan);
        }
    }

    fn reap_aborted(&self, s: &mut Shared) {
        let gone: Vec<ReqId> = s
            .clients
            .iter()
            .filter(|(_, c)| c.tx.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            s.clients.remove(&id);
            if s.core.abort(id) {
                tracing::debug!(request = id, "client went away: aborted");
                self.metrics
                    .on_finished(FinishReason::Abort, Duration::ZERO);
            }
        }
    }

    fn finish_step(&self, plan: &StepPlan) {
        let mut s = self.shared.lock();
        s.inflight = None;
        let now = Instant::now();
        for a in &plan.admitted {
            if let Some(c) = s.clients.get(&a.id) {
                self.metrics
                    .on_scheduled(a.queried, a.hit, now.duration_since(c.arrival));
            }
        }
        for _ in &plan.preempted {
            self.metrics.on_preempted();
        }
        let emitted = s.core.complete(plan);
        for e in emitted {
            let Some(c) = s.clients.get_mut(&e.id) else {
                continue;
            };
            match c.last_token {
                None => self.metrics.on_first_token(
                    e.num_prompt,
                    e.cached_tokens,
                    now.duration_since(c.arrival),
                ),
                Some(prev) => self.metrics.on_token(now.duration_since(prev)),
            }
            c.last_token = Some(now);
            let out = TokenOut {
                token: e.token,
                cached_tokens: e.cached_tokens,
                prompt_tokens: e.num_prompt,
                index: e.index,
                finish: e.finish,
            };
            let delivered = c.tx.send(out).is_ok();
            if let Some(reason) = e.finish {
                let arrival = c.arrival;
                s.clients.remove(&e.id);
                self.metrics
                    .on_finished(reason, now.duration_since(arrival));
            } else if !delivered {
                s.clients.remove(&e.id);
                s.core.abort(e.id);
                self.metrics
                    .on_finished(FinishReason::Abort, Duration::ZERO);
            }
        }
    }
}
