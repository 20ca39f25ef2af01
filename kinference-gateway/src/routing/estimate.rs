//! The time-to-first-token estimate per candidate worker, the rates it learns, and the final choice.
//!
//! Model: `ttft = overhead + seconds_per_token * work`, where
//! `work = queued prefill tokens ahead + this request's prefill + K * running requests`, and the
//! prefill is its uncached tokens plus, where the model's profile says so, its attention pairs at a
//! fixed token-equivalent each ([`profiles`]: a prefill's attention grows with the square of its
//! length, which dominates on small models).
//! The last term stands for decode interference: every running sequence takes part of each engine
//! step, roughly like `K` prefill tokens over the request's wait (K = 16 by default). Expressing it in
//! tokens keeps the whole estimate in one learned unit, so it is right at any hardware speed (and any
//! simulator time scale) once the rate is learned.
//!
//! Both rates are learned per worker from observed TTFTs with a robust EWMA: a sample moves the
//! estimate by at most a factor of 3, the step size starts large (fast convergence from the prior)
//! and settles at 0.1, and both are clamped to sane bounds. Requests with a large `work` teach the
//! per-token rate; small ones teach the overhead.
//!
//! ## The queue ahead: whose requests, from which signal ([`queue`])
//!
//! A gateway's in-flight ledger is exact and current, but only for its own requests; with several gateway
//! replicas (or clients that reach a worker another way) most of a worker's queue can be invisible to it.
//! The node agent adds two views that count *every* client's requests, this gateway's included:
//! - the **kernel view** (eBPF on the worker's port, sent within ~25 ms of a change): requests in flight,
//!   and of those the ones with no response byte yet (`waiting`);
//! - the **engine view** (the worker's own `vllm:num_requests_running` / `_waiting`, scraped every 250 ms).
//!
//! Because both include this gateway's own requests, they are never added to the ledger. A view is a
//! little behind, so it is compared with the ledger *as the view saw it* ([`Seen`]): our requests then in
//! flight (the current ones, minus those started since, plus those finished since) and, for the kernel
//! view, also our responses that finished within the agent's idle gap before it (HTTP/1.1 keeps the
//! connection open, so the kernel counts a finished response until the connection's next request, its
//! close, or that gap; without this every finished request of ours showed as another client's for half a
//! second). The rule:
//! 1. *others* = `view total - ours as seen` (never negative); total in flight = `ledger + others`;
//! 2. the others still waiting for their first token: where the agent's kernel counts a streaming
//!    response as waiting until its first body byte (`waits_for_body`), exactly what the kernel view shows
//!    beyond our own waiting ones as it saw them (and *others* is at least that). Otherwise a guess: at
//!    least what a view shows beyond our own, and at least the others' share at the waiting fraction our
//!    own requests on that worker have (the replicas send alike traffic; a streaming response sends its
//!    headers before the first token, so such a kernel's `waiting` undercounts them), capped at the others;
//! 3. queued prefill = our own backlog (our requests' uncached tokens as a first-come-first-served queue
//!    the worker drains at its rate, [`super::workers::Backlog`]) + others waiting x our average uncached
//!    tokens per request; `running` (decode interference) = the total.
//!
//! The kernel view is preferred when it is live and fresh (younger than `kernel_max_age`: the agent resends
//! unchanged figures every second); else the engine view when its scrape is fresh; else the ledger alone.
//! A candidate estimated without the kernel view says why in the decision's explanation (`kernel=no_agent`,
//! `kernel=ebpf_off`, `kernel=stale`), counts in `kinference_routing_kernel_view_missing_total{reason}`
//! and is logged (at most once a minute per reason).
//!
//! ## Memory pressure: a cached prefix about to be evicted ([`KvRoom`])
//!
//! vLLM keeps a finished request's blocks as cached but free, and evicts free blocks least recently used
//! first whenever it allocates new ones (a request's blocks are freed tail first, so a prefix loses its
//! last blocks first). When the conversations on a worker outgrow its cache, a prefix the index still
//! lists can be gone by the time the request is scheduled: the multi-turn benchmark at concurrency 32
//! sent requests to a "holder" predicted to have 4-6k tokens cached that had kept 0-2k.
//!
//! Where the agent reports the worker's capacity (`num_gpu_blocks`), the estimate sizes the room left for
//! cached prefixes when this request is scheduled: `free = capacity - in use - queued`, where *in use* is
//! held by running requests (`kv_cache_usage_perc x capacity`, not evictable) and *queued* is what the
//! requests ahead of it will allocate (the queue's prefill tokens, [`Queue::queue_tokens`], in blocks;
//! our own ones are the in-flight tickets' uncached prompts). Only `min(run, free)` leading blocks of the
//! request's cached run count as cached. The rule is optimistic on purpose (it takes the prefix as the
//! most recently used blocks of the cache, the last to go): it discounts only a prefix the cache cannot
//! hold in any order, so it changes no decision on a worker with room to spare. Nor does it discount
//! the leading blocks the prompt shares with one of this gateway's requests in flight there
//! ([`super::workers::InFlightPrompts`]): a running request holds them (they are part of *in use*), and
//! one queued ahead allocates or recomputes them before this one runs. Without a capacity (an
//! older agent, vLLM not profiled yet, no fresh scrape) the run counts in full, as before, and the
//! decision's explanation says `kv=capacity_unknown`.
//!
//! ## Cache tiers
//!
//! A worker may hold a prefix outside GPU memory: vLLM's native CPU offloading (`medium: "CPU"` in its
//! events), a disk tier or LMCache. The agent sends those keys apart (`offloaded_keys`), and a prompt's
//! blocks found there right after its GPU run ([`Inputs::offloaded_tokens`]) are loaded back, not
//! computed: each costs [`EstimatorConfig::offloaded_token_cost`] (0.1) of a prefill token. A PCIe
//! copy of a block's KV runs about ten times faster than computing it on a mid-size model; the
//! figure is a prior, not measured on real vLLM. So a GPU hit beats an equal CPU hit, and a CPU hit
//! beats a miss; the prefill externality charges only the tokens computed.
//!
//! ## Running late ([`Rates::slowed`])
//!
//! The rates learn only from first tokens, and those come late exactly when a worker is far slower than
//! estimated (a slowed GPU, a cache too small for the prompts it runs, a hung engine). So a candidate's
//! rates are scaled by its *lateness*: the largest `waited / (2 x estimated TTFT)` among this gateway's
//! requests still awaiting their first token there ([`super::workers::InFlightPrompts::lateness`]; 1,
//! no change, while every one is within twice its estimate). The explanation shows it as `late:F`.
//!
//! ## The choice
//!
//! Each candidate's cost is its estimated TTFT plus the delay its uncached prefill imposes on other
//! requests: `cost = ttft + prefill_externality * uncached * seconds_per_token`. A prefill holds the
//! worker's admissions and stalls its decode steps while it runs (vLLM schedules running prefills
//! before waiting requests), and sending a prompt cold to a second worker copies a prefix the cluster
//! already holds, evicting other prefixes there. Greedy per-request TTFT ignores that cost: on the
//! shared-prefix benchmark an oracle minimising each request's exact TTFT lost to a plain prefix hash,
//! and Kinference's diversions (holder's estimate 0.41 s against a cold worker's 0.32 s) cost 3-4 s
//! each. With the default 0.5, leaving a prompt's cached prefix pays only when the holder's queue is
//! worse than the cold prefill by half a prefill; a prompt cold everywhere (unique traffic) pays the
//! same everywhere, so the choice is unchanged.
//!
//! Choice: the minimum cost among workers that pass the load guard. Near-ties (within 3% + 1 ms)
//! go to the one holding most of the prompt (less prefill for the cluster), then to the emptiest cache
//! (a cold prompt stored there evicts least; within 2% or 64 blocks counts as equal), and what is still
//! equal is drawn at random so cache misses do not all land on the same replica. The load guard (between
//! AIBrix: least-loaded when max - min running > 16, and SGLang: balance when max - min > 64 and max >
//! 1.5 min) excludes workers whose in-flight count exceeds `min + max(32, min)`: estimates can be
//! wrong, and piling without bound onto one worker is the failure mode users report most. It is kept
//! loose on purpose: a worker holding popular prefixes legitimately runs many more (cheap, cached)
//! requests than one holding rare ones, and every request the guard moves off its prefix costs a full
//! prefill that stalls the target's queue (routing benchmark, shared prefix at concurrency 32: a slack
//! of 16 diverted 4 of 96 requests from a holder with 18-19 running to a cold worker, 3.3-4.1 s TTFT
//! each against an estimated 0.04 s on the holder).

