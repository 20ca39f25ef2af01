//! Standard pools -> workers: the Gateway API Inference Extension's `InferencePool`
//! (`inference.networking.k8s.io/v1`) whose `endpointPickerRef` names Kinference's Service is one
//! Kinference serves as its endpoint picker. Its members are the Running, Ready pods its selector
//! picks in its namespace; every `podIP:port` of its `targetPorts` is one worker (so a pod serving
//! on two ports is two workers), of the model named by the pod's (or else the pool's)
//! `kinference.ai/model` label or annotation: the standard pool names no model, the router needs
//! one.
//!
//! The picker writes no status on the pool: the standard gives `status.parents` to the Gateways
//! (each parent's `Accepted` and `ResolvedRefs` conditions, by its `controllerName`), not to the
//! picker, and the reference picker writes none either.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kinference_crds::standard::{InferencePool, InferencePoolSpec};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::sync::watch;

use super::pods::{MODEL_KEY, PodWorker, pod_key, ready_ip};
use super::{WorkerSet, WorkerSink};

/// A standard pool Kinference serves.
#[derive(Clone, Debug, PartialEq)]
pub struct ServedPool {
    /// `namespace/name`.
    pub key: String,
    /// Its namespace: members are pods of this namespace only.
    pub namespace: String,
    /// Selector and ports.
    pub spec: InferencePoolSpec,
    /// The pool's own `kinference.ai/model` (label or annotation), for members that name none.
    pub model: Option<String>,
}

/// The pool as one Kinference serves, when its picker is the Service `service` (a Service
/// reference is namespace-local: the Service of the pool's namespace).
pub fn served(pool: &InferencePool, service: &str) -> Option<ServedPool> {
    let picker = pool.spec.endpoint_picker_ref.as_ref()?;
    if !picker.names_service(service) {
        return None;
    }
    let meta = &pool.metadata;
    let namespace = meta.namespace.clone().unwrap_or_default();
    let model = [meta.labels.as_ref(), meta.annotations.as_ref()]
        .into_iter()
        .flatten()
        .find_map(|m| m.get(MODEL_KEY).filter(|v| !v.is_empty()).cloned());
    Some(ServedPool {
        key: format!("{namespace}/{}", meta.name.as_deref().unwrap_or("")),
        namespace,
        spec: pool.spec.clone(),
        model,
    })
}

/// The workers `pod` is for the served `pools`: one per `podIP:port` of every pool that selects
/// it (none while it is not Running and Ready with an IP, or names no model and its pool neither).
pub fn workers_of(pools: &[ServedPool], pod: &Pod) -> Vec<PodWorker> {
    let Some(ip) = ready_ip(pod) else {
        return Vec::new();
    };
    let meta = &pod.metadata;
    let labels = meta.labels.clone().unwrap_or_default();
    let own_model = [meta.labels.as_ref(), meta.annotations.as_ref()]
        .into_iter()
        .flatten()
        .find_map(|m| m.get(MODEL_KEY).filter(|v| !v.is_empty()).cloned());
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    };
    let mut workers: BTreeMap<String, PodWorker> = BTreeMap::new();
    for pool in pools {
        if meta.namespace.as_deref() != Some(pool.namespace.as_str()) || !pool.spec.selects(&labels)
        {
            continue;
        }
        let Some(model) = own_model.clone().or_else(|| pool.model.clone()) else {
            tracing::warn!(pod = %pod_key(pod), pool = %pool.key,
                "pod of a standard pool names no model (label or annotate the pod or the pool with kinference.ai/model); skipped");
            continue;
        };
        for port in pool.spec.ports() {
            let url = format!("http://{host}:{port}");
            workers.entry(url.clone()).or_insert(PodWorker {
                url,
                model: model.clone(),
                labels: labels.clone(),
            });
        }
    }
    workers.into_values().collect()
}

/// What one scope (a namespace, or all) has found, and what it told the sink.
struct Table {
    pools: HashMap<String, ServedPool>,
    pods: HashMap<String, Pod>,
    published: HashMap<String, Vec<PodWorker>>,
    sink: Arc<dyn WorkerSink>,
    set: Arc<watch::Sender<WorkerSet>>,
}

impl Table {
    /// Brings what the sink has for pod `key` to what it is now.
    fn refresh(&mut self, key: &str) {
        let pools: Vec<ServedPool> = self.pools.values().cloned().collect();
        let now = self
            .pods
            .get(key)
            .map(|pod| workers_of(&pools, pod))
            .unwrap_or_default();
        let before = self.published.remove(key).unwrap_or_default();
        for old in &before {
            if !now.iter().any(|w| w.url == old.url) {
                tracing::info!(pod = %key, worker = %old.url, "standard pool endpoint left");
                self.sink.remove(&old.url);
                self.set.send_modify(|s| {
                    s.remove(&old.url);
                });
            }
        }
        for w in &now {
            if !before.contains(w) {
                tracing::info!(pod = %key, worker = %w.url, model = %w.model, "standard pool endpoint ready");
                self.sink.upsert(w);
                self.set.send_modify(|s| {
                    s.insert(w.url.clone(), w.clone());
                });
            }
        }
        if !now.is_empty() {
            self.published.insert(key.to_string(), now);
        }
    }

    fn refresh_all(&mut self) {
        let keys: Vec<String> = self
            .pods
            .keys()
            .chain(self.published.keys())
            .cloned()
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        for key in keys {
            self.refresh(&key);
        }
    }
}

