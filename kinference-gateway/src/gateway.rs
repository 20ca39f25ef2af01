//! [`Gateway`]: what every request handler shares (router, worker client, metrics, tenancy, policies).
//! Built once by `main`; the servers, the pipeline, health probing and ext_proc read it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::access::Access;
use crate::backend::health::{Health, HealthSettings, Prober};
use crate::backend::worker::{HttpSettings, Upstream};
use crate::metrics::Metrics;
use crate::overload::{Overload, OverloadSettings};
use crate::policy::stage::PolicyStage;
use crate::pools::Pools;
use crate::routing::Router;
use crate::tenancy::{Tenancy, TenancyConfig, TenancyError};

/// What every request handler shares.
#[derive(Debug)]
pub struct Gateway {
    /// Picks workers.
    pub router: Arc<Router>,
    /// Talks to workers.
    pub upstream: Upstream,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// Limits and timeouts.
    pub settings: HttpSettings,
    /// Served model names (for `/v1/models`).
    pub models: Vec<String>,
    /// Models whose workers serve Anthropic's `/v1/messages`: Anthropic requests for them pass
    /// through unchanged.
    pub messages_models: Vec<String>,
    /// API keys, rate limits, budgets, usage (`/admin/usage`).
    pub tenancy: Arc<Tenancy>,
    /// The policy stage, when `gateway.yaml` names a policy directory (or the CRDs are watched).
    pub policy: Option<Arc<PolicyStage>>,
    /// The policy set's pools and providers at run time (with the policy stage).
    pub pools: Option<Arc<Pools>>,
    /// Who is an admin (the admin API, debug explanations, worker addresses).
    pub access: Access,
    /// Each worker's health (probes, hysteresis, outliers); tells the router whom it may pick.
    pub health: Arc<Health>,
    /// Connection and in-flight limits.
    pub overload: crate::overload::Overload,
    /// Set on SIGTERM: `/readyz` answers 503 while the listeners still serve.
    pub draining: AtomicBool,
    /// The standard `InferenceObjective`s discovery found (empty outside a cluster).
    pub objectives: crate::discovery::objectives::Objectives,
}

/// What [`Gateway::assemble`] builds a gateway from besides its router; what is not given takes
/// the flags' defaults.
#[derive(Debug, Default)]
pub struct Parts {
    /// Tenants, limits and usage (default: an open gateway, its journal in `journal_dir`).
    pub tenancy: Option<Arc<Tenancy>>,
    /// Where the usage journal of a default tenancy goes (default: the temporary directory).
    pub journal_dir: Option<std::path::PathBuf>,
    /// The policy stage.
    pub policy: Option<Arc<PolicyStage>>,
    /// In-flight, body and connection limits.
    pub overload: Option<OverloadSettings>,
    /// Served model names (`/v1/models`).
    pub models: Vec<String>,
}

impl Gateway {
    /// A gateway over `router` and `parts`, everything else at the flags' defaults (loopback callers
    /// are admins): what `main` assembles from the command line, for tests and benches that drive
    /// the pipeline or the ext_proc handler in-process.
    pub fn assemble(router: Arc<Router>, parts: Parts) -> Result<Arc<Self>, TenancyError> {
        let metrics = Metrics::new();
        let tenancy = match parts.tenancy {
            Some(t) => t,
            None => {
                let dir = parts.journal_dir.unwrap_or_else(std::env::temp_dir);
                let config = dir.join(format!("gateway-{:x}.yaml", rand::random::<u64>()));
                metrics.with_registry(|registry| {
                    Tenancy::start(
                        TenancyConfig::default(),
                        &config,
                        None,
                        parts.models.clone(),
                        registry,
                    )
                })?
            }
        };
        let overload = metrics
            .with_registry(|registry| Overload::new(parts.overload.unwrap_or_default(), registry));
        let health = metrics.with_registry(|registry| {
            Health::new(
                HealthSettings::default(),
                Arc::clone(&router),
                metrics.clone(),
                registry,
            )
        });
        let settings = HttpSettings::default();
        let pools = parts
            .policy
            .as_ref()
            .map(|stage| Pools::new(Arc::clone(stage), settings.connect_timeout(), None));
        Ok(Arc::new(Gateway {
            router,
            upstream: Upstream::new(&settings),
            metrics,
            settings,
            models: parts.models,
            messages_models: Vec::new(),
            tenancy,
            policy: parts.policy,
            pools,
            access: Access::default(),
            health: Arc::new(health),
            overload,
            draining: Default::default(),
            objectives: Default::default(),
        }))
    }

    /// The prober of the workers' `/health`, with the configured timings.
    pub fn prober(&self) -> Prober {
        Prober {
            health: Arc::clone(&self.health),
            upstream: self.upstream.clone(),
            interval: self.settings.health_interval(),
            timeout: self.settings.health_timeout(),
        }
    }

    /// Ready (for `/readyz`) while not draining: the configuration is loaded and the listeners are
    /// bound before the admin port answers at all. Worker health is deliberately not part of it: a
    /// busy or loading vLLM fleet would otherwise take every gateway out of its Service at once.
    pub fn ready(&self) -> bool {
        !self.draining.load(Ordering::Relaxed)
    }

    /// Whether the workers of `model` (a served name) take Anthropic requests as they are:
    /// `serves_messages` in `gateway.yaml`, or `servesMessages` on its `InferenceModel` in the
    /// current policy set (read per request, so a reload applies at once).
    pub fn serves_messages(&self, model: &str) -> bool {
        self.messages_models.iter().any(|m| m == model)
            || self.policy.as_ref().is_some_and(|stage| {
                stage
                    .current()
                    .models
                    .values()
                    .any(|m| m.spec.served_name == model && m.spec.serves_messages)
            })
    }

    /// The current policy set's `InferencePool`s with their workers, for the pool gauges (none
    /// without policies).
    pub fn pool_members(&self) -> Vec<crate::metrics::fleet::PoolMembers> {
        self.pools
            .as_ref()
            .map(|pools| pools.members())
            .unwrap_or_default()
    }

    /// Starts draining: `/readyz` answers 503 from now on.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }
}
