//! Tenancy: who is calling (API keys), how much they may (token rate limits, monthly budgets), and
//! what they used (durable usage and cost, per-tenant metrics).
//!
//! The pipeline meets it three times per request:
//! 1. [`Tenancy::authenticate`] at the start: the API key (`Authorization: Bearer` or `x-api-key`)
//!    -> the tenant ([`keys`]); 401 otherwise. With no tenant source configured the gateway is open
//!    and every caller is `anonymous` (logged at start-up). With one configured it fails closed: a
//!    tenant set that fails to load keeps the last good one (per object), and while none was ever
//!    loaded every request is refused with 503, never served as `anonymous`.
//! 2. [`Tenancy::admit`] before routing: the monthly budget ([`budget`]) and the token buckets
//!    ([`limits`]) in one atomic step, in process or in Redis ([`store`]); 429 otherwise. It returns
//!    an [`Admission`] that follows the request.
//! 3. [`Admission::settle`] at the end, exactly once (also from `Drop` for errors and aborted
//!    streams): reconciles the buckets with the worker's real token counts, appends the usage record
//!    to the journal ([`store::Journal`]) and Redis, and updates the per-tenant metrics
//!    ([`metrics`]).
//!
//! Usage and cost per tenant / model / pool / provider are served by `GET /admin/usage` on the admin
//! port ([`Tenancy::usage_report`], [`usage`]).
//!
//! Files: `table` (tenants, keys, prices; authentication), `admission` (admit, the
//! [`Admission`], settlement), `headers` (rate-limit headers), `report` (`/admin/usage`); the
//! building blocks in [`keys`], [`limits`], [`budget`], [`store`], [`usage`], [`metrics`].

mod admission;
pub mod budget;
mod from_source;
mod headers;
pub mod isolation;
pub mod keys;
pub mod limits;
pub mod metrics;
mod report;
mod served;
pub mod store;
mod table;
pub mod usage;

pub use admission::Admission;
pub use from_source::PolicyFiles;
#[cfg(test)]
use headers::go_duration;
pub use report::ReportError;
#[cfg(test)]
use report::percent_decode;
use table::TenantTable;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kinference_crds::{Budget, RateLimits, TokenPrices};
use parking_lot::{Mutex, RwLock};
use prometheus_client::registry::Registry;
use serde::Deserialize;

use limits::{LocalBuckets, TenantSettings};
use metrics::TenancyMetrics;
use store::{Journal, JournalConfig, RedisStore, StoreMetrics};
use usage::Aggregates;

use crate::config_source;

/// Where the rate-limit buckets and the shared usage live.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// In this process (one gateway replica); usage in the local journal.
    #[default]
    Embedded,
    /// Redis, shared by every replica (`redis_url`).
    Redis,
}

fn default_redis_timeout_ms() -> u64 {
    250
}

fn default_output_reservation() -> u64 {
    256
}

fn default_redis_pending_max() -> usize {
    store::DEFAULT_REDIS_PENDING_MAX
}

fn default_reload_ms() -> u64 {
    2_000
}

