//! Tenancy fed by [`crate::config_source::ConfigSource`]s: the watched CRDs in a cluster
//! ([`Tenancy::follow`]), the tenants' files and the gateway's policy-directory source
//! ([`PolicyFiles`]) in local mode ([`Tenancy::follow_files`]). Tenancy never
//! reads files itself; both modes build the table the same way ([`Tenancy::table_from`]).
//!
//! The tenants are the snapshot's serving `InferenceTenant` objects (each at its last valid
//! generation). Their keys: in a cluster the watched Secrets their `secretRef`s name, rebuilt on
//! every snapshot or Secret change, so a rotated key works and the old one is refused as soon as the
//! watch delivers the change; in local mode the environment and `tenancy.secrets_dir`, re-resolved
//! every `reload_interval_ms` (a key file can change without its tenant). Fail closed: with a tenant
//! source configured, until it has loaded once every request gets 503, and a tenant whose key is
//! missing has no key (its callers get 401), never an open gateway.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kinference_crds::CredentialRef;
use tokio::sync::watch;

use super::table::TenantTable;
use super::{Tenancy, Tenant, keys, metrics};
use crate::config_source::secrets::SecretValues;
use crate::config_source::{ConfigSource, Snapshot};
use crate::policy::PolicySet;

/// The policy directory's configuration source (local mode), started once by the gateway and
/// shared with the policy stage: tenancy reads the pools and models from it, and the tenants too
/// when `tenancy.tenants_dir` is that same directory.
#[derive(Debug, Clone)]
pub struct PolicyFiles {
    /// The directory (or file) the source reads: `policy_dir`.
    pub dir: PathBuf,
    /// The source's snapshots ([`ConfigSource::subscribe`]).
    pub snapshots: watch::Receiver<Arc<Snapshot>>,
}

/// Where tenants' API keys come from.
enum Keys<'a> {
    /// The watched Secrets (cluster mode), in the tenant's namespace.
    Secrets(&'a SecretValues),
    /// The environment and `tenancy.secrets_dir` (local mode).
    Local(Option<&'a Path>),
}

impl Keys<'_> {
    fn resolve(&self, namespace: &str, cred: &CredentialRef) -> Result<Vec<u8>, String> {
        match self {
            Keys::Secrets(values) => values.resolve(namespace, cred).map_err(|e| e.to_string()),
            Keys::Local(dir) => keys::resolve(cred, *dir).map_err(|e| e.to_string()),
        }
    }
}

/// A table and what to say about it once it is swapped in.
struct Built {
    table: TenantTable,
    /// (tenant, key index, why the key is missing).
    missing_keys: Vec<(String, usize, String)>,
}

