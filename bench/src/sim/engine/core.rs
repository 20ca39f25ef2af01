//! The scheduler as a pure state machine (no clocks, no channels): vLLM V1's continuous batching with a
//! token budget per step, so it can run in real time (the engine loop) and in virtual time (forecasts
//! for `/sim/estimate`, calibration tests).
//!
//! Each step (`schedule`): running requests first, in order: a decoding request takes 1 token, a
//! prefilling one takes up to the remaining budget (chunked prefill); then waiting requests are admitted
//! FCFS while the budget, `max_num_seqs` and free blocks allow, each with its prefix-cache hit (full
//! blocks only, at most `n - 1` tokens so one is always computed). Blocks are allocated for the tokens
//! computed in the step and newly full ones are cached at once, as in vLLM. When a running request
//! cannot get a block the last running request is preempted (recompute, back to the front of the
//! queue). After the step (`complete`), a request whose known tokens are all computed samples one
//! token; it finishes after `max_tokens` tokens.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::latency::LatencyModel;
use crate::sim::cache::{
    BlockDigest, BlockId, BlockPool, KvCacheEvent, LoraAdapter, hash_block_tokens,
};
use crate::sim::metrics::FinishReason;

/// Engine-wide request id.
pub type ReqId = u64;

/// Static scheduler settings.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_num_seqs: usize,
    pub latency: LatencyModel,
    /// Token ids generated text is drawn from.
    pub output_vocab: Arc<[u32]>,
    pub seed: u64,
}

#[derive(Debug)]
struct Req {
    tokens: Vec<u32>,
    num_prompt: usize,
    max_tokens: usize,
    num_computed: usize,
    blocks: Vec<BlockId>,
    num_cached_blocks: usize,
    hashes: Vec<BlockDigest>,
    cached_tokens: Option<usize>,
    rng: u64,
    /// The adapter the request runs with (`None`: the base model).
    lora: Option<Arc<LoraAdapter>>,
    /// Its `cache_salt` (its `hashes` carry it in the first block; its first event names it).
    salt: Option<Arc<str>>,
    /// Its prompt's KV cache was pulled from a prefill worker (disaggregation): admitted with all
    /// but the last prompt token computed. Cleared by a preemption (the pulled cache is gone).
    remote: bool,
}

impl Req {
    fn num_output(&self) -> usize {
        self.tokens.len() - self.num_prompt
    }
}

/// A request admitted from the queue for the first time in a step.
#[derive(Debug, Clone, Copy)]
pub struct Admitted {
    pub id: ReqId,
    /// Tokens looked up in the prefix cache.
    pub queried: usize,
    /// Tokens found.
    pub hit: usize,
}

/// What one step runs.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    /// Requests and the tokens each computes in this step.
    pub scheduled: Vec<(ReqId, usize)>,
    pub admitted: Vec<Admitted>,
    pub preempted: Vec<ReqId>,
    /// Model seconds the step takes.
    pub duration_s: f64,
    /// KV events produced by the step's scheduling (published with the step).
    pub events: Vec<KvCacheEvent>,
    pub prefill_tokens: usize,
    pub decode_seqs: usize,
}

/// One sampled token.
#[derive(Debug, Clone, Copy)]
pub struct Emitted {
    pub id: ReqId,
    pub token: u32,
    /// Prompt tokens served from the prefix cache (fixed at first scheduling).
    pub cached_tokens: usize,
    pub num_prompt: usize,
    /// 0 for the first token.
    pub index: usize,
    pub finish: Option<FinishReason>,
}

/// The forecast for a new prompt, in model seconds.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Forecast {
    pub cached_tokens: usize,
    pub prompt_tokens: usize,
    /// Model seconds until its first token, from the end of the in-flight step.
    pub ttft_s: f64,
    /// Uncomputed prompt tokens ahead of it (running prefills and waiting requests).
    pub queue_prefill_tokens: usize,
    pub running: usize,
    pub waiting: usize,
}

