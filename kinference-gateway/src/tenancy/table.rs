//! The tenant table: tenants, their keys and the pools' prices, loaded from the tenants' files and
//! reloaded when they change; authentication against it.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use http::HeaderMap;
use kinference_crds::{InferencePoolSpec, TokenPrices};

use super::keys::{self, KeyRing};
use super::metrics::{self, TenantStatus};
use super::{Caller, Tenancy, Tenant};
use crate::errors::GatewayError;

/// The tenants and keys currently in force.
#[derive(Debug, Default)]
pub(super) struct TenantTable {
    tenants: Vec<Arc<Tenant>>,
    ring: KeyRing,
    /// Pools for pricing: (name, spec), and InferenceModel name -> served name.
    pools: Vec<(String, InferencePoolSpec)>,
    served_names: HashMap<String, String>,
    /// A fingerprint of what was loaded (tenant names, key digests), to log changes only.
    fingerprint: Vec<u8>,
}

/// A YAML file or a directory as a policy set (problems are logged by the loader's callers).
fn load_set(path: &Path, log: bool) -> Option<crate::policy::PolicySet> {
    if path.is_dir() {
        match crate::policy::load_dir(path, None) {
            Ok(loaded) => {
                if log {
                    for p in &loaded.problems {
                        tracing::warn!(file = %p.file.display(), line = p.line, "tenancy: {}", p.message);
                    }
                    for p in &loaded.outcome.problems {
                        tracing::warn!(object = %p.object, "tenancy: object not applied: {}", p.message);
                    }
                }
                Some(loaded.outcome.set)
            }
            Err(error) => {
                tracing::warn!(%error, "tenancy: cannot read the tenants");
                None
            }
        }
    } else {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "tenancy: cannot read the tenants file");
                return None;
            }
        };
        let parsed = crate::policy::source::parse_file(path, &text);
        let outcome = crate::policy::PolicySet::build(&parsed.manifests, None, &BTreeMap::new());
        if log {
            for p in &parsed.problems {
                tracing::warn!(file = %p.file.display(), line = p.line, "tenancy: {}", p.message);
            }
            for p in &outcome.problems {
                tracing::warn!(object = %p.object, "tenancy: object not applied: {}", p.message);
            }
        }
        Some(outcome.set)
    }
}

impl Tenancy {
    /// Re-reads the tenants, their keys and the pools' prices; swaps them in when they changed.
    pub(super) fn reload(&self, first: bool) {
        // Problems in the files are logged at start-up; later reloads are quiet unless they change
        // something (the policy stage logs its own directory's problems on every change).
        let table = self.load_table(first);
        let current = self.table.read().clone();
        if !first && table.fingerprint == current.fingerprint {
            return;
        }
        let open = table.tenants.is_empty();
        self.metrics.tenants.set(table.tenants.len() as i64);
        if open {
            tracing::warn!(
                "no tenants configured (tenancy.tenants_dir): the gateway is OPEN, every request is served as tenant `anonymous` without an API key"
            );
        } else {
            tracing::info!(
                tenants = table.tenants.len(),
                keys = table.ring.len(),
                "tenants loaded; requests need an API key"
            );
        }
        *self.table.write() = Arc::new(table);
    }