use std::time::Instant;

use rand::Rng;

pub mod profiles;

/// Knobs of the estimate and the choice.
#[derive(Clone, Debug)]
pub struct EstimatorConfig {
    /// Prior prefill throughput, tokens per second.
    pub prior_tokens_per_s: f64,
    /// Prior fixed overhead per request, seconds.
    pub prior_overhead_s: f64,
    /// Token-equivalents of decode interference per running request.
    pub running_token_equiv: f64,
    /// Work (tokens) above which a sample teaches the per-token rate rather than the overhead.
    pub rate_sample_min_work: f64,
    /// Near-tie band: relative part.
    pub tie_rel: f64,
    /// Near-tie band: absolute part, seconds.
    pub tie_abs_s: f64,
    /// Among near-ties, caches within this many blocks (or 2%) of the emptiest count as equally empty.
    pub tie_held_blocks: usize,
    /// Seconds of other requests' delay charged per second of uncached prefill a choice adds (see
    /// "The choice" above); 0 chooses by estimated TTFT alone.
    pub prefill_externality: f64,
    /// Load guard: a worker may exceed the least loaded one by `max(guard_abs, guard_rel * min)`.
    pub guard_abs: usize,
    /// Load guard, relative part.
    pub guard_rel: f64,
    /// Kernel figures older than this are not used (the agent resends unchanged figures every second).
    pub kernel_max_age: std::time::Duration,
    /// How far the kernel view runs behind: the agent sends a changed figure within one poll plus its
    /// coalescing delay, so figures received earlier and not replaced still held this long ago.
    pub kernel_delay: std::time::Duration,
    /// Waiting fraction assumed for other clients' requests when neither this gateway's ledger nor the
    /// engine view shows one.
    pub default_waiting_fraction: f64,
    /// Prefill tokens' worth of work per prompt token loaded back from a lower tier (see "Cache
    /// tiers" in the module docs).
    pub offloaded_token_cost: f64,
}