impl Tenancy {
    /// Follows `snapshots` and `secrets` from now on (call before serving: authentication is
    /// required at once). The task ends when either channel closes or tenancy is dropped.
    pub fn follow(
        self: &Arc<Self>,
        mut snapshots: watch::Receiver<Arc<Snapshot>>,
        mut secrets: watch::Receiver<Arc<SecretValues>>,
    ) -> tokio::task::JoinHandle<()> {
        {
            // Under the table's lock, so a local update in flight cannot write after this.
            let mut table = self.table.write();
            self.followed.store(true, Ordering::Release);
            *table = Arc::new(TenantTable::empty(true));
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let snapshot = Arc::clone(&snapshots.borrow_and_update());
                let values = Arc::clone(&secrets.borrow_and_update());
                let Some(tenancy) = weak.upgrade() else {
                    return;
                };
                if snapshot.synced {
                    tenancy.apply_snapshot(&snapshot, &values);
                }
                drop(tenancy);
                tokio::select! {
                    r = snapshots.changed() => if r.is_err() { return },
                    r = secrets.changed() => if r.is_err() { return },
                }
            }
        })
    }

    /// Swaps in the tenants of `snapshot` with keys from `values`.
    pub fn apply_snapshot(&self, snapshot: &Snapshot, values: &SecretValues) {
        let built = self.table_from(Some(snapshot), &[], &Keys::Secrets(values), true);
        self.install(built, false, values.synced, " from the cluster", true);
    }

    /// Local mode: the tenants from `tenants` (the `tenancy.tenants_dir` source's snapshots) and
    /// the pools' prices from them and from `policy` (the policy directory's), with keys from the
    /// environment and `secrets_dir`. Applies the current snapshots now and keeps following until
    /// tenancy is dropped or a cluster source takes over ([`Tenancy::follow`]). `own`: a source
    /// tenancy started itself, kept alive as long as it follows.
    pub(super) fn follow_files(
        self: &Arc<Self>,
        mut tenants_rx: Option<watch::Receiver<Arc<Snapshot>>>,
        mut policy_rx: Option<watch::Receiver<Arc<Snapshot>>>,
        own: Option<ConfigSource>,
        every: Duration,
    ) {
        let (t, p) = (current(&mut tenants_rx), current(&mut policy_rx));
        self.apply_files(t.as_deref(), p.as_deref(), true);
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            // A source of tenancy's own lives as long as this task.
            let _own = own;
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = changed(&mut tenants_rx) => {}
                    _ = changed(&mut policy_rx) => {}
                    _ = tick.tick() => {}
                }
                let Some(tenancy) = weak.upgrade() else {
                    return;
                };
                if tenancy.followed.load(Ordering::Acquire) {
                    return;
                }
                let (t, p) = (current(&mut tenants_rx), current(&mut policy_rx));
                tenancy.apply_files(t.as_deref(), p.as_deref(), false);
            }
        });
    }

    /// Swaps in the table of the local sources' snapshots when it changed.
    fn apply_files(&self, tenants: Option<&Snapshot>, policy: Option<&Snapshot>, first: bool) {
        let required = self.config.tenants_dir.is_some();
        let others: Vec<&PolicySet> = policy.map(|p| &*p.set).into_iter().collect();
        let keys = Keys::Local(self.config.secrets_dir.as_deref());
        let tenants = tenants.filter(|t| t.synced);
        let built = self.table_from(tenants, &others, &keys, required);
        if first {
            for name in self.config.tenants.keys() {
                if !built.table.tenants.iter().any(|t| &t.name == name) {
                    tracing::warn!(tenant = %name, "tenancy.tenants names a tenant that is not configured");
                }
            }
        }
        self.install(built, first, true, "", false);
    }

    /// The table of `tenants`' serving tenants (none without it) and of the pools and models of
    /// `tenants` and `others`.
    fn table_from(
        &self,
        tenants: Option<&Snapshot>,
        others: &[&PolicySet],
        keys: &Keys<'_>,
        required: bool,
    ) -> Built {
        let mut table = TenantTable::empty(required);
        let mut missing_keys = Vec::new();
        let sets = others
            .iter()
            .copied()
            .chain(tenants.map(|t| &*t.set))
            .collect::<Vec<_>>();
        let mut served_names = HashMap::new();
        for set in &sets {
            for (name, pool) in &set.pools {
                table
                    .fingerprint
                    .extend_from_slice(format!("{name}{:?}", pool.spec).as_bytes());
                table.pools.push((name.clone(), pool.spec.clone()));
            }
            for (name, model) in &set.models {
                table
                    .fingerprint
                    .extend_from_slice(format!("{name}{:?}", model.spec).as_bytes());
                served_names.insert(name.clone(), model.spec.served_name.clone());
                table.served.add(name, &model.spec);
            }
        }
        table.served_names = served_names;
        let Some(snapshot) = tenants else {
            return Built {
                table,
                missing_keys,
            };
        };
        for (i, (name, t)) in snapshot.set.tenants.iter().enumerate() {
            let namespace = snapshot
                .entry("InferenceTenant", name)
                .map(|e| e.object.namespace.clone())
                .unwrap_or_default();
            let index = table.tenants.len() as u32;
            for (k, cred) in t.spec.api_keys.iter().enumerate() {
                match keys.resolve(&namespace, cred) {
                    Ok(key) => {
                        let digest = keys::digest(&key);
                        table.fingerprint.extend_from_slice(&digest);
                        table.ring.insert(digest, index);
                    }
                    Err(reason) => missing_keys.push((name.clone(), k, reason)),
                }
            }
            table.fingerprint.extend_from_slice(name.as_bytes());
            table.fingerprint.push(0);
            table
                .fingerprint
                .extend_from_slice(format!("{:?}", t.spec).as_bytes());
            table.tenants.push(Arc::new(Tenant {
                name: name.clone(),
                label: if i < metrics::MAX_TENANT_LABELS {
                    name.clone()
                } else {
                    "other".into()
                },
                limits: t.spec.limits.clone(),
                budget: t.spec.budget.clone(),
                settings: self.config.tenants.get(name).cloned().unwrap_or_default(),
                priority: t.spec.priority,
                flow_control: t.spec.flow_control.clone(),
                allowed_models: t.spec.allowed_models.clone(),
                allowed_classes: t.spec.allowed_classes.clone(),
                prompt_cache: t.spec.prompt_cache.clone(),
            }));
        }
        Built {
            table,
            missing_keys,
        }
    }

    /// Swaps `built` in when it differs from the current table (always when `first`) and says so;
    /// a local table never replaces one a cluster source installed. `origin` ends the log line.
    fn install(&self, built: Built, first: bool, log_keys: bool, origin: &str, from_cluster: bool) {
        let Built {
            table,
            missing_keys,
        } = built;
        if !first && table.fingerprint == self.table.read().fingerprint {
            return;
        }
        if log_keys {
            for (tenant, key, reason) in &missing_keys {
                tracing::warn!(%tenant, key, %reason, "API key not available");
            }
        }
        let open = table.tenants.is_empty();
        if open && table.required {
            tracing::error!(
                "a tenant source is configured but no valid tenant is loaded{origin}: every request is refused (503) until one is"
            );
        } else if open {
            tracing::warn!(
                "no tenants configured (tenancy.tenants_dir): the gateway is OPEN, every request is served as tenant `anonymous` without an API key"
            );
        } else {
            tracing::info!(
                tenants = table.tenants.len(),
                keys = table.ring.len(),
                "tenants loaded{origin}; requests need an API key"
            );
        }
        // Under the lock: a cluster source that took over meanwhile wins.
        let mut slot = self.table.write();
        if from_cluster || !self.followed.load(Ordering::Acquire) {
            self.metrics.tenants.set(table.tenants.len() as i64);
            *slot = Arc::new(table);
        }
    }
}

/// The latest snapshot of `rx`, marked seen.
fn current(rx: &mut Option<watch::Receiver<Arc<Snapshot>>>) -> Option<Arc<Snapshot>> {
    rx.as_mut().map(|rx| Arc::clone(&rx.borrow_and_update()))
}

/// Waits for the next snapshot of `rx`; forever without one (or once its source is gone).
async fn changed(rx: &mut Option<watch::Receiver<Arc<Snapshot>>>) {
    let Some(r) = rx else {
        return std::future::pending().await;
    };
    if r.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}
