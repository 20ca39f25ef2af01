//! One source of truth for the five CRDs: what the policy stage, tenancy and the providers read.
//!
//! A [`ConfigSource`] publishes an immutable [`Snapshot`] through a tokio `watch`: the validated
//! [`PolicySet`] plus, for every object offered, its serving generation and its [`ObjectState`].
//! Two front ends feed it:
//! - [`files`]: a directory of CRD-shaped YAML (local mode), polled for changes;
//! - [`kube`]: `kube-runtime` watchers of the five kinds in the configured namespaces.
//!
//! Both go through the same per-object apply with last-known-good ([`Applier`]): each object is
//! validated on its own (the CRD schema, the typed spec, then the set's cross-checks); a valid new
//! generation replaces the old one; an invalid one never replaces the serving generation of the
//! same object and never removes the others (the object is `RolledBack`, with the error and the
//! generation still serving); deleting an object removes it.
//!
//! Around it, for a cluster: [`lease`] elects one writer among gateway replicas, [`status`] writes
//! `status.conditions` / `observedGeneration` with server-side apply, and [`secrets`] watches the
//! Secrets that tenants' API keys and providers' credentials name.

pub mod cluster;
pub mod files;
pub mod inspect;
pub mod kube;
pub mod lease;
pub mod secrets;
pub mod status;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use serde::Serialize;
use tokio::sync::watch;

use crate::policy::PolicySet;
use crate::policy::model::{ApplyState, Manifest, ObjectKey};

/// Identity of an object in the source: kind, namespace (empty in local mode) and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ObjectRef {
    /// One of [`kinference_crds::KINDS`].
    pub kind: &'static str,
    /// Namespace (empty for objects read from files).
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
}

impl ObjectRef {
    /// The key of the object in a [`PolicySet`] (kind and name).
    pub fn key(&self) -> ObjectKey {
        ObjectKey {
            kind: self.kind,
            name: self.name.clone(),
        }
    }
}

impl fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{}/{}", self.kind, self.name)
        } else {
            write!(f, "{}/{}/{}", self.kind, self.namespace, self.name)
        }
    }
}

/// What happened to the latest generation of an object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state")]
pub enum ObjectState {
    /// The latest generation validated and is serving.
    Accepted,
    /// The latest generation is invalid; `serving_generation` (an older one) keeps serving.
    RolledBack {
        /// Why the latest generation was refused (names the field).
        error: String,
        /// The generation still serving.
        serving_generation: Option<i64>,
    },
    /// The latest generation is invalid and no older one was ever valid: nothing serves.
    Rejected {
        /// Why it was refused.
        error: String,
    },
    /// An object of the same kind and name in another watched namespace was created first and
    /// owns the name (names are unique across the watched namespaces): this one never serves.
    Conflict {
        /// Which object owns the name, and what to do about it.
        error: String,
        /// The object that owns the name.
        owner: ObjectRef,
    },
}

impl ObjectState {
    /// `Accepted`, `RolledBack`, `Rejected` or `Conflict`.
    pub fn name(&self) -> &'static str {
        match self {
            ObjectState::Accepted => "Accepted",
            ObjectState::RolledBack { .. } => "RolledBack",
            ObjectState::Rejected { .. } => "Rejected",
            ObjectState::Conflict { .. } => "Conflict",
        }
    }

    /// Why the latest generation is not serving (None when it is).
    pub fn error(&self) -> Option<&str> {
        match self {
            ObjectState::Accepted => None,
            ObjectState::RolledBack { error, .. }
            | ObjectState::Rejected { error }
            | ObjectState::Conflict { error, .. } => Some(error),
        }
    }
}

/// One object of a snapshot.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ObjectEntry {
    /// Which object.
    pub object: ObjectRef,
    /// `metadata.generation` of the latest version seen.
    pub observed_generation: Option<i64>,
    /// The generation serving (None: not serving).
    pub serving_generation: Option<i64>,
    /// What happened to the latest version.
    pub state: ObjectState,
    /// The object's `status` as last read from the API server (cluster mode), to write only changes.
    #[serde(skip)]
    pub live_status: Option<serde_json::Value>,
    /// `metadata.uid` (cluster mode).
    #[serde(skip)]
    pub uid: Option<String>,
}