impl Default for EstimatorConfig {
    fn default() -> Self {
        Self {
            prior_tokens_per_s: 5_000.0,
            prior_overhead_s: 0.02,
            running_token_equiv: 16.0,
            rate_sample_min_work: 512.0,
            tie_rel: 0.03,
            tie_abs_s: 0.001,
            tie_held_blocks: 64,
            prefill_externality: 0.5,
            guard_abs: 32,
            guard_rel: 1.0,
            kernel_max_age: std::time::Duration::from_millis(2500),
            kernel_delay: std::time::Duration::from_millis(50),
            default_waiting_fraction: 0.5,
            offloaded_token_cost: 0.1,
        }
    }
}

const MIN_S_PER_TOKEN: f64 = 1e-8; // 100M tokens/s: far beyond any GPU, allows fast simulators
const MAX_S_PER_TOKEN: f64 = 0.1; // 10 tokens/s
const MAX_OVERHEAD_S: f64 = 10.0;

/// A worker's learned rates.
#[derive(Clone, Debug, PartialEq)]
pub struct Rates {
    /// Seconds per token of prefill work.
    pub s_per_token: f64,
    /// Fixed seconds per request (network, scheduling, first decode step).
    pub overhead_s: f64,
    /// Samples learned from.
    pub samples: u64,
    /// Of which taught the per-token rate (the others taught the overhead).
    pub rate_samples: u64,
    /// When the latest sample came.
    pub last_observed: Option<Instant>,
    /// Prefill-token equivalents per attention pair, from the model's profile (not learned; 0 without
    /// one).
    pub attention_pair_tokens: f64,
}

impl Rates {
    /// The priors.
    pub fn prior(cfg: &EstimatorConfig) -> Self {
        Self {
            s_per_token: (1.0 / cfg.prior_tokens_per_s.max(1.0))
                .clamp(MIN_S_PER_TOKEN, MAX_S_PER_TOKEN),
            overhead_s: cfg.prior_overhead_s.clamp(0.0, MAX_OVERHEAD_S),
            samples: 0,
            rate_samples: 0,
            last_observed: None,
            attention_pair_tokens: 0.0,
        }
    }

