//! Token rate limits: token buckets over requests, input tokens and output tokens, per tenant and per
//! tenant + model.
//!
//! Each configured per-minute limit is a bucket of capacity `limit x burst_seconds / 60` (a full
//! minute's worth by default) refilled continuously at `limit / 60` per second. A request is admitted
//! only if *every* bucket that applies to it (tenant-wide and tenant + model, each of requests,
//! input, output) holds what it asks for; then all of them are debited at once (all or nothing, so a
//! rejected request costs nothing). Amounts larger than a bucket's capacity are clamped to it, so a
//! single large request is never refused forever.
//!
//! What is debited at admission, and reconciled later:
//! - requests: 1;
//! - input tokens: the prompt's size at admission (`PromptTokens::size`: the gateway's tokenizer
//!   count, else about four bytes per token), corrected to the router's count
//!   (`Decision::prompt_tokens`) when a worker's `/tokenize` counted later, and to the worker's
//!   `usage.prompt_tokens` when the request ends;
//! - output tokens: a reservation of the request's `max_tokens` (or `default_output_reservation`
//!   when it has none), charged further while a stream runs past it (every
//!   [`STREAM_CHARGE_STEP`] tokens) and settled to the worker's `usage.completion_tokens` at the end
//!   (the unused part is refunded).
//!
//! Overshoot: reconciliation may push a bucket below zero (debt); admission then waits until it has
//! refilled, so over any window the admitted amount exceeds `rate x window + capacity` by at most
//! what requests in flight consumed beyond their reservation: zero for output tokens of requests
//! with `max_tokens` (the worker cannot exceed it), at most `max_model_len - reservation` per
//! in-flight request without it, and the estimate's error for input tokens until routing corrects
//! it (microseconds later). Streams past their reservation are charged as they go, so the *next*
//! admission already sees it.
//!
//! The buckets live in a [`LocalBuckets`] map (one gateway) or in Redis
//! ([`super::store::RedisStore`], several replicas); both implement the same arithmetic
//! ([`Bucket`]) so that tests of one hold for the other.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use kinference_crds::RateLimits;
use parking_lot::Mutex;
use serde::Deserialize;

/// Output tokens a stream may run past its reservation before it is charged again.
pub const STREAM_CHARGE_STEP: u64 = 32;

/// What a limit counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dim {
    /// Requests per minute.
    Requests,
    /// Prompt tokens per minute.
    InputTokens,
    /// Generated tokens per minute.
    OutputTokens,
}

impl Dim {
    /// Label value and key part.
    pub fn as_str(self) -> &'static str {
        match self {
            Dim::Requests => "requests",
            Dim::InputTokens => "input_tokens",
            Dim::OutputTokens => "output_tokens",
        }
    }
}

/// What one request asks of its buckets.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Demand {
    /// Requests (1 at admission, 0 in adjustments).
    pub requests: f64,
    /// Input tokens.
    pub input: f64,
    /// Output tokens.
    pub output: f64,
}

impl Demand {
    fn get(&self, dim: Dim) -> f64 {
        match dim {
            Dim::Requests => self.requests,
            Dim::InputTokens => self.input,
            Dim::OutputTokens => self.output,
        }
    }
}

/// Per-model limits and burst, beyond what `InferenceTenant.spec.limits` holds (gateway.yaml
/// `tenancy.tenants.<name>`).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TenantSettings {
    /// Limits per served model (keyed by the name the workers serve: a request by alias or class
    /// counts against the model that serves it), on top of the tenant-wide ones.
    #[serde(default)]
    pub models: BTreeMap<String, ModelLimits>,
    /// Bucket capacity in seconds of the rate (default 60: a full minute's worth may come at once).
    #[serde(default)]
    pub burst_seconds: Option<f64>,
    /// What to do when the shared store (Redis) cannot be reached or answer in time: `closed` (503,
    /// the default: a limit is never silently lifted) or `open` (admit without limits).
    #[serde(default)]
    pub on_store_unavailable: FailMode,
    /// What to do while the usage journal cannot be written (a full disk): `serve` or `refuse`
    /// (503). Default: `tenancy.journal.on_usage_unrecorded`.
    #[serde(default)]
    pub on_usage_unrecorded: Option<OnUnrecorded>,
}

