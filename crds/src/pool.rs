//! `InferencePool`: a set of vLLM workers serving the same models on the same GPU class.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::{CredentialRef, Locality, ResourceStatus, TokenPrices};

/// A set of vLLM workers (found by label selector in a cluster, or listed statically in local mode)
/// that serve the listed models on one GPU class.
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[kube(
    group = "kinference.ai",
    version = "v1alpha1",
    kind = "InferencePool",
    namespaced,
    status = "ResourceStatus",
    shortname = "ipool",
    category = "kinference",
    printcolumn(name = "GPU", type_ = "string", json_path = ".spec.gpuClass"),
    printcolumn(name = "Locality", type_ = "string", json_path = ".spec.locality"),
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
pub struct InferencePoolSpec {
    /// Names of the `InferenceModel`s every worker of the pool serves.
    #[schemars(length(min = 1))]
    pub models: Vec<String>,
    /// Pods whose labels match are the pool's workers (cluster mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<WorkerSelector>,
    /// Worker base URLs (local mode, or workers outside the cluster).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<StaticEndpoint>,
    /// GPU class, e.g. `l40s` or `h100` (informational, and a routing match key).
    #[schemars(length(min = 1, max = 63))]
    pub gpu_class: String,
    /// Where the workers run; requests that must stay local only go to `Local` pools.
    #[serde(default)]
    pub locality: Locality,
    /// What serving a token on this pool costs.
    pub prices: TokenPrices,
    /// The workers' API key (vLLM `--api-key`), sent as `Authorization: Bearer`; without it the
    /// gateway-wide `worker_api_key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_credentials: Option<CredentialRef>,
    /// Headers sent with every request to the pool's workers, over the gateway-wide `worker_headers`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub worker_headers: BTreeMap<String, String>,
    /// The workers' part in prefill/decode disaggregation, unless an endpoint's own `role` or its
    /// pod's `kinference.ai/role` label says otherwise.
    #[serde(default, skip_serializing_if = "WorkerRole::is_both")]
    pub role: WorkerRole,
    /// How requests this pool serves are split between a prefill worker and one of this pool's
    /// decode workers. Without it a pool that holds `prefill` workers splits with the defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disaggregation: Option<Disaggregation>,
    /// How the pool's workers order their own waiting requests: `Priority` where every one runs
    /// vLLM with `--scheduling-policy priority`; the gateway then sends each request's band as the
    /// body's `priority` (high -1, medium 0, low 1: lower runs earlier).
    #[serde(default, skip_serializing_if = "SchedulingPolicy::is_fcfs")]
    pub scheduling_policy: SchedulingPolicy,
}

/// The order in which a worker serves its waiting requests (vLLM's `--scheduling-policy`).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, JsonSchema, Default)]
pub enum SchedulingPolicy {
    /// First come, first served (vLLM's default): no `priority` is sent.
    #[default]
    Fcfs,
    /// By the request's `priority` (lower first), then arrival.
    Priority,
}

impl SchedulingPolicy {
    /// Whether it is the default (left out when serialized).
    pub fn is_fcfs(&self) -> bool {
        *self == SchedulingPolicy::Fcfs
    }
}

/// A worker's part in prefill/decode disaggregation (vLLM started with a KV connector, e.g.
/// `--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'`).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, JsonSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum WorkerRole {
    /// Whole requests only.
    #[default]
    Both,
    /// The prefill of split requests: it computes the prompt's KV cache for a decode worker.
    Prefill,
    /// The decode of split requests (from a prefill worker's KV cache), and whole short requests.
    Decode,
}

impl WorkerRole {
    /// Whether it is the default (left out when serialized).
    pub fn is_both(&self) -> bool {
        *self == WorkerRole::Both
    }
}

/// Prefill/decode disaggregation of a pool's requests: vLLM's two-step protocol (a prefill call that
/// returns `kv_transfer_params`, then the decode call carrying them).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Disaggregation {
    /// The pool whose `prefill` workers run this pool's prefills (the prompt is billed at its
    /// prices); default: this pool's own `prefill` workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub prefill_pool: Option<String>,
    /// A request whose prompt has fewer tokens than this left to compute on the best decode worker
    /// (its prompt less what that worker already caches) runs whole on one worker: below it the
    /// KV transfer and the second call cost more than the prefill they move. Default 512.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 1_000_000))]
    pub min_uncached_tokens: Option<u32>,
}

/// Label selector for the pool's worker pods.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkerSelector {
    /// Labels every worker pod carries.
    #[schemars(length(min = 1))]
    pub match_labels: BTreeMap<String, String>,
    /// vLLM's HTTP port on the pods.
    #[schemars(range(min = 1, max = 65535))]
    pub target_port: u16,
}

/// One worker given by URL.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StaticEndpoint {
    /// Worker base URL, e.g. `http://127.0.0.1:8001`.
    #[schemars(regex(pattern = r"^https?://[^\s/]+"))]
    pub url: String,
    /// This worker's role, over the pool's `role`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<WorkerRole>,
}
