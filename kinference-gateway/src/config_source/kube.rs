//! Cluster mode: the [`ConfigSource`] fed by `kube-runtime` watchers of the five kinds.
//!
//! One watcher per kind and namespace reads objects as [`DynamicObject`]s, so a malformed object
//! is one invalid candidate (kept as unreadable by the [`Applier`], its previous generation serving)
//! rather than an error of the whole stream. All events go to one task that owns the [`Applier`]
//! and publishes a new [`Snapshot`] after each batch. A watch restart re-lists (`Init` ..
//! `InitDone`) and replaces that kind's objects of that namespace at once, so an object deleted
//! while the watch was down disappears.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::StreamExt;
use kinference_crds::{
    InferenceModel, InferencePolicy, InferencePool, InferenceProvider, InferenceTenant,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::{ApiResource, DynamicObject};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use serde::Deserialize;
use tokio::sync::{mpsc, watch};

use super::{Applier, ConfigSource, ConfigSourceError, Snapshot};

fn default_true() -> bool {
    true
}

fn default_lease_name() -> String {
    "kinference-gateway-status".into()
}

fn default_lease_duration_s() -> u64 {
    15
}

/// `crds:` in `gateway.yaml`: read the five kinds from the API server instead of a directory.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubeSourceConfig {
    /// Namespaces whose `InferencePolicy`, `InferencePool`, `InferenceModel`, `InferenceProvider`
    /// and `InferenceTenant` objects the gateway serves.
    pub namespaces: Vec<String>,
    /// A kubeconfig file (default: in-cluster, else `$KUBECONFIG` / `~/.kube/config`).
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    /// Write each object's `status` (one replica at a time, elected with a Lease).
    #[serde(default = "default_true")]
    pub write_status: bool,
    /// The Lease that elects the status writer.
    #[serde(default = "default_lease_name")]
    pub lease_name: String,
    /// Its namespace (default: the first of `namespaces`).
    #[serde(default)]
    pub lease_namespace: Option<String>,
    /// How long a lease holder that stopped renewing keeps the lease, in seconds.
    #[serde(default = "default_lease_duration_s")]
    pub lease_duration_s: u64,
    /// This replica's identity in the Lease (default: `$POD_NAME`, else the host name, plus a
    /// random suffix).
    #[serde(default)]
    pub identity: Option<String>,
}

impl KubeSourceConfig {
    /// The Lease's namespace.
    pub fn lease_namespace(&self) -> String {
        self.lease_namespace
            .clone()
            .or_else(|| self.namespaces.first().cloned())
            .unwrap_or_else(|| "default".into())
    }
}

/// A client from `kubeconfig`, or the default (in-cluster, `$KUBECONFIG`, `~/.kube/config`).
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, ConfigSourceError> {
    match kubeconfig {
        None => Ok(Client::try_default().await?),
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .map_err(|e| ConfigSourceError::Kubeconfig(format!("{}: {e}", path.display())))?;
            let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|e| ConfigSourceError::Kubeconfig(format!("{}: {e}", path.display())))?;
            Ok(Client::try_from(config)?)
        }
    }
}

/// The API resource of one of the five kinds.
pub fn api_resource(kind: &str) -> Option<ApiResource> {
    Some(match kind {
        "InferencePolicy" => ApiResource::erase::<InferencePolicy>(&()),
        "InferencePool" => ApiResource::erase::<InferencePool>(&()),
        "InferenceModel" => ApiResource::erase::<InferenceModel>(&()),
        "InferenceProvider" => ApiResource::erase::<InferenceProvider>(&()),
        "InferenceTenant" => ApiResource::erase::<InferenceTenant>(&()),
        _ => return None,
    })
}

struct Message {
    kind: &'static str,
    namespace: String,
    event: Event<DynamicObject>,
}

