//! The Secrets that tenants' API keys, providers' credentials and pools' worker credentials name
//! (`secretRef`), watched.
//!
//! Only the Secrets a serving object references are read, each by its own watch with a
//! `metadata.name` field selector (so RBAC can name them: get/list/watch on those Secrets, nothing
//! wider). A rotated key reaches [`SecretValues`] as soon as the API server sends the change, and
//! consumers rebuild from it (tenancy swaps its key ring: the new key works, the old one gets 401).
//! Values are kept in memory only, never logged. Environment variables are for local mode; in a
//! cluster a `CredentialRef` resolves through its `secretRef` alone.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kinference_crds::CredentialRef;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::sync::{mpsc, watch};

use super::Snapshot;

/// `(namespace, name)` of a Secret.
pub type SecretName = (String, String);

/// The data of every watched Secret. Deliberately not `Debug` (it holds credentials).
#[derive(Default, Clone)]
pub struct SecretValues {
    data: BTreeMap<SecretName, BTreeMap<String, Vec<u8>>>,
    /// Every referenced Secret has been listed once.
    pub synced: bool,
}

impl std::fmt::Debug for SecretValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretValues")
            .field("secrets", &self.data.len())
            .field("synced", &self.synced)
            .finish()
    }
}

/// Why a credential could not be resolved (names the reference, never a value).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// The reference has no `secretRef` (environment variables are for local mode).
    #[error("no secretRef (environment variables are read in local mode only)")]
    NoSecretRef,
    /// The Secret or its key does not exist (yet).
    #[error("Secret {namespace}/{name} has no key {key:?}")]
    Missing {
        /// Namespace.
        namespace: String,
        /// Secret name.
        name: String,
        /// Key.
        key: String,
    },
}

impl SecretValues {
    /// The value of `cred`'s `secretRef` in `namespace`, trimmed of surrounding whitespace.
    pub fn resolve(&self, namespace: &str, cred: &CredentialRef) -> Result<Vec<u8>, SecretError> {
        let r = cred.secret_ref.as_ref().ok_or(SecretError::NoSecretRef)?;
        self.data
            .get(&(namespace.to_string(), r.name.clone()))
            .and_then(|d| d.get(&r.key))
            .map(|v| v.trim_ascii().to_vec())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| SecretError::Missing {
                namespace: namespace.to_string(),
                name: r.name.clone(),
                key: r.key.clone(),
            })
    }
}

/// The Secrets the serving objects of `snapshot` reference.
pub fn referenced(snapshot: &Snapshot) -> BTreeSet<SecretName> {
    let ns_of = |kind: &str, name: &str| {
        snapshot
            .entry(kind, name)
            .map(|e| e.object.namespace.clone())
            .unwrap_or_default()
    };
    let mut out = BTreeSet::new();
    for (name, t) in &snapshot.set.tenants {
        let ns = ns_of("InferenceTenant", name);
        for k in &t.spec.api_keys {
            if let Some(r) = &k.secret_ref {
                out.insert((ns.clone(), r.name.clone()));
            }
        }
    }
    for (name, p) in &snapshot.set.providers {
        if let Some(r) = &p.spec.credentials.secret_ref {
            out.insert((ns_of("InferenceProvider", name), r.name.clone()));
        }
    }
    for (name, p) in &snapshot.set.pools {
        if let Some(r) = p
            .spec
            .worker_credentials
            .as_ref()
            .and_then(|c| c.secret_ref.as_ref())
        {
            out.insert((ns_of("InferencePool", name), r.name.clone()));
        }
    }
    out.retain(|(ns, _)| !ns.is_empty());
    out
}

enum Update {
    Set(SecretName, BTreeMap<String, Vec<u8>>),
    Gone(SecretName),
    Listed(SecretName),
}

fn data_of(s: &Secret) -> BTreeMap<String, Vec<u8>> {
    let mut out: BTreeMap<String, Vec<u8>> = s
        .data
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.0.clone()))
        .collect();
    for (k, v) in s.string_data.iter().flatten() {
        out.insert(k.clone(), v.clone().into_bytes());
    }
    out
}

/// Watches the Secrets that `snapshots` reference, following the references as they change.
/// The returned receiver sees every change; the task ends when `snapshots` closes.
pub fn start(
    client: Client,
    mut snapshots: watch::Receiver<Arc<Snapshot>>,
) -> (
    watch::Receiver<Arc<SecretValues>>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = watch::channel(Arc::new(SecretValues::default()));
    let task = tokio::spawn(async move {
        let (up_tx, mut up_rx) = mpsc::channel::<Update>(256);
        let mut watches: BTreeMap<SecretName, tokio::task::JoinHandle<()>> = BTreeMap::new();
        let mut values = SecretValues::default();
        let mut listed: BTreeSet<SecretName> = BTreeSet::new();
        let mut wanted = referenced(&snapshots.borrow_and_update());
        loop {
            // Start watches for new references, stop those no longer referenced.
            for name in &wanted {
                if !watches.contains_key(name) {
                    watches.insert(
                        name.clone(),
                        spawn_watch(client.clone(), name.clone(), up_tx.clone()),
                    );
                }
            }
            let gone: Vec<SecretName> = watches
                .keys()
                .filter(|n| !wanted.contains(*n))
                .cloned()
                .collect();
            for name in gone {
                if let Some(t) = watches.remove(&name) {
                    t.abort();
                }
                values.data.remove(&name);
                listed.remove(&name);
            }
            values.synced = wanted.iter().all(|n| listed.contains(n));
            tx.send_replace(Arc::new(values.clone()));
            tokio::select! {
                r = snapshots.changed() => {
                    if r.is_err() {
                        break;
                    }
                    wanted = referenced(&snapshots.borrow_and_update());
                }
                Some(first) = up_rx.recv() => {
                    let mut next = Some(first);
                    while let Some(u) = next.take() {
                        match u {
                            Update::Set(n, d) => {
                                if watches.contains_key(&n) {
                                    values.data.insert(n, d);
                                }
                            }
                            Update::Gone(n) => {
                                values.data.remove(&n);
                            }
                            Update::Listed(n) => {
                                listed.insert(n);
                            }
                        }
                        next = up_rx.try_recv().ok();
                    }
                }
            }
        }
        for (_, t) in watches {
            t.abort();
        }
    });
    (rx, task)
}

fn spawn_watch(
    client: Client,
    name: SecretName,
    tx: mpsc::Sender<Update>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let api: Api<Secret> = Api::namespaced(client, &name.0);
        let config = watcher::Config::default().fields(&format!("metadata.name={}", name.1));
        let mut events = std::pin::pin!(watcher::watcher(api, config).default_backoff());
        let mut seen_in_list = false;
        while let Some(event) = events.next().await {
            let update = match event {
                Ok(Event::Apply(s)) => Update::Set(name.clone(), data_of(&s)),
                Ok(Event::InitApply(s)) => {
                    seen_in_list = true;
                    Update::Set(name.clone(), data_of(&s))
                }
                Ok(Event::Delete(_)) => Update::Gone(name.clone()),
                Ok(Event::Init) => {
                    seen_in_list = false;
                    continue;
                }
                Ok(Event::InitDone) => {
                    if !seen_in_list && tx.send(Update::Gone(name.clone())).await.is_err() {
                        return;
                    }
                    Update::Listed(name.clone())
                }
                Err(error) => {
                    tracing::warn!(namespace = %name.0, secret = %name.1, %error, "watch of a referenced Secret failed; retrying");
                    continue;
                }
            };
            if tx.send(update).await.is_err() {
                return;
            }
        }
    })
}
