//! Usage and cost per tenant / model / pool / provider: the record of one finished request, the
//! prices that turn it into cost, and the aggregates the admin API (`GET /admin/usage`) answers from.
//!
//! Token figures are the worker's own (`usage.prompt_tokens`, `prompt_tokens_details.cached_tokens`,
//! `completion_tokens`), so they add up to the workers' `vllm:*_tokens_total` counters. Only when a
//! stream ended before the worker's usage chunk (the client went away, the worker broke) are they the
//! gateway's: its prompt token count and the text chunks it relayed; such records say
//! `"estimated": true`.

use std::collections::BTreeMap;

use kinference_crds::TokenPrices;
use serde::{Deserialize, Serialize};

/// One finished request (a line of the journal).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageRecord {
    /// Request id (made by the gateway; unique).
    pub id: String,
    /// End time, Unix milliseconds.
    pub ts_ms: u64,
    /// Tenant (`anonymous` when the gateway is open).
    pub tenant: String,
    /// Requested model.
    pub model: String,
    /// The `InferencePool` that served it ("" when unknown or none).
    #[serde(default)]
    pub pool: String,
    /// The `InferenceProvider` that served it ("" for local pools).
    #[serde(default)]
    pub provider: String,
    /// Final HTTP status (499: client went away).
    pub status: u16,
    /// 1 (a field so that aggregates are sums of records).
    pub requests: u64,
    /// Prompt tokens that were prefilled.
    pub input_uncached: u64,
    /// Prompt tokens served from the prefix cache.
    pub input_cached: u64,
    /// Generated tokens.
    pub output: u64,
    /// Cost in the prices' currency.
    pub cost: f64,
    /// The token figures are the gateway's, not the worker's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub estimated: bool,
}

/// Separator of the group fields in Redis hash fields.
pub const SEP: char = '\u{1f}';

impl UsageRecord {
    /// `tenant SEP model SEP pool SEP provider` (the Redis aggregate's field prefix).
    pub fn group_field(&self) -> String {
        format!(
            "{}{SEP}{}{SEP}{}{SEP}{}",
            self.tenant, self.model, self.pool, self.provider
        )
    }
}

/// Cost of the given tokens at `prices` (per million tokens).
pub fn cost(prices: Option<&TokenPrices>, uncached: u64, cached: u64, output: u64) -> f64 {
    let Some(p) = prices else { return 0.0 };
    (uncached as f64 * p.uncached_input_per_million
        + cached as f64 * p.cached_input_per_million
        + output as f64 * p.output_per_million)
        / 1e6
}

/// Summed figures of a group.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Totals {
    /// Requests.
    pub requests: u64,
    /// Prefilled prompt tokens.
    pub input_uncached_tokens: u64,
    /// Cached prompt tokens.
    pub input_cached_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Cost.
    pub cost: f64,
}

impl Totals {
    /// Adds one record.
    pub fn add(&mut self, r: &UsageRecord) {
        self.requests += r.requests;
        self.input_uncached_tokens += r.input_uncached;
        self.input_cached_tokens += r.input_cached;
        self.output_tokens += r.output;
        self.cost += r.cost;
    }

    /// Adds another total.
    pub fn merge(&mut self, o: &Totals) {
        self.requests += o.requests;
        self.input_uncached_tokens += o.input_uncached_tokens;
        self.input_cached_tokens += o.input_cached_tokens;
        self.output_tokens += o.output_tokens;
        self.cost += o.cost;
    }
}

/// The grouping of the aggregates.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Group {
    /// Tenant.
    pub tenant: String,
    /// Model.
    pub model: String,
    /// Pool.
    pub pool: String,
    /// Provider.
    pub provider: String,
}

impl Group {
    /// Parses [`UsageRecord::group_field`].
    pub fn from_field(field: &str) -> Option<Group> {
        let mut parts = field.split(SEP);
        Some(Group {
            tenant: parts.next()?.to_string(),
            model: parts.next()?.to_string(),
            pool: parts.next()?.to_string(),
            provider: parts.next()?.to_string(),
        })
    }
}

/// In-memory aggregates per minute and group (what replay and live requests build).
#[derive(Debug, Default)]
pub struct Aggregates {
    /// Minute (Unix ms / 60000) -> group -> totals.
    minutes: BTreeMap<u64, BTreeMap<Group, Totals>>,
}

impl Aggregates {
    /// Adds one record.
    pub fn add(&mut self, r: &UsageRecord) {
        let group = Group {
            tenant: r.tenant.clone(),
            model: r.model.clone(),
            pool: r.pool.clone(),
            provider: r.provider.clone(),
        };
        self.minutes
            .entry(r.ts_ms / 60_000)
            .or_default()
            .entry(group)
            .or_default()
            .add(r);
    }

    /// Totals per group of records with `from_ms <= ts < to_ms` (to the minute), optionally of one
    /// tenant.
    pub fn query(&self, tenant: Option<&str>, from_ms: u64, to_ms: u64) -> BTreeMap<Group, Totals> {
        let mut out: BTreeMap<Group, Totals> = BTreeMap::new();
        let (from, to) = (from_ms / 60_000, to_ms.div_ceil(60_000));
        for (_, groups) in self.minutes.range(from..to.max(from)) {
            for (g, t) in groups {
                if tenant.is_some_and(|want| want != g.tenant) {
                    continue;
                }
                out.entry(g.clone()).or_default().merge(t);
            }
        }
        out
    }
}

/// The JSON answer of `GET /admin/usage`.
pub fn report(
    groups: &BTreeMap<Group, Totals>,
    from_ms: u64,
    to_ms: u64,
    source: &str,
) -> serde_json::Value {
    let mut total = Totals::default();
    let rows: Vec<serde_json::Value> = groups
        .iter()
        .map(|(g, t)| {
            total.merge(t);
            serde_json::json!({
                "tenant": g.tenant, "model": g.model, "pool": g.pool, "provider": g.provider,
                "requests": t.requests,
                "input_uncached_tokens": t.input_uncached_tokens,
                "input_cached_tokens": t.input_cached_tokens,
                "output_tokens": t.output_tokens,
                "cost": t.cost,
            })
        })
        .collect();
    serde_json::json!({
        "from": super::budget::rfc3339(from_ms),
        "to": super::budget::rfc3339(to_ms),
        "source": source,
        "usage": rows,
        "total": total,
    })
}

#[cfg(test)]
mod tests;
