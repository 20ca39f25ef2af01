//! Per-tenant metrics (`kinference_gateway_tenant_*`), registered in the gateway's registry.
//!
//! Cardinality is bounded: the `tenant` label is a configured tenant's name, `anonymous` (open
//! gateway), `unauthenticated` (401s) or `other` (past [`MAX_TENANT_LABELS`] tenants); the `model`
//! label is a served model or `other`; `reason`, `limit` and `scope` are fixed sets. Never a key.
//!
//! Counters are always exported; the five histograms per tenant and model (about 100 series for each
//! pair: 18 or 16 buckets plus sum and count) only with `tenancy.per_tenant_histograms: true`. The
//! gateway-wide latency histograms (`kinference_gateway_*_seconds`, by model and worker) answer the
//! fleet's questions; per-tenant latency distributions are the opt-in for who needs them.
//!
//! What each tenant spends (`..._tenant_cost_total`, `..._tenant_budget_spent`) is on the page only
//! with `--metrics-tenant-spend`: `/metrics` is open to whoever reaches the admin port unless
//! `--admin-key-for-metrics`, while spend is the admin API's to tell (`/admin/usage`, behind the admin
//! key or the tenant's own). The families are kept either way (the settlement records into them).

use kinference_api::metrics::Described;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[cfg(test)]
mod tests;

/// Tenants beyond this many (in name order) share the label value `other`.
pub const MAX_TENANT_LABELS: usize = 500;

/// `{tenant, model}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantModel {
    /// Tenant label.
    pub tenant: String,
    /// Model label.
    pub model: String,
}

/// `{tenant, model, status}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantStatus {
    /// Tenant label.
    pub tenant: String,
    /// Model label.
    pub model: String,
    /// HTTP status.
    pub status: u16,
}

/// `{tenant, model, cache}`: cached or uncached prompt tokens.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantCache {
    /// Tenant label.
    pub tenant: String,
    /// Model label.
    pub model: String,
    /// `cached` or `uncached`.
    pub cache: &'static str,
}

/// `{tenant, model, pool, provider}`: cost.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantBackend {
    /// Tenant label.
    pub tenant: String,
    /// Model label.
    pub model: String,
    /// Pool ("" when none).
    pub pool: String,
    /// Provider ("" when none).
    pub provider: String,
}

/// `{tenant, reason}`: routing decision reasons.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantReason {
    /// Tenant label.
    pub tenant: String,
    /// Model label.
    pub model: String,
    /// The router's reason (`cache_hit`, `least_loaded`, ...).
    pub reason: String,
}

/// `{tenant, limit, scope}`: rejections.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLimit {
    /// Tenant label.
    pub tenant: String,
    /// `requests`, `input_tokens`, `output_tokens` or `budget`.
    pub limit: &'static str,
    /// `tenant` (tenant-wide) or `model` (tenant + model).
    pub scope: &'static str,
}

/// `{tenant, policy, outcome}`: policy matches and rejects (the policy stage reports them).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantPolicy {
    /// Tenant label.
    pub tenant: String,
    /// Policy (and rule) that decided, or `default`.
    pub policy: String,
    /// `route`, `reject`, `burst`, ...
    pub outcome: String,
}

/// `{reason}`: authentication failures.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AuthFailure {
    /// `missing` or `unknown`.
    pub reason: &'static str,
}

/// `{mode}`: limit store failures.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreFailure {
    /// `open` (admitted anyway) or `closed` (refused).
    pub mode: &'static str,
}

/// `{tenant}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantOnly {
    /// Tenant label.
    pub tenant: String,
}

type Hist = Family<TenantModel, Histogram, fn() -> Histogram>;

fn latency() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

fn itl() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 16))
}

fn token_sizes() -> Histogram {
    // 1 .. ~131k tokens
    Histogram::new(exponential_buckets(1.0, 2.0, 18))
}

/// The per-tenant histograms, present only when they are on.
#[derive(Debug, Clone)]
pub(super) struct TenantHistograms {
    input_size: Hist,
    output_size: Hist,
    ttft: Hist,
    itl: Hist,
    e2e: Hist,
}

/// The per-tenant families.
#[derive(Debug, Clone)]
pub struct TenancyMetrics {
    pub(super) requests: Family<TenantStatus, Counter>,
    pub(super) input_tokens: Family<TenantCache, Counter>,
    pub(super) output_tokens: Family<TenantModel, Counter>,
    /// `None` unless `tenancy.per_tenant_histograms`: nothing is observed, no series exists.
    histograms: Option<TenantHistograms>,
    pub(super) cost: Family<TenantBackend, Counter<f64, std::sync::atomic::AtomicU64>>,
    pub(super) decisions: Family<TenantReason, Counter>,
    pub(super) rejections: Family<TenantLimit, Counter>,
    pub(super) policy: Family<TenantPolicy, Counter>,
    pub(super) auth_failures: Family<AuthFailure, Counter>,
    pub(super) store_errors: Family<StoreFailure, Counter>,
    pub(super) spend: Family<TenantOnly, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub(super) tenants: Gauge,
}

