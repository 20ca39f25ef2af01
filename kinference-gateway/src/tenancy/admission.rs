//! Admission: the budget and the token buckets at the start of a request, the [`Admission`] that
//! follows it, and its settlement (bucket reconciliation, usage record, cost, per-tenant metrics).

use std::sync::Arc;
use std::time::Instant;

use kinference_crds::{BudgetAction, TokenPrices};

use super::headers::rate_headers;
use super::limits::{self, Demand, Dim, FailMode, LimitVerdict, Take};
use super::metrics::{self, TenantBackend, TenantCache, TenantLimit, TenantModel, TenantStatus};
use super::store::{self, OnUnrecorded, RedisVerdict};
use super::usage::{self, UsageRecord};
use super::{Caller, Tenancy, Tenant, budget, now_ms};
use crate::api::openai::Usage;
use crate::errors::{GatewayError, Protocol};

/// One admitted request's tenancy state, from admission to settlement. Settles exactly once:
/// [`Admission::settle`], or `Drop` (status 499, the gateway's own figures) when the request ends
/// without it (an error, an aborted stream).
pub struct Admission {
    tenancy: Arc<Tenancy>,
    id: String,
    /// The request's `x-request-id`, for the usage record.
    request_id: String,
    tenant: String,
    labels: TenantModel,
    /// The served model (once known: the one name or alias resolved, or the model routed to); the
    /// requested name until then. Prices and the usage record follow it.
    model: String,
    /// The tenant's limits and settings (none when the gateway is open).
    limited: Option<Arc<Tenant>>,
    /// What was asked of the buckets at admission.
    demand: Demand,
    /// Buckets debited at admission, with the amounts debited (input corrected after routing).
    takes: Vec<Take>,
    headers: Vec<(&'static str, String)>,
    started: Instant,
    worker: Option<String>,
    /// The prefill of a split request (prefill/decode disaggregation): its worker and the prompt
    /// tokens it computed and found cached. The prompt is billed by these figures at that worker's
    /// pool's prices, the output at the decode worker's.
    prefill: Option<Prefilled>,
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
    /// The usage it is settled with was counted by the gateway, not reported by the backend.
    counted: bool,
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

/// The prefill half of a split request, as its worker reported it.
#[derive(Debug, Clone)]
struct Prefilled {
    worker: String,
    prompt: u64,
    cached: u64,
}

impl Admission {
    /// The gateway's id of this request (the usage record's key).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The request's `x-request-id` (carried by the usage record).
    pub fn request_id(&mut self, id: &str) {
        self.request_id = id.to_string();
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

    /// The request is served by `worker` now, in place of the one it was routed to (its stream was
    /// sent again): the usage record names it.
    pub fn moved(&mut self, worker: &str) {
        self.worker = Some(worker.to_string());
    }

    /// The prefill of this split request ran on `worker`, which reported `usage` (its prompt tokens
    /// and those it found cached; its one output token is the gateway's, not billed). The request
    /// is still settled once, with the decode worker's answer.
    pub fn prefilled(&mut self, worker: &str, usage: Option<&Usage>) {
        self.prefill = Some(Prefilled {
            worker: worker.to_string(),
            prompt: usage.map_or(0, |u| u.prompt_tokens),
            cached: usage.and_then(Usage::cached_tokens).unwrap_or(0),
        });
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

    /// The request is served by `served` (a policy resolved its alias or class, or chose a pool of
    /// another model): its per-model buckets and its price follow that model. Buckets of the other
    /// models it was admitted against are refunded; a model it was not admitted against is charged
    /// now, into debt if need be, so the next request for it waits.
    pub fn serving(&mut self, served: &str) {
        if let Some(tenant) = &self.limited {
            let demand = Demand {
                input: self
                    .gateway_prompt_tokens
                    .map_or(self.demand.input, |n| n as f64),
                ..self.demand
            };
            let wanted = limits::model_takes(&tenant.name, &tenant.settings, served, demand);
            let mut adjust = Vec::new();
            let mut kept = Vec::new();
            for t in std::mem::take(&mut self.takes) {
                if t.per_model && !wanted.iter().any(|w| w.key == t.key) {
                    let mut refund = t.clone();
                    refund.amount = -t.amount;
                    adjust.push(refund);
                } else {
                    kept.push(t);
                }
            }
            for mut w in wanted {
                if !kept.iter().any(|t| t.key == w.key) {
                    w.amount = w.amount.min(w.capacity);
                    adjust.push(w.clone());
                    kept.push(w);
                }
            }
            self.takes = kept;
            self.tenancy.adjust(adjust);
        }
        self.model = served.to_string();
        self.labels.model = self.tenancy.model_label(served);
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

    /// The usage it will be settled with was counted by the gateway (the backend reported none):
    /// the usage record says `estimated`.
    pub fn estimated(&mut self) {
        self.counted = true;
    }

    /// The prompt tokens it was admitted with (the router's count once routed).
    pub fn input_estimate(&self) -> u64 {
        self.gateway_prompt_tokens
            .unwrap_or(self.demand.input as u64)
    }

    /// The output tokens reserved at admission.
    pub fn output_reserved(&self) -> u64 {
        self.output_reserved
    }

    /// Whether an output-token bucket holds this request's reservation (then the worker must be
    /// sent exactly that limit: more would be generated than was reserved).
    pub fn reserves_output(&self) -> bool {
        self.takes.iter().any(|t| t.dim == Dim::OutputTokens)
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
                    .observe_ttft(&self.labels, now.duration_since(self.started).as_secs_f64());
            }
            Some(last) => self
                .tenancy
                .metrics
                .observe_itl(&self.labels, now.duration_since(last).as_secs_f64()),
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

impl Tenancy {
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
        // The served models the name may stand for (an alias: one; a class: each of its models).
        let (candidates, allowed) = {
            let table = self.table.read();
            let allowed = caller.tenant.as_ref().is_none_or(|t| {
                model.is_empty()
                    || table
                        .served
                        .allows(model, &t.allowed_models, &t.allowed_classes)
            });
            (table.served.candidates(model), allowed)
        };
        if let (false, Some(tenant)) = (allowed, &caller.tenant) {
            return Err(self.model_not_allowed(tenant, model));
        }
        let served = match candidates.as_slice() {
            [one] => one.as_str(),
            _ => model,
        };
        let demand = Demand {
            requests: 1.0,
            input: input_estimate as f64,
            output: output_reservation as f64,
        };
        let mut admission = Admission {
            tenancy: Arc::clone(self),
            id: format!("{:032x}", rand::random::<u128>()),
            request_id: String::new(),
            tenant: caller.name().to_string(),
            labels: TenantModel {
                tenant: caller.label().to_string(),
                model: self.model_label(served),
            },
            model: served.to_string(),
            limited: caller.tenant.clone(),
            demand,
            takes: Vec::new(),
            headers: Vec::new(),
            started: Instant::now(),
            worker: None,
            prefill: None,
            provider: None,
            local_only: false,
            gateway_prompt_tokens: None,
            chunks: 0,
            first_text: None,
            last_text: None,
            stream_charged: 0,
            output_reserved: output_reservation,
            counted: false,
            // Armed (false) only when admitted: a refused request has nothing to settle.
            settled: true,
        };
        if !self.journal.healthy() {
            self.refuse_unrecorded(caller)?;
        }
        let Some(tenant) = caller.tenant.clone() else {
            return Ok(admission.armed());
        };
        // Tenant-wide buckets, and the per-model ones of every model the request may be served by.
        let first = candidates.first().map_or(model, String::as_str);
        let mut takes = limits::takes(
            &tenant.name,
            tenant.limits.as_ref(),
            &tenant.settings,
            first,
            demand,
        );
        for other in candidates.iter().skip(1) {
            takes.extend(limits::model_takes(
                &tenant.name,
                &tenant.settings,
                other,
                demand,
            ));
        }
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
            LimitVerdict::Admitted(levels) => {
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
            LimitVerdict::Limited {
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
                    let limited = candidates
                        .iter()
                        .find(|c| take.key.contains(&format!("}}:{c}:")))
                        .map_or(model, String::as_str);
                    format!(" for model `{limited}`")
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

    /// Whether `caller` may ask for `model` (its tenant's `allowedModels` / `allowedClasses`).
    pub fn allows(&self, caller: &Caller, model: &str) -> bool {
        caller.tenant.as_ref().is_none_or(|t| {
            self.table
                .read()
                .served
                .allows(model, &t.allowed_models, &t.allowed_classes)
        })
    }

    /// 403 for a model outside the tenant's `allowedModels` / `allowedClasses` (counted), as the
    /// policy engine answers it: the same on every endpoint, with or without policies.
    fn model_not_allowed(&self, tenant: &Tenant, model: &str) -> GatewayError {
        self.metrics
            .rejections
            .get_or_create(&TenantLimit {
                tenant: tenant.label.clone(),
                limit: "model",
                scope: "tenant",
            })
            .inc();
        GatewayError::PolicyRejected {
            status: http::StatusCode::FORBIDDEN,
            code: "model_not_allowed",
            message: format!(
                "tenant {:?} may not use model {model:?} (allowed models: {:?}, classes: {:?})",
                tenant.name, tenant.allowed_models, tenant.allowed_classes
            ),
        }
    }

    /// While the usage journal cannot be written: refuses the caller (counted) when its
    /// `on_usage_unrecorded` (or the journal's default, for every tenant without one and the open
    /// gateway) is `refuse`.
    fn refuse_unrecorded(&self, caller: &Caller) -> Result<(), GatewayError> {
        let mode = caller
            .tenant
            .as_ref()
            .and_then(|t| t.settings.on_usage_unrecorded)
            .unwrap_or(self.config.journal.on_usage_unrecorded);
        if mode == OnUnrecorded::Serve {
            return Ok(());
        }
        self.journal.refused();
        Err(GatewayError::UsageUnrecorded)
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
        m.observe_e2e(&a.labels, elapsed);
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
            // Reached a backend and reported nothing: estimated, unless it was billed no tokens
            // (tokenizing: admitted with none).
            _ => {
                let bills = a.demand.input > 0.0 || a.output_reserved > 0;
                (
                    0,
                    0,
                    0,
                    bills && (a.worker.is_some() || a.provider.is_some()),
                )
            }
        };
        // A split request's prompt was computed by its prefill worker: the decode worker reports it
        // as cached (pulled), the prefill worker says what was really computed.
        let (prompt, cached) = match &a.prefill {
            Some(p) if p.prompt > 0 && output > 0 => (p.prompt, p.cached.min(p.prompt)),
            _ => (prompt, cached),
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
        m.observe_sizes(&a.labels, prompt, output);
        // The prompt at the prefill worker's pool's prices, the output at the decode worker's.
        let prefill_pool = a
            .prefill
            .as_ref()
            .filter(|_| provider.is_empty())
            .and_then(|p| self.pool_of(&p.worker, &a.model));
        let cost = match &prefill_pool {
            Some((_, input_prices)) => {
                usage::cost(Some(input_prices), uncached, cached, 0)
                    + usage::cost(prices.as_ref(), 0, 0, output)
            }
            None => usage::cost(prices.as_ref(), uncached, cached, output),
        };
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
            request_id: a.request_id.clone(),
            ts_ms,
            tenant: a.tenant.clone(),
            model: a.model.clone(),
            pool,
            prefill_pool: prefill_pool.map(|(name, _)| name).unwrap_or_default(),
            provider,
            status,
            requests: 1,
            input_uncached: uncached,
            input_cached: cached,
            output,
            cost,
            estimated: estimated || a.counted,
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

    /// The output tokens a request reserves at admission: the largest output limit it sets among
    /// the fields its worker honours (`asked`), else the model's own limit (`model_limit`: its
    /// context length less the prompt, when its `InferenceModel` declares one), else 16 for
    /// completions (the API's default) or `default_output_reservation`.
    pub fn output_reservation(
        &self,
        asked: Option<u64>,
        model_limit: Option<u64>,
        completion: bool,
    ) -> u64 {
        asked.or(model_limit).unwrap_or(if completion {
            16
        } else {
            self.config.default_output_reservation
        })
    }
}
