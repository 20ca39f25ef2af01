//! The pools at run time, beside the policy stage's decisions ([`crate::policy::stage`]): what the
//! policy set's `InferencePool`s and `InferenceProvider`s make of the gateway's other parts.
//!
//! - the router's workers follow the pools' static endpoints on every reload, with their roles
//!   (prefill/decode disaggregation), and selector pools' members get their pool's role
//!   ([`Pools::spawn_sync`]);
//! - each pool's workers get the pool's own credentials and headers (`workerCredentials`,
//!   `workerHeaders`) from the upstream client ([`Pools::spawn_worker_headers`]);
//! - the providers' clients, made once per provider and reused ([`Pools::provider`]);
//! - the pools' members for the fleet gauges ([`Pools::members`]);
//! - each pool's `schedulingPolicy` to its members in the router: a worker with priority
//!   scheduling is sent each request's band as `priority` ([`crate::pipeline::forward`]).
//!
//! The decisions name pools and providers; only this module turns those names into workers'
//! headers and provider clients.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kinference_crds::Locality;

use crate::backend::provider::{CredentialResolver, ProviderClient, Providers};
use crate::backend::worker::Upstream;
use crate::backend::worker::credentials;
use crate::metrics::fleet::PoolMembers;
use crate::policy::model::PolicySet;
use crate::policy::stage::PolicyStage;
use crate::routing::{ModelConfig, Router, WorkerConfig};
use kinference_api::WorkerRole;

/// The pools' run-time part: the policy stage it follows, the provider clients, the pools' worker
/// credentials.
pub struct Pools {
    stage: Arc<PolicyStage>,
    providers: Providers,
    /// Pools' worker keys from Secrets (cluster mode); unset: from the environment.
    credentials: OnceLock<CredentialResolver>,
}

impl std::fmt::Debug for Pools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pools")
            .field("providers", &self.providers)
            .finish()
    }
}

impl Pools {
    /// The pools of `stage`'s sets; providers connect within `connect_timeout`, their keys read
    /// through `provider_credentials` (cluster mode: Secrets) instead of the environment.
    pub fn new(
        stage: Arc<PolicyStage>,
        connect_timeout: Duration,
        provider_credentials: Option<CredentialResolver>,
    ) -> Arc<Self> {
        let providers = Providers::new(connect_timeout);
        if let Some(c) = provider_credentials {
            providers.set_credentials(c);
        }
        Arc::new(Pools {
            stage,
            providers,
            credentials: OnceLock::new(),
        })
    }

    /// The policy stage the pools follow.
    pub fn stage(&self) -> &Arc<PolicyStage> {
        &self.stage
    }

    /// The client of provider `name` of `set` (`None`: the set has no such provider).
    pub fn provider(&self, set: &PolicySet, name: &str) -> Option<Arc<ProviderClient>> {
        let spec = &set.providers.get(name)?.spec;
        Some(self.providers.client(name, spec))
    }

    /// Every pool of the current set: its name, its models' served names and its workers (`None`:
    /// every worker of its models), for the fleet gauges.
    pub fn members(&self) -> Vec<PoolMembers> {
        let set = self.stage.current();
        set.pools
            .iter()
            .map(|(name, pool)| PoolMembers {
                name: name.clone(),
                models: pool
                    .spec
                    .models
                    .iter()
                    .map(|m| {
                        set.models
                            .get(m)
                            .map_or(m.clone(), |m| m.spec.served_name.clone())
                    })
                    .collect(),
                workers: self.stage.members(&pool.spec),
            })
            .collect()
    }

    /// Reads pools' `workerCredentials` through `resolver` (cluster mode: Secrets) instead of the
    /// environment. Set once, at start.
    pub fn set_pool_credentials(&self, resolver: CredentialResolver) {
        if self.credentials.set(resolver).is_err() {
            tracing::warn!("the pools already have a credential resolver");
        }
    }