    /// The priors of a model with a [`profiles::Profile`].
    pub fn from_profile(profile: &profiles::Profile) -> Self {
        Self {
            s_per_token: (1.0 / profile.prefill_tokens_per_s.max(1.0))
                .clamp(MIN_S_PER_TOKEN, MAX_S_PER_TOKEN),
            overhead_s: profile.overhead_s.clamp(0.0, MAX_OVERHEAD_S),
            attention_pair_tokens: profile.attention_pair_tokens.max(0.0),
            samples: 0,
            rate_samples: 0,
            last_observed: None,
        }
    }

    /// The rates of a worker running `factor` times slower than they say (both parameters scaled).
    pub fn slowed(mut self, factor: f64) -> Self {
        if factor.is_finite() && factor > 1.0 {
            self.s_per_token *= factor;
            self.overhead_s *= factor;
        }
        self
    }

    /// Learns from one observed TTFT of a request whose `work` (tokens, as estimated at decision) is
    /// known.
    pub fn observe(&mut self, ttft_s: f64, work: f64, cfg: &EstimatorConfig) {
        if !ttft_s.is_finite() || ttft_s < 0.0 || !work.is_finite() || work < 0.0 {
            return;
        }
        // Each parameter's step size follows its own sample count.
        let alpha = |n: u64| (1.0 / (n as f64 + 2.0)).max(0.1);
        if work >= cfg.rate_sample_min_work {
            let alpha = alpha(self.rate_samples);
            let sample = ((ttft_s - self.overhead_s).max(0.0) / work)
                .clamp(self.s_per_token / 3.0, self.s_per_token * 3.0);
            self.s_per_token = ((1.0 - alpha) * self.s_per_token + alpha * sample)
                .clamp(MIN_S_PER_TOKEN, MAX_S_PER_TOKEN);
            self.rate_samples += 1;
        } else {
            let alpha = alpha(self.samples - self.rate_samples);
            let floor = self.overhead_s / 3.0;
            let ceil = (self.overhead_s * 3.0).max(self.overhead_s + 0.001);
            let sample = (ttft_s - self.s_per_token * work).clamp(floor, ceil);
            self.overhead_s =
                ((1.0 - alpha) * self.overhead_s + alpha * sample).clamp(0.0, MAX_OVERHEAD_S);
        }
        self.samples += 1;
        self.last_observed = Some(Instant::now());
    }
}

/// Samples of its own a worker needs before its rates outweigh the fleet's. Large on purpose: the
/// workers of one pool are usually identical, and a rate difference of 10-30% (within the noise of a
/// few samples) decides where every cold prompt goes; chasing it sent every new prefix to one worker
/// until its cache overflowed (routing benchmark, shared prefix c=4/c=8 with a weight of 16: 88-90%
/// of prompt tokens cached against 96% with 64).
const FLEET_SHRINK_SAMPLES: f64 = 64.0;
/// A worker's own samples count half after this long without a new one.
const OWN_RATES_HALF_LIFE_S: f64 = 20.0;

/// A worker's rates shrunk toward the fleet's rates (learned from every worker's observations).
///
/// Without it, the first worker to be observed learns its real speed while the others keep the
/// static prior; when the prior is pessimistic the learned worker looks many times faster than its
/// identical peers and every request piles onto it (seen in the routing benchmark: one worker took
/// every request, evicted its own cache and halved the hit rate). Borrowing the fleet's rates until
/// a worker has samples of its own keeps peers comparable while still letting a genuinely slower or
/// faster worker stand out.
///
/// A worker's own samples also fade with their age (half-life [`OWN_RATES_HALF_LIFE_S`]): a worker
/// that once looked slow gets few requests, so without fading it would never get the samples that
/// correct it (seen in the routing benchmark: one worker that learned a 2x faster rate than its
/// identical peers took 83 of 96 requests while theirs stayed stale).
///
/// The rate and the overhead are blended separately, each by the samples that taught it: counting a
/// worker's overhead samples toward its never-taught prefill rate kept that rate at the (10x slow)
/// prior on every worker that cold prompts did not reach, so all cold prompts kept going to the one
/// that had learned, until its cache overflowed.
pub fn blended(own: &Rates, fleet: &Rates, now: Instant) -> Rates {
    if fleet.samples == 0 {
        return own.clone();
    }
    let age_s = own.last_observed.map_or(f64::INFINITY, |t| {
        now.saturating_duration_since(t).as_secs_f64()
    });
    let fade = 0.5f64.powf(age_s / OWN_RATES_HALF_LIFE_S);
    // Each parameter by its own samples: a worker that only ever served cached prompts has learned its
    // overhead, not its prefill rate, and must borrow the fleet's rate however many samples it has.
    let weight = |n: u64| {
        let n = n as f64 * fade;
        n / (n + FLEET_SHRINK_SAMPLES)
    };
    let w_rate = weight(own.rate_samples);
    let w_overhead = weight(own.samples - own.rate_samples);
    Rates {
        s_per_token: w_rate * own.s_per_token + (1.0 - w_rate) * fleet.s_per_token,
        overhead_s: w_overhead * own.overhead_s + (1.0 - w_overhead) * fleet.overhead_s,
        samples: own.samples,
        rate_samples: own.rate_samples,
        last_observed: own.last_observed,
        attention_pair_tokens: own.attention_pair_tokens,
    }
}

