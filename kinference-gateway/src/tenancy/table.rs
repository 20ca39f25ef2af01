//! The tenant table: tenants, their keys and the pools' prices, loaded from the tenants' files and
//! reloaded when they change; authentication against it.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use http::HeaderMap;
use kinference_crds::{InferencePoolSpec, TokenPrices};

use super::keys::{self, KeyRing};
use super::metrics::{self, TenantStatus};
use super::served::ServedModels;
use super::{Caller, Tenancy, Tenant};
use crate::errors::GatewayError;

/// The tenants and keys currently in force.
#[derive(Debug, Default)]
pub(super) struct TenantTable {
    pub(super) tenants: Vec<Arc<Tenant>>,
    pub(super) ring: KeyRing,
    /// Pools for pricing: (name, spec), and InferenceModel name -> served name.
    pub(super) pools: Vec<(String, InferencePoolSpec)>,
    pub(super) served_names: HashMap<String, String>,
    /// Requested names (model, alias, class) -> served models, for limits and prices.
    pub(super) served: ServedModels,
    /// A fingerprint of what was loaded (tenant names, key digests), to log changes only.
    pub(super) fingerprint: Vec<u8>,
    /// A tenant source is configured: an empty table refuses requests (503) instead of opening.
    pub(super) required: bool,
    /// The tenant objects last loaded, each at its last valid generation: what a broken reload
    /// falls back to, object by object.
    tenant_set: Option<crate::policy::PolicySet>,
}

impl TenantTable {
    /// No tenant yet; `required`: a tenant source is configured (closed until it loads).
    pub(super) fn empty(required: bool) -> Self {
        TenantTable {
            required,
            ..TenantTable::default()
        }
    }
}

/// A YAML file or a directory as a policy set (problems are logged by the loader's callers).
fn load_set(
    path: &Path,
    log: bool,
    previous: Option<&crate::policy::PolicySet>,
) -> Option<crate::policy::PolicySet> {
    if path.is_dir() {
        match crate::policy::load_dir(path, previous) {
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
        let mut kept = parsed.invalid.clone();
        // A document that could not even be identified may be a broken version of any tenant of
        // this file: every previous object not present now keeps its last good version.
        if parsed.unreadable
            && let Some(prev) = previous
        {
            let present: std::collections::BTreeSet<_> =
                parsed.manifests.iter().map(|m| m.key()).collect();
            for name in prev.tenants.keys() {
                let key = crate::policy::model::ObjectKey {
                    kind: "InferenceTenant",
                    name: name.clone(),
                };
                if !present.contains(&key) {
                    kept.entry(key).or_insert_with(|| {
                        "its file has errors; the previous version stays".into()
                    });
                }
            }
        }
        let outcome = crate::policy::PolicySet::build(&parsed.manifests, previous, &kept);
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
        if self.followed.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        // Problems in the files are logged at start-up; later reloads are quiet unless they change
        // something (the policy stage logs its own directory's problems on every change).
        let current = self.table.read().clone();
        let Some(table) = self.load_table(first, current.tenant_set.as_ref()) else {
            // Fail closed: the tenants could not be read at all, so the last good table stays.
            if first {
                tracing::error!(
                    "tenants unreadable at start-up: every request is refused (503) until they load"
                );
            } else {
                tracing::warn!("tenants unreadable; the last good tenant set keeps serving");
            }
            return;
        };
        if !first && table.fingerprint == current.fingerprint {
            return;
        }
        let open = table.tenants.is_empty();
        self.metrics.tenants.set(table.tenants.len() as i64);
        if open && table.required {
            tracing::error!(
                "a tenant source is configured but no valid tenant is loaded: every request is refused (503) until one is"
            );
        } else if open {
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
        // Under the lock: a source that took over meanwhile ([`Tenancy::follow`]) wins.
        let mut slot = self.table.write();
        if !self.followed.load(std::sync::atomic::Ordering::Acquire) {
            *slot = Arc::new(table);
        }
    }

    /// The table from the files; `None` when the tenants themselves could not be read (the caller
    /// keeps the current table). `previous` is the last tenant set, kept per object on errors.
    fn load_table(
        &self,
        log: bool,
        previous: Option<&crate::policy::PolicySet>,
    ) -> Option<TenantTable> {
        let mut table = TenantTable {
            required: self.config.tenants_dir.is_some(),
            ..TenantTable::default()
        };
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
            let is_tenants = Some(dir) == tenants_dir;
            let Some(set) = load_set(dir, log, previous.filter(|_| is_tenants)) else {
                if is_tenants {
                    return None;
                }
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
                    .fingerprint
                    .extend_from_slice(format!("{name}{:?}", model.spec).as_bytes());
                table
                    .served_names
                    .insert(name.clone(), model.spec.served_name.clone());
                table.served.add(name, &model.spec);
            }
            if is_tenants {
                for (name, t) in &set.tenants {
                    tenant_specs.insert(name.clone(), t.spec.clone());
                }
                table.tenant_set = Some(set);
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
                priority: spec.priority,
            }));
        }
        Some(table)
    }

    /// Whether the gateway serves without API keys (no tenant configured).
    pub fn is_open(&self) -> bool {
        let table = self.table.read();
        table.tenants.is_empty() && !table.required
    }

    /// Stage "authenticate": the caller of a request, or 401.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, GatewayError> {
        let table = self.table.read().clone();
        if table.tenants.is_empty() {
            if table.required {
                self.auth_failed("tenants_unavailable");
                return Err(GatewayError::TenantsUnavailable(
                    "No valid tenant configuration is loaded; requests are refused until one is. Retry shortly."
                        .into(),
                ));
            }
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
