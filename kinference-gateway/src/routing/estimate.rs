//! The time-to-first-token estimate per candidate worker, the rates it learns, and the final choice.
//!
//! Model: `ttft = overhead + seconds_per_token * work`, where
//! `work = queued prefill tokens ahead + this request's uncached tokens + K * running requests`.
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
//! Choice: the minimum estimate among workers that pass the load guard. Near-ties (within 3% + 1 ms)
//! go to the one holding most of the prompt (less prefill for the cluster), and what is still equal is
//! drawn at random so cache misses do not all land on the same replica. The load guard (as in
//! AIBrix: least-loaded when max - min running > 16; SGLang: balance when max - min > 64 and max > 1.5
//! min) excludes workers whose in-flight count exceeds `min + max(16, min)`: estimates can be wrong,
//! and piling without bound onto one worker is the failure mode users report most.

use rand::Rng;

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
    /// Load guard: a worker may exceed the least loaded one by `max(guard_abs, guard_rel * min)`.
    pub guard_abs: usize,
    /// Load guard, relative part.
    pub guard_rel: f64,
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
            guard_abs: 16,
            guard_rel: 1.0,
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
}

impl Rates {
    /// The priors.
    pub fn prior(cfg: &EstimatorConfig) -> Self {
        Self {
            s_per_token: (1.0 / cfg.prior_tokens_per_s.max(1.0))
                .clamp(MIN_S_PER_TOKEN, MAX_S_PER_TOKEN),
            overhead_s: cfg.prior_overhead_s.clamp(0.0, MAX_OVERHEAD_S),
            samples: 0,
        }
    }

    /// Learns from one observed TTFT of a request whose `work` (tokens, as estimated at decision) is
    /// known.
    pub fn observe(&mut self, ttft_s: f64, work: f64, cfg: &EstimatorConfig) {
        if !ttft_s.is_finite() || ttft_s < 0.0 || !work.is_finite() || work < 0.0 {
            return;
        }
        let alpha = (1.0 / (self.samples as f64 + 2.0)).max(0.1);
        if work >= cfg.rate_sample_min_work {
            let sample = ((ttft_s - self.overhead_s).max(0.0) / work)
                .clamp(self.s_per_token / 3.0, self.s_per_token * 3.0);
            self.s_per_token = ((1.0 - alpha) * self.s_per_token + alpha * sample)
                .clamp(MIN_S_PER_TOKEN, MAX_S_PER_TOKEN);
        } else {
            let floor = self.overhead_s / 3.0;
            let ceil = (self.overhead_s * 3.0).max(self.overhead_s + 0.001);
            let sample = (ttft_s - self.s_per_token * work).clamp(floor, ceil);
            self.overhead_s =
                ((1.0 - alpha) * self.overhead_s + alpha * sample).clamp(0.0, MAX_OVERHEAD_S);
        }
        self.samples += 1;
    }
}

/// What the estimate needs to know about one candidate.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Inputs {
    /// Prompt tokens of this request.
    pub prompt_tokens: usize,
    /// Of which the worker holds (or will hold) in its prefix cache.
    pub cached_tokens: usize,
    /// Prefill tokens already admitted ahead of this request.
    pub queue_tokens: f64,
    /// Requests running (decoding or prefilling) on the worker.
    pub running: usize,
}

/// One candidate's estimate.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Estimate {
    /// Work in tokens (queue + uncached + decode interference).
    pub work: f64,
    /// Seconds of the estimate spent waiting for work ahead.
    pub queue_s: f64,
    /// Estimated time to first token, seconds.
    pub ttft_s: f64,
}

/// Estimates one candidate.
pub fn estimate(rates: &Rates, inputs: &Inputs, cfg: &EstimatorConfig) -> Estimate {
    let uncached = inputs.prompt_tokens.saturating_sub(inputs.cached_tokens) as f64;
    let ahead = inputs.queue_tokens.max(0.0) + cfg.running_token_equiv * inputs.running as f64;
    let work = ahead + uncached;
    Estimate {
        work,
        queue_s: ahead * rates.s_per_token,
        ttft_s: rates.overhead_s + work * rates.s_per_token,
    }
}

/// A candidate as the choice sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scored {
    /// Estimated TTFT, seconds.
    pub ttft_s: f64,
    /// Requests in flight on the worker (the larger of the gateway's ledger and the agent's view).
    pub load: usize,
    /// Cached prompt tokens on the worker.
    pub cached_tokens: usize,
}

/// Why the choice went where it did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// The chosen worker is strictly best and holds part of the prompt.
    CacheHit,
    /// The chosen worker is strictly best without a cache advantage.
    LeastLoaded,
    /// Several workers were within the near-tie band; one was drawn at random.
    TieSpread,
    /// The best estimate was on a worker over the load guard.
    LoadGuard,
}

impl Why {
    /// The reason label.
    pub fn as_str(self) -> &'static str {
        match self {
            Why::CacheHit => "cache_hit",
            Why::LeastLoaded => "least_loaded",
            Why::TieSpread => "tie_spread",
            Why::LoadGuard => "load_guard",
        }
    }
}

/// Whether a candidate with `load` passes the guard given the least load `min`.
pub fn within_guard(load: usize, min: usize, cfg: &EstimatorConfig) -> bool {
    let slack = cfg.guard_abs.max((cfg.guard_rel * min as f64) as usize);
    load <= min.saturating_add(slack)
}

/// Picks among `scored` (non-empty). Returns the index and why.
pub fn choose(
    scored: &[Scored],
    cfg: &EstimatorConfig,
    rng: &mut impl Rng,
) -> Option<(usize, Why)> {
    let min_load = scored.iter().map(|s| s.load).min()?;
    let best_any = scored
        .iter()
        .enumerate()
        .min_by(|a, b| a.1.ttft_s.total_cmp(&b.1.ttft_s))
        .map(|(i, _)| i)?;
    let eligible = |s: &Scored| within_guard(s.load, min_load, cfg);
    let best = scored
        .iter()
        .filter(|s| eligible(s))
        .map(|s| s.ttft_s)
        .min_by(f64::total_cmp)?;
    let band = best + cfg.tie_rel * best.abs() + cfg.tie_abs_s;
    let ties: Vec<usize> = scored
        .iter()
        .enumerate()
        .filter(|(_, s)| eligible(s) && s.ttft_s <= band)
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
    let pick = match ties.len() {
        0 => return None,
        1 => ties[0],
        n => ties[rng.random_range(0..n)],
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

#[cfg(test)]
mod tests;
