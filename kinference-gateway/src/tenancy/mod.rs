//! Tenancy: who is calling (API keys), how much they may (token rate limits, monthly budgets), and
//! what they used (durable usage and cost, per-tenant metrics).
//!
//! The pipeline meets it three times per request:
//! 1. [`Tenancy::authenticate`] at the start: the API key (`Authorization: Bearer` or `x-api-key`)
//!    -> the tenant ([`keys`]); 401 otherwise. With no tenant configured the gateway is open and
//!    every caller is `anonymous` (logged at start-up).
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

pub mod budget;
pub mod keys;
pub mod limits;
pub mod metrics;
pub mod store;
pub mod usage;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::HeaderMap;
use kinference_crds::{Budget, BudgetAction, InferencePoolSpec, RateLimits, TokenPrices};
use parking_lot::{Mutex, RwLock};
use prometheus_client::registry::Registry;
use serde::Deserialize;

use crate::api::openai::Usage;
use crate::errors::{GatewayError, Protocol};
use keys::KeyRing;
use limits::{Demand, Dim, FailMode, LocalBuckets, Take, TenantSettings, Verdict};
use metrics::{TenancyMetrics, TenantBackend, TenantCache, TenantLimit, TenantModel, TenantStatus};
use store::{Journal, RedisStore, RedisVerdict};
use usage::{Aggregates, UsageRecord};

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
    /// Output tokens reserved at admission for requests without `max_tokens`.
    #[serde(default = "default_output_reservation")]
    pub default_output_reservation: u64,
    /// Per-tenant settings the CRD does not hold: limits per model, burst, fail mode.
    #[serde(default)]
    pub tenants: BTreeMap<String, TenantSettings>,
    /// Prices per served model, for models no `InferencePool` of the policy directory prices.
    #[serde(default)]
    pub prices: BTreeMap<String, TokenPrices>,
    /// How often the tenants' files and key sources are re-read, in milliseconds.
    #[serde(default = "default_reload_ms")]
    pub reload_interval_ms: u64,
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
            default_output_reservation: default_output_reservation(),
            tenants: BTreeMap::new(),
            prices: BTreeMap::new(),
            reload_interval_ms: default_reload_ms(),
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
}

/// The tenants and keys currently in force.
#[derive(Debug, Default)]
struct TenantTable {
    tenants: Vec<Arc<Tenant>>,
    ring: KeyRing,
    /// Pools for pricing: (name, spec), and InferenceModel name -> served name.
    pools: Vec<(String, InferencePoolSpec)>,
    served_names: HashMap<String, String>,
    /// A fingerprint of what was loaded (tenant names, key digests), to log changes only.
    fingerprint: Vec<u8>,
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
}