/// Per-minute limits of one tenant + model.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ModelLimits {
    /// Prompt tokens per minute.
    #[serde(default)]
    pub input_tokens_per_minute: Option<u64>,
    /// Generated tokens per minute.
    #[serde(default)]
    pub output_tokens_per_minute: Option<u64>,
    /// Requests per minute.
    #[serde(default)]
    pub requests_per_minute: Option<u64>,
}

impl From<&RateLimits> for ModelLimits {
    fn from(l: &RateLimits) -> Self {
        ModelLimits {
            input_tokens_per_minute: l.input_tokens_per_minute,
            output_tokens_per_minute: l.output_tokens_per_minute,
            requests_per_minute: l.requests_per_minute,
        }
    }
}

impl ModelLimits {
    fn per_minute(&self, dim: Dim) -> Option<u64> {
        match dim {
            Dim::Requests => self.requests_per_minute,
            Dim::InputTokens => self.input_tokens_per_minute,
            Dim::OutputTokens => self.output_tokens_per_minute,
        }
        .filter(|n| *n > 0)
    }
}

/// Behaviour when the shared limit store is unreachable.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FailMode {
    /// Admit without limits (and count it in `kinference_gateway_tenant_limit_store_errors_total`).
    Open,
    /// Refuse with 503 until the store is back (the default).
    #[default]
    Closed,
}

/// What a tenant's requests get while its usage cannot be written (a full disk): the default is
/// `tenancy.journal.on_usage_unrecorded`, which the journal holds.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OnUnrecorded {
    /// Serve them; their records wait in the bounded buffer, and what overflows it is counted lost
    /// (the default: a full disk does not stop inference).
    #[default]
    Serve,
    /// Refuse new requests with 503 in the client's protocol until a write succeeds again.
    Refuse,
}

/// One bucket a request touches: its store key, parameters, and the amount asked.
#[derive(Debug, Clone, PartialEq)]
pub struct Take {
    /// Store key (`kinf:rl:{tenant}:<model or *>:<dim>`; the braces keep a tenant on one Redis
    /// cluster slot).
    pub key: String,
    /// What it counts.
    pub dim: Dim,
    /// Whether it is a tenant + model bucket.
    pub per_model: bool,
    /// Refill per second.
    pub rate_per_s: f64,
    /// Capacity.
    pub capacity: f64,
    /// Amount asked (clamped to the capacity at admission; may be negative in adjustments).
    pub amount: f64,
}

/// The buckets that apply to `tenant` asking `demand` for `model`.
pub fn takes(
    tenant: &str,
    tenant_limits: Option<&RateLimits>,
    settings: &TenantSettings,
    model: &str,
    demand: Demand,
) -> Vec<Take> {
    let tenant_wide = tenant_limits.map(ModelLimits::from);
    let mut out = scope_takes(tenant, tenant_wide.as_ref(), settings, "*", false, demand);
    out.extend(model_takes(tenant, settings, model, demand));
    out
}

/// The tenant + model buckets of `model` alone (empty when the tenant has no limits for it).
pub fn model_takes(
    tenant: &str,
    settings: &TenantSettings,
    model: &str,
    demand: Demand,
) -> Vec<Take> {
    scope_takes(
        tenant,
        settings.models.get(model),
        settings,
        model,
        true,
        demand,
    )
}

fn scope_takes(
    tenant: &str,
    limits: Option<&ModelLimits>,
    settings: &TenantSettings,
    scope: &str,
    per_model: bool,
    demand: Demand,
) -> Vec<Take> {
    let burst = settings.burst_seconds.filter(|b| *b > 0.0).unwrap_or(60.0);
    let Some(limits) = limits else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for dim in [Dim::Requests, Dim::InputTokens, Dim::OutputTokens] {
        let Some(per_minute) = limits.per_minute(dim) else {
            continue;
        };
        let rate_per_s = per_minute as f64 / 60.0;
        out.push(Take {
            key: format!("kinf:rl:{{{tenant}}}:{scope}:{}", dim.as_str()),
            dim,
            per_model,
            rate_per_s,
            capacity: (rate_per_s * burst).max(1.0),
            amount: demand.get(dim),
        });
    }
    out
}