/// An immutable view of the configuration: the serving set and the state of every object.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Increases with every published snapshot.
    pub revision: u64,
    /// The set the gateway serves (each object at its serving generation).
    pub set: Arc<PolicySet>,
    /// Every object offered, by identity.
    pub objects: BTreeMap<ObjectRef, ObjectEntry>,
    /// The front end has read everything once (the initial list in a cluster, the first load of
    /// the files). Consumers that must fail closed treat an unsynced snapshot as "nothing loaded".
    pub synced: bool,
}

impl Snapshot {
    /// The entry of `kind`/`name` in whichever namespace owns the name (not one refused as a
    /// [`ObjectState::Conflict`]): the namespace its Secrets are read from.
    pub fn entry(&self, kind: &str, name: &str) -> Option<&ObjectEntry> {
        self.objects.values().find(|e| {
            e.object.kind == kind
                && e.object.name == name
                && !matches!(e.state, ObjectState::Conflict { .. })
        })
    }
}

/// The latest version offered for one object: parsed, or the reason it is unreadable.
#[derive(Debug, Clone)]
struct Candidate {
    generation: Option<i64>,
    parsed: Result<Manifest, String>,
    live_status: Option<serde_json::Value>,
    uid: Option<String>,
    /// `metadata.creationTimestamp` (RFC 3339, so it sorts as text): the first created of two
    /// objects with the same kind and name owns the name.
    created: Option<String>,
}

/// Per-object apply with last-known-good: the candidates of every object -> a [`Snapshot`].
///
/// Pure state, no I/O: the front ends feed it and publish what [`Applier::build`] returns.
#[derive(Debug, Default)]
pub struct Applier {
    candidates: BTreeMap<ObjectRef, Candidate>,
    previous: Arc<PolicySet>,
    revision: u64,
}

impl Applier {
    /// Offers the latest version of an object as the API server returns it (JSON). The CRD schema
    /// and the typed spec are checked here; an object that fails is kept as unreadable, so its
    /// previous generation keeps serving.
    pub fn upsert_value(&mut self, kind: &'static str, value: &serde_json::Value) {
        let namespace = value
            .pointer("/metadata/namespace")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string();
        let name = value
            .pointer("/metadata/name")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string();
        if name.is_empty() {
            return;
        }
        let object = ObjectRef {
            kind,
            namespace,
            name,
        };
        let generation = value
            .pointer("/metadata/generation")
            .and_then(|v| v.as_i64());
        let uid = value
            .pointer("/metadata/uid")
            .and_then(|v| v.as_str())
            .map(str::to_string);
        let live_status = value.get("status").cloned();
        let created = value
            .pointer("/metadata/creationTimestamp")
            .and_then(|v| v.as_str())
            .map(str::to_string);
        let parsed = parse_object(&object, value);
        self.candidates.insert(
            object,
            Candidate {
                generation,
                parsed,
                live_status,
                uid,
                created,
            },
        );
    }

    /// Offers an already parsed object (local mode).
    pub fn upsert_manifest(&mut self, namespace: &str, manifest: Manifest) {
        let object = ObjectRef {
            kind: manifest.spec.kind(),
            namespace: namespace.to_string(),
            name: manifest.name.clone(),
        };
        self.candidates.insert(
            object,
            Candidate {
                generation: manifest.generation,
                parsed: Ok(manifest),
                live_status: None,
                uid: None,
                created: None,
            },
        );
    }

    /// Offers an object whose latest version could not be read (local mode: a YAML error).
    pub fn upsert_invalid(&mut self, object: ObjectRef, error: String) {
        self.candidates.insert(
            object,
            Candidate {
                generation: None,
                parsed: Err(error),
                live_status: None,
                uid: None,
                created: None,
            },
        );
    }

    /// The object was deleted: it stops serving.
    pub fn remove(&mut self, object: &ObjectRef) {
        self.candidates.remove(object);
    }

    /// Replaces every object for which `scope` holds by `objects` (a re-list after a watch restart:
    /// objects deleted while the watch was down disappear).
    pub fn replace_where(
        &mut self,
        scope: impl Fn(&ObjectRef) -> bool,
        kind: &'static str,
        objects: &[serde_json::Value],
    ) {
        self.candidates.retain(|o, _| !scope(o));
        for v in objects {
            self.upsert_value(kind, v);
        }
    }

