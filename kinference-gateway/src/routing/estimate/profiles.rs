//! Engine profiles: what the estimate assumes about one model on one kind of hardware before it has
//! learned anything, and the part of the prefill cost it does not learn.
//!
//! The estimate learns two figures per worker from observed first tokens (seconds per prefill token and
//! a fixed overhead, [`super::Rates`]). A third shapes the prefill itself and is not learned: the cost of
//! attention, which grows with the *pairs* of (new token, token it attends to), not with the tokens.
//! A prompt of `u` new tokens after `c` cached ones computes `u * c + u * (u + 1) / 2` pairs
//! ([`attention_pairs`]). On a large model on a GPU the pairs are a small part of the prefill (the
//! weights' matrix products dominate: about 4% at 2k tokens for a 27B model on an L40S); on a small model
//! they are most of it (the random 3M-parameter Qwen2 on CPU spends half of a 2,048-token prefill in
//! attention), and a prefill cost linear in tokens is then wrong by 30-60% away from the lengths it
//! learned from.
//!
//! A profile gives the priors and the attention cost per pair in prefill-token equivalents. Models
//! without one keep the defaults (`EstimatorConfig`'s priors, no attention term), as before profiles
//! existed. A profile is named in the gateway configuration per model (`models[].profile`).
//!
//! The profiles are the same fits as the simulator's presets (`bench/src/sim/engine/latency.rs`):
//! - `cpu-qwen2-small`: measured on vLLM 0.32 on CPU (`bench/real-vllm/run.sh calibrate`; the fit and
//!   every measured point: `bench/results/real-vllm/calibration-cpu-qwen2-small.md`).
//! - `l40s-27b-fp8`: from published figures (the L40S's 362 dense FP8 TFLOPS and 864 GB/s, a 27B
//!   model's 54 GFLOP per token), not measured here.

/// One profile.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Profile {
    /// The name the configuration uses.
    pub name: &'static str,
    /// Prefill throughput, tokens per second, attention aside (the learned rate's prior).
    pub prefill_tokens_per_s: f64,
    /// Fixed time per request: one engine step and the server's own work (the learned overhead's prior).
    pub overhead_s: f64,
    /// Prefill-token equivalents per attention pair (not learned).
    pub attention_pair_tokens: f64,
}

/// Every profile the configuration may name.
pub const PROFILES: &[Profile] = &[
    Profile {
        name: "cpu-qwen2-small",
        // 72.7 us per token, 80 ns per pair; 10.5 ms per step + 2.9 ms per request outside the steps.
        prefill_tokens_per_s: 1.0 / 72.7e-6,
        overhead_s: 0.0105 + 0.0029,
        attention_pair_tokens: 80.0e-9 / 72.7e-6,
    },
    Profile {
        name: "l40s-27b-fp8",
        // 0.30 ms per token, 13 ns per pair, 30 ms per step.
        prefill_tokens_per_s: 1.0 / 0.000_30,
        overhead_s: 0.030,
        attention_pair_tokens: 13.0e-9 / 0.000_30,
    },
];

/// The profile called `name`.
pub fn profile(name: &str) -> Option<&'static Profile> {
    PROFILES.iter().find(|p| p.name == name)
}

/// The names, for error messages and the configuration reference.
pub fn names() -> Vec<&'static str> {
    PROFILES.iter().map(|p| p.name).collect()
}

/// Attention (query, key) pairs of a causal prefill of `uncached` new tokens after `cached` ones: each
/// new token attends to every token before it and to itself.
pub fn attention_pairs(uncached: f64, cached: f64) -> f64 {
    let u = uncached.max(0.0);
    u * cached.max(0.0) + u * (u + 1.0) / 2.0
}
