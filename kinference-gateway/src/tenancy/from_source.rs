//! Tenancy fed by a [`crate::config_source::ConfigSource`] (cluster mode) instead of its own files.
//!
//! The tenants are the snapshot's serving `InferenceTenant` objects (each at its last valid
//! generation), their keys the watched Secrets their `secretRef`s name. The table is rebuilt on
//! every snapshot or Secret change, so a rotated key works and the old one is refused as soon as the
//! watch delivers the change. Fail closed: authentication is required from the start; until the
//! source has listed everything once every request gets 503, and a tenant whose Secret is missing
//! has no key (its callers get 401), never an open gateway.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::watch;

use super::table::TenantTable;
use super::{Tenancy, Tenant, keys, metrics};
use crate::config_source::Snapshot;
use crate::config_source::secrets::SecretValues;

impl Tenancy {
    /// Follows `snapshots` and `secrets` from now on (call before serving: authentication is
    /// required at once). The task ends when either channel closes or tenancy is dropped.
    pub fn follow(
        self: &Arc<Self>,
        mut snapshots: watch::Receiver<Arc<Snapshot>>,
        mut secrets: watch::Receiver<Arc<SecretValues>>,
    ) -> tokio::task::JoinHandle<()> {
        {
            // Under the table's lock, so a file reload in flight cannot write after this.
            let mut table = self.table.write();
            self.followed
                .store(true, std::sync::atomic::Ordering::Release);
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
        let set = &snapshot.set;
        let mut table = TenantTable::empty(true);
        for (name, pool) in &set.pools {
            table
                .fingerprint
                .extend_from_slice(format!("{name}{:?}", pool.spec).as_bytes());
            table.pools.push((name.clone(), pool.spec.clone()));
        }
        table.served_names = set
            .models
            .iter()
            .map(|(n, m)| (n.clone(), m.spec.served_name.clone()))
            .collect::<HashMap<_, _>>();
        for (name, model) in &set.models {
            table.served.add(name, &model.spec);
        }
        for (i, (name, t)) in set.tenants.iter().enumerate() {
            let namespace = snapshot
                .entry("InferenceTenant", name)
                .map(|e| e.object.namespace.clone())
                .unwrap_or_default();
            let index = table.tenants.len() as u32;
            for (k, cred) in t.spec.api_keys.iter().enumerate() {
                match values.resolve(&namespace, cred) {
                    Ok(key) => {
                        let digest = keys::digest(&key);
                        table.fingerprint.extend_from_slice(&digest);
                        table.ring.insert(digest, index);
                    }
                    Err(reason) => {
                        if values.synced {
                            tracing::warn!(tenant = %name, key = k, %reason, "API key not available");
                        }
                    }
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
            }));
        }
        if table.fingerprint == self.table.read().fingerprint {
            return;
        }
        self.metrics.tenants.set(table.tenants.len() as i64);
        if table.tenants.is_empty() {
            tracing::error!(
                "no InferenceTenant serves in the watched namespaces: every request is refused (503)"
            );
        } else {
            tracing::info!(
                tenants = table.tenants.len(),
                keys = table.ring.len(),
                "tenants loaded from the cluster; requests need an API key"
            );
        }
        *self.table.write() = Arc::new(table);
    }
}
