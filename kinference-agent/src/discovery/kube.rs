//! The Kubernetes worker source: the vLLM pods on this agent's node, followed with
//! `kube::runtime::watcher` (field selector `spec.nodeName=<node>`, the chart's worker label selector),
//! emitting the same [`WorkerChange`]s as the workers file.
//!
//! A pod is a worker while it is Running and Ready with a pod IP and a model (label or annotation
//! `kinference.ai/model`). Its spec follows the chart's conventions (deploy/examples/vllm-worker.yaml):
//! URL `http://<pod ip>:<kinference.ai/http-port, default 8000>`, topic `kv@<pod name>@<model>`, replay at
//! `tcp://<pod ip>:<kinference.ai/kv-replay-port>` when annotated, role (prefill/decode disaggregation)
//! from the label or annotation `kinference.ai/role`, sent to the gateways with the worker's state, and
//! data-parallel ranks from the annotation `kinference.ai/data-parallel-size` (vLLM's
//! `--data-parallel-size`: 1 to 256; another value is followed as rank-less). KV events:
//! - with the annotation `kinference.ai/kv-events-port`, the worker's publisher binds that port in its own
//!   pod (vLLM `"endpoint":"tcp://*:<port>"`) and the agent connects to `tcp://<pod ip>:<port>`: one
//!   endpoint per worker pod, so any number of workers on a node each reach the agent;
//! - without it, the agent binds its own listen endpoint for the worker and vLLM connects to it. Only one
//!   worker per node can use that endpoint (a second bind of the same address fails), so that pod-less
//!   form is for a node with a single worker; the agent warns when a second such pod appears.
//!
//! Configured by the DaemonSet's environment: `KINFERENCE_AGENT_WORKER_SELECTOR` (on when set),
//! `KINFERENCE_AGENT_NAMESPACES` (comma-separated; empty = all), `KINFERENCE_AGENT_KV_EVENTS_LISTEN`.

use std::collections::{BTreeMap, HashMap};

use ::kube::runtime::WatchStreamExt;
use ::kube::runtime::watcher::{self, Event};
use ::kube::{Api, Client};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{WorkerChange, diff};
use crate::config::WorkerSpec;
use kinference_api::role::ROLE_KEY;

/// Annotation with the worker's HTTP port.
pub const HTTP_PORT_ANNOTATION: &str = "kinference.ai/http-port";
/// Annotation with the worker's KV replay port.
pub const REPLAY_PORT_ANNOTATION: &str = "kinference.ai/kv-replay-port";
/// Annotation with the port the worker's KV-event publisher binds in its pod (the agent connects to it).
pub const KV_EVENTS_PORT_ANNOTATION: &str = "kinference.ai/kv-events-port";
/// Annotation with the worker's data-parallel size (its engines' count, vLLM's `--data-parallel-size`).
pub const DATA_PARALLEL_SIZE_ANNOTATION: &str = "kinference.ai/data-parallel-size";
/// Label (or annotation) with the served model.
pub const MODEL_KEY: &str = "kinference.ai/model";
/// vLLM's default HTTP port.
pub const DEFAULT_HTTP_PORT: u16 = 8000;

/// Where and what the Kubernetes source watches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeSource {
    /// This node's name (`spec.nodeName` of the pods to follow).
    pub node: String,
    /// Namespaces to watch; empty means all.
    pub namespaces: Vec<String>,
    /// Label selector of worker pods, e.g. `kinference.ai/worker=true`.
    pub selector: String,
    /// The agent's KV-event listen endpoint the workers connect to, e.g. `tcp://0.0.0.0:5557`.
    pub kv_events_endpoint: Option<String>,
}

impl KubeSource {
    /// The source the DaemonSet's environment describes, or `None` when no selector is set.
    pub fn from_env(node: &str) -> Option<Self> {
        let selector = std::env::var("KINFERENCE_AGENT_WORKER_SELECTOR").ok()?;
        let namespaces = std::env::var("KINFERENCE_AGENT_NAMESPACES")
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        Some(Self {
            node: node.to_string(),
            namespaces,
            selector,
            kv_events_endpoint: std::env::var("KINFERENCE_AGENT_KV_EVENTS_LISTEN")
                .ok()
                .filter(|s| !s.is_empty()),
        })
    }