    /// The objects currently offered.
    pub fn objects(&self) -> impl Iterator<Item = &ObjectRef> {
        self.candidates.keys()
    }

    /// Builds the next snapshot: valid objects replace their previous generation; invalid ones keep
    /// it (rolled back); objects no longer offered are gone; of several objects with the same kind
    /// and name (in different namespaces) only the owner ([`Applier::owners`]) is considered.
    pub fn build(&mut self, synced: bool) -> Snapshot {
        let owners = self.owners();
        let mut manifests = Vec::new();
        let mut kept = BTreeMap::new();
        for (object, c) in &self.candidates {
            if owners.get(&object.key()) != Some(&object) {
                continue;
            }
            match &c.parsed {
                Ok(m) => manifests.push(m.clone()),
                Err(e) => {
                    kept.insert(object.key(), e.clone());
                }
            }
        }
        let outcome = PolicySet::build(&manifests, Some(&self.previous), &kept);
        let serving = |key: &ObjectKey| outcome.set.manifest(key).and_then(|m| m.generation);
        let mut objects = BTreeMap::new();
        for (object, c) in &self.candidates {
            let key = object.key();
            let owner = owners.get(&key).copied().unwrap_or(object);
            let state = if owner != object {
                ObjectState::Conflict {
                    error: format!(
                        "{} {:?} already exists in namespace {:?} (created first); names are unique across the watched namespaces: rename or delete one",
                        object.kind, object.name, owner.namespace
                    ),
                    owner: owner.clone(),
                }
            } else {
                match outcome.states.get(&key) {
                    Some(ApplyState::Applied) | None => ObjectState::Accepted,
                    Some(ApplyState::RolledBack { reason }) => ObjectState::RolledBack {
                        error: reason.clone(),
                        serving_generation: serving(&key),
                    },
                    Some(ApplyState::Rejected { reason }) => ObjectState::Rejected {
                        error: reason.clone(),
                    },
                }
            };
            let serving_generation = match &state {
                ObjectState::Accepted | ObjectState::RolledBack { .. } => serving(&key),
                ObjectState::Rejected { .. } | ObjectState::Conflict { .. } => None,
            };
            objects.insert(
                object.clone(),
                ObjectEntry {
                    object: object.clone(),
                    observed_generation: c.generation,
                    serving_generation,
                    state,
                    live_status: c.live_status.clone(),
                    uid: c.uid.clone(),
                },
            );
        }
        self.previous = Arc::new(outcome.set);
        self.revision += 1;
        Snapshot {
            revision: self.revision,
            set: Arc::clone(&self.previous),
            objects,
            synced,
        }
    }

    /// The object that owns each kind and name: of several in different namespaces, the one created
    /// first (`creationTimestamp` has whole seconds: a tie goes to the first namespace in name
    /// order), whatever its validity, so the choice is the
    /// same on every replica and does not flip when the owner gets a bad generation. Deleting the
    /// owner hands the name to the next one.
    fn owners(&self) -> BTreeMap<ObjectKey, &ObjectRef> {
        let mut owners: BTreeMap<ObjectKey, (&ObjectRef, &Candidate)> = BTreeMap::new();
        for (object, c) in &self.candidates {
            let rank = |o: &ObjectRef, c: &Candidate| {
                (c.created.is_none(), c.created.clone(), o.namespace.clone())
            };
            owners
                .entry(object.key())
                .and_modify(|cur| {
                    if rank(object, c) < rank(cur.0, cur.1) {
                        *cur = (object, c);
                    }
                })
                .or_insert((object, c));
        }
        owners.into_iter().map(|(k, (o, _))| (k, o)).collect()
    }
}