impl TenancyMetrics {
    /// Creates the families and registers them under `kinference_gateway_tenant_*`; the histograms
    /// only when `histograms` is on, the cost and budget spent only when `spend` is.
    pub fn register(registry: &mut Registry, histograms: bool, spend: bool) -> Self {
        let m = TenancyMetrics {
            requests: Family::default(),
            input_tokens: Family::default(),
            output_tokens: Family::default(),
            histograms: histograms.then(|| TenantHistograms {
                input_size: Family::new_with_constructor(token_sizes as fn() -> Histogram),
                output_size: Family::new_with_constructor(token_sizes as fn() -> Histogram),
                ttft: Family::new_with_constructor(latency as fn() -> Histogram),
                itl: Family::new_with_constructor(itl as fn() -> Histogram),
                e2e: Family::new_with_constructor(latency as fn() -> Histogram),
            }),
            cost: Family::default(),
            decisions: Family::default(),
            rejections: Family::default(),
            policy: Family::default(),
            auth_failures: Family::default(),
            store_errors: Family::default(),
            spend: Family::default(),
            tenants: Gauge::default(),
        };
        let r = registry.sub_registry_with_prefix("kinference_gateway_tenant");
        r.register(
            "requests",
            "Admitted requests by tenant, model and final status (rejections: rate_limited, auth_failures)",
            Described(m.requests.clone()),
        );
        r.register(
            "input_tokens",
            "Prompt tokens by tenant and model, cached (prefix cache) or uncached",
            Described(m.input_tokens.clone()),
        );
        r.register(
            "output_tokens",
            "Generated tokens by tenant and model",
            Described(m.output_tokens.clone()),
        );
        if spend {
            r.register(
                "cost",
                "Cost from the configured prices (cached and uncached prompt tokens priced separately)",
                Described(m.cost.clone()),
            );
            r.register(
                "budget_spent",
                "Spend this calendar month (UTC) as this replica knows it",
                Described(m.spend.clone()),
            );
        }
        r.register(
            "routing_decisions",
            "Routing decisions by tenant, model and the router's reason",
            Described(m.decisions.clone()),
        );
        r.register(
            "rate_limited",
            "Requests refused by a rate limit or an exhausted budget",
            Described(m.rejections.clone()),
        );
        r.register(
            "policy_decisions",
            "Policy matches and rejects by tenant",
            Described(m.policy.clone()),
        );
        r.register(
            "auth_failures",
            "Requests refused with 401 (missing or unknown API key)",
            Described(m.auth_failures.clone()),
        );
        r.register(
            "limit_store_errors",
            "Admissions that could not reach the shared limit store, by fail mode",
            Described(m.store_errors.clone()),
        );
        r.register(
            "configured",
            "Tenants configured (0: the gateway is open)",
            Described(m.tenants.clone()),
        );
        if let Some(h) = &m.histograms {
            r.register(
                "input_tokens_per_request",
                "Prompt size in tokens",
                Described(h.input_size.clone()),
            );
            r.register(
                "output_tokens_per_request",
                "Generated tokens per request",
                Described(h.output_size.clone()),
            );
            r.register(
                "time_to_first_token_seconds",
                "Time from arrival to the first generated token (streams)",
                Described(h.ttft.clone()),
            );
            r.register(
                "inter_token_latency_seconds",
                "Time between two streamed chunks carrying text",
                Described(h.itl.clone()),
            );
            r.register(
                "e2e_request_latency_seconds",
                "Time from arrival to the end of the response",
                Described(h.e2e.clone()),
            );
        }
        m
    }

    /// Records a prompt's and a response's sizes in tokens (histograms on only).
    pub(super) fn observe_sizes(&self, labels: &TenantModel, input: u64, output: u64) {
        if let Some(h) = &self.histograms {
            h.input_size.get_or_create(labels).observe(input as f64);
            h.output_size.get_or_create(labels).observe(output as f64);
        }
    }

    /// Records a time to first token (histograms on only).
    pub(super) fn observe_ttft(&self, labels: &TenantModel, seconds: f64) {
        if let Some(h) = &self.histograms {
            h.ttft.get_or_create(labels).observe(seconds);
        }
    }

    /// Records an inter-token gap (histograms on only).
    pub(super) fn observe_itl(&self, labels: &TenantModel, seconds: f64) {
        if let Some(h) = &self.histograms {
            h.itl.get_or_create(labels).observe(seconds);
        }
    }

    /// Records an end-to-end latency (histograms on only).
    pub(super) fn observe_e2e(&self, labels: &TenantModel, seconds: f64) {
        if let Some(h) = &self.histograms {
            h.e2e.get_or_create(labels).observe(seconds);
        }
    }
}