    /// The worker a pod is, if it should be followed now.
    pub fn spec_of(&self, pod: &Pod) -> Option<WorkerSpec> {
        let meta = &pod.metadata;
        if meta.deletion_timestamp.is_some() {
            return None;
        }
        let spec_node = pod.spec.as_ref()?.node_name.as_deref();
        if spec_node != Some(self.node.as_str()) {
            return None;
        }
        let status = pod.status.as_ref()?;
        if status.phase.as_deref() != Some("Running") {
            return None;
        }
        let ready = status
            .conditions
            .as_ref()?
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        if !ready {
            return None;
        }
        let ip = status.pod_ip.as_deref().filter(|ip| !ip.is_empty())?;
        let host = if ip.contains(':') {
            format!("[{ip}]")
        } else {
            ip.to_string()
        };
        let model = lookup(meta.labels.as_ref(), MODEL_KEY)
            .or_else(|| lookup(meta.annotations.as_ref(), MODEL_KEY))?;
        let port = match lookup(meta.annotations.as_ref(), HTTP_PORT_ANNOTATION) {
            Some(p) => p.trim().parse::<u16>().ok()?,
            None => DEFAULT_HTTP_PORT,
        };
        let replay = lookup(meta.annotations.as_ref(), REPLAY_PORT_ANNOTATION)
            .and_then(|p| p.trim().parse::<u16>().ok())
            .map(|p| format!("tcp://{host}:{p}"));
        let name = meta.name.as_deref()?;
        // A worker that binds its own publisher gets its own endpoint; otherwise the agent's shared one.
        let (kv_events_endpoint, kv_events_bind) =
            match lookup(meta.annotations.as_ref(), KV_EVENTS_PORT_ANNOTATION) {
                Some(p) => (
                    Some(format!("tcp://{host}:{}", p.trim().parse::<u16>().ok()?)),
                    false,
                ),
                None => (self.kv_events_endpoint.clone(), true),
            };
        Some(WorkerSpec {
            url: format!("http://{host}:{port}"),
            model: model.to_string(),
            kv_events_endpoint,
            kv_events_bind,
            kv_replay_endpoint: replay,
            kv_topic: Some(format!("kv@{name}@{model}")),
            // An unknown role name is left out (the gateways keep theirs), not a reason to drop the pod.
            role: lookup(meta.labels.as_ref(), ROLE_KEY)
                .or_else(|| lookup(meta.annotations.as_ref(), ROLE_KEY))
                .and_then(|r| r.parse().ok()),
            data_parallel_size: lookup(meta.annotations.as_ref(), DATA_PARALLEL_SIZE_ANNOTATION)
                .and_then(|n| n.trim().parse::<u32>().ok())
                .filter(|n| (1..=crate::config::MAX_DATA_PARALLEL_SIZE).contains(n)),
        })
    }
}

#[cfg(test)]
mod tests;

fn lookup<'a>(map: Option<&'a BTreeMap<String, String>>, key: &str) -> Option<&'a str> {
    map?.get(key).map(String::as_str).filter(|v| !v.is_empty())
}

fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}

