//! Types shared by several resources: prices, secret references, locality and status conditions.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Where a backend runs. Requests that must stay local (personal data, `requireLocal`) only go to
/// `Local` backends; providers are always `Remote`.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, JsonSchema, Default)]
pub enum Locality {
    /// On infrastructure the operator controls (the cluster's own GPUs).
    #[default]
    Local,
    /// Anywhere else (a cloud provider, a rented pool in another organisation).
    Remote,
}

/// Prices in the operator's currency per one million tokens. Cached and uncached prompt tokens are
/// priced separately because prefix caching makes cached tokens much cheaper to serve.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenPrices {
    /// Price per 1M prompt tokens served from the prefix cache.
    #[schemars(range(min = 0.0))]
    pub cached_input_per_million: f64,
    /// Price per 1M prompt tokens that must be prefilled.
    #[schemars(range(min = 0.0))]
    pub uncached_input_per_million: f64,
    /// Price per 1M generated tokens.
    #[schemars(range(min = 0.0))]
    pub output_per_million: f64,
    /// ISO 4217 currency code (informational; all prices in one policy set should share it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 3, max = 3))]
    pub currency: Option<String>,
}

/// A key inside a Kubernetes Secret in the resource's namespace.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretKeyRef {
    /// Secret name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key within the secret's data.
    #[schemars(length(min = 1))]
    pub key: String,
}

/// A credential: a Secret key in a cluster, an environment variable in local mode. At least one
/// must be given; in a cluster the secret wins, in local mode the variable.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CredentialRef {
    /// Secret key holding the credential (cluster mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,
    /// Environment variable holding the credential (local mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub env: Option<String>,
}

/// Status of a condition, as in `metav1.Condition`.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, JsonSchema)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

/// One observation about a resource, shaped like `metav1.Condition` (kept local so the schema does
/// not depend on k8s-openapi's optional schemars support).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Condition type: `Accepted`, `Ready` or `RolledBack`.
    #[serde(rename = "type")]
    pub type_: String,
    /// True, False or Unknown.
    pub status: ConditionStatus,
    /// Machine-readable CamelCase reason.
    pub reason: String,
    /// Human-readable explanation (required, as in `metav1.Condition`; an empty-string default
    /// is rejected by 1.20 apiservers).
    pub message: String,
    /// RFC 3339 time of the last status change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    /// The `metadata.generation` this condition was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Status shared by all five resources: whether the gateways accepted the current generation.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema, Default)]
#[serde(rename_all = "camelCase")]
pub struct ResourceStatus {
    /// Latest generation the gateways have processed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The generation currently serving (older than `observedGeneration` after a rollback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_generation: Option<i64>,
    /// `Accepted` (the latest generation validated), `Ready` (a generation is serving) and
    /// `RolledBack` (the latest generation was refused; the message names the error and the
    /// generation still serving).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}