    /// What each worker of a pool is sent when it is not the gateway-wide `gateway` headers (the
    /// workers' key included):
    /// - a local pool with its own `workerCredentials` or `workerHeaders`: `gateway` with the pool's
    ///   headers over it, and the pool's key as `Authorization`;
    /// - a `Remote` pool (a third party's): only what the pool itself is configured with, never the
    ///   gateway-wide key or headers;
    /// - a key that is named but cannot be read (a missing Secret, an unset variable) is sent as no
    ///   key at all, never as the gateway-wide one: the worker refuses, the client gets 502;
    /// - a worker that two pools would send different headers to gets none of them (no key: fail
    ///   closed, logged naming the pools);
    /// - a pool whose workers are not known by URL (a selector without discovery) stands for every
    ///   worker of its models in `workers` (URL, served model), as it does for routing.
    pub fn worker_headers(
        &self,
        gateway: &http::HeaderMap,
        workers: &[(String, String)],
    ) -> HashMap<String, http::HeaderMap> {
        let set = self.stage.current();
        // Each worker's headers from each pool that lists it.
        let mut wanted: BTreeMap<String, Vec<(&str, http::HeaderMap)>> = BTreeMap::new();
        for (name, pool) in &set.pools {
            let spec = &pool.spec;
            let remote = spec.locality != Locality::Local;
            let own = spec.worker_credentials.is_some() || !spec.worker_headers.is_empty();
            let headers = if own || remote {
                self.pool_headers(name, spec, if remote { None } else { Some(gateway) })
            } else {
                gateway.clone()
            };
            let members = self.stage.members(spec).unwrap_or_else(|| {
                let served: Vec<String> = spec
                    .models
                    .iter()
                    .map(|m| {
                        set.models
                            .get(m)
                            .map_or(m.clone(), |m| m.spec.served_name.clone())
                    })
                    .collect();
                workers
                    .iter()
                    .filter(|(_, model)| served.contains(model))
                    .map(|(url, _)| url.clone())
                    .collect()
            });
            for url in members {
                wanted
                    .entry(url)
                    .or_default()
                    .push((name.as_str(), headers.clone()));
            }
        }
        let mut out = HashMap::new();
        for (url, from) in wanted {
            let (_, first) = &from[0];
            if from.iter().all(|(_, h)| h == first) {
                if first != gateway {
                    out.insert(url, first.clone());
                }
                continue;
            }
            let pools: Vec<&str> = from.iter().map(|(p, _)| *p).collect();
            tracing::warn!(worker = %url, ?pools,
                "a worker in pools that send it different credentials or headers gets none of them");
            out.insert(url, http::HeaderMap::new());
        }
        out
    }

    /// Pool `name`'s own headers and key, over `base` (a local pool: the gateway-wide headers; a
    /// remote one: none).
    fn pool_headers(
        &self,
        name: &str,
        spec: &kinference_crds::InferencePoolSpec,
        base: Option<&http::HeaderMap>,
    ) -> http::HeaderMap {
        let mut headers = base.cloned().unwrap_or_default();
        match credentials::worker_headers(None, &spec.worker_headers) {
            Ok(extra) => headers.extend(extra),
            Err(error) => tracing::warn!(pool = %name, %error, "pool workerHeaders skipped"),
        }
        headers.remove(http::header::AUTHORIZATION);
        let Some(cred) = &spec.worker_credentials else {
            // A local pool without its own key keeps the gateway-wide one.
            if let Some(auth) = base.and_then(|b| b.get(http::header::AUTHORIZATION)) {
                headers.insert(http::header::AUTHORIZATION, auth.clone());
            }
            return headers;
        };
        let key = match self.credentials.get() {
            Some(resolve) => resolve(name, cred),
            None => cred.env.as_deref().and_then(|var| std::env::var(var).ok()),
        }
        .filter(|k| !k.trim().is_empty());
        match credentials::worker_headers(key.as_deref().map(str::trim), &Default::default()) {
            Ok(auth) if key.is_some() => headers.extend(auth),
            Ok(_) => tracing::warn!(pool = %name,
                "pool workerCredentials cannot be read: its workers get no key"),
            Err(error) => tracing::warn!(pool = %name, %error,
                "pool workerCredentials unusable: its workers get no key"),
        }
        headers
    }