    fn load_table(&self, log: bool) -> TenantTable {
        let mut table = TenantTable::default();
        let mut dirs: Vec<&Path> = Vec::new();
        if let Some(d) = &self.policy_dir {
            dirs.push(d);
        }
        let tenants_dir = self.config.tenants_dir.as_deref();
        if let Some(d) = tenants_dir
            && Some(d) != self.policy_dir.as_deref()
        {
            dirs.push(d);
        }
        let mut tenant_specs = BTreeMap::new();
        for dir in dirs {
            let Some(set) = load_set(dir, log) else {
                continue;
            };
            for (name, pool) in &set.pools {
                table
                    .fingerprint
                    .extend_from_slice(format!("{name}{:?}", pool.spec).as_bytes());
                table.pools.push((name.clone(), pool.spec.clone()));
            }
            for (name, model) in &set.models {
                table
                    .served_names
                    .insert(name.clone(), model.spec.served_name.clone());
            }
            if Some(dir) == tenants_dir {
                for (name, t) in &set.tenants {
                    tenant_specs.insert(name.clone(), t.spec.clone());
                }
            }
        }
        let mut names: Vec<&String> = tenant_specs.keys().collect();
        names.sort();
        for name in self.config.tenants.keys() {
            if log && !tenant_specs.contains_key(name) {
                tracing::warn!(tenant = %name, "tenancy.tenants names a tenant that is not configured");
            }
        }
        for (i, name) in names.into_iter().enumerate() {
            let spec = &tenant_specs[name];
            let index = table.tenants.len() as u32;
            let mut resolved = 0;
            for (k, cred) in spec.api_keys.iter().enumerate() {
                match keys::resolve(cred, self.config.secrets_dir.as_deref()) {
                    Ok(key) => {
                        let digest = keys::digest(&key);
                        table.fingerprint.extend_from_slice(&digest);
                        table.ring.insert(digest, index);
                        resolved += 1;
                    }
                    Err(e) if log => {
                        tracing::warn!(tenant = %name, key = k, reason = %e, "API key not available")
                    }
                    Err(_) => {}
                }
            }
            if log && resolved == 0 {
                tracing::warn!(tenant = %name, "tenant has no usable API key; nobody can call as it");
            }
            table.fingerprint.extend_from_slice(name.as_bytes());
            table.fingerprint.push(0);
            table
                .fingerprint
                .extend_from_slice(format!("{spec:?}").as_bytes());
            table.tenants.push(Arc::new(Tenant {
                name: name.clone(),
                label: if i < metrics::MAX_TENANT_LABELS {
                    name.clone()
                } else {
                    "other".into()
                },
                limits: spec.limits.clone(),
                budget: spec.budget.clone(),
                settings: self.config.tenants.get(name).cloned().unwrap_or_default(),
            }));
        }
        table
    }

    /// Whether the gateway serves without API keys (no tenant configured).
    pub fn is_open(&self) -> bool {
        self.table.read().tenants.is_empty()
    }

    /// Stage "authenticate": the caller of a request, or 401.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, GatewayError> {
        let table = self.table.read().clone();
        if table.tenants.is_empty() {
            return Ok(Caller { tenant: None });
        }
        let Some(key) = keys::presented_key(headers) else {
            self.auth_failed("missing");
            return Err(GatewayError::Unauthenticated(
                "Missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`."
                    .into(),
            ));
        };
        match table.ring.lookup(&key) {
            Some(i) => Ok(Caller {
                tenant: table.tenants.get(i as usize).cloned(),
            }),
            None => {
                self.auth_failed("unknown");
                Err(GatewayError::Unauthenticated(
                    "Incorrect API key provided.".into(),
                ))
            }
        }
    }

    fn auth_failed(&self, reason: &'static str) {
        self.metrics
            .auth_failures
            .get_or_create(&metrics::AuthFailure { reason })
            .inc();
        self.metrics
            .requests
            .get_or_create(&TenantStatus {
                tenant: "unauthenticated".into(),
                model: String::new(),
                status: 401,
            })
            .inc();
    }

    /// The pool that serves `model` on `worker`: one listing the worker's URL, else one serving it.
    pub(super) fn pool_of(&self, worker: &str, model: &str) -> Option<(String, TokenPrices)> {
        let table = self.table.read().clone();
        let by_url = table.pools.iter().find(|(_, p)| {
            p.endpoints
                .iter()
                .any(|e| e.url.trim_end_matches('/') == worker.trim_end_matches('/'))
        });
        let by_model = || {
            table.pools.iter().find(|(_, p)| {
                p.models
                    .iter()
                    .any(|m| m == model || table.served_names.get(m).is_some_and(|s| s == model))
            })
        };
        by_url
            .or_else(by_model)
            .map(|(name, p)| (name.clone(), p.prices.clone()))
    }
}
