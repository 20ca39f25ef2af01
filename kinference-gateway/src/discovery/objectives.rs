//! Standard objectives -> bands: the Gateway API Inference Extension's `InferenceObjective`
//! (`inference.networking.x-k8s.io/v1alpha2`), watched where its CRD is served. A request naming one
//! in `x-gateway-inference-objective` (its `metadata.name`) asks for the band its `priority` maps to:
//!
//! | `spec.priority` | band |
//! |---|---|
//! | above 0 | `high` |
//! | 0 or unset | `medium` |
//! | below 0 | `low` |
//!
//! It is a claim like `x-kinference-priority`, bounded by the same tenant rule (stage "queue"): a
//! lower band always applies, a higher one only where the tenant's `flowControl.requestPriority`
//! allows. An objective name found in several watched namespaces gives the lowest of their bands
//! (the header names no namespace; the cautious reading wins). `poolRef` is kept and shown, not
//! matched: Kinference applies the objective to whichever pool serves the request.
//!
//! Read in picker mode only (`kubernetes.picker_service`, the chart's
//! `gateway.extproc.servesStandardPools`, which grants list and watch on them). Without the CRD
//! nothing is watched; its presence is checked again every [`CRD_RECHECK`], so
//! installing it later needs no restart.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kinference_crds::TenantPriority;
use kinference_crds::standard::{InferenceObjective, X_GROUP};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use parking_lot::RwLock;

/// How often the gateway looks again for the `InferenceObjective` CRD while it is not served.
pub const CRD_RECHECK: Duration = Duration::from_secs(30);

/// One watched objective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Objective {
    /// `metadata.name`: what requests name.
    pub name: String,
    /// `spec.priority` (0 when unset).
    pub priority: i32,
    /// `spec.poolRef.name`.
    pub pool: String,
}

/// The objectives known now, by `namespace/name`; shared by discovery (which writes) and the
/// pipeline (which reads).
#[derive(Clone, Debug, Default)]
pub struct Objectives {
    by_key: Arc<RwLock<BTreeMap<String, Objective>>>,
}

/// The band a standard objective's `priority` maps to (see the module's table).
pub fn band_of(priority: i32) -> TenantPriority {
    match priority {
        p if p > 0 => TenantPriority::High,
        0 => TenantPriority::Medium,
        _ => TenantPriority::Low,
    }
}

impl Objectives {
    /// The band the objective `name` asks for (the lowest among namespaces), if one is known.
    pub fn band(&self, name: &str) -> Option<TenantPriority> {
        self.by_key
            .read()
            .values()
            .filter(|o| o.name == name)
            .map(|o| o.priority)
            .min()
            .map(band_of)
    }

    /// Every objective known, by `namespace/name`.
    pub fn all(&self) -> BTreeMap<String, Objective> {
        self.by_key.read().clone()
    }

    /// Records `objective` (created or changed).
    pub fn upsert(&self, objective: &InferenceObjective) {
        let meta = &objective.metadata;
        let name = meta.name.clone().unwrap_or_default();
        self.by_key.write().insert(
            key(meta.namespace.as_deref(), &name),
            Objective {
                name,
                priority: objective.spec.priority(),
                pool: objective.spec.pool_ref.name.clone(),
            },
        );
    }

    fn remove(&self, objective: &InferenceObjective) {
        let meta = &objective.metadata;
        self.by_key.write().remove(&key(
            meta.namespace.as_deref(),
            meta.name.as_deref().unwrap_or(""),
        ));
    }

    /// Keeps only the objectives of `scope` (a namespace, or all) that `listed` holds.
    fn retain_listed(&self, scope: Option<&str>, listed: &[String]) {
        self.by_key.write().retain(|k, _| {
            let in_scope = scope.is_none_or(|ns| k.starts_with(&format!("{ns}/")));
            !in_scope || listed.contains(k)
        });
    }
}

fn key(namespace: Option<&str>, name: &str) -> String {
    format!("{}/{name}", namespace.unwrap_or(""))
}

/// Whether the API server serves `InferenceObjective` in `v1alpha2`.
async fn crd_served(client: &Client) -> bool {
    match client
        .list_api_group_resources(&format!("{X_GROUP}/v1alpha2"))
        .await
    {
        Ok(list) => list
            .resources
            .iter()
            .any(|r| r.kind == "InferenceObjective"),
        Err(_) => false,
    }
}

/// Follows the `InferenceObjective`s of `namespace` (all when `None`) into `table`, once their CRD is
/// served, until the task is aborted.
pub async fn follow(client: Client, namespace: Option<String>, table: Objectives) {
    let mut told = false;
    while !crd_served(&client).await {
        if !told {
            tracing::info!(
                ?namespace,
                "no InferenceObjective CRD served; x-gateway-inference-objective is ignored until it is"
            );
            told = true;
        }
        tokio::time::sleep(CRD_RECHECK).await;
    }
    let api: Api<InferenceObjective> = match &namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let mut events = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut listed: Option<Vec<String>> = None;
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => listed = Some(Vec::new()),
            Ok(Event::InitApply(o) | Event::Apply(o)) => {
                let meta = &o.metadata;
                if let Some(l) = listed.as_mut() {
                    l.push(key(
                        meta.namespace.as_deref(),
                        meta.name.as_deref().unwrap_or(""),
                    ));
                }
                tracing::info!(objective = ?meta.name, namespace = ?meta.namespace,
                    priority = o.spec.priority(), band = band_of(o.spec.priority()).as_str(),
                    "InferenceObjective");
                table.upsert(&o);
            }
            Ok(Event::InitDone) => {
                if let Some(l) = listed.take() {
                    table.retain_listed(namespace.as_deref(), &l);
                }
            }
            Ok(Event::Delete(o)) => table.remove(&o),
            Err(error) => {
                tracing::warn!(?namespace, %error, "watching InferenceObjectives failed; retrying")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn objective(ns: &str, name: &str, priority: Option<i32>) -> InferenceObjective {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"priority": priority, "poolRef": {"name": "qwen"}}
        }))
        .expect("objective")
    }

    #[test]
    fn priorities_map_onto_bands_and_a_name_in_two_namespaces_takes_the_lower() {
        assert_eq!(band_of(10), TenantPriority::High);
        assert_eq!(band_of(1), TenantPriority::High);
        assert_eq!(band_of(0), TenantPriority::Medium);
        assert_eq!(band_of(-1), TenantPriority::Low);
        let table = Objectives::default();
        assert_eq!(table.band("chat"), None);
        table.upsert(&objective("a", "chat", Some(5)));
        table.upsert(&objective("a", "batch", None));
        assert_eq!(table.band("chat"), Some(TenantPriority::High));
        assert_eq!(table.band("batch"), Some(TenantPriority::Medium));
        table.upsert(&objective("b", "chat", Some(-3)));
        assert_eq!(table.band("chat"), Some(TenantPriority::Low));
        table.remove(&objective("b", "chat", Some(-3)));
        assert_eq!(table.band("chat"), Some(TenantPriority::High));
        // A relist of namespace `a` without `batch`: gone; other namespaces untouched.
        table.upsert(&objective("c", "batch", Some(2)));
        table.retain_listed(Some("a"), &["a/chat".to_string()]);
        assert_eq!(table.band("batch"), Some(TenantPriority::High));
        assert_eq!(table.all().len(), 2);
    }
}