/// Everything tenancy needs at run time; one per gateway, shared.
#[derive(Debug)]
pub struct Tenancy {
    config: TenancyConfig,
    policy_dir: Option<PathBuf>,
    table: RwLock<Arc<TenantTable>>,
    local: LocalBuckets,
    redis: Option<Arc<RedisStore>>,
    journal: Journal,
    aggregates: Mutex<Aggregates>,
    spend: budget::Spend,
    metrics: TenancyMetrics,
    models: Vec<String>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Tenancy {
    /// Loads tenants and keys, opens the usage journal (replaying it), connects the store lazily,
    /// registers the metrics and starts the reload task (on the current tokio runtime).
    pub fn start(
        config: TenancyConfig,
        config_path: &Path,
        policy_dir: Option<PathBuf>,
        models: Vec<String>,
        registry: &mut Registry,
    ) -> Result<Arc<Tenancy>, TenancyError> {
        let base = config_path.parent().unwrap_or(Path::new("."));
        let journal_path = config
            .usage_journal
            .clone()
            .map(|p| if p.is_relative() { base.join(p) } else { p })
            .unwrap_or_else(|| base.join("kinference-usage.jsonl"));
        let redis = match config.store {
            StoreKind::Embedded => None,
            StoreKind::Redis => {
                let url = config
                    .redis_url
                    .as_deref()
                    .ok_or_else(|| TenancyError::Config("store: redis needs redis_url".into()))?;
                Some(RedisStore::new(
                    url,
                    Duration::from_millis(config.redis_timeout_ms.max(1)),
                )?)
            }
        };
        let (forward_tx, forward_rx) = tokio::sync::mpsc::unbounded_channel();
        let forward = redis.as_ref().map(|_| forward_tx);
        let (journal, replayed, journal_path) = match Journal::open(&journal_path, forward.clone())
        {
            Ok((j, r)) => (j, r, journal_path),
            // The default place (beside gateway.yaml) may be read-only, e.g. a ConfigMap mount:
            // keep serving with a journal in the temp directory, and say that usage is not durable.
            Err(error) if config.usage_journal.is_none() => {
                let fallback = std::env::temp_dir().join("kinference-usage.jsonl");
                tracing::warn!(%error, fallback = %fallback.display(),
                    "usage journal not writable beside gateway.yaml; set tenancy.usage_journal to a persistent volume");
                let (j, r) = Journal::open(&fallback, forward)?;
                (j, r, fallback)
            }
            Err(error) => return Err(error.into()),
        };
        if let Some(r) = &redis {
            tokio::spawn(Arc::clone(r).forward_usage(forward_rx));
        }
        let metrics = TenancyMetrics::register(registry);
        let mut aggregates = Aggregates::default();
        let spend = budget::Spend::default();
        for r in &replayed {
            aggregates.add(r);
            spend.add(&r.tenant, r.ts_ms, r.cost);
        }
        let tenancy = Arc::new(Tenancy {
            config,
            policy_dir,
            table: RwLock::new(Arc::new(TenantTable::default())),
            local: LocalBuckets::default(),
            redis,
            journal,
            aggregates: Mutex::new(aggregates),
            spend,
            metrics,
            models,
        });
        tenancy.reload(true);
        tracing::info!(journal = %journal_path.display(), replayed = replayed.len(),
            store = ?tenancy.config.store, "usage journal replayed");
        let weak = Arc::downgrade(&tenancy);
        let every = Duration::from_millis(tenancy.config.reload_interval_ms.max(100));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                match weak.upgrade() {
                    Some(t) => t.reload(false),
                    None => return,
                }
            }
        });
        Ok(tenancy)
    }

    /// Re-reads the tenants, their keys and the pools' prices; swaps them in when they changed.
    fn reload(&self, first: bool) {
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

    fn model_label(&self, model: &str) -> String {
        if self.models.iter().any(|m| m == model) {
            model.to_string()
        } else {
            "other".into()
        }
    }

    /// Stage "admit": the budget and the rate limits for `caller` asking `model` with about
    /// `input_estimate` prompt tokens and up to `output_reservation` generated ones.
    pub async fn admit(
        self: &Arc<Self>,
        caller: &Caller,
        model: &str,
        input_estimate: u64,
        output_reservation: u64,
        protocol: Protocol,
    ) -> Result<Admission, GatewayError> {
        let now = now_ms();
        let mut admission = Admission {
            tenancy: Arc::clone(self),
            id: format!("{:032x}", rand::random::<u128>()),
            tenant: caller.name().to_string(),
            labels: TenantModel {
                tenant: caller.label().to_string(),
                model: self.model_label(model),
            },
            model: model.to_string(),
            takes: Vec::new(),
            headers: Vec::new(),
            started: Instant::now(),
            worker: None,
            provider: None,
            local_only: false,
            gateway_prompt_tokens: None,
            chunks: 0,
            first_text: None,
            last_text: None,
            stream_charged: 0,
            output_reserved: output_reservation,
            // Armed (false) only when admitted: a refused request has nothing to settle.
            settled: true,
        };
        let Some(tenant) = caller.tenant.clone() else {
            return Ok(admission.armed());
        };
        let takes = limits::takes(
            &tenant.name,
            tenant.limits.as_ref(),
            &tenant.settings,
            model,
            Demand {
                requests: 1.0,
                input: input_estimate as f64,
                output: output_reservation as f64,
            },
        );
        let budget = tenant
            .budget
            .as_ref()
            .filter(|b| b.on_exceeded == BudgetAction::Reject)
            .map(|b| b.monthly_limit);
        // `LocalOnly`: past the budget the tenant is still served, by local pools only. The spend is
        // this replica's view (the journal replayed at start plus what it settled since).
        if let Some(b) = tenant
            .budget
            .as_ref()
            .filter(|b| b.on_exceeded == BudgetAction::LocalOnly)
        {
            admission.local_only = self.spend.spent(&tenant.name, now) >= b.monthly_limit;
        }
        if takes.is_empty() && budget.is_none() {
            return Ok(admission.armed());
        }
        let verdict = match &self.redis {
            None => {
                if let Some(limit) = budget {
                    let spent = self.spend.spent(&tenant.name, now);
                    if spent >= limit {
                        return Err(self.budget_spent(&tenant, spent, limit, now));
                    }
                }
                self.local.admit(&takes)
            }
            Some(redis) => {
                let spend_key = budget::spend_key(&tenant.name, now);
                match redis.admit(&takes, &spend_key, budget).await {
                    Ok(RedisVerdict::Buckets(v)) => v,
                    Ok(RedisVerdict::BudgetSpent(spent)) => {
                        return Err(self.budget_spent(&tenant, spent, budget.unwrap_or(0.0), now));
                    }
                    Err(error) => {
                        return match tenant.settings.on_store_unavailable {
                            FailMode::Open => {
                                self.store_failed("open", &error);
                                Ok(admission.armed())
                            }
                            FailMode::Closed => {
                                self.store_failed("closed", &error);
                                Err(GatewayError::LimitsUnavailable)
                            }
                        };
                    }
                }
            }
        };
        match verdict {
            Verdict::Admitted(levels) => {
                admission.headers = rate_headers(protocol, &takes, &levels, None);
                admission.takes = takes
                    .into_iter()
                    .map(|mut t| {
                        t.amount = t.amount.min(t.capacity);
                        t
                    })
                    .collect();
                Ok(admission.armed())
            }
            Verdict::Limited {
                retry_after_s,
                refused,
                levels,
            } => {
                let take = &takes[refused];
                self.metrics
                    .rejections
                    .get_or_create(&TenantLimit {
                        tenant: tenant.label.clone(),
                        limit: take.dim.as_str(),
                        scope: if take.per_model { "model" } else { "tenant" },
                    })
                    .inc();
                let scope = if take.per_model {
                    format!(" for model `{model}`")
                } else {
                    String::new()
                };
                Err(GatewayError::RateLimited {
                    message: format!(
                        "Rate limit reached for tenant `{}`{scope}: {} per minute ({:.0}). Retry after {:.1} s.",
                        tenant.name,
                        take.dim.as_str().replace('_', " "),
                        take.rate_per_s * 60.0,
                        retry_after_s
                    ),
                    headers: rate_headers(protocol, &takes, &levels, Some(retry_after_s)),
                })
            }
        }
    }

    fn budget_spent(&self, tenant: &Tenant, spent: f64, limit: f64, now: u64) -> GatewayError {
        self.metrics
            .rejections
            .get_or_create(&TenantLimit {
                tenant: tenant.label.clone(),
                limit: "budget",
                scope: "tenant",
            })
            .inc();
        let retry = (budget::next_month_ms(now).saturating_sub(now)).div_ceil(1000);
        GatewayError::BudgetExceeded {
            message: format!(
                "Tenant `{}` has spent its monthly budget ({spent:.4} of {limit:.4}); requests are refused until {}.",
                tenant.name,
                budget::rfc3339(budget::next_month_ms(now))
            ),
            headers: vec![("retry-after", retry.to_string())],
        }
    }

    fn store_failed(&self, mode: &'static str, error: &store::StoreError) {
        self.metrics
            .store_errors
            .get_or_create(&metrics::StoreFailure { mode })
            .inc();
        tracing::warn!(%error, fail = mode, "rate-limit store unreachable");
    }

    /// The pool that serves `model` on `worker`: one listing the worker's URL, else one serving it.
    fn pool_of(&self, worker: &str, model: &str) -> Option<(String, TokenPrices)> {
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

    /// Settles one request (called once per [`Admission`]).
    fn settle(&self, a: &mut Admission, status: u16, usage: Option<&Usage>) {
        let elapsed = a.started.elapsed().as_secs_f64();
        let m = &self.metrics;
        m.requests
            .get_or_create(&TenantStatus {
                tenant: a.labels.tenant.clone(),
                model: a.labels.model.clone(),
                status,
            })
            .inc();
        m.e2e.get_or_create(&a.labels).observe(elapsed);
        // The worker's figures when it sent them; the gateway's own when the stream ended early.
        let (prompt, cached, output, estimated) = match usage {
            Some(u) if u.prompt_tokens > 0 || u.completion_tokens > 0 => (
                u.prompt_tokens,
                u.cached_tokens().unwrap_or(0).min(u.prompt_tokens),
                u.completion_tokens,
                false,
            ),
            _ if a.first_text.is_some() => {
                (a.gateway_prompt_tokens.unwrap_or(0), 0, a.chunks, true)
            }
            _ => (0, 0, 0, a.worker.is_some() || a.provider.is_some()),
        };
        // Reconcile the buckets: what was debited becomes what was used.
        let mut adjust = Vec::new();
        for t in &a.takes {
            let used = match t.dim {
                Dim::Requests => continue,
                Dim::InputTokens => prompt as f64,
                Dim::OutputTokens => output as f64,
            };
            let debited = if t.dim == Dim::OutputTokens {
                t.amount + a.stream_charged as f64
            } else {
                t.amount
            };
            let mut t = t.clone();
            t.amount = used - debited;
            adjust.push(t);
        }
        self.adjust(adjust);
        // Where it was served: a provider at its price, a worker at its pool's.
        let (pool, provider, prices) = match (&a.provider, &a.worker) {
            (Some((name, prices)), _) => (String::new(), name.clone(), prices.clone()),
            (None, Some(worker)) => match self.pool_of(worker, &a.model) {
                Some((name, prices)) => (name, String::new(), Some(prices)),
                None => (
                    String::new(),
                    String::new(),
                    self.config.prices.get(&a.model).cloned(),
                ),
            },
            (None, None) => return, // never reached a backend: nothing used, nothing to bill
        };
        let uncached = prompt - cached;
        m.input_tokens
            .get_or_create(&TenantCache {
                tenant: a.labels.tenant.clone(),
                model: a.labels.model.clone(),
                cache: "uncached",
            })
            .inc_by(uncached);
        m.input_tokens
            .get_or_create(&TenantCache {
                tenant: a.labels.tenant.clone(),
                model: a.labels.model.clone(),
                cache: "cached",
            })
            .inc_by(cached);
        m.output_tokens.get_or_create(&a.labels).inc_by(output);
        m.input_size.get_or_create(&a.labels).observe(prompt as f64);
        m.output_size
            .get_or_create(&a.labels)
            .observe(output as f64);
        let cost = usage::cost(prices.as_ref(), uncached, cached, output);
        let ts_ms = now_ms();
        m.cost
            .get_or_create(&TenantBackend {
                tenant: a.labels.tenant.clone(),
                model: a.labels.model.clone(),
                pool: pool.clone(),
                provider: provider.clone(),
            })
            .inc_by(cost);
        self.spend.add(&a.tenant, ts_ms, cost);
        m.spend
            .get_or_create(&metrics::TenantOnly {
                tenant: a.labels.tenant.clone(),
            })
            .set(self.spend.spent(&a.tenant, ts_ms));
        let record = UsageRecord {
            id: a.id.clone(),
            ts_ms,
            tenant: a.tenant.clone(),
            model: a.model.clone(),
            pool,
            provider,
            status,
            requests: 1,
            input_uncached: uncached,
            input_cached: cached,
            output,
            cost,
            estimated,
        };
        self.aggregates.lock().add(&record);
        self.journal.append(record);
    }

    /// Applies bucket adjustments (in the background with Redis).
    fn adjust(&self, takes: Vec<Take>) {
        let takes: Vec<Take> = takes.into_iter().filter(|t| t.amount != 0.0).collect();
        if takes.is_empty() {
            return;
        }
        match &self.redis {
            None => self.local.adjust(&takes),
            Some(redis) => {
                let redis = Arc::clone(redis);
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(async move {
                        if let Err(error) = redis.adjust(&takes).await {
                            tracing::debug!(%error, "rate-limit reconciliation not applied");
                        }
                    });
                }
            }
        }
    }

    /// `GET /admin/usage?tenant=&from=&to=`: usage and cost per tenant / model / pool / provider.
    /// `from`/`to`: Unix seconds, `YYYY-MM-DD` or RFC 3339 (UTC); default: this month so far.
    pub async fn usage_report(&self, query: &str) -> Result<serde_json::Value, String> {
        let mut tenant = None;
        let mut from = None;
        let mut to = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_decode(v);
            if v.is_empty() {
                continue;
            }
            match k {
                "tenant" => tenant = Some(v),
                "from" => from = Some(budget::parse_time(&v).ok_or(format!("bad `from`: {v}"))?),
                "to" => to = Some(budget::parse_time(&v).ok_or(format!("bad `to`: {v}"))?),
                other => return Err(format!("unknown parameter `{other}`")),
            }
        }
        let now = now_ms();
        let to = to.unwrap_or(now + 60_000);
        let from = from.unwrap_or_else(|| budget::month_start_ms(now));
        match &self.redis {
            None => {
                let groups = self.aggregates.lock().query(tenant.as_deref(), from, to);
                Ok(usage::report(&groups, from, to, "journal"))
            }
            Some(redis) => {
                let mut groups: BTreeMap<usage::Group, usage::Totals> = BTreeMap::new();
                let mut hour = from - from % 3_600_000;
                let mut hours = 0;
                while hour < to {
                    hours += 1;
                    if hours > 24 * 400 {
                        return Err("range too long (at most 400 days)".into());
                    }
                    let fields = redis
                        .hour(&budget::hour_key(hour))
                        .await
                        .map_err(|e| e.to_string())?;
                    for (field, value) in fields {
                        let Some((group, what)) = field.rsplit_once(usage::SEP) else {
                            continue;
                        };
                        let Some(g) = usage::Group::from_field(group) else {
                            continue;
                        };
                        if tenant.as_deref().is_some_and(|t| t != g.tenant) {
                            continue;
                        }
                        let t = groups.entry(g).or_default();
                        let n = value.parse::<u64>().unwrap_or(0);
                        match what {
                            "requests" => t.requests += n,
                            "input_uncached" => t.input_uncached_tokens += n,
                            "input_cached" => t.input_cached_tokens += n,
                            "output" => t.output_tokens += n,
                            "cost" => t.cost += value.parse::<f64>().unwrap_or(0.0),
                            _ => {}
                        }
                    }
                    hour += 3_600_000;
                }
                let mut report = usage::report(&groups, from, to, "redis");
                report["pending_records"] = redis.pending().into();
                Ok(report)
            }
        }
    }

    /// What a request asks of the buckets at admission: (input token estimate, output reservation).
    /// The estimate is the prompt's bytes / 4 (corrected to the router's count right after routing);
    /// the reservation is `max_tokens` / `max_completion_tokens`, else 16 for completions (the API's
    /// default) or `default_output_reservation` for chat.
    pub fn demand(
        &self,
        prompt: crate::routing::Prompt<'_>,
        fields: &serde_json::Map<String, serde_json::Value>,
        completion: bool,
    ) -> (u64, u64) {
        let bytes = match prompt {
            crate::routing::Prompt::Text(t) => t.len(),
            crate::routing::Prompt::Chat(messages) => messages.as_array().map_or(0, |ms| {
                ms.iter()
                    .map(|m| match m.get("content") {
                        Some(serde_json::Value::String(s)) => s.len() + 16,
                        Some(other) => other.to_string().len() + 16,
                        None => 16,
                    })
                    .sum()
            }),
        };
        let max_tokens = ["max_tokens", "max_completion_tokens"]
            .iter()
            .find_map(|k| fields.get(*k).and_then(serde_json::Value::as_u64));
        let reservation = max_tokens.unwrap_or(if completion {
            16
        } else {
            self.config.default_output_reservation
        });
        ((bytes / 4) as u64, reservation)
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

    /// Waits until every usage record so far is on disk (graceful shutdown).
    pub async fn flush(&self) {
        self.journal.flush().await;
    }
}