/// What the estimate needs to know about one candidate.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Inputs {
    /// Prompt tokens of this request.
    pub prompt_tokens: usize,
    /// Of which the worker holds (or will hold) in its prefix cache, on the GPU.
    pub cached_tokens: usize,
    /// Of the rest, the leading ones it holds in a lower tier (CPU offload, disk, LMCache): loaded
    /// back at [`EstimatorConfig::offloaded_token_cost`], not computed.
    pub offloaded_tokens: usize,
    /// Prefill tokens already admitted ahead of this request.
    pub queue_tokens: f64,
    /// Requests running (decoding or prefilling) on the worker.
    pub running: usize,
}

/// A worker's KV cache in blocks, as the request's cached prefix will find it when it is scheduled (see
/// "Memory pressure" in the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvRoom {
    /// The cache's capacity (`num_gpu_blocks`).
    pub capacity: usize,
    /// Held by running requests (`kv_cache_usage_perc x capacity`): not evictable.
    pub in_use: usize,
    /// What the requests queued ahead of this one will allocate.
    pub queued: usize,
}

impl KvRoom {
    /// The room from the worker's figures: `kv_usage` (0..1), and the queue ahead in prefill tokens.
    pub fn new(capacity: u32, kv_usage: f32, queue_tokens: f64, block_size: usize) -> Self {
        let capacity = capacity as usize;
        let usage = if kv_usage.is_finite() {
            f64::from(kv_usage).clamp(0.0, 1.0)
        } else {
            0.0
        };
        Self {
            capacity,
            in_use: (usage * capacity as f64).round() as usize,
            queued: (queue_tokens.max(0.0) / block_size.max(1) as f64).ceil() as usize,
        }
    }

    /// Blocks left for cached prefixes once the queue ahead has taken its own.
    pub fn free(&self) -> usize {
        self.capacity
            .saturating_sub(self.in_use)
            .saturating_sub(self.queued)
    }

    /// Of a cached run of `run` leading blocks, how many are still there when the request is scheduled,
    /// when the first `pinned` of them are shared with requests in flight there (held or recomputed by
    /// them whatever the room): those, and as much of the rest as the room left keeps.
    pub fn surviving(&self, run: usize, pinned: usize) -> usize {
        let pinned = pinned.min(run);
        pinned + (run - pinned).min(self.free())
    }
}

/// One candidate's estimate.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Estimate {
    /// Work in tokens (queue + this request's prefill + decode interference).
    pub work: f64,
    /// This request's own prefill in tokens: the uncached ones with their attention, and the loads from
    /// a lower tier (what it adds to the worker's queue).
    pub prefill: f64,
    /// Seconds of the estimate spent waiting for work ahead.
    pub queue_s: f64,
    /// Estimated time to first token, seconds.
    pub ttft_s: f64,
    /// What the choice minimises: the TTFT plus the delay the request's prefill imposes on others.
    pub cost_s: f64,
}