/// A bucket's level after an operation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Level {
    /// Tokens (or requests) left; negative while in debt.
    pub remaining: f64,
}

/// The answer to an admission.
#[derive(Debug, Clone, PartialEq)]
pub enum LimitVerdict {
    /// Every bucket had enough; levels after the debit, in the order of the takes.
    Admitted(Vec<Level>),
    /// Some bucket had not; nothing was debited.
    Limited {
        /// Seconds until the emptiest bucket holds enough.
        retry_after_s: f64,
        /// The take that refused (index into the takes).
        refused: usize,
        /// Levels now, in the order of the takes.
        levels: Vec<Level>,
    },
}

/// One bucket's state: a level at a time (seconds on the store's clock).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    /// Level at `at`.
    pub tokens: f64,
    /// When `tokens` was computed.
    pub at: f64,
}

impl Bucket {
    /// A full bucket.
    pub fn full(capacity: f64, now: f64) -> Self {
        Bucket {
            tokens: capacity,
            at: now,
        }
    }

    /// The level at `now` (refilled, capped).
    pub fn level(&self, now: f64, rate_per_s: f64, capacity: f64) -> f64 {
        (self.tokens + (now - self.at).max(0.0) * rate_per_s).min(capacity)
    }
}

/// The admission arithmetic over current levels: `Ok(())` or `(retry_after_s, refused)`.
pub fn decide(takes: &[Take], levels: &[f64]) -> Result<(), (f64, usize)> {
    let mut worst: Option<(f64, usize)> = None;
    for (i, (t, level)) in takes.iter().zip(levels).enumerate() {
        let need = t.amount.min(t.capacity);
        if need > 0.0 && *level < need {
            let wait = (need - level) / t.rate_per_s;
            if worst.is_none_or(|(w, _)| wait > w) {
                worst = Some((wait, i));
            }
        }
    }
    match worst {
        None => Ok(()),
        Some(w) => Err(w),
    }
}

/// Buckets in this process (one gateway replica, the embedded default).
#[derive(Debug)]
pub struct LocalBuckets {
    epoch: Instant,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl Default for LocalBuckets {
    fn default() -> Self {
        LocalBuckets {
            epoch: Instant::now(),
            buckets: Mutex::new(HashMap::new()),
        }
    }
}

impl LocalBuckets {
    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    /// Admits `takes` all or nothing.
    pub fn admit(&self, takes: &[Take]) -> LimitVerdict {
        self.admit_at(takes, self.now())
    }

    /// [`LocalBuckets::admit`] at a given time (seconds since the map was made).
    pub(crate) fn admit_at(&self, takes: &[Take], now: f64) -> LimitVerdict {
        let mut map = self.buckets.lock();
        let levels: Vec<f64> = takes
            .iter()
            .map(|t| {
                map.get(&t.key)
                    .map_or(t.capacity, |b| b.level(now, t.rate_per_s, t.capacity))
            })
            .collect();
        match decide(takes, &levels) {
            Ok(()) => {
                let mut out = Vec::with_capacity(takes.len());
                for (t, level) in takes.iter().zip(&levels) {
                    let tokens = level - t.amount.min(t.capacity);
                    map.insert(t.key.clone(), Bucket { tokens, at: now });
                    out.push(Level { remaining: tokens });
                }
                LimitVerdict::Admitted(out)
            }
            Err((retry_after_s, refused)) => LimitVerdict::Limited {
                retry_after_s,
                refused,
                levels: levels.iter().map(|l| Level { remaining: *l }).collect(),
            },
        }
    }

    /// Debits (positive amounts) or refunds (negative) without checking: reconciliation.
    pub fn adjust(&self, takes: &[Take]) {
        self.adjust_at(takes, self.now());
    }

    /// [`LocalBuckets::adjust`] at a given time.
    pub(crate) fn adjust_at(&self, takes: &[Take], now: f64) {
        let mut map = self.buckets.lock();
        for t in takes {
            if t.amount == 0.0 {
                continue;
            }
            let level = map
                .get(&t.key)
                .map_or(t.capacity, |b| b.level(now, t.rate_per_s, t.capacity));
            let tokens = (level - t.amount).min(t.capacity);
            map.insert(t.key.clone(), Bucket { tokens, at: now });
        }
    }
}

#[cfg(test)]
mod tests;