/// Follows the standard pools naming `service` and their pods in `namespace` (all when `None`),
/// feeding `sink` and `set`, until the task is aborted.
pub async fn follow(
    client: Client,
    namespace: Option<String>,
    service: String,
    sink: Arc<dyn WorkerSink>,
    set: Arc<watch::Sender<WorkerSet>>,
) {
    let (pools_api, pods_api): (Api<InferencePool>, Api<Pod>) = match &namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client, ns),
        ),
        None => (Api::all(client.clone()), Api::all(client)),
    };
    let mut pools = watcher::watcher(pools_api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut pods = watcher::watcher(pods_api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut table = Table {
        pools: HashMap::new(),
        pods: HashMap::new(),
        published: HashMap::new(),
        sink,
        set,
    };
    // Keys seen in a relist in progress: what is not seen again is gone.
    let mut pools_listed: Option<HashSet<String>> = None;
    let mut pods_listed: Option<HashSet<String>> = None;
    loop {
        tokio::select! {
            Some(event) = pools.next() => match event {
                Ok(Event::Init) => pools_listed = Some(HashSet::new()),
                Ok(Event::InitApply(pool) | Event::Apply(pool)) => {
                    let key = format!("{}/{}", pool.metadata.namespace.as_deref().unwrap_or(""),
                        pool.metadata.name.as_deref().unwrap_or(""));
                    if let Some(listed) = pools_listed.as_mut() {
                        listed.insert(key.clone());
                    }
                    match served(&pool, &service) {
                        Some(p) => {
                            if table.pools.get(&key) != Some(&p) {
                                tracing::info!(pool = %key, ports = ?p.spec.ports(), "serving standard InferencePool");
                            }
                            table.pools.insert(key, p);
                        }
                        None => {
                            table.pools.remove(&key);
                        }
                    }
                    if pools_listed.is_none() {
                        table.refresh_all();
                    }
                }
                Ok(Event::InitDone) => {
                    if let Some(listed) = pools_listed.take() {
                        table.pools.retain(|k, _| listed.contains(k));
                    }
                    table.refresh_all();
                }
                Ok(Event::Delete(pool)) => {
                    let key = format!("{}/{}", pool.metadata.namespace.as_deref().unwrap_or(""),
                        pool.metadata.name.as_deref().unwrap_or(""));
                    table.pools.remove(&key);
                    table.refresh_all();
                }
                Err(error) => tracing::warn!(?namespace, %error, "watching standard InferencePools failed; retrying"),
            },
            Some(event) = pods.next() => match event {
                Ok(Event::Init) => pods_listed = Some(HashSet::new()),
                Ok(Event::InitApply(pod) | Event::Apply(pod)) => {
                    let key = pod_key(&pod);
                    table.pods.insert(key.clone(), pod);
                    match pods_listed.as_mut() {
                        Some(listed) => {
                            listed.insert(key);
                        }
                        None => table.refresh(&key),
                    }
                }
                Ok(Event::InitDone) => {
                    if let Some(listed) = pods_listed.take() {
                        table.pods.retain(|k, _| listed.contains(k));
                    }
                    table.refresh_all();
                }
                Ok(Event::Delete(pod)) => {
                    let key = pod_key(&pod);
                    table.pods.remove(&key);
                    table.refresh(&key);
                }
                Err(error) => tracing::warn!(?namespace, %error, "watching standard pool pods failed; retrying"),
            },
            else => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(name: &str, picker: &str, ports: &[u16], model: Option<&str>) -> InferencePool {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": "inference",
                "annotations": model.map(|m| serde_json::json!({"kinference.ai/model": m}))},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}},
                "targetPorts": ports.iter().map(|p| serde_json::json!({"number": p})).collect::<Vec<_>>(),
                "endpointPickerRef": {"name": picker, "port": {"number": 9002}}}
        }))
        .expect("pool")
    }

    fn pod(ns: &str, labels: serde_json::Value, ready: bool) -> Pod {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": ns, "labels": labels},
            "status": {"phase": "Running", "podIP": "10.0.0.7",
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}
        }))
        .expect("pod")
    }

    #[test]
    fn each_port_of_a_ready_member_is_a_worker_of_the_pools_model() {
        let pools: Vec<ServedPool> = [
            pool("a", "kinference-picker", &[8000, 8001], Some("qwen")),
            pool("b", "other-epp", &[9000], Some("qwen")),
        ]
        .iter()
        .filter_map(|p| served(p, "kinference-picker"))
        .collect();
        assert_eq!(pools.len(), 1, "a pool naming another picker is not served");
        let member = pod("inference", serde_json::json!({"app": "vllm"}), true);
        let urls: Vec<(String, String)> = workers_of(&pools, &member)
            .into_iter()
            .map(|w| (w.url, w.model))
            .collect();
        assert_eq!(
            urls,
            [
                ("http://10.0.0.7:8000".to_string(), "qwen".to_string()),
                ("http://10.0.0.7:8001".to_string(), "qwen".to_string())
            ]
        );
        // Not ready, another namespace, not selected, or no model anywhere: no worker.
        assert!(
            workers_of(
                &pools,
                &pod("inference", serde_json::json!({"app": "vllm"}), false)
            )
            .is_empty()
        );
        assert!(
            workers_of(
                &pools,
                &pod("elsewhere", serde_json::json!({"app": "vllm"}), true)
            )
            .is_empty()
        );
        assert!(
            workers_of(
                &pools,
                &pod("inference", serde_json::json!({"app": "web"}), true)
            )
            .is_empty()
        );
        let unnamed: Vec<ServedPool> = served(
            &pool("c", "kinference-picker", &[8000], None),
            "kinference-picker",
        )
        .into_iter()
        .collect();
        assert!(workers_of(&unnamed, &member).is_empty());
        // The pod's own model wins over the pool's.
        let own = pod(
            "inference",
            serde_json::json!({"app": "vllm", "kinference.ai/model": "llama"}),
            true,
        );
        assert!(workers_of(&pools, &own).iter().all(|w| w.model == "llama"));
    }
}