/// Estimates one candidate.
pub fn estimate(rates: &Rates, inputs: &Inputs, cfg: &EstimatorConfig) -> Estimate {
    let offloaded = inputs
        .offloaded_tokens
        .min(inputs.prompt_tokens.saturating_sub(inputs.cached_tokens));
    let uncached = inputs
        .prompt_tokens
        .saturating_sub(inputs.cached_tokens)
        .saturating_sub(offloaded) as f64;
    let load = offloaded as f64 * cfg.offloaded_token_cost.clamp(0.0, 1.0);
    // The uncached tokens attend to the whole prefix before them, the loaded tiers' included.
    let context = (inputs.cached_tokens + offloaded) as f64;
    let computed =
        uncached + rates.attention_pair_tokens * profiles::attention_pairs(uncached, context);
    let ahead = inputs.queue_tokens.max(0.0) + cfg.running_token_equiv * inputs.running as f64;
    let work = ahead + load + computed;
    let ttft_s = rates.overhead_s + work * rates.s_per_token;
    Estimate {
        work,
        prefill: load + computed,
        queue_s: ahead * rates.s_per_token,
        ttft_s,
        cost_s: ttft_s + cfg.prefill_externality.max(0.0) * computed * rates.s_per_token,
    }
}

/// This gateway's own requests on one worker (its in-flight ledger): exact and current.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Ledger {
    /// Requests this gateway has in flight there.
    pub in_flight: usize,
    /// Of which the first token has not arrived yet.
    pub awaiting_first_token: usize,
    /// Their prefill still to do (the backlog's remaining tokens).
    pub pending_prefill_tokens: f64,
    /// Average uncached prompt tokens per request routed there (sizes other clients' requests).
    pub avg_uncached: f64,
}

/// The agent's kernel-level view of the worker's port: every client's requests, this gateway's included.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelQueue {
    /// Requests in flight.
    pub in_flight: u32,
    /// Of which no response byte has been sent yet.
    pub waiting: u32,
    /// `waiting` lasts until a streaming response's first body byte (its first token): it counts exactly
    /// the requests still queued or in prefill.
    pub waits_for_body: bool,
}

/// The worker's own counters as the agent scraped them: every client's requests, at scrape time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineQueue {
    /// `vllm:num_requests_running` (prefilling or decoding).
    pub running: u32,
    /// `vllm:num_requests_waiting` (not scheduled yet).
    pub waiting: u32,
}

/// This gateway's own requests on one worker as a view counted them when it was taken (see the module
/// docs); for a view taken now with nothing lingering, the ledger's own figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    /// Our requests the view counts as in flight.
    pub in_flight: usize,
    /// Of which it counts as waiting for their first token.
    pub waiting: usize,
}

/// Which view sized the other clients' share of a worker's queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueSignal {
    /// The agent's kernel view (eBPF).
    Kernel,
    /// The worker's scraped counters.
    Engine,
    /// Only this gateway's ledger: other clients are invisible.
    Ledger,
}

impl QueueSignal {
    /// The label used in explanations.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueSignal::Kernel => "kernel",
            QueueSignal::Engine => "engine",
            QueueSignal::Ledger => "ledger",
        }
    }
}

/// Why a worker's kernel view was not used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelMissing {
    /// No live agent reports the worker.
    NoAgent,
    /// The agent reports the worker without a kernel view (eBPF off, not loaded, or not watching the port).
    EbpfOff,
    /// The figures are older than `kernel_max_age`.
    Stale,
}

impl KernelMissing {
    /// The metric and explanation label.
    pub fn as_str(self) -> &'static str {
        match self {
            KernelMissing::NoAgent => "no_agent",
            KernelMissing::EbpfOff => "ebpf_off",
            KernelMissing::Stale => "stale",
        }
    }
}

/// A worker's queue as the estimate uses it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Queue {
    /// Prefill tokens ahead of a new request ([`Inputs::queue_tokens`]).
    pub queue_tokens: f64,
    /// Requests in flight, every client's ([`Inputs::running`]).
    pub running: usize,
    /// Of which other clients' (not in this gateway's ledger).
    pub others: usize,
    /// Of those, the ones counted as still waiting for their first token.
    pub others_waiting: usize,
}

