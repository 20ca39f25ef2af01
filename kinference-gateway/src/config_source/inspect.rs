//! What `kinfctl status`, `kinfctl diff` and `kinfctl explain KIND/NAME` show: the objects of a
//! live cluster, their serving generation and conditions, what a directory of objects would change
//! against them, and one object's apply state in the same words as the status and the metrics.

use std::collections::BTreeMap;

use kube::core::DynamicObject;
use kube::{Api, Client};
use serde::Serialize;
use serde_json::Value;

use super::kube::api_resource;
use super::{ObjectRef, parse_object};
use crate::policy::model::{Manifest, Spec};

/// One object of the cluster as `kinfctl status` prints it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StatusRow {
    /// Which object.
    pub object: ObjectRef,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// `status.observedGeneration`.
    pub observed_generation: Option<i64>,
    /// `status.activeGeneration`: the generation serving.
    pub active_generation: Option<i64>,
    /// `type` -> (`status`, `message`).
    pub conditions: BTreeMap<String, (String, String)>,
    /// The apply state, as the metric names it ([`state_of`]; `Pending` without a status yet).
    pub state: &'static str,
}

/// The live objects of the five kinds in `namespaces` (all namespaces when empty).
pub async fn live_objects(
    client: &Client,
    namespaces: &[String],
) -> Result<Vec<(ObjectRef, Value)>, kube::Error> {
    let mut out = Vec::new();
    for kind in kinference_crds::KINDS.iter().copied() {
        let Some(ar) = api_resource(kind) else {
            continue;
        };
        let apis: Vec<Api<DynamicObject>> = if namespaces.is_empty() {
            vec![Api::all_with(client.clone(), &ar)]
        } else {
            namespaces
                .iter()
                .map(|ns| Api::namespaced_with(client.clone(), ns, &ar))
                .collect()
        };
        for api in apis {
            for obj in api.list(&Default::default()).await? {
                let object = ObjectRef {
                    kind,
                    namespace: obj.metadata.namespace.clone().unwrap_or_default(),
                    name: obj.metadata.name.clone().unwrap_or_default(),
                };
                let mut v = serde_json::to_value(&obj).unwrap_or(Value::Null);
                if let Some(o) = v.as_object_mut() {
                    o.insert("apiVersion".into(), kinference_crds::API_VERSION.into());
                    o.insert("kind".into(), kind.into());
                }
                out.push((object, v));
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// The status row of a live object.
pub fn status_row(object: &ObjectRef, value: &Value) -> StatusRow {
    let i = |p: &str| value.pointer(p).and_then(Value::as_i64);
    let conditions = value
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .map(|cs| {
            cs.iter()
                .map(|c| {
                    let s = |k: &str| c.get(k).and_then(Value::as_str).unwrap_or_default();
                    (
                        s("type").to_string(),
                        (s("status").to_string(), s("message").to_string()),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    StatusRow {
        object: object.clone(),
        generation: i("/metadata/generation"),
        observed_generation: i("/status/observedGeneration"),
        active_generation: i("/status/activeGeneration"),
        conditions,
        state: value.get("status").and_then(state_of).unwrap_or("Pending"),
    }
}

/// What applying a directory would do to one object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "change", rename_all = "snake_case")]
pub enum Change {
    /// Only in the directory: would be created.
    Create {
        /// `Kind/name`.
        object: String,
    },
    /// In both, with different specs: the JSON paths that differ.
    Update {
        /// `Kind/name`.
        object: String,
        /// e.g. `spec.rules[0].action.route.targets[0].pool`.
        paths: Vec<String>,
    },
    /// Only in the cluster (in the namespace compared): applying the directory with pruning
    /// would delete it.
    Delete {
        /// `Kind/name`.
        object: String,
    },
}

fn spec_json(spec: &Spec) -> Value {
    let v = match spec {
        Spec::Model(s) => serde_json::to_value(s),
        Spec::Pool(s) => serde_json::to_value(s),
        Spec::Provider(s) => serde_json::to_value(s),
        Spec::Tenant(s) => serde_json::to_value(s),
        Spec::Policy(s) => serde_json::to_value(s),
    };
    v.unwrap_or(Value::Null)
}

fn differences(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let null = Value::Null;
                differences(
                    &format!("{path}.{k}"),
                    x.get(k).unwrap_or(&null),
                    y.get(k).unwrap_or(&null),
                    out,
                );
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                differences(&format!("{path}[{i}]"), p, q, out);
            }
        }
        _ if a != b => out.push(path.to_string()),
        _ => {}
    }
}

/// The changes that `local` (the directory's valid objects) would make to `live` (the cluster's
/// objects of one namespace). Specs are compared after parsing both sides the same way, so
/// defaults and field order do not show as changes.
pub fn diff(local: &[Manifest], live: &[(ObjectRef, Value)]) -> Vec<Change> {
    let mut live_specs: BTreeMap<(String, String), Value> = BTreeMap::new();
    for (object, value) in live {
        let spec = match parse_object(object, value) {
            Ok(m) => spec_json(&m.spec),
            Err(_) => value.get("spec").cloned().unwrap_or(Value::Null),
        };
        live_specs.insert((object.kind.to_string(), object.name.clone()), spec);
    }
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for m in local {
        let key = (m.spec.kind().to_string(), m.name.clone());
        let name = format!("{}/{}", key.0, key.1);
        seen.insert(key.clone());
        match live_specs.get(&key) {
            None => out.push(Change::Create { object: name }),
            Some(live) => {
                let mut paths = Vec::new();
                differences("spec", live, &spec_json(&m.spec), &mut paths);
                if !paths.is_empty() {
                    out.push(Change::Update {
                        object: name,
                        paths,
                    });
                }
            }
        }
    }
    for key in live_specs.keys() {
        if !seen.contains(key) {
            out.push(Change::Delete {
                object: format!("{}/{}", key.0, key.1),
            });
        }
    }
    out
}

/// The kind `name` stands for: a kind (`InferencePolicy`), its plural (`inferencepolicies`) or its
/// short name (`ipol`), in any case, as `kubectl` accepts them.
pub fn kind_named(name: &str) -> Option<&'static str> {
    let name = name.to_ascii_lowercase();
    kinference_crds::KINDS.iter().copied().find(|kind| {
        let ar = api_resource(kind);
        kind.to_ascii_lowercase() == name
            || ar.as_ref().is_some_and(|ar| ar.plural == name)
            || short_name(kind) == Some(name.as_str())
    })
}

fn short_name(kind: &str) -> Option<&'static str> {
    Some(match kind {
        "InferencePolicy" => "ipol",
        "InferencePool" => "ipool",
        "InferenceModel" => "imodel",
        "InferenceProvider" => "iprov",
        "InferenceTenant" => "itenant",
        _ => return None,
    })
}

/// One condition of an object's status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConditionRow {
    /// `Accepted`, `Ready` or `RolledBack`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True` or `False`.
    pub status: String,
    /// CamelCase reason.
    pub reason: String,
    /// What happened (the error, the generation still serving).
    pub message: String,
}

/// What `kinfctl explain KIND/NAME` shows: the object's apply state (the `state` label of
/// `kinference_gateway_config_objects`), its generations and its status conditions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Explanation {
    /// Which object.
    pub object: ObjectRef,
    /// `metadata.generation` (the latest).
    pub generation: Option<i64>,
    /// `status.observedGeneration`: the latest generation a gateway has seen.
    pub observed_generation: Option<i64>,
    /// `status.activeGeneration`: the generation serving.
    pub serving_generation: Option<i64>,
    /// `Accepted`, `RolledBack`, `Rejected` or `Conflict` ([`super::ObjectState::name`]); `Pending`
    /// while no gateway has written a status.
    pub state: &'static str,
    /// `status.conditions`.
    pub conditions: Vec<ConditionRow>,
    /// What the object's flow-control and objective fields do, in words ([`flow_notes`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub flow: Vec<String>,
}

/// What the flow-control and objective fields of an object of `kind` with `spec` do, one line each:
/// a tenant's band, weight, queue deadline, the bands its requests may claim and its latency
/// objectives; a pool's scheduling policy. Empty for other kinds.
pub fn flow_notes(kind: &str, spec: &Value) -> Vec<String> {
    match kind {
        "InferenceTenant" => {
            let Ok(t) =
                serde_json::from_value::<kinference_crds::InferenceTenantSpec>(spec.clone())
            else {
                return Vec::new();
            };
            let f = t.flow_control.clone().unwrap_or_default();
            let mut out = vec![
                format!(
                    "band {}: waits in a saturated pool's queue behind higher bands, shed {} them",
                    t.priority.as_str(),
                    if t.priority == kinference_crds::TenantPriority::High {
                        "after"
                    } else {
                        "before"
                    }
                ),
                format!(
                    "weight {}: its share of tokens let through among the tenants of its band",
                    f.weight
                ),
                match f.queue_deadline_ms {
                    Some(ms) => format!("queue deadline {ms} ms, then shed (503, Retry-After)"),
                    None => "queue deadline: its band's (--flow-deadline-ms)".to_string(),
                },
                if f.request_priority {
                    "x-kinference-priority and x-gateway-inference-objective may raise or lower its band".to_string()
                } else {
                    "x-kinference-priority and x-gateway-inference-objective may only lower its band".to_string()
                },
            ];
            match &f.objectives {
                None => out.push(
                    "latency objectives: not allowed (x-kinference-ttft-objective-ms ignored)"
                        .to_string(),
                ),
                Some(o) => {
                    let miss = match o.on_miss {
                        kinference_crds::ObjectiveMiss::Fallback => {
                            "the plan's next pool estimated to meet it, or its next provider; else 503 objective_unmet"
                        }
                        kinference_crds::ObjectiveMiss::Refuse => {
                            "503 objective_unmet at once, with Retry-After"
                        }
                        kinference_crds::ObjectiveMiss::Serve => {
                            "served anyway by the fastest worker"
                        }
                    };
                    out.push(format!(
                        "latency objectives: TTFT no tighter than {} ms, TPOT no tighter than {} ms (not estimated yet); workers estimated to meet the TTFT are preferred; none: {miss}",
                        o.min_ttft_ms.unwrap_or(1),
                        o.min_tpot_ms.unwrap_or(1)
                    ));
                }
            }
            out
        }
        "InferencePool" => {
            let priority = spec.get("schedulingPolicy").and_then(Value::as_str) == Some("Priority");
            vec![if priority {
                "scheduling Priority: its workers run --scheduling-policy priority and are sent each request's band as priority (high -1, medium 0, low 1)".to_string()
            } else {
                "scheduling Fcfs: its workers serve their own queue first come first served (no priority sent)".to_string()
            }]
        }
        _ => Vec::new(),
    }
}

/// The apply state a status says, as [`super::ObjectState::name`] names it (None: no conditions).
pub fn state_of(status: &Value) -> Option<&'static str> {
    let conditions = status.get("conditions")?.as_array()?;
    let find = |t: &str| conditions.iter().find(|c| c["type"] == t);
    let accepted = find("Accepted")?;
    let rolled_back = find("RolledBack").is_some_and(|c| c["status"] == "True");
    Some(if accepted["status"] == "True" {
        "Accepted"
    } else if rolled_back {
        "RolledBack"
    } else if accepted["reason"] == "NameConflict" {
        "Conflict"
    } else {
        "Rejected"
    })
}

/// The explanation of an object as the API server returns it (its status as a gateway wrote it).
pub fn explain_live(object: &ObjectRef, value: &Value) -> Explanation {
    let status = value.get("status").cloned().unwrap_or(Value::Null);
    let i = |v: &Value, p: &str| v.pointer(p).and_then(Value::as_i64);
    let conditions = status
        .get("conditions")
        .and_then(Value::as_array)
        .map(|cs| {
            cs.iter()
                .map(|c| {
                    let s = |k: &str| c[k].as_str().unwrap_or_default().to_string();
                    ConditionRow {
                        type_: s("type"),
                        status: s("status"),
                        reason: s("reason"),
                        message: s("message"),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    Explanation {
        object: object.clone(),
        generation: i(value, "/metadata/generation"),
        observed_generation: i(&status, "/observedGeneration"),
        serving_generation: i(&status, "/activeGeneration"),
        state: state_of(&status).unwrap_or("Pending"),
        conditions,
        flow: value
            .get("spec")
            .map(|spec| flow_notes(object.kind, spec))
            .unwrap_or_default(),
    }
}

/// The explanation of an object of a snapshot: the status a gateway serving this snapshot writes
/// ([`super::status::desired_status`]), so it reads exactly as [`explain_live`] would afterwards.
pub fn explain_entry(e: &super::ObjectEntry) -> Explanation {
    let value = serde_json::json!({
        "metadata": { "generation": e.observed_generation },
        "status": super::status::desired_status(e),
    });
    explain_live(&e.object, &value)
}

impl std::fmt::Display for Explanation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = |g: Option<i64>| g.map_or("-".to_string(), |g| g.to_string());
        writeln!(f, "{}", self.object)?;
        writeln!(
            f,
            "  state: {} (kinference_gateway_config_objects{{kind=\"{}\",state=\"{}\"}})",
            self.state, self.object.kind, self.state
        )?;
        writeln!(
            f,
            "  generation: {}, observed: {}, serving: {}",
            g(self.generation),
            g(self.observed_generation),
            g(self.serving_generation)
        )?;
        if self.conditions.is_empty() {
            writeln!(
                f,
                "  no conditions yet: no gateway watching this namespace has written a status"
            )?;
        }
        for c in &self.conditions {
            writeln!(
                f,
                "  {:<10} {:<5} {:<26} {}",
                c.type_, c.status, c.reason, c.message
            )?;
        }
        if !self.flow.is_empty() {
            writeln!(f, "  flow control:")?;
        }
        for line in &self.flow {
            writeln!(f, "    {line}")?;
        }
        Ok(())
    }
}