/// Checks one API object: the CRD schema and the typed spec (through the same parser as the
/// files, so messages name the field the same way).
fn parse_object(object: &ObjectRef, value: &serde_json::Value) -> Result<Manifest, String> {
    let mut value = value.clone();
    // What the API server adds is not part of the spec and not checked by the schema.
    if let Some(obj) = value.as_object_mut() {
        obj.remove("status");
    }
    if let Some(meta) = value.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        meta.remove("managedFields");
        meta.remove("annotations");
    }
    let text = serde_yaml::to_string(&value).map_err(|e| format!("cannot read object: {e}"))?;
    let origin = PathBuf::from(format!("{object}"));
    let parsed = crate::policy::source::parse_file(&origin, &text);
    if let Some(m) = parsed.manifests.into_iter().next() {
        return Ok(m);
    }
    let reason = parsed
        .problems
        .iter()
        .map(|p| p.message.clone())
        .collect::<Vec<_>>()
        .join("; ");
    Err(if reason.is_empty() {
        "object could not be read".into()
    } else {
        reason
    })
}

/// Labels of `kinference_gateway_config_objects`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    kind: &'static str,
    state: &'static str,
}

/// Why a source could not start.
#[derive(Debug, thiserror::Error)]
pub enum ConfigSourceError {
    /// The policy directory could not be read.
    #[error(transparent)]
    Files(#[from] crate::policy::source::SourceError),
    /// The Kubernetes client could not be built.
    #[error("kubernetes client: {0}")]
    Kube(#[from] ::kube::Error),
    /// A kubeconfig could not be read.
    #[error("kubeconfig: {0}")]
    Kubeconfig(String),
}

/// The configuration the gateway's consumers subscribe to. Dropping it stops its tasks.
#[derive(Debug)]
pub struct ConfigSource {
    rx: watch::Receiver<Arc<Snapshot>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for ConfigSource {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl ConfigSource {
    /// A source published through `rx`, alive as long as `tasks`.
    pub fn new(
        rx: watch::Receiver<Arc<Snapshot>>,
        tasks: Vec<tokio::task::JoinHandle<()>>,
    ) -> Self {
        ConfigSource { rx, tasks }
    }

    /// The current snapshot.
    pub fn current(&self) -> Arc<Snapshot> {
        self.rx.borrow().clone()
    }

    /// A receiver that sees every new snapshot.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.rx.clone()
    }

    /// Keeps a task alive with the source (a status writer, a bridge).
    pub fn keep(&mut self, task: tokio::task::JoinHandle<()>) {
        self.tasks.push(task);
    }

    /// The serving policy set, as its own watch (what the policy stage subscribes to).
    pub fn policy_sets(&mut self) -> watch::Receiver<Arc<PolicySet>> {
        let mut rx = self.subscribe();
        let (tx, out) = watch::channel(Arc::clone(&rx.borrow().set));
        self.keep(tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                let set = Arc::clone(&rx.borrow_and_update().set);
                if tx.send(set).is_err() {
                    return;
                }
            }
        }));
        out
    }

    /// The serving policy set as its own watch, for a consumer that outlives this handle: the
    /// tasks are not stopped with it but end by themselves once every receiver is gone.
    pub fn into_policy_sets(mut self) -> watch::Receiver<Arc<PolicySet>> {
        let sets = self.policy_sets();
        self.tasks.clear();
        sets
    }

    /// Registers `kinference_gateway_config_objects{kind, state}` (objects per kind and
    /// Accepted / RolledBack / Rejected / Conflict), kept current with every snapshot.
    pub fn register_metrics(&mut self, registry: &mut prometheus_client::registry::Registry) {
        let objects: Family<StateLabels, Gauge> = Family::default();
        registry.sub_registry_with_prefix("kinference_gateway").register(
            "config_objects",
            "Configuration objects (the five CRDs) by kind and apply state (Accepted, RolledBack: an older generation serves, Rejected: none does, Conflict: the name is taken in another namespace)",
            objects.clone(),
        );
        let mut rx = self.subscribe();
        self.keep(tokio::spawn(async move {
            loop {
                let snapshot = Arc::clone(&rx.borrow_and_update());
                objects.clear();
                for e in snapshot.objects.values() {
                    objects
                        .get_or_create(&StateLabels {
                            kind: e.object.kind,
                            state: e.state.name(),
                        })
                        .inc();
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        }));
    }

    /// Waits until the front end has read everything once, at most `timeout`; whether it has.
    pub async fn wait_synced(&self, timeout: Duration) -> bool {
        let mut rx = self.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|s| s.synced))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}
