//! What `kinfctl status` and `kinfctl diff` show: the objects of a live cluster, their serving
//! generation and conditions, and what a directory of objects would change against them.

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
