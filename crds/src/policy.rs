//! `InferencePolicy`: ordered rules that route, reject, burst or keep requests local.
//!
//! Policies run in ascending `priority` (ties by name), their rules in list order. `requireLocal`
//! rules add a constraint and evaluation continues; `route`, `reject` and a `burst` whose condition
//! holds end it. See `kinference_gateway::policy::engine` for the exact semantics.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::ResourceStatus;

/// Ordered routing rules. Each policy is applied (and rolled back) on its own.
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[kube(
    group = "kinference.ai",
    version = "v1alpha1",
    kind = "InferencePolicy",
    namespaced,
    status = "ResourceStatus",
    shortname = "ipol",
    category = "kinference",
    printcolumn(name = "Priority", type_ = "integer", json_path = ".spec.priority"),
    printcolumn(name = "Suspended", type_ = "boolean", json_path = ".spec.suspend"),
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
pub struct InferencePolicySpec {
    /// Evaluation order across policies: lower first; equal priorities run in name order.
    #[schemars(range(min = -10000, max = 10000))]
    pub priority: i32,
    /// A suspended policy is kept but not evaluated.
    #[serde(default)]
    pub suspend: bool,
    /// The rules, evaluated in order.
    #[schemars(length(min = 1, max = 256))]
    pub rules: Vec<PolicyRule>,
}

/// One rule: when every given condition of `match` holds, apply `action`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PolicyRule {
    /// Rule name, unique within the policy (decisions and metrics name it).
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// Why the rule exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Conditions; all given ones must hold. Empty: matches every request.
    #[serde(default, rename = "match")]
    pub match_: RuleMatch,
    /// Exactly one action.
    pub action: RuleAction,
}

/// Conditions of a rule. Lists match when the request's value is in the list; empty lists and
/// absent fields do not constrain.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleMatch {
    /// `InferenceTenant` names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<String>,
    /// `true`: only requests without a known tenant; `false`: only authenticated ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unknown_tenant: Option<bool>,
    /// Requested model, by `InferenceModel` name or alias.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    /// Requested model class (asked for directly, or the class of the requested model).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<String>,
    /// Tags that must all be present (`pii`, `pii:email`, custom tags from headers or classifiers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// Tags of which at least one must be present.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub any_tags: Vec<String>,
    /// Tags that must all be absent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub without_tags: Vec<String>,
    /// Prompt complexity levels.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub complexity: Vec<Complexity>,
    /// A condition on the state of pools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_state: Option<PoolCondition>,
}

/// Prompt complexity, from the gateway's deterministic classifier.
#[derive(
    Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, JsonSchema,
)]
pub enum Complexity {
    Simple,
    Moderate,
    Complex,
}

/// A condition on pool state. It holds when the given thresholds are all exceeded on every pool
/// (`mode: All`, "saturated") or on at least one (`mode: Any`). Pools without reported state never
/// satisfy it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolCondition {
    /// Pools to look at; empty: the local pools that serve the requested model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<String>,
    /// All pools or any pool.
    #[serde(default)]
    pub mode: ConditionMode,
    /// Requests waiting in the pool's queues above this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000000))]
    pub queue_depth_above: Option<u32>,
    /// KV-cache usage (0 to 1) above this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub kv_cache_usage_above: Option<f64>,
    /// The request's estimated time to first token on the pool's best worker above this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600000))]
    pub estimated_ttft_above_ms: Option<u32>,
}

/// How a pool condition combines several pools.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, JsonSchema, Default)]
pub enum ConditionMode {
    #[default]
    All,
    Any,
}

/// The action of a rule; exactly one field must be set (checked by `kinfctl lint` and the gateway,
/// since the test apiserver has no CEL).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleAction {
    /// Send the request to these targets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<RouteAction>,
    /// Refuse the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reject: Option<RejectAction>,
    /// Send the request to providers while a saturation condition holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<BurstAction>,
    /// From here on only local backends may serve the request; refuse it when none can.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub require_local: Option<RequireLocalAction>,
}

/// Route to pools or model classes.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteAction {
    /// Candidates, most preferred first.
    #[schemars(length(min = 1))]
    pub targets: Vec<RouteTarget>,
    /// How to order the candidates.
    #[serde(default)]
    pub select: Selection,
    /// `CheaperUnlessFaster`: the dearer target wins only when its estimated TTFT is lower by at
    /// least this much (default 100 ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 600000))]
    pub min_ttft_gain_ms: Option<u32>,
}

/// One route target: a pool, or every pool serving a model class; exactly one of the two.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteTarget {
    /// An `InferencePool`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// A model class: every local pool serving a model of that class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_class: Option<String>,
    /// With `pool`: the `InferenceModel` to use there (default: the requested one if served, else
    /// the pool's first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// How route candidates are ordered.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, JsonSchema, Default)]
pub enum Selection {
    /// As listed.
    #[default]
    Ordered,
    /// Lowest estimated cost of this request first.
    Cheapest,
    /// Lowest estimated TTFT first.
    Fastest,
    /// The cheapest, unless a dearer one is faster by `minTtftGainMs` (e.g. its cache holds the
    /// prompt while the cheap one is cold).
    CheaperUnlessFaster,
}

/// Refuse the request with this HTTP status and message (in the client's protocol).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RejectAction {
    /// HTTP status, 400 to 599.
    #[schemars(range(min = 400, max = 599))]
    pub status: u16,
    /// Message shown to the client.
    #[schemars(length(min = 1, max = 1024))]
    pub message: String,
}

/// Send to providers while `when` holds; local pools serving the model stay as fallbacks.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BurstAction {
    /// `InferenceProvider` names, most preferred first.
    #[schemars(length(min = 1))]
    pub providers: Vec<String>,
    /// The saturation condition.
    pub when: PoolCondition,
}

/// Keep the request on local backends; refuse it when no local backend can serve it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RequireLocalAction {
    /// Message when the request has to be refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}