/// Follows this node's worker pods until `cancel`; emits the current workers, then every change.
pub fn watch_pods(
    client: Client,
    source: KubeSource,
    cancel: CancellationToken,
) -> mpsc::Receiver<WorkerChange> {
    let (tx, rx) = mpsc::channel(64);
    let scopes: Vec<Option<String>> = if source.namespaces.is_empty() {
        vec![None]
    } else {
        source.namespaces.iter().cloned().map(Some).collect()
    };
    // One watch per namespace, all feeding one table so the emitted diff covers the whole node.
    let (events_tx, mut events) = mpsc::channel::<(usize, Event<Pod>)>(64);
    for (i, ns) in scopes.into_iter().enumerate() {
        let api: Api<Pod> = match &ns {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        };
        let config = watcher::Config::default()
            .labels(&source.selector)
            .fields(&format!("spec.nodeName={}", source.node));
        let events_tx = events_tx.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let mut stream = watcher::watcher(api, config).default_backoff().boxed();
            loop {
                let event = tokio::select! {
                    _ = cancel.cancelled() => return,
                    e = stream.next() => e,
                };
                match event {
                    Some(Ok(e)) => {
                        if events_tx.send((i, e)).await.is_err() {
                            return;
                        }
                    }
                    Some(Err(error)) => {
                        tracing::warn!(namespace = ?ns, %error, "watching worker pods failed; retrying")
                    }
                    None => return,
                }
            }
        });
    }
    drop(events_tx);
    tokio::spawn(async move {
        // (scope, pod key) -> spec of the pods that are workers now.
        let mut pods: HashMap<(usize, String), WorkerSpec> = HashMap::new();
        let mut listing: HashMap<usize, HashMap<String, Option<WorkerSpec>>> = HashMap::new();
        let mut current: BTreeMap<String, WorkerSpec> = BTreeMap::new();
        loop {
            let (scope, event) = tokio::select! {
                _ = cancel.cancelled() => return,
                e = events.recv() => match e {
                    Some(e) => e,
                    None => return,
                },
            };
            match event {
                Event::Init => {
                    listing.insert(scope, HashMap::new());
                    continue;
                }
                Event::InitApply(pod) => {
                    if let Some(l) = listing.get_mut(&scope) {
                        l.insert(pod_key(&pod), source.spec_of(&pod));
                    }
                    continue;
                }
                Event::InitDone => {
                    let listed = listing.remove(&scope).unwrap_or_default();
                    pods.retain(|(s, _), _| *s != scope);
                    for (key, spec) in listed {
                        if let Some(spec) = spec {
                            pods.insert((scope, key), spec);
                        }
                    }
                }
                Event::Apply(pod) => match source.spec_of(&pod) {
                    Some(spec) => {
                        pods.insert((scope, pod_key(&pod)), spec);
                    }
                    None => {
                        pods.remove(&(scope, pod_key(&pod)));
                    }
                },
                Event::Delete(pod) => {
                    pods.remove(&(scope, pod_key(&pod)));
                }
            }
            let next: BTreeMap<String, WorkerSpec> =
                pods.values().map(|s| (s.url.clone(), s.clone())).collect();
            let shared = next.values().filter(|s| s.kv_events_bind).count();
            if shared > 1 {
                tracing::warn!(
                    workers = shared,
                    node = %source.node,
                    "several worker pods on this node share the agent's KV-event listen endpoint; only one can bind it. Annotate each pod with {KV_EVENTS_PORT_ANNOTATION} (its publisher binds that port) so each has its own"
                );
            }
            for change in diff(&current, &next) {
                tracing::info!(?change, node = %source.node, "worker pods changed");
                if tx.send(change).await.is_err() {
                    return;
                }
            }
            current = next;
        }
    });
    rx
}

/// Adds the Kubernetes source to `file_changes` when the environment configures one (in a cluster);
/// otherwise returns `file_changes` unchanged. Without a usable client the file stays the only source.
pub async fn with_kube_source(
    file_changes: mpsc::Receiver<WorkerChange>,
    node: &str,
    cancel: CancellationToken,
) -> mpsc::Receiver<WorkerChange> {
    let Some(source) = KubeSource::from_env(node) else {
        return file_changes;
    };
    let client = match Client::try_default().await {
        Ok(c) => c,
        Err(error) => {
            tracing::error!(%error, "KINFERENCE_AGENT_WORKER_SELECTOR is set but there is no Kubernetes client; following the workers file only");
            return file_changes;
        }
    };
    tracing::info!(node, selector = %source.selector, namespaces = ?source.namespaces, "following worker pods on this node");
    let pods = watch_pods(client, source, cancel);
    merge(file_changes, pods)
}

/// Both sources into one stream.
fn merge(
    mut a: mpsc::Receiver<WorkerChange>,
    mut b: mpsc::Receiver<WorkerChange>,
) -> mpsc::Receiver<WorkerChange> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let (mut a_open, mut b_open) = (true, true);
        while a_open || b_open {
            let change = tokio::select! {
                c = a.recv(), if a_open => match c { Some(c) => c, None => { a_open = false; continue; } },
                c = b.recv(), if b_open => match c { Some(c) => c, None => { b_open = false; continue; } },
            };
            if tx.send(change).await.is_err() {
                return;
            }
        }
    });
    rx
}