/// Combines the ledger with the best available view of the other clients (see the module docs): the
/// kernel view when given, else the engine view, else the ledger alone. Each view comes with our own
/// requests as it saw them.
pub fn queue(
    ledger: &Ledger,
    kernel: Option<(KernelQueue, Seen)>,
    engine: Option<(EngineQueue, Seen)>,
    cfg: &EstimatorConfig,
) -> (Queue, QueueSignal) {
    let (others, view_waiting, signal) = match (kernel, engine) {
        (Some((k, ours)), _) => {
            let waiting = (k.waiting as usize).saturating_sub(ours.waiting);
            let others = (k.in_flight as usize).saturating_sub(ours.in_flight);
            if k.waits_for_body {
                // The kernel counts exactly who is still before the first token: no guess needed.
                let others = others.max(waiting);
                return (queue_of(ledger, others, waiting), QueueSignal::Kernel);
            }
            (others, waiting, QueueSignal::Kernel)
        }
        (None, Some((e, ours))) => (
            ((e.running + e.waiting) as usize).saturating_sub(ours.in_flight),
            (e.waiting as usize).saturating_sub(ours.waiting),
            QueueSignal::Engine,
        ),
        (None, None) => (0, 0, QueueSignal::Ledger),
    };
    let fraction = if ledger.in_flight > 0 {
        ledger.awaiting_first_token.min(ledger.in_flight) as f64 / ledger.in_flight as f64
    } else {
        match engine {
            Some((e, _)) if e.running + e.waiting > 0 => {
                f64::from(e.waiting) / f64::from(e.running + e.waiting)
            }
            _ => cfg.default_waiting_fraction.clamp(0.0, 1.0),
        }
    };
    // The engine's waiting queue is a lower bound even when the kernel view sized the total.
    let engine_waiting = engine.map_or(0, |(e, ours)| {
        (e.waiting as usize).saturating_sub(ours.waiting)
    });
    let shown = view_waiting.max(engine_waiting);
    let others_waiting = shown
        .max((others as f64 * fraction).round() as usize)
        .min(others);
    (queue_of(ledger, others, others_waiting), signal)
}

/// The queue from the ledger and the other clients' requests (`others`, of which `others_waiting` are
/// before their first token, each taken as our average uncached prompt).
fn queue_of(ledger: &Ledger, others: usize, others_waiting: usize) -> Queue {
    Queue {
        queue_tokens: ledger.pending_prefill_tokens.max(0.0)
            + others_waiting as f64 * ledger.avg_uncached.max(0.0),
        running: ledger.in_flight + others,
        others,
        others_waiting,
    }
}

/// A candidate as the choice sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scored {
    /// What the choice minimises ([`Estimate::cost_s`]), seconds.
    pub cost_s: f64,
    /// Requests in flight on the worker (the larger of the gateway's ledger and the agent's view).
    pub load: usize,
    /// Cached prompt tokens on the worker.
    pub cached_tokens: usize,
    /// Blocks the worker's cache holds (any prompt's), as the index knows them.
    pub held_blocks: usize,
}

/// Why the choice went where it did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// The chosen worker is strictly best and holds part of the prompt.
    CacheHit,
    /// The chosen worker is strictly best without a cache advantage.
    LeastLoaded,
    /// Several workers were within the near-tie band; the prompt's leading tokens chose one
    /// (rendezvous hashing, the same choice on every replica), or a random draw.
    TieSpread,
    /// The best estimate was on a worker over the load guard.
    LoadGuard,
    /// The worker of the conversation's previous turn, within the session slack of the best.
    Session,
    /// The worker holding the stored answer the request continues (`previous_response_id`): the
    /// only one that can serve it ([`super::sessions`]).
    PreviousResponse,
}

impl Why {
    /// The reason label.
    pub fn as_str(self) -> &'static str {
        match self {
            Why::CacheHit => "cache_hit",
            Why::LeastLoaded => "least_loaded",
            Why::TieSpread => "tie_spread",
            Why::LoadGuard => "load_guard",
            Why::Session => "session",
            Why::PreviousResponse => "previous_response",
        }
    }
}

/// Whether a candidate with `load` passes the guard given the least load `min`.
pub fn within_guard(load: usize, min: usize, cfg: &EstimatorConfig) -> bool {
    let slack = cfg.guard_abs.max((cfg.guard_rel * min as f64) as usize);
    load <= min.saturating_add(slack)
}

/// Picks among `scored` (non-empty), near-ties drawn at random. Returns the index and why.
pub fn choose(
    scored: &[Scored],
    cfg: &EstimatorConfig,
    rng: &mut impl Rng,
) -> Option<(usize, Why)> {
    choose_spread(scored, cfg, rng, None)
}