fn percent_decode(s: &str) -> String {
    fn hex(b: u8) -> Option<u8> {
        (b as char).to_digit(16).map(|d| d as u8)
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let decoded = match bytes[i] {
            b'%' => bytes
                .get(i + 1)
                .and_then(|h| hex(*h))
                .zip(bytes.get(i + 2).and_then(|l| hex(*l)))
                .map(|(h, l)| h * 16 + l),
            _ => None,
        };
        match (decoded, bytes[i]) {
            (Some(b), _) => {
                out.push(b);
                i += 3;
            }
            (None, b'+') => {
                out.push(b' ');
                i += 1;
            }
            (None, b) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
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

/// OpenAI `1s`, `6m0s`, `20ms` style durations.
fn go_duration(seconds: f64) -> String {
    let s = seconds.max(0.0);
    if s < 1.0 {
        return format!("{}ms", (s * 1000.0).ceil() as u64);
    }
    let total = s.ceil() as u64;
    let (m, sec) = (total / 60, total % 60);
    if m > 0 {
        format!("{m}m{sec}s")
    } else {
        format!("{sec}s")
    }
}

/// The conventional rate-limit headers of the client's protocol, from the tightest bucket of each
/// kind; with `retry_after` also `Retry-After` (whole seconds, rounded up).
fn rate_headers(
    protocol: Protocol,
    takes: &[Take],
    levels: &[limits::Level],
    retry_after: Option<f64>,
) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    for dim in [Dim::Requests, Dim::InputTokens, Dim::OutputTokens] {
        let tightest = takes
            .iter()
            .zip(levels)
            .filter(|(t, _)| t.dim == dim)
            .min_by(|a, b| a.1.remaining.total_cmp(&b.1.remaining));
        let Some((t, level)) = tightest else { continue };
        let limit = (t.rate_per_s * 60.0).round() as u64;
        let remaining = level.remaining.max(0.0).floor() as u64;
        let reset_s = (t.capacity - level.remaining).max(0.0) / t.rate_per_s;
        match protocol {
            Protocol::OpenAi => {
                let names: [&'static str; 3] = match dim {
                    Dim::Requests => [
                        "x-ratelimit-limit-requests",
                        "x-ratelimit-remaining-requests",
                        "x-ratelimit-reset-requests",
                    ],
                    Dim::InputTokens => [
                        "x-ratelimit-limit-tokens",
                        "x-ratelimit-remaining-tokens",
                        "x-ratelimit-reset-tokens",
                    ],
                    Dim::OutputTokens => [
                        "x-ratelimit-limit-output-tokens",
                        "x-ratelimit-remaining-output-tokens",
                        "x-ratelimit-reset-output-tokens",
                    ],
                };
                out.push((names[0], limit.to_string()));
                out.push((names[1], remaining.to_string()));
                out.push((names[2], go_duration(reset_s)));
            }
            Protocol::Anthropic => {
                let names: [&'static str; 3] = match dim {
                    Dim::Requests => [
                        "anthropic-ratelimit-requests-limit",
                        "anthropic-ratelimit-requests-remaining",
                        "anthropic-ratelimit-requests-reset",
                    ],
                    Dim::InputTokens => [
                        "anthropic-ratelimit-input-tokens-limit",
                        "anthropic-ratelimit-input-tokens-remaining",
                        "anthropic-ratelimit-input-tokens-reset",
                    ],
                    Dim::OutputTokens => [
                        "anthropic-ratelimit-output-tokens-limit",
                        "anthropic-ratelimit-output-tokens-remaining",
                        "anthropic-ratelimit-output-tokens-reset",
                    ],
                };
                out.push((names[0], limit.to_string()));
                out.push((names[1], remaining.to_string()));
                let at = now_ms() + (reset_s * 1000.0).ceil() as u64;
                out.push((names[2], budget::rfc3339(at)));
            }
        }
    }
    if let Some(s) = retry_after {
        out.push(("retry-after", (s.ceil() as u64).max(1).to_string()));
    }
    out
}

/// One admitted request's tenancy state, from admission to settlement. Settles exactly once:
/// [`Admission::settle`], or `Drop` (status 499, the gateway's own figures) when the request ends
/// without it (an error, an aborted stream).
pub struct Admission {
    tenancy: Arc<Tenancy>,
    id: String,
    tenant: String,
    labels: TenantModel,
    model: String,
    /// Buckets debited at admission, with the amounts debited (input corrected after routing).
    takes: Vec<Take>,
    headers: Vec<(&'static str, String)>,
    started: Instant,
    worker: Option<String>,
    /// The provider that served the request (name, prices of the model it was asked for).
    provider: Option<(String, Option<TokenPrices>)>,
    /// The tenant spent its monthly budget and its `onExceeded` is `LocalOnly`.
    local_only: bool,
    gateway_prompt_tokens: Option<u64>,
    chunks: u64,
    first_text: Option<Instant>,
    last_text: Option<Instant>,
    /// Output tokens charged while streaming past the reservation.
    stream_charged: u64,
    output_reserved: u64,
    settled: bool,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("id", &self.id)
            .field("tenant", &self.tenant)
            .field("model", &self.model)
            .finish()
    }
}

impl Admission {
    /// The gateway's id of this request (the usage record's key).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The tenant's name.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// Rate-limit headers for the response (empty without limits).
    pub fn headers(&self) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (name, value) in &self.headers {
            if let Ok(v) = http::HeaderValue::from_str(value) {
                h.insert(*name, v);
            }
        }
        h
    }

    /// The router chose `worker` for `reason`; `prompt_tokens` is its own count, which replaces the
    /// admission's estimate in the input buckets right away.
    pub fn routed(&mut self, worker: &str, reason: &str, prompt_tokens: Option<usize>) {
        self.worker = Some(worker.to_string());
        self.tenancy
            .metrics
            .decisions
            .get_or_create(&metrics::TenantReason {
                tenant: self.labels.tenant.clone(),
                model: self.labels.model.clone(),
                reason: reason.to_string(),
            })
            .inc();
        let Some(n) = prompt_tokens else { return };
        self.gateway_prompt_tokens = Some(n as u64);
        let mut adjust = Vec::new();
        for t in self.takes.iter_mut().filter(|t| t.dim == Dim::InputTokens) {
            let mut delta = t.clone();
            delta.amount = n as f64 - t.amount;
            t.amount = n as f64;
            adjust.push(delta);
        }
        self.tenancy.adjust(adjust);
    }

    /// A provider serves the request (cloud burst): it is billed at `prices` (the provider's price
    /// of the model it was asked for) under the provider's name, and counted against the tenant's
    /// limits and budget like any other request.
    pub fn provider(&mut self, name: &str, prices: Option<TokenPrices>) {
        self.worker = None;
        self.provider = Some((name.to_string(), prices));
        self.tenancy
            .metrics
            .decisions
            .get_or_create(&metrics::TenantReason {
                tenant: self.labels.tenant.clone(),
                model: self.labels.model.clone(),
                reason: "provider".to_string(),
            })
            .inc();
    }

    /// Whether only local pools may serve this request: the tenant spent its monthly budget and its
    /// `onExceeded` is `LocalOnly` (paid providers are out).
    pub fn local_only(&self) -> bool {
        self.local_only
    }

    /// A streamed chunk carrying text arrived: per-tenant TTFT / ITL, and output charged as a
    /// stream runs past its reservation.
    pub fn text_chunk(&mut self) {
        let now = Instant::now();
        match self.last_text {
            None => {
                self.first_text = Some(now);
                self.tenancy
                    .metrics
                    .ttft
                    .get_or_create(&self.labels)
                    .observe(now.duration_since(self.started).as_secs_f64());
            }
            Some(last) => self
                .tenancy
                .metrics
                .itl
                .get_or_create(&self.labels)
                .observe(now.duration_since(last).as_secs_f64()),
        }
        self.last_text = Some(now);
        self.chunks += 1;
        let covered = self.output_reserved + self.stream_charged;
        if self.chunks > covered {
            let step = limits::STREAM_CHARGE_STEP;
            let adjust: Vec<Take> = self
                .takes
                .iter()
                .filter(|t| t.dim == Dim::OutputTokens)
                .map(|t| {
                    let mut t = t.clone();
                    t.amount = step as f64;
                    t
                })
                .collect();
            self.stream_charged += step;
            self.tenancy.adjust(adjust);
        }
    }

    fn armed(mut self) -> Self {
        self.settled = false;
        self
    }

    /// Ends the request with `status` and the worker's usage (exactly once).
    pub fn settle(mut self, status: u16, usage: Option<&Usage>) {
        self.finish(status, usage);
    }

    fn finish(&mut self, status: u16, usage: Option<&Usage>) {
        if self.settled {
            return;
        }
        self.settled = true;
        let tenancy = Arc::clone(&self.tenancy);
        tenancy.settle(self, status, usage);
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.finish(499, None);
    }
}

#[cfg(test)]
mod tests;