/// `tenancy:` in `gateway.yaml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenancyConfig {
    /// A YAML file or directory of `InferenceTenant` objects (may be the policy directory). None:
    /// no tenants, the gateway is open.
    #[serde(default)]
    pub tenants_dir: Option<PathBuf>,
    /// Where Secrets are mounted: a key `secretRef {name, key}` is read from
    /// `<secrets_dir>/<name>/<key>`. `env` references read the environment.
    #[serde(default)]
    pub secrets_dir: Option<PathBuf>,
    /// `embedded` (default) or `redis`.
    #[serde(default)]
    pub store: StoreKind,
    /// `redis://host:port/db` for `store: redis`.
    #[serde(default)]
    pub redis_url: Option<String>,
    /// Timeout of one Redis call in milliseconds (then the tenant's `on_store_unavailable` applies).
    #[serde(default = "default_redis_timeout_ms")]
    pub redis_timeout_ms: u64,
    /// The usage journal (default: `kinference-usage.jsonl` beside `gateway.yaml`).
    #[serde(default)]
    pub usage_journal: Option<PathBuf>,
    /// The journal's rotation, compaction, retention and full-disk behaviour.
    #[serde(default)]
    pub journal: JournalConfig,
    /// Most usage aggregates (tenant / model / pool / provider and hour) waiting for Redis; a record
    /// that would open one more is dropped (and counted).
    #[serde(default = "default_redis_pending_max")]
    pub redis_pending_max: usize,
    /// Output tokens reserved at admission for requests without `max_tokens`.
    #[serde(default = "default_output_reservation")]
    pub default_output_reservation: u64,
    /// Per-tenant settings the CRD does not hold: limits per model, burst, fail mode.
    #[serde(default)]
    pub tenants: BTreeMap<String, TenantSettings>,
    /// Prices per served model, for models no `InferencePool` of the policy directory prices.
    #[serde(default)]
    pub prices: BTreeMap<String, TokenPrices>,
    /// How often the tenants' files and key sources are re-read, in milliseconds (a `tenants_dir`
    /// that is the policy directory is read with it, every `policy_reload_interval_ms`).
    #[serde(default = "default_reload_ms")]
    pub reload_interval_ms: u64,
    /// Latency and size histograms per tenant and model (about 100 series per pair); the counters
    /// per tenant are always exported.
    #[serde(default)]
    pub per_tenant_histograms: bool,
    /// The secret the tenants' cache salts are derived from ([`isolation`]): a file of at least 32
    /// bytes, a mounted Secret in a cluster, the same for every replica. Absent: a key of this
    /// process alone (salts change when it restarts and differ between replicas: cache hits are
    /// lost, never isolation).
    #[serde(default)]
    pub cache_salt_key_file: Option<PathBuf>,
    /// Each tenant's cost and monthly spend on `/metrics` (`--metrics-tenant-spend`; not a
    /// `gateway.yaml` key).
    #[serde(skip)]
    pub per_tenant_spend: bool,
}

impl Default for TenancyConfig {
    fn default() -> Self {
        TenancyConfig {
            tenants_dir: None,
            secrets_dir: None,
            store: StoreKind::Embedded,
            redis_url: None,
            redis_timeout_ms: default_redis_timeout_ms(),
            usage_journal: None,
            journal: JournalConfig::default(),
            redis_pending_max: default_redis_pending_max(),
            default_output_reservation: default_output_reservation(),
            tenants: BTreeMap::new(),
            prices: BTreeMap::new(),
            reload_interval_ms: default_reload_ms(),
            per_tenant_histograms: false,
            cache_salt_key_file: None,
            per_tenant_spend: false,
        }
    }
}

/// A configured tenant.
#[derive(Debug, Clone)]
pub struct Tenant {
    /// `metadata.name`.
    pub name: String,
    /// Metric label (the name, or `other` past [`metrics::MAX_TENANT_LABELS`]).
    pub label: String,
    /// Tenant-wide limits.
    pub limits: Option<RateLimits>,
    /// Monthly budget.
    pub budget: Option<Budget>,
    /// Gateway-side settings.
    pub settings: TenantSettings,
    /// Who is shed first when the gateway is overloaded.
    pub priority: kinference_crds::TenantPriority,
    /// Its share of a saturated pool's queue (flow control; absent: weight 1, the band's deadline).
    pub flow_control: Option<kinference_crds::TenantFlowControl>,
    /// Models (names or aliases) the tenant may request; with `allowed_classes` both empty: all.
    pub allowed_models: Vec<String>,
    /// Model classes the tenant may request.
    pub allowed_classes: Vec<String>,
    /// Whose requests share its cached prompts (`None`: its own only).
    pub prompt_cache: Option<kinference_crds::PromptCache>,
}

/// Who is calling.
#[derive(Debug, Clone)]
pub struct Caller {
    tenant: Option<Arc<Tenant>>,
}

impl Caller {
    /// The tenant's name (`anonymous` when the gateway is open).
    pub fn name(&self) -> &str {
        self.tenant.as_ref().map_or("anonymous", |t| &t.name)
    }