/// Starts watching the five kinds in `namespaces`; the first snapshots are unsynced until every
/// watcher has listed once ([`ConfigSource::wait_synced`]).
pub fn start(client: Client, namespaces: &[String]) -> ConfigSource {
    let (tx, rx) = mpsc::channel::<Message>(1024);
    let mut tasks = Vec::new();
    let mut scopes = BTreeSet::new();
    for ns in namespaces {
        for kind in kinference_crds::KINDS.iter().copied() {
            let Some(ar) = api_resource(kind) else {
                continue;
            };
            scopes.insert((kind, ns.clone()));
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
            let tx = tx.clone();
            let ns = ns.clone();
            tasks.push(tokio::spawn(async move {
                let mut events =
                    std::pin::pin!(watcher::watcher(api, watcher::Config::default()).default_backoff());
                while let Some(event) = events.next().await {
                    match event {
                        Ok(event) => {
                            let msg = Message {
                                kind,
                                namespace: ns.clone(),
                                event,
                            };
                            if tx.send(msg).await.is_err() {
                                return;
                            }
                        }
                        Err(error) => {
                            tracing::warn!(kind, namespace = %ns, %error, "watch of configuration objects failed; retrying");
                        }
                    }
                }
            }));
        }
    }
    drop(tx);
    let (snap_tx, snap_rx) = watch::channel(Arc::new(Snapshot::default()));
    tasks.push(tokio::spawn(apply_loop(rx, snap_tx, scopes)));
    ConfigSource::new(snap_rx, tasks)
}

fn value_of(kind: &'static str, obj: &DynamicObject) -> Option<serde_json::Value> {
    let mut v = serde_json::to_value(obj).ok()?;
    // List items may come without their type; the parser wants both.
    if let Some(o) = v.as_object_mut() {
        o.insert(
            "apiVersion".into(),
            serde_json::Value::String(kinference_crds::API_VERSION.into()),
        );
        o.insert("kind".into(), serde_json::Value::String(kind.into()));
    }
    Some(v)
}

async fn apply_loop(
    mut rx: mpsc::Receiver<Message>,
    tx: watch::Sender<Arc<Snapshot>>,
    scopes: BTreeSet<(&'static str, String)>,
) {
    let mut applier = Applier::default();
    let mut listing: BTreeMap<(&'static str, String), Vec<serde_json::Value>> = BTreeMap::new();
    let mut listed: BTreeSet<(&'static str, String)> = BTreeSet::new();
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        let mut changed = false;
        // Apply everything already queued, then publish once.
        while let Some(msg) = next.take() {
            let scope = (msg.kind, msg.namespace.clone());
            match msg.event {
                Event::Apply(obj) => {
                    if let Some(v) = value_of(msg.kind, &obj) {
                        applier.upsert_value(msg.kind, &v);
                        changed = true;
                    }
                }
                Event::Delete(obj) => {
                    if let Some(name) = obj.metadata.name.clone() {
                        applier.remove(&super::ObjectRef {
                            kind: msg.kind,
                            namespace: msg.namespace.clone(),
                            name,
                        });
                        changed = true;
                    }
                }
                Event::Init => {
                    listing.insert(scope, Vec::new());
                }
                Event::InitApply(obj) => {
                    if let Some(v) = value_of(msg.kind, &obj) {
                        listing.entry(scope).or_default().push(v);
                    }
                }
                Event::InitDone => {
                    let objects = listing.remove(&scope).unwrap_or_default();
                    let (kind, ns) = (msg.kind, msg.namespace.clone());
                    applier.replace_where(
                        |o| o.kind == kind && o.namespace == ns,
                        msg.kind,
                        &objects,
                    );
                    listed.insert(scope);
                    changed = true;
                }
            }
            next = rx.try_recv().ok();
        }
        if changed {
            let synced = scopes.iter().all(|s| listed.contains(s));
            let snapshot = applier.build(synced);
            let before = Arc::clone(&tx.borrow());
            for e in snapshot.objects.values() {
                // Once per new state or generation, not on every snapshot.
                let seen = before.objects.get(&e.object).is_some_and(|b| {
                    b.state == e.state && b.observed_generation == e.observed_generation
                });
                if seen {
                    continue;
                }
                if let Some(error) = e.state.error() {
                    tracing::warn!(object = %e.object, generation = ?e.observed_generation, %error, state = e.state.name(),
                        "configuration object not applied");
                }
            }
            if tx.send(Arc::new(snapshot)).is_err() {
                return;
            }
        }
    }
}
