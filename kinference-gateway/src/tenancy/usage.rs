//! Usage and cost per tenant / model / pool / provider: the record of one finished request, the
//! prices that turn it into cost, and the aggregates the admin API (`GET /admin/usage`) answers from.
//!
//! Token figures are the worker's own (`usage.prompt_tokens`, `prompt_tokens_details.cached_tokens`,
//! `completion_tokens`), so they add up to the workers' `vllm:*_tokens_total` counters. Only when a
//! stream ended before the worker's usage chunk (the client went away, the worker broke) are they the
//! gateway's: its prompt token count and the text chunks it relayed; such records say
//! `"estimated": true`.

use std::collections::{BTreeMap, HashSet};

use kinference_crds::TokenPrices;
use serde::{Deserialize, Serialize};

/// One finished request (a line of the journal).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageRecord {
    /// Record id (made by the gateway; unique).
    pub id: String,
    /// The request's `x-request-id` (the client's, or made by the gateway; not necessarily unique).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub request_id: String,
    /// End time, Unix milliseconds.
    pub ts_ms: u64,
    /// Tenant (`anonymous` when the gateway is open).
    pub tenant: String,
    /// Requested model.
    pub model: String,
    /// The `InferencePool` that served it ("" when unknown or none); for a split request
    /// (prefill/decode disaggregation), its decode worker's pool, billed the output.
    #[serde(default)]
    pub pool: String,
    /// The pool whose worker computed the prompt of a split request, billed the input ("" for a
    /// request served whole).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub prefill_pool: String,
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
    /// The group of a record.
    pub fn of(r: &UsageRecord) -> Group {
        Group {
            tenant: r.tenant.clone(),
            model: r.model.clone(),
            pool: r.pool.clone(),
            provider: r.provider.clone(),
        }
    }

    /// Where groups past [`MAX_GROUPS`] are counted.
    pub fn other() -> Group {
        let other = || "other".to_string();
        Group {
            tenant: other(),
            model: other(),
            pool: other(),
            provider: other(),
        }
    }

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

/// Distinct groups the in-memory aggregates keep apart; records of further groups are summed
/// under [`Group::other`]. Tenants, models, pools and providers are configured sets, so this is
/// reached only by a configuration far larger than any seen.
pub const MAX_GROUPS: usize = 10_000;

/// Minutes kept at minute resolution; older ones are summed into their hour.
const MINUTES_KEPT: u64 = 24 * 60;

const MINUTE_MS: u64 = 60_000;
const HOUR_MS: u64 = 3_600_000;

/// In-memory aggregates per group: per minute for the last day, per hour before that (what replay
/// and live requests build). Bounded: at most [`MAX_GROUPS`] groups, one day of minutes, and
/// `keep_ms` of hours (older hours are dropped, as the journal's compaction drops old periods).
#[derive(Debug)]
pub struct Aggregates {
    /// Minute (Unix ms / 60000) -> group -> totals.
    minutes: BTreeMap<u64, BTreeMap<Group, Totals>>,
    /// Hour (Unix ms / 3600000) -> group -> totals.
    hours: BTreeMap<u64, BTreeMap<Group, Totals>>,
    groups: HashSet<Group>,
    keep_hours: u64,
}

impl Default for Aggregates {
    fn default() -> Self {
        Aggregates::new(62 * 24 * HOUR_MS)
    }
}

impl Aggregates {
    /// Empty aggregates that keep `keep_ms` of history.
    pub fn new(keep_ms: u64) -> Self {
        Aggregates {
            minutes: BTreeMap::new(),
            hours: BTreeMap::new(),
            groups: HashSet::new(),
            keep_hours: keep_ms.div_ceil(HOUR_MS).max(1),
        }
    }

    /// Adds one record.
    pub fn add(&mut self, r: &UsageRecord) {
        let group = self.bounded(Group::of(r));
        let minute = r.ts_ms / MINUTE_MS;
        let new_minute = !self.minutes.contains_key(&minute);
        self.minutes
            .entry(minute)
            .or_default()
            .entry(group)
            .or_default()
            .add(r);
        if new_minute {
            self.coarsen();
        }
    }

    /// Adds the compacted totals of a period starting at `start_ms` (counted in its first hour).
    pub fn add_totals(&mut self, start_ms: u64, group: Group, totals: &Totals) {
        let group = self.bounded(group);
        self.hours
            .entry(start_ms / HOUR_MS)
            .or_default()
            .entry(group)
            .or_default()
            .merge(totals);
        self.coarsen();
    }

    /// `group`, or [`Group::other`] once [`MAX_GROUPS`] others are known.
    fn bounded(&mut self, group: Group) -> Group {
        if self.groups.contains(&group) {
            return group;
        }
        if self.groups.len() < MAX_GROUPS {
            self.groups.insert(group.clone());
            return group;
        }
        Group::other()
    }

    /// Sums minutes older than a day into hours and drops hours older than `keep_hours`.
    fn coarsen(&mut self) {
        let Some(&newest) = self.minutes.keys().next_back() else {
            return;
        };
        let oldest_minute = newest.saturating_sub(MINUTES_KEPT - 1);
        while let Some(entry) = self.minutes.first_entry() {
            if *entry.key() >= oldest_minute {
                break;
            }
            let (minute, groups) = entry.remove_entry();
            let hour = self.hours.entry(minute * MINUTE_MS / HOUR_MS).or_default();
            for (g, t) in groups {
                hour.entry(g).or_default().merge(&t);
            }
        }
        let newest_hour =
            (newest * MINUTE_MS / HOUR_MS).max(self.hours.keys().next_back().copied().unwrap_or(0));
        let oldest_hour = newest_hour.saturating_sub(self.keep_hours - 1);
        self.hours.retain(|h, _| *h >= oldest_hour);
    }

    /// Totals per group of records with `from_ms <= ts < to_ms`: to the minute over the last day,
    /// to the hour before it. Optionally of one tenant.
    pub fn query(&self, tenant: Option<&str>, from_ms: u64, to_ms: u64) -> BTreeMap<Group, Totals> {
        let mut out: BTreeMap<Group, Totals> = BTreeMap::new();
        let (from, to) = (from_ms / MINUTE_MS, to_ms.div_ceil(MINUTE_MS));
        let (from_h, to_h) = (from_ms / HOUR_MS, to_ms.div_ceil(HOUR_MS));
        let minutes = self.minutes.range(from..to.max(from));
        let hours = self.hours.range(from_h..to_h.max(from_h));
        for (_, groups) in minutes.chain(hours) {
            for (g, t) in groups {
                if tenant.is_some_and(|want| want != g.tenant) {
                    continue;
                }
                out.entry(g.clone()).or_default().merge(t);
            }
        }
        out
    }

    /// Time buckets held (minutes and hours): what bounds this structure's memory.
    pub fn buckets(&self) -> usize {
        self.minutes.len() + self.hours.len()
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
