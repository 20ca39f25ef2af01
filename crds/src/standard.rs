//! The Gateway API Inference Extension's own `InferencePool` (`inference.networking.k8s.io/v1`):
//! the pool a Gateway routes an HTTPRoute to, whose `endpointPickerRef` names the endpoint picker
//! the proxy consults over ext_proc. Kinference reads it (as that picker) and never writes it.
//!
//! Same Kind name as Kinference's own `kinference.ai/v1alpha1` [`crate::InferencePool`], another
//! group and another role: this one says which pods serve and who picks among them; Kinference's
//! says what a pool costs, where it runs and with which credentials. The fields follow the v1 API
//! types (`api/v1/inferencepool_types.go`, v1.x of the project); the CRD YAML the tests install is
//! `deploy/gateway-api/crds/inference.networking.k8s.io_inferencepools.yaml`.

use std::collections::BTreeMap;

use kube::CustomResource;
use serde::{Deserialize, Serialize};

/// API group of the standard resources.
pub const GROUP: &str = "inference.networking.k8s.io";
/// API group of the standard's alpha resources ([`InferenceObjective`]).
pub const X_GROUP: &str = "inference.networking.x-k8s.io";
/// The request header naming a request's [`InferenceObjective`] (its `metadata.name`).
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// The most ports a pool may expose (`targetPorts` `MaxItems`).
pub const MAX_TARGET_PORTS: usize = 8;
/// The endpoint picker port a Service reference implies when it names none.
pub const DEFAULT_PICKER_PORT: u16 = 9002;

/// The pods serving one pool of model servers, and the endpoint picker that chooses among them.
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[kube(
    group = "inference.networking.k8s.io",
    version = "v1",
    kind = "InferencePool",
    namespaced,
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// Which pods (by label, in the pool's namespace) are members.
    pub selector: LabelSelector,
    /// The ports of each member: every `podIP:port` is an endpoint (1 to 8 ports, unique).
    pub target_ports: Vec<Port>,
    /// `http` (HTTP/1.1, the default) or `kubernetes.io/h2c`: how the proxy speaks to the members.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_protocol: Option<String>,
    /// The endpoint picker and how the proxy behaves when it fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// `matchLabels` only: the standard keeps its selector as simple as a Service's.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// Labels a member carries, all of them.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// One port of the members.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Port {
    /// 1 to 65535.
    pub number: u16,
}

/// The endpoint picker a pool names.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    /// API group of the referent; empty (the core group) for a Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Kind of the referent; `Service` when empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name of the referent, in the pool's namespace.
    pub name: String,
    /// The Service port of the picker (required for a Service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<Port>,
    /// What the proxy does when the picker fails: `FailClose` (the default) or `FailOpen`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}

impl EndpointPickerRef {
    /// Whether this names the Service `service` (core group, kind `Service` or unset).
    pub fn names_service(&self, service: &str) -> bool {
        let core = self.group.as_deref().unwrap_or("").is_empty();
        let kind = self.kind.as_deref().unwrap_or("Service");
        core && kind == "Service" && self.name == service
    }

    /// Whether the proxy forwards without the picker when it fails.
    pub fn fails_open(&self) -> bool {
        self.failure_mode.as_deref() == Some("FailOpen")
    }
}

impl InferencePoolSpec {
    /// The distinct target ports, at most [`MAX_TARGET_PORTS`] (what the CRD's validation admits).
    pub fn ports(&self) -> Vec<u16> {
        let mut ports: Vec<u16> = Vec::new();
        for p in &self.target_ports {
            if p.number != 0 && !ports.contains(&p.number) {
                ports.push(p.number);
            }
        }
        ports.truncate(MAX_TARGET_PORTS);
        ports
    }

    /// Whether a pod with `labels` is a member.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        !self.selector.match_labels.is_empty()
            && self
                .selector
                .match_labels
                .iter()
                .all(|(k, v)| labels.get(k) == Some(v))
    }
}

/// The standard's `InferenceObjective` (`inference.networking.x-k8s.io/v1alpha2`): how important a
/// workload's requests are against the others of its pool. A request names one by its
/// `metadata.name` in [`OBJECTIVE_HEADER`]. The fields follow the alpha API types
/// (`apix/v1alpha2/inferenceobjective_types.go`; `priority` was `criticality` in earlier revisions);
/// the CRD YAML the tests install is
/// `deploy/gateway-api/crds/inference.networking.x-k8s.io_inferenceobjectives.yaml`.
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[kube(
    group = "inference.networking.x-k8s.io",
    version = "v1alpha2",
    kind = "InferenceObjective",
    namespaced,
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct InferenceObjectiveSpec {
    /// Higher is served first when the pool is short of room; negative values are allowed; unset
    /// is 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// The pool (in the objective's namespace) whose requests it describes.
    pub pool_ref: PoolObjectReference,
}

/// A pool in the referrer's namespace.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PoolObjectReference {
    /// API group of the pool (the standard's `inference.networking.k8s.io` when empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Kind of the pool (`InferencePool` when empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name of the pool.
    pub name: String,
}

impl InferenceObjectiveSpec {
    /// The priority, 0 when unset.
    pub fn priority(&self) -> i32 {
        self.priority.unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(yaml: &str) -> InferencePool {
        serde_yaml::from_str(yaml).expect("pool")
    }

    #[test]
    fn a_pool_names_its_picker_and_its_ports() {
        let p = pool(
            "apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: qwen, namespace: inference}
spec:
  selector: {matchLabels: {app: vllm}}
  targetPorts: [{number: 8000}, {number: 8001}, {number: 8000}]
  appProtocol: http
  endpointPickerRef: {name: kinference-picker, port: {number: 9002}, failureMode: FailOpen}
",
        );
        assert_eq!(p.spec.ports(), [8000, 8001]);
        let picker = p.spec.endpoint_picker_ref.as_ref().expect("ref");
        assert!(picker.names_service("kinference-picker"));
        assert!(!picker.names_service("other-epp"));
        assert!(picker.fails_open());
        let labels = BTreeMap::from([
            ("app".to_string(), "vllm".to_string()),
            ("tier".to_string(), "gpu".to_string()),
        ]);
        assert!(p.spec.selects(&labels));
        assert!(!p.spec.selects(&BTreeMap::new()));
    }

    #[test]
    fn an_objective_has_a_priority_zero_when_unset_and_names_its_pool() {
        let o: InferenceObjective = serde_yaml::from_str(
            "apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: chat-critical, namespace: inference}
spec: {priority: 10, poolRef: {name: qwen}}
",
        )
        .expect("objective");
        assert_eq!(o.spec.priority(), 10);
        assert_eq!(o.spec.pool_ref.name, "qwen");
        let unset: InferenceObjectiveSpec =
            serde_json::from_value(serde_json::json!({"poolRef": {"name": "qwen"}})).expect("spec");
        assert_eq!(unset.priority(), 0);
        assert!(serde_json::from_value::<InferenceObjectiveSpec>(serde_json::json!({})).is_err());
    }

    #[test]
    fn a_reference_to_another_kind_or_group_is_not_a_service() {
        let r = EndpointPickerRef {
            group: Some("example.com".into()),
            name: "kinference-picker".into(),
            ..Default::default()
        };
        assert!(!r.names_service("kinference-picker"));
        let r = EndpointPickerRef {
            kind: Some("Deployment".into()),
            name: "kinference-picker".into(),
            ..Default::default()
        };
        assert!(!r.names_service("kinference-picker"));
        // The default failure mode is FailClose.
        assert!(!r.fails_open());
    }
}