/// Picks among `scored` (non-empty); near-ties go to the candidate `rank` puts highest (the router
/// ranks them by the prompt's leading tokens and the worker's URL, rendezvous hashing), else to a
/// random one. Returns the index and why.
///
/// With a rank, replicas that each see the same near-tie send the same new prefix to the same
/// worker without having heard from each other (a burst of one prefix through N replicas stays on
/// one worker), and different prefixes still spread evenly, like the random draw.
pub fn choose_spread(
    scored: &[Scored],
    cfg: &EstimatorConfig,
    rng: &mut impl Rng,
    rank: Option<&dyn Fn(usize) -> u64>,
) -> Option<(usize, Why)> {
    let min_load = scored.iter().map(|s| s.load).min()?;
    let best_any = scored
        .iter()
        .enumerate()
        .min_by(|a, b| a.1.cost_s.total_cmp(&b.1.cost_s))
        .map(|(i, _)| i)?;
    let eligible = |s: &Scored| within_guard(s.load, min_load, cfg);
    let best = scored
        .iter()
        .filter(|s| eligible(s))
        .map(|s| s.cost_s)
        .min_by(f64::total_cmp)?;
    let band = best + cfg.tie_rel * best.abs() + cfg.tie_abs_s;
    let ties: Vec<usize> = scored
        .iter()
        .enumerate()
        .filter(|(_, s)| eligible(s) && s.cost_s <= band)
        .map(|(i, _)| i)
        .collect();
    // Among near-equal estimates, the one holding more of the prompt costs the cluster less prefill
    // (and keeps a burst of one prefix together); spread only what is equal in that too.
    let most_cached = ties
        .iter()
        .map(|i| scored[*i].cached_tokens)
        .max()
        .unwrap_or(0);
    let ties: Vec<usize> = ties
        .into_iter()
        .filter(|i| scored[*i].cached_tokens == most_cached)
        .collect();
    // A prompt that goes in cold is best stored where it evicts least: the emptiest cache (near-equal
    // ones are drawn at random). A random draw let caches fill unevenly, and the fullest one then
    // evicted prefixes the next requests needed.
    let emptiest = ties
        .iter()
        .map(|i| scored[*i].held_blocks)
        .min()
        .unwrap_or(0);
    let room = emptiest + (emptiest / 50).max(cfg.tie_held_blocks);
    let ties: Vec<usize> = ties
        .into_iter()
        .filter(|i| scored[*i].held_blocks <= room)
        .collect();
    let pick = match (ties.len(), rank) {
        (0, _) => return None,
        (1, _) => ties[0],
        (_, Some(rank)) => *ties.iter().max_by_key(|i| rank(**i))?,
        (n, None) => ties[rng.random_range(0..n)],
    };
    let why = if !eligible(&scored[best_any]) {
        Why::LoadGuard
    } else if ties.len() > 1 {
        Why::TieSpread
    } else if scored[pick].cached_tokens > 0 {
        Why::CacheHit
    } else {
        Why::LeastLoaded
    };
    Some((pick, why))
}

/// Seconds the session's worker may exceed the best cost by, beside [`SessionsConfig::slack`]'s
/// fraction: below this, estimates differ by less than their own error.
///
/// [`SessionsConfig::slack`]: super::sessions::SessionsConfig::slack
pub const SESSION_SLACK_ABS_S: f64 = 0.05;

/// Whether a conversation goes back to `session` (the index in `scored` of the worker its previous
/// turn went to) instead of `pick`: when that worker passes the load guard and its cost is at most
/// `slack` (a fraction) plus [`SESSION_SLACK_ABS_S`] above the pick's. A soft signal: a worker clearly
/// faster (a queue ahead of the conversation's worker worth more than the slack) still wins.
pub fn prefer_session(
    scored: &[Scored],
    pick: usize,
    session: usize,
    slack: f64,
    cfg: &EstimatorConfig,
) -> bool {
    let (Some(best), Some(held)) = (scored.get(pick), scored.get(session)) else {
        return false;
    };
    let Some(min_load) = scored.iter().map(|s| s.load).min() else {
        return false;
    };
    session != pick
        && within_guard(held.load, min_load, cfg)
        && held.cost_s <= best.cost_s * (1.0 + slack.max(0.0)) + SESSION_SLACK_ABS_S
}

#[cfg(test)]
mod tests;