/// Counters for `/sim/state`.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct CoreCounts {
    pub running: usize,
    pub waiting: usize,
    pub free_blocks: usize,
    pub num_blocks: usize,
    pub kv_cache_usage: f64,
}

/// The scheduler and KV cache.
#[derive(Debug)]
pub struct EngineCore {
    cfg: CoreConfig,
    pool: BlockPool,
    waiting: VecDeque<ReqId>,
    running: Vec<ReqId>,
    reqs: HashMap<ReqId, Req>,
    next_id: ReqId,
}

/// Block digests of every full block of `tokens` (done outside the engine lock by callers).
pub fn prompt_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockDigest> {
    crate::sim::cache::hash_blocks(None, tokens, block_size)
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// (query, key) pairs of causal attention when `n` tokens are computed after `start` cached ones.
fn attention_pairs(start: usize, n: usize) -> f64 {
    let (s, n) = (start as f64, n as f64);
    n * s + n * (n + 1.0) / 2.0
}

fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl EngineCore {
    pub fn new(cfg: CoreConfig) -> Self {
        let pool = BlockPool::new(cfg.num_blocks, cfg.block_size);
        Self {
            cfg,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            reqs: HashMap::new(),
            next_id: 1,
        }
    }

    /// The block pool (cached blocks for `/sim/state`).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn counts(&self) -> CoreCounts {
        CoreCounts {
            running: self.running.len(),
            waiting: self.waiting.len(),
            free_blocks: self.pool.num_free(),
            num_blocks: self.pool.num_blocks(),
            kv_cache_usage: self.pool.usage(),
        }
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Queues a request. `hashes` are the digests of the prompt's full blocks ([`prompt_hashes`]).
    /// Output tokens are a deterministic function of the seed and the prompt.
    pub fn add(&mut self, prompt: Vec<u32>, hashes: Vec<BlockDigest>, max_tokens: usize) -> ReqId {
        self.add_with(prompt, hashes, max_tokens, None, None)
    }

    /// [`EngineCore::add`] for a request to a LoRA adapter, whose `hashes` chain from the adapter's
    /// root, and with a `cache_salt`, hashed into its first block.
    pub fn add_with(
        &mut self,
        prompt: Vec<u32>,
        hashes: Vec<BlockDigest>,
        max_tokens: usize,
        lora: Option<Arc<LoraAdapter>>,
        salt: Option<Arc<str>>,
    ) -> ReqId {
        self.add_request(prompt, hashes, max_tokens, (lora, salt), false)
    }

    /// [`EngineCore::add_with`] for a request whose prompt's KV cache was pulled from a prefill worker:
    /// when admitted, it allocates and caches the prompt's blocks and computes only the last token.
    pub fn add_remote(
        &mut self,
        prompt: Vec<u32>,
        hashes: Vec<BlockDigest>,
        max_tokens: usize,
        lora: Option<Arc<LoraAdapter>>,
        salt: Option<Arc<str>>,
    ) -> ReqId {
        self.add_request(prompt, hashes, max_tokens, (lora, salt), true)
    }

    fn add_request(
        &mut self,
        prompt: Vec<u32>,
        hashes: Vec<BlockDigest>,
        max_tokens: usize,
        (lora, salt): (Option<Arc<LoraAdapter>>, Option<Arc<str>>),
        remote: bool,
    ) -> ReqId {
        let id = self.next_id;
        self.next_id += 1;
        let rng = prompt
            .iter()
            .fold(splitmix(self.cfg.seed), |h, &t| splitmix(h ^ u64::from(t)));
        self.reqs.insert(
            id,
            Req {
                num_prompt: prompt.len(),
                tokens: prompt,
                max_tokens: max_tokens.max(1),
                num_computed: 0,
                blocks: Vec::new(),
                num_cached_blocks: 0,
                hashes,
                cached_tokens: None,
                rng,
                lora,
                salt,
                remote,
            },
        );
        self.waiting.push_back(id);
        id
    }

    /// Drops a request wherever it is and frees its blocks. Returns whether it existed.
    pub fn abort(&mut self, id: ReqId) -> bool {
        let Some(req) = self.reqs.remove(&id) else {
            return false;
        };
        self.pool.free(&req.blocks);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        true
    }

    /// `reset_prefix_cache`; refused while requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset()
    }

    /// Longest cached prefix of `hashes` usable by a prompt of `n` tokens, in blocks.
    fn hit_blocks(&self, hashes: &[BlockDigest], n: usize) -> Vec<BlockId> {
        let max_blocks = n.saturating_sub(1) / self.cfg.block_size;
        self.pool
            .find_prefix(&hashes[..hashes.len().min(max_blocks)])
    }

    /// Cached prompt tokens a new prompt would get now.
    pub fn cached_tokens_for(&self, hashes: &[BlockDigest], n: usize) -> usize {
        self.hit_blocks(hashes, n).len() * self.cfg.block_size
    }

    /// Blocks a request needs in addition to its own to hold `upto` tokens.
    fn blocks_needed(&self, req: &Req, upto: usize) -> usize {
        cdiv(upto, self.cfg.block_size).saturating_sub(req.blocks.len())
    }

    /// Caches the request's blocks that are full once `upto` tokens are computed.
    fn cache_blocks(&mut self, id: ReqId, upto: usize) {
        let bs = self.cfg.block_size;
        let Some(req) = self.reqs.get_mut(&id) else {
            return;
        };
        let num_full = (upto / bs).min(req.hashes.len());
        if num_full > req.num_cached_blocks {
            self.pool.cache_full_blocks(
                &req.blocks,
                &req.hashes,
                &req.tokens,
                req.num_cached_blocks,
                num_full,
                crate::sim::cache::BlockExtras {
                    lora: req.lora.as_ref(),
                    salt: req.salt.as_ref(),
                },
            );
            req.num_cached_blocks = num_full;
        }
    }

    fn preempt(&mut self, id: ReqId) {
        if let Some(req) = self.reqs.get_mut(&id) {
            self.pool.free(&req.blocks);
            req.blocks.clear();
            req.num_computed = 0;
            req.num_cached_blocks = 0;
            req.remote = false;
        }
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
    }

    /// Plans the next step; `None` when there is nothing to run.
    pub fn schedule(&mut self) -> Option<StepPlan> {
        if self.is_idle() {
            return None;
        }
        let mut plan = StepPlan::default();
        let mut budget = self.cfg.latency.max_num_batched_tokens.max(1);
        let mut ctx_tokens = 0usize;
        let mut attn_pairs = 0.0f64;

        // Running requests.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(req) = self.reqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let n_new = (req.tokens.len() - req.num_computed).min(budget);
            if n_new == 0 {
                i += 1;
                continue;
            }
            let upto = req.num_computed + n_new;
            let mut scheduled = true;
            loop {
                let Some(req) = self.reqs.get(&id) else {
                    scheduled = false;
                    break;
                };
                let need = self.blocks_needed(req, upto);
                if need <= self.pool.num_free() {
                    let new = self.pool.allocate(need).unwrap_or_default();
                    if let Some(req) = self.reqs.get_mut(&id) {
                        req.blocks.extend(new);
                    }
                    break;
                }
                // Out of blocks: preempt the lowest-priority (last) running request.
                let Some(&victim) = self.running.last() else {
                    scheduled = false;
                    break;
                };
                self.preempt(victim);
                plan.preempted.push(victim);
                plan.scheduled.retain(|&(r, _)| r != victim);
                if victim == id {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                continue;
            }
            self.cache_blocks(id, upto);
            if let Some(req) = self.reqs.get(&id) {
                if n_new == 1 && req.num_output() > 0 {
                    plan.decode_seqs += 1;
                    ctx_tokens += req.tokens.len();
                } else {
                    plan.prefill_tokens += n_new;
                    attn_pairs += attention_pairs(req.num_computed, n_new);
                }
            }
            plan.scheduled.push((id, n_new));
            budget -= n_new;
            i += 1;
        }

        // Waiting requests, FCFS, unless this step had to preempt (vLLM skips admission then).
        while plan.preempted.is_empty() && budget > 0 && self.running.len() < self.cfg.max_num_seqs
        {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let Some(req) = self.reqs.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            let hit = self.hit_blocks(&req.hashes, req.tokens.len());
            let hit_tokens = hit.len() * self.cfg.block_size;
            // A pulled prompt is computed but for its last token (its blocks are allocated here).
            let computed = if req.remote {
                hit_tokens.max(req.tokens.len() - 1)
            } else {
                hit_tokens
            };
            let n_new = (req.tokens.len() - computed).min(budget);
            let upto = computed + n_new;
            let need = cdiv(upto, self.cfg.block_size).saturating_sub(hit.len());
            if need + self.pool.num_evictable(&hit) > self.pool.num_free() {
                break;
            }
            self.pool.touch(&hit);
            let new = self.pool.allocate(need).unwrap_or_default();
            let queried = req.tokens.len();
            if let Some(req) = self.reqs.get_mut(&id) {
                req.blocks = hit.clone();
                req.blocks.extend(new);
                req.num_cached_blocks = hit.len();
                req.num_computed = computed;
                if req.cached_tokens.is_none() {
                    // vLLM counts the pulled tokens with the prefix-cache hits in `cached_tokens`.
                    req.cached_tokens = Some(computed);
                    plan.admitted.push(Admitted {
                        id,
                        queried,
                        hit: hit_tokens,
                    });
                }
            }
            self.cache_blocks(id, upto);
            self.waiting.pop_front();
            self.running.push(id);
            plan.prefill_tokens += n_new;
            attn_pairs += attention_pairs(computed, n_new);
            plan.scheduled.push((id, n_new));
            budget -= n_new;
        }

        plan.events = self.pool.take_events();
        plan.duration_s = self.cfg.latency.step_time(
            plan.prefill_tokens,
            attn_pairs,
            plan.decode_seqs,
            ctx_tokens,
        );
        if plan.scheduled.is_empty() && plan.events.is_empty() {
            // Nothing fits (e.g. a prompt larger than the whole cache): avoid a busy loop.
            plan.duration_s = plan.duration_s.max(self.cfg.latency.step_base_s);
        }
        Some(plan)
    }

    /// Applies a finished step: advances computed tokens and samples tokens.
    pub fn complete(&mut self, plan: &StepPlan) -> Vec<Emitted> {
        let bs = self.cfg.block_size;
        let vocab = self.cfg.output_vocab.clone();
        let mut out = Vec::new();
        for &(id, n) in &plan.scheduled {
            let Some(req) = self.reqs.get_mut(&id) else {
                continue;
            };
            req.num_computed += n;
            if req.num_computed < req.tokens.len() {
                continue;
            }
            req.rng = splitmix(req.rng);
            let token = if vocab.is_empty() {
                (req.rng % 30_000) as u32 + 1_000
            } else {
                vocab[(req.rng % vocab.len() as u64) as usize]
            };
            req.tokens.push(token);
            while (req.hashes.len() + 1) * bs <= req.tokens.len() {
                let k = req.hashes.len();
                let parent = req.hashes.last().or(req.lora.as_ref().map(|l| l.root()));
                let d = hash_block_tokens(parent, &req.tokens[k * bs..(k + 1) * bs]);
                req.hashes.push(d);
            }
            let index = req.num_output() - 1;
            let finish = (req.num_output() >= req.max_tokens).then_some(FinishReason::Length);
            out.push(Emitted {
                id,
                token,
                cached_tokens: req.cached_tokens.unwrap_or(0),
                num_prompt: req.num_prompt,
                index,
                finish,
            });
            if finish.is_some() {
                self.abort(id);
            }
        }
        out
    }

    /// Forecasts a new prompt's TTFT by running this scheduler forward in virtual time on a copy of
    /// the queue (token counts only; blocks assumed available), the in-flight step counted as done.
    pub fn forecast(
        &self,
        inflight: Option<&StepPlan>,
        hashes: &[BlockDigest],
        n_prompt: usize,
    ) -> Forecast {
        #[derive(Clone, Copy)]
        struct Lite {
            to_compute: usize,
            tokens_left: usize,
            ctx: usize,
            has_output: bool,
            target: bool,
        }
        let done: HashMap<ReqId, usize> = inflight
            .map(|p| p.scheduled.iter().copied().collect())
            .unwrap_or_default();
        let lite = |id: &ReqId, waiting: bool| -> Option<Lite> {
            let r = self.reqs.get(id)?;
            let mut computed = r.num_computed + done.get(id).copied().unwrap_or(0);
            if waiting && computed == 0 {
                computed = self.cached_tokens_for(&r.hashes, r.tokens.len());
            }
            let mut l = Lite {
                to_compute: r.tokens.len().saturating_sub(computed),
                tokens_left: r.max_tokens - r.num_output(),
                ctx: r.tokens.len(),
                has_output: r.num_output() > 0,
                target: false,
            };
            if l.to_compute == 0 {
                // The in-flight step samples its token: one fewer to go, the next needs 1 token.
                l.tokens_left = l.tokens_left.saturating_sub(1);
                l.to_compute = 1;
                l.has_output = true;
                l.ctx += 1;
            }
            (l.tokens_left > 0).then_some(l)
        };
        let mut running: Vec<Lite> = self
            .running
            .iter()
            .filter_map(|id| lite(id, false))
            .collect();
        let mut waiting: VecDeque<Lite> = self
            .waiting
            .iter()
            .filter_map(|id| lite(id, true))
            .collect();
        let queue_prefill_tokens = running
            .iter()
            .chain(waiting.iter())
            .filter(|l| !l.has_output)
            .map(|l| l.to_compute)
            .sum();
        let cached = self.cached_tokens_for(hashes, n_prompt);
        waiting.push_back(Lite {
            to_compute: n_prompt.saturating_sub(cached).max(1),
            tokens_left: 1,
            ctx: n_prompt,
            has_output: false,
            target: true,
        });
        let lat = &self.cfg.latency;
        let mut t = 0.0;
        // Bounded: a pathological queue must not stall the HTTP handler.
        for _ in 0..200_000 {
            let mut budget = lat.max_num_batched_tokens.max(1);
            let (mut prefill, mut decode, mut ctx) = (0usize, 0usize, 0usize);
            let mut pairs = 0.0f64;
            let mut sched: Vec<(usize, usize)> = Vec::new();
            for (i, l) in running.iter().enumerate() {
                if budget == 0 {
                    break;
                }
                let n = l.to_compute.min(budget);
                if n == 1 && l.has_output {
                    decode += 1;
                    ctx += l.ctx;
                } else {
                    prefill += n;
                    pairs += attention_pairs(l.ctx - l.to_compute, n);
                }
                sched.push((i, n));
                budget -= n;
            }
            while budget > 0 && running.len() < self.cfg.max_num_seqs {
                let Some(l) = waiting.pop_front() else { break };
                let n = l.to_compute.min(budget);
                prefill += n;
                pairs += attention_pairs(l.ctx - l.to_compute, n);
                running.push(l);
                sched.push((running.len() - 1, n));
                budget -= n;
            }
            t += lat.step_time(prefill, pairs, decode, ctx);
            for &(i, n) in &sched {
                let l = &mut running[i];
                l.to_compute -= n;
                if l.to_compute == 0 {
                    if l.target {
                        return Forecast {
                            cached_tokens: cached,
                            prompt_tokens: n_prompt,
                            ttft_s: t,
                            queue_prefill_tokens,
                            running: self.running.len(),
                            waiting: self.waiting.len(),
                        };
                    }
                    l.tokens_left -= 1;
                    l.to_compute = 1;
                    l.has_output = true;
                    l.ctx += 1;
                }
            }
            running.retain(|l| l.tokens_left > 0);
        }
        Forecast {
            cached_tokens: cached,
            prompt_tokens: n_prompt,
            ttft_s: t,
            queue_prefill_tokens,
            running: self.running.len(),
            waiting: self.waiting.len(),
        }
    }
}
