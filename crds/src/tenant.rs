//! `InferenceTenant`: who may call, how much, and which models.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::{CredentialRef, ResourceStatus};

/// A tenant: its API keys, token rate limits, monthly budget and allowed models.
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[kube(
    group = "kinference.ai",
    version = "v1alpha1",
    kind = "InferenceTenant",
    namespaced,
    status = "ResourceStatus",
    shortname = "itenant",
    category = "kinference",
    printcolumn(
        name = "RPM",
        type_ = "integer",
        json_path = ".spec.limits.requestsPerMinute"
    ),
    printcolumn(
        name = "Budget",
        type_ = "number",
        json_path = ".spec.budget.monthlyLimit"
    ),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "RolledBack",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"RolledBack\")].status"
    ),
    printcolumn(
        name = "Serving",
        type_ = "integer",
        json_path = ".status.activeGeneration"
    ),
    printcolumn(
        name = "Observed",
        type_ = "integer",
        json_path = ".status.observedGeneration",
        priority = 1
    ),
    printcolumn(
        name = "Message",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].message",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferenceTenantSpec {
    /// API keys that authenticate as this tenant.
    #[schemars(length(min = 1))]
    pub api_keys: Vec<CredentialRef>,
    /// Rate limits (absent: unlimited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<RateLimits>,
    /// Spending limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<Budget>,
    /// Models (names or aliases) the tenant may request; empty: all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_models: Vec<String>,
    /// Model classes the tenant may request; empty: all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_classes: Vec<String>,
    /// Who is shed first when a gateway is overloaded: near its in-flight limit a higher-priority
    /// tenant's request is admitted while a lower one's waits briefly, then is refused (503).
    #[serde(default)]
    pub priority: TenantPriority,
    /// Its share of a saturated pool, where the gateway holds requests in its own queue (flow
    /// control): its weight among the tenants of its band, its queue deadline, and whether its
    /// requests may name their own band.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_control: Option<TenantFlowControl>,
    /// Whose requests may hit this tenant's prompts in the workers' prefix caches (absent: this
    /// tenant's alone, whenever the gateway has tenants).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_cache: Option<PromptCache>,
}

/// How a tenant's prompts are kept apart in the workers' prefix caches. The gateway salts every
/// request it sends a worker (vLLM's `cache_salt`) with a value derived from a gateway-side secret
/// and the scope below, so a prompt is a cache hit only for requests of the same scope: no other
/// tenant can learn from `cached_tokens`, or from where it is routed, that it was sent.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PromptCache {
    /// Who shares the cached prompts.
    #[serde(default)]
    pub isolation: CacheIsolation,
    /// The group whose tenants share with each other (`isolation: Group`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub group: Option<String>,
}

/// Whose requests share a tenant's cached prompts.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, JsonSchema, Default)]
pub enum CacheIsolation {
    /// The tenant's own requests only (the default).
    #[default]
    Tenant,
    /// Every tenant naming the same `group`.
    Group,
    /// Every tenant that shares on purpose (no salt: the workers' common cache).
    Shared,
}

/// A tenant's share of an overloaded gateway.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, JsonSchema, Default)]
pub enum TenantPriority {
    /// Admitted up to the gateway's in-flight limit.
    High,
    /// Admitted while some headroom is left for high-priority tenants.
    #[default]
    Medium,
    /// Shed first: admitted while headroom is left for medium and high.
    Low,
}

impl TenantPriority {
    /// Label value for metrics (`high`, `medium`, `low`).
    pub fn as_str(self) -> &'static str {
        match self {
            TenantPriority::High => "high",
            TenantPriority::Medium => "medium",
            TenantPriority::Low => "low",
        }
    }
}

/// A tenant's share of a saturated pool's queue in the gateway.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantFlowControl {
    /// Its weight among the tenants of its band: tokens let through per turn, relative to theirs
    /// (1 to 1000; default 1).
    #[serde(default = "default_weight")]
    #[schemars(range(min = 1, max = 1000))]
    pub weight: u32,
    /// Its requests may ask for a band above the tenant's priority with `x-kinference-priority`
    /// (`high`, `medium`, `low`); asking for a lower one is always allowed.
    #[serde(default)]
    pub request_priority: bool,
    /// Longest wait in the queue, in milliseconds, before a request is shed (absent: its band's,
    /// the gateway's `--flow-deadline-ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 600000))]
    pub queue_deadline_ms: Option<u32>,
    /// Its requests may name their own latency objectives (`x-kinference-ttft-objective-ms`,
    /// `x-kinference-tpot-objective-ms`); absent: those headers are ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objectives: Option<TenantObjectives>,
}

fn default_weight() -> u32 {
    1
}

/// The latency objectives a tenant's requests may name, and what happens when no worker is
/// estimated to meet one.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantObjectives {
    /// The tightest time-to-first-token objective its requests may name, in milliseconds; a
    /// tighter one is taken as this (absent: 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 600000))]
    pub min_ttft_ms: Option<u32>,
    /// The tightest time-per-output-token objective its requests may name, in milliseconds; a
    /// tighter one is taken as this (absent: 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 60000))]
    pub min_tpot_ms: Option<u32>,
    /// What happens when no worker of the plan's first pool is estimated to meet the objective.
    #[serde(default)]
    pub on_miss: ObjectiveMiss,
}

/// What the gateway does with a request whose objective no worker of its pool is estimated to meet.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, JsonSchema, Default)]
pub enum ObjectiveMiss {
    /// The plan's next pool estimated to meet it, or its next provider (a burst); none: refused.
    #[default]
    Fallback,
    /// Refused at once (503 `objective_unmet` with `Retry-After`), before it waits anywhere.
    Refuse,
    /// Served anyway, by the worker estimated fastest.
    Serve,
}

impl Default for TenantFlowControl {
    fn default() -> Self {
        TenantFlowControl {
            weight: default_weight(),
            request_priority: false,
            queue_deadline_ms: None,
            objectives: None,
        }
    }
}

impl TenantPriority {
    /// The band named `name` (`high`, `medium`, `low`, any case).
    pub fn parse(name: &str) -> Option<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "high" => Some(TenantPriority::High),
            "medium" => Some(TenantPriority::Medium),
            "low" => Some(TenantPriority::Low),
            _ => None,
        }
    }

    /// Whether it is served before `other`.
    pub fn above(self, other: Self) -> bool {
        let rank = |p| match p {
            TenantPriority::High => 0,
            TenantPriority::Medium => 1,
            TenantPriority::Low => 2,
        };
        rank(self) < rank(other)
    }
}

/// Per-minute limits, enforced over a sliding minute.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RateLimits {
    /// Prompt tokens per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub input_tokens_per_minute: Option<u64>,
    /// Generated tokens per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub output_tokens_per_minute: Option<u64>,
    /// Requests per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub requests_per_minute: Option<u64>,
}

/// A monthly spending limit, in the currency of the prices.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Budget {
    /// Limit per calendar month (UTC).
    #[schemars(range(min = 0.0))]
    pub monthly_limit: f64,
    /// What happens when it is spent.
    #[serde(default)]
    pub on_exceeded: BudgetAction,
}

/// What happens when a tenant's budget is spent.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, JsonSchema, Default)]
pub enum BudgetAction {
    /// Refuse requests with 429 until the month ends.
    #[default]
    Reject,
    /// Keep serving, but only from local pools (no paid providers).
    LocalOnly,
}