    /// The tenant, when one authenticated.
    pub fn tenant(&self) -> Option<&Tenant> {
        self.tenant.as_deref()
    }

    /// The tenant's priority under overload (medium when the gateway is open).
    pub fn priority(&self) -> kinference_crds::TenantPriority {
        self.tenant
            .as_ref()
            .map_or_else(Default::default, |t| t.priority)
    }

    fn label(&self) -> &str {
        self.tenant.as_ref().map_or("anonymous", |t| &t.label)
    }
}

/// Errors starting tenancy.
#[derive(Debug, thiserror::Error)]
pub enum TenancyError {
    /// The store could not be opened.
    #[error(transparent)]
    Store(#[from] store::StoreError),
    /// The configuration is inconsistent.
    #[error("tenancy: {0}")]
    Config(String),
    /// The cache salt key could not be read.
    #[error(transparent)]
    SaltKey(#[from] isolation::SaltKeyError),
}

/// Everything tenancy needs at run time; one per gateway, shared.
#[derive(Debug)]
pub struct Tenancy {
    config: TenancyConfig,
    table: RwLock<Arc<TenantTable>>,
    local: LocalBuckets,
    redis: Option<Arc<RedisStore>>,
    journal: Journal,
    aggregates: Mutex<Aggregates>,
    spend: budget::Spend,
    metrics: TenancyMetrics,
    models: Vec<String>,
    /// Fed by a configuration source ([`Tenancy::follow`]): the files are not read any more.
    followed: std::sync::atomic::AtomicBool,
    /// The secret of the tenants' cache salts.
    salt_key: isolation::SaltKey,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Tenancy {
    /// Loads tenants and keys (local mode: `tenants_dir` and the pools of `policy_dir`, each
    /// followed through a [`config_source::files`] source), opens the usage journal (replaying
    /// it), connects the store lazily and registers the metrics (on the current tokio runtime).
    pub fn start(
        config: TenancyConfig,
        config_path: &Path,
        policy: Option<PolicyFiles>,
        models: Vec<String>,
        registry: &mut Registry,
    ) -> Result<Arc<Tenancy>, TenancyError> {
        let base = config_path.parent().unwrap_or(Path::new("."));
        let journal_path = config
            .usage_journal
            .clone()
            .map(|p| if p.is_relative() { base.join(p) } else { p })
            .unwrap_or_else(|| base.join("kinference-usage.jsonl"));
        let store_metrics = StoreMetrics::default();
        store_metrics.register(registry);
        let redis = match config.store {
            StoreKind::Embedded => None,
            StoreKind::Redis => {
                let url = config
                    .redis_url
                    .as_deref()
                    .ok_or_else(|| TenancyError::Config("store: redis needs redis_url".into()))?;
                Some(RedisStore::bounded(
                    url,
                    Duration::from_millis(config.redis_timeout_ms.max(1)),
                    config.redis_pending_max,
                    store_metrics.clone(),
                )?)
            }
        };
        let (forward_tx, forward_rx) = tokio::sync::mpsc::channel(store::FORWARD_BATCHES);
        let forward = redis.as_ref().map(|_| forward_tx);
        let open = |path: &Path, forward| {
            Journal::open(path, &config.journal, store_metrics.clone(), forward)
        };
        let (journal, replayed, journal_path) = match open(&journal_path, forward.clone()) {
            Ok((j, r)) => (j, r, journal_path),
            // The default place (beside gateway.yaml) may be read-only, e.g. a ConfigMap mount:
            // keep serving with a journal in the temp directory, and say that usage is not durable.
            Err(error) if config.usage_journal.is_none() => {
                let fallback = std::env::temp_dir().join("kinference-usage.jsonl");
                tracing::warn!(%error, fallback = %fallback.display(),
                    "usage journal not writable beside gateway.yaml; set tenancy.usage_journal to a persistent volume");
                let (j, r) = open(&fallback, forward)?;
                (j, r, fallback)
            }
            Err(error) => return Err(error.into()),
        };
        if let Some(r) = &redis {
            tokio::spawn(Arc::clone(r).forward_usage(forward_rx));
        }
        let metrics = TenancyMetrics::register(
            registry,
            config.per_tenant_histograms,
            config.per_tenant_spend,
        );
        let kept_ms = config.journal.keep_periods.max(1) * config.journal.period.ms();
        let mut aggregates = Aggregates::new(kept_ms);
        let spend = budget::Spend::default();
        for p in &replayed.periods {
            spend.add(&p.group.tenant, p.start_ms, p.totals.cost);
            aggregates.add_totals(p.start_ms, p.group.clone(), &p.totals);
        }
        for r in &replayed.records {
            aggregates.add(r);
            spend.add(&r.tenant, r.ts_ms, r.cost);
        }
        let required = config.tenants_dir.is_some();
        let salt_key = match &config.cache_salt_key_file {
            Some(path) => {
                let path = if path.is_relative() {
                    base.join(path)
                } else {
                    path.clone()
                };
                isolation::SaltKey::from_file(&path)?
            }
            None => {
                if required {
                    tracing::warn!(
                        "tenancy.cache_salt_key_file is not set: cache salts are this process's own; with several replicas, mount one Secret in all of them"
                    );
                }
                isolation::SaltKey::generate()
            }
        };
        let tenancy = Arc::new(Tenancy {
            config,
            // Until a first load succeeds: closed (503) when a tenant source is configured.
            table: RwLock::new(Arc::new(TenantTable::empty(required))),
            local: LocalBuckets::default(),
            redis,
            journal,
            aggregates: Mutex::new(aggregates),
            spend,
            metrics,
            models,
            followed: std::sync::atomic::AtomicBool::new(false),
            salt_key,
        });
        // Local mode: the tenants (and the pools' prices) through the same kind of configuration
        // source as the cluster's, fed by the files; a cluster source replaces them
        // ([`Tenancy::follow`]). The policy directory's source is the gateway's, shared with the
        // policy stage; the tenants' directory gets one of its own unless it is that directory.
        let every = Duration::from_millis(tenancy.config.reload_interval_ms.max(100));
        let (own, tenants, policy) = match (tenancy.config.tenants_dir.clone(), policy) {
            (Some(dir), Some(shared)) if dir == shared.dir => (None, Some(shared.snapshots), None),
            (dir, shared) => {
                let own = dir.map(|d| config_source::files::start_or_wait(d, every));
                let tenants = own.as_ref().map(config_source::ConfigSource::subscribe);
                (own, tenants, shared.map(|s| s.snapshots))
            }
        };
        tenancy.follow_files(tenants, policy, own, every);
        tracing::info!(journal = %journal_path.display(), records = replayed.records.len(),
            periods = replayed.periods.len(),
            store = ?tenancy.config.store, "usage journal replayed");
        Ok(tenancy)
    }

    fn model_label(&self, model: &str) -> String {
        if self.models.iter().any(|m| m == model) {
            model.to_string()
        } else {
            "other".into()
        }
    }

    /// Records a policy decision for the per-tenant metrics (called by the policy stage).
    pub fn policy_decision(&self, caller: &Caller, policy: &str, outcome: &str) {
        self.metrics
            .policy
            .get_or_create(&metrics::TenantPolicy {
                tenant: caller.label().to_string(),
                policy: policy.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// The `cache_salt` a worker is sent for `caller`'s request whose client sent `client`
    /// ([`isolation`]): a tenant's request gets its scope's salt, with the client's mixed in; an
    /// open gateway's caller keeps the client's salt (or none) as sent.
    pub fn cache_salt(&self, caller: &Caller, client: Option<&str>) -> Option<String> {
        let Some(tenant) = caller.tenant() else {
            return client.map(str::to_string);
        };
        let scope = isolation::Scope::of(&tenant.name, tenant.prompt_cache.as_ref());
        self.salt_key.worker_salt(scope, client)
    }

    /// Waits until every usage record so far is on disk (graceful shutdown).
    pub async fn flush(&self) {
        self.journal.flush().await;
    }
}

#[cfg(test)]
mod tests;
