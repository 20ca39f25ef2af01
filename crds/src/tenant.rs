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