    /// Keeps `upstream`'s per-worker headers in line with the pools ([`Pools::worker_headers`]):
    /// set now, then on every new policy set and every `interval` (Secrets rotate, discovered
    /// members change).
    pub fn spawn_worker_headers(
        self: &Arc<Self>,
        upstream: Upstream,
        router: Arc<Router>,
        interval: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let gateway = upstream.headers().clone();
        let workers = |router: &Router| -> Vec<(String, String)> {
            router
                .workers()
                .into_iter()
                .map(|w| (w.url, w.model))
                .collect()
        };
        upstream.set_worker_headers(self.worker_headers(&gateway, &workers(&router)));
        let pools = Arc::clone(self);
        let mut rx = self.stage.subscribe();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() { return },
                    _ = tokio::time::sleep(interval) => {}
                }
                upstream.set_worker_headers(pools.worker_headers(&gateway, &workers(&router)));
            }
        })
    }

    /// Workers and models the pools of the current set add to the router's configuration: every
    /// static endpoint with its pool's first model's served name, and each model's tokenizer
    /// directory.
    pub fn routing_additions(&self) -> (Vec<WorkerConfig>, Vec<ModelConfig>) {
        let set = self.stage.current();
        (pool_workers(&set), pool_models(&set))
    }

    /// Keeps the router's workers in line with the pools' endpoints on every reload: new endpoints are
    /// added (with their roles), removed ones stop being candidates (workers from `gateway.yaml` stay).
    /// The `role` of a pool with a selector goes to its discovered members now and every
    /// [`ROLE_INTERVAL`] (members come and go without a reload), unless a pod has its own.
    pub fn spawn_sync(&self, router: Arc<Router>) -> tokio::task::JoinHandle<()> {
        let mut rx = self.stage.subscribe();
        let stage = Arc::clone(&self.stage);
        tokio::spawn(async move {
            let mut known: BTreeSet<String> = pool_workers(&rx.borrow())
                .into_iter()
                .map(|w| w.url)
                .collect();
            loop {
                apply_member_roles(&stage, &router);
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() { return },
                    _ = tokio::time::sleep(ROLE_INTERVAL) => continue,
                }
                let (workers, models) = {
                    let set = rx.borrow_and_update();
                    (pool_workers(&set), pool_models(&set))
                };
                // A profile set or changed applies now; one removed, at the next start (so a model's
                // profile from gateway.yaml is not undone by a pool that does not name one).
                for m in models.iter().filter(|m| m.profile.is_some()) {
                    // The CRD's schema names only profiles the gateway has.
                    if let Err(e) = router.set_model_profile(&m.name, m.profile.as_deref()) {
                        tracing::warn!(model = %m.name, error = %e, "engine profile not applied");
                    }
                }
                let now: BTreeSet<String> = workers.iter().map(|w| w.url.clone()).collect();
                for w in &workers {
                    if !router.upsert_worker(&w.url, &w.model) {
                        tracing::warn!(worker = %w.url, "router worker table full; pool endpoint not added");
                        continue;
                    }
                    if w.role != WorkerRole::Both {
                        router.set_role(&w.url, w.role);
                    }
                }
                for gone in known.difference(&now) {
                    router.remove_worker(gone);
                }
                known = now;
            }
        })
    }
}

#[cfg(test)]
mod tests;

/// How often a selector pool's `role` is applied to its discovered members.
pub const ROLE_INTERVAL: Duration = Duration::from_secs(2);

/// A pool's `role` (CRD) as the router names it.
pub fn role(role: kinference_crds::WorkerRole) -> WorkerRole {
    match role {
        kinference_crds::WorkerRole::Both => WorkerRole::Both,
        kinference_crds::WorkerRole::Prefill => WorkerRole::Prefill,
        kinference_crds::WorkerRole::Decode => WorkerRole::Decode,
    }
}

/// Gives the members of every pool with a `role` that role, where they have none of their own,
/// and every pool's members its `schedulingPolicy` (static endpoints and selector members alike).
fn apply_member_roles(stage: &PolicyStage, router: &Router) {
    let set = stage.current();
    for pool in set.pools.values() {
        let priority = pool.spec.scheduling_policy == kinference_crds::SchedulingPolicy::Priority;
        for endpoint in &pool.spec.endpoints {
            router.set_priority_scheduling(endpoint.url.trim_end_matches('/'), priority);
        }
        if pool.spec.selector.is_some() {
            for member in stage.members(&pool.spec).unwrap_or_default() {
                router.set_priority_scheduling(&member, priority);
            }
        }
    }
    for pool in set.pools.values() {
        if pool.spec.role.is_both() || pool.spec.selector.is_none() {
            continue;
        }
        for member in stage.members(&pool.spec).unwrap_or_default() {
            router.set_pool_role(&member, role(pool.spec.role));
        }
    }
}

/// Static pool endpoints as router workers (the pool's first model's served name; the endpoint's
/// role, else the pool's).
fn pool_workers(set: &PolicySet) -> Vec<WorkerConfig> {
    let mut out: Vec<WorkerConfig> = Vec::new();
    for pool in set.pools.values() {
        let Some(model) = pool.spec.models.first() else {
            continue;
        };
        let served = set
            .models
            .get(model)
            .map_or(model.clone(), |m| m.spec.served_name.clone());
        for e in &pool.spec.endpoints {
            let url = e.url.trim_end_matches('/').to_string();
            if !out.iter().any(|w| w.url == url) {
                out.push(WorkerConfig {
                    url,
                    model: served.clone(),
                    role: role(e.role.unwrap_or(pool.spec.role)),
                });
            }
        }
    }
    out
}

/// Served models with their tokenizer directory (`spec.tokenizer.dir`), whether their workers
/// serve Anthropic's `/v1/messages` (`spec.servesMessages`) and their engine profile
/// (`spec.engineProfile`; also applied on every reload by [`Pools::spawn_sync`]).
pub(crate) fn pool_models(set: &PolicySet) -> Vec<ModelConfig> {
    set.models
        .values()
        .map(|m| ModelConfig {
            name: m.spec.served_name.clone(),
            tokenizer_dir: m
                .spec
                .tokenizer
                .as_ref()
                .and_then(|t| t.dir.as_ref())
                .map(PathBuf::from),
            serves_messages: m.spec.serves_messages,
            profile: m.spec.engine_profile.map(|p| p.as_str().to_string()),
        })
        .collect()
}
