//! The policy stage of the gateway's request pipeline: classify the request, read the pools' state
//! from the router, evaluate the current policy set, and hand the pipeline an ordered [`Plan`] of
//! pools (with their workers) and providers, or a rejection.
//!
//! Decisions only: what the pools do at run time (the router's workers kept in line with their
//! endpoints, their workers' credentials and headers, the provider clients) is [`crate::pools`]'s.
//! A pool's workers are its static `endpoints`; with discovery ([`PolicyStage::follow_discovered`])
//! a pool's `selector` picks its workers among the discovered pods by label and GPU class
//! ([`pool_members`]); without it, a pool without endpoints stands for every worker serving its
//! model.
//!
//! Pool state per pool, for this request: `available` (a healthy worker), the best worker's estimated
//! TTFT and cached prompt tokens (the router's estimate, as [`crate::routing::Router::pick`] would
//! compute it), queue depth (sum of `waiting`) and KV-cache usage (mean) from a live agent, else from the
//! gateway's own scrape of the workers' `/metrics` ([`super::worker_load`]). A pool with no healthy
//! worker reports itself saturated (queue depth at its maximum, KV cache full), so "burst while the local
//! pools are saturated" also covers "while they are down".
//!
//! Fail closed: a plan for a local-only request (PII, `requireLocal`) never holds a remote target, checked
//! here again after the engine. The request is classified before anything else; while it may be
//! local-only (personal data, or a `requireLocal` rule in the set) no byte of it goes to a worker
//! outside the local pools (a worker's `/tokenize` is asked among the local pools' workers only), and
//! a local pool found by selector stands for the model's workers that no remote pool lists.
//!
//! The prompt is tokenized at most once per served model for the whole request: the estimates keep
//! their tokens in the request's [`PromptTokens`] and the router's pick reuses them.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use kinference_crds::{InferencePoolSpec, Locality};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde_json::Value;
use tracing::Instrument as _;

use super::classify::Classifier;
use super::engine::{self, Backend, Outcome, PoolSnapshot, PoolStates, RequestFacts};
use super::model::{Named, PolicySet, Requested};
use super::pool_members;
use super::source::PolicyWatcher;
use super::worker_load::WorkerLoad;
use crate::discovery::WorkerSet;
use crate::errors::GatewayError;
use crate::routing::pools::WorkerEstimate;
use crate::routing::tokenize::PromptTokens;
use crate::routing::{Prompt, RouteRequest, Router};

#[cfg(test)]
mod tests;

/// The request as the stage sees it.
#[derive(Debug, Clone, Copy)]
pub struct StageRequest<'a> {
    /// The client's JSON body (OpenAI or Anthropic shape): all message text is classified.
    pub body: &'a Value,
    /// The `model` the client asked for (name, alias or class).
    pub model: &'a str,
    /// The prompt, for the router's estimates.
    pub prompt: Prompt<'a>,
    /// The authenticated tenant, if any.
    pub tenant: Option<&'a str>,
    /// The `x-kinference-tags` header.
    pub tags_header: Option<&'a str>,
    /// Build the explanation for `x-kinference-decision`.
    pub debug: bool,
    /// The prompt's tokens so far (the estimates add theirs; the route reuses them).
    pub tokens: &'a PromptTokens,
    /// The `cache_salt` the workers will be sent: the estimates key the prompt with it.
    pub cache_salt: Option<&'a str>,
}

/// Where the request may go, most preferred first.
#[derive(Debug)]
pub struct Plan {
    /// Candidates in order; the pipeline tries the next one when a target cannot take the request.
    pub targets: Vec<PlanTarget>,
    /// The request goes to providers because local pools are saturated.
    pub burst: bool,
    /// Only local backends may serve it (the plan holds no provider).
    pub local_only: bool,
    /// `policy/rule` that decided, or [`DEFAULT_RULE`].
    pub rule: String,
    /// Keeps the policy set of this request alive until it ends (reloads never change a request's
    /// plan); none without policies.
    pub set: Option<Arc<PolicySet>>,
    /// The decision in one line, when the request asked for it (`x-kinference-decision`).
    pub explain: Option<String>,
}

/// [`Plan::rule`] of a plan no policy rule decided.
pub const DEFAULT_RULE: &str = "default";

impl Plan {
    /// Whether a policy's rule chose the targets and their order (not the default route).
    pub fn chosen_by_a_rule(&self) -> bool {
        self.rule != DEFAULT_RULE
    }

    /// The plan without policies: every worker serving `model`.
    pub fn default_pool(model: &str) -> Self {
        Plan {
            targets: vec![PlanTarget::Pool {
                pool: "default".into(),
                model: model.to_string(),
                workers: None,
            }],
            burst: false,
            local_only: false,
            rule: DEFAULT_RULE.into(),
            set: None,
            explain: None,
        }
    }
}

/// A request the policies refused, with the decision's explanation when it was asked for.
#[derive(Debug)]
pub struct Refused {
    /// The answer (403, or the status a `reject` rule gives).
    pub error: GatewayError,
    /// The decision in one line, when the request asked for it.
    pub explain: Option<String>,
}

impl From<GatewayError> for Refused {
    fn from(error: GatewayError) -> Self {
        Refused {
            error,
            explain: None,
        }
    }
}

/// One candidate of a plan.
#[derive(Debug, Clone, PartialEq)]
pub enum PlanTarget {
    /// A pool: `model` is the served name to send; `workers` the pool's worker URLs (`None`: every
    /// worker serving `model`).
    Pool {
        /// Pool name.
        pool: String,
        /// Served model name.
        model: String,
        /// Worker base URLs.
        workers: Option<Vec<String>>,
    },
    /// A provider (an `InferenceProvider` of the plan's set), with its model name.
    Provider {
        /// The provider's name.
        provider: String,
        /// The provider's model name.
        model: String,
    },
}

impl PlanTarget {
    /// `pool/<name>` or `provider/<name>`.
    pub fn label(&self) -> String {
        match self {
            PlanTarget::Pool { pool, .. } => format!("pool/{pool}"),
            PlanTarget::Provider { provider, .. } => format!("provider/{provider}"),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyDecisionLabels {
    policy: String,
    rule: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RejectLabels {
    policy: String,
    rule: String,
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendLabels {
    backend: String,
    burst: &'static str,
}

/// The stage's metrics.
#[derive(Clone, Debug, Default)]
struct StageMetrics {
    decisions: Family<PolicyDecisionLabels, Counter>,
    rejects: Family<RejectLabels, Counter>,
    served: Family<BackendLabels, Counter>,
}

/// The policy stage: the watched policy set, the pools' load, the classifiers.
pub struct PolicyStage {
    watcher: PolicyWatcher,
    load: WorkerLoad,
    metrics: StageMetrics,
    /// The discovered workers (cluster, with discovery): what pools' selectors pick from.
    discovered: std::sync::OnceLock<tokio::sync::watch::Receiver<WorkerSet>>,
    /// The built-in classifiers and the external one, when configured.
    classifier: Classifier,
}

impl std::fmt::Debug for PolicyStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyStage")
            .field("policies", &self.watcher.current().policies.len())
            .finish()
    }
}

impl PolicyStage {
    /// The stage over the sets a configuration source publishes (the policy directory's, or the
    /// cluster's), scraping the pools' workers every `load_interval`.
    pub fn start(
        sets: tokio::sync::watch::Receiver<Arc<PolicySet>>,
        load_interval: Duration,
    ) -> Arc<Self> {
        let watcher = PolicyWatcher::from_receiver(sets);
        let load = WorkerLoad::start(watcher.subscribe(), load_interval);
        Arc::new(PolicyStage {
            watcher,
            load,
            metrics: StageMetrics::default(),
            discovered: Default::default(),
            classifier: Classifier::default(),
        })
    }

    /// Every new policy set from now on.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Arc<PolicySet>> {
        self.watcher.subscribe()
    }

    /// The current policy set.
    pub fn current(&self) -> Arc<PolicySet> {
        self.watcher.current()
    }

    /// From now on a pool with a `selector` is the discovered workers it picks
    /// ([`pool_members`]), not every worker serving its model. Set once, at start.
    pub fn follow_discovered(&self, workers: tokio::sync::watch::Receiver<WorkerSet>) {
        if self.discovered.set(workers).is_err() {
            tracing::warn!("the policy stage already follows discovered workers");
        }
    }

    /// The pool's worker URLs ([`pool_members::members`]; `None`: every worker of its model).
    pub fn members(&self, pool: &InferencePoolSpec) -> Option<Vec<String>> {
        let discovered = self.discovered.get().map(|rx| rx.borrow());
        pool_members::members(pool, discovered.as_deref())
    }

    /// [`local_pool_workers`] with the discovered workers.
    fn local_members(
        &self,
        set: &PolicySet,
        pool: &str,
        served: &str,
        router: &Router,
    ) -> Vec<String> {
        let discovered = self.discovered.get().map(|rx| rx.borrow());
        local_pool_workers(set, pool, served, router, discovered.as_deref())
    }

    /// Registers `kinference_gateway_policy_*`.
    pub fn register_metrics(&self, registry: &mut Registry) {
        let sub = registry.sub_registry_with_prefix("kinference_gateway");
        self.classifier.register_metrics(sub);
        sub.register(
            "policy_decisions",
            "Policy decisions by deciding policy and rule (empty: the default route) and outcome (route, burst, reject)",
            self.metrics.decisions.clone(),
        );
        sub.register(
            "policy_rejects",
            "Requests refused by the policy stage, by policy, rule and code",
            self.metrics.rejects.clone(),
        );
        sub.register(
            "policy_backend_requests",
            "Requests sent on by the policy stage, by backend (pool/NAME, provider/NAME) and whether it was a burst",
            self.metrics.served.clone(),
        );
    }

    /// Counts a request sent to `target` (after fallbacks).
    pub fn count_sent(&self, target: &PlanTarget, burst: bool) {
        self.metrics
            .served
            .get_or_create(&BackendLabels {
                backend: target.label(),
                burst: if burst { "true" } else { "false" },
            })
            .inc();
    }

    /// The classifiers (`classifier` in `gateway.yaml` configures the external one).
    pub fn classifier(&self) -> &Classifier {
        &self.classifier
    }

    /// Stage "classify", before any byte of the request goes anywhere (no `/tokenize` either):
    /// every classifier over the whole body, token-id prompts decoded with the tokenizers of the
    /// models the request may be served by, then the external classifier when configured.
    async fn classify(
        &self,
        set: &PolicySet,
        router: &Router,
        req: StageRequest<'_>,
    ) -> Result<RequestFacts, GatewayError> {
        let served = served_names(set, req.model);
        // Every tokenizer's reading: ids mean different text to different vocabularies.
        let decode = |ids: &[u32]| {
            let texts: Vec<String> = served
                .iter()
                .filter_map(|m| router.tokenizer(m)?.decode(ids).ok())
                .collect();
            (!texts.is_empty()).then(|| texts.join("\n\n"))
        };
        self.classifier
            .facts(req.body, req.tenant, req.tags_header, &decode)
            .await
            .map(|(facts, _)| facts)
            .ok_or_else(|| GatewayError::invalid("model", "`model` must be a string"))
    }

    /// Decides where `req` may go: the plan, or the refusal to answer with; either carries the
    /// decision's explanation when `req.debug` asks for it.
    pub async fn decide(&self, router: &Router, req: StageRequest<'_>) -> Result<Plan, Refused> {
        let set = self.current();
        // A LoRA adapter is no `InferenceModel`: the policies decide for the model it adapts, and
        // the plan's pools then serve the adapter itself (on the workers that have it loaded).
        let adapter = adapted_model(&set, router, req.model);
        let req = match &adapter {
            Some(a) => StageRequest {
                model: &a.base,
                ..req
            },
            None => req,
        };
        let mut facts = self
            .classify(&set, router, req)
            .instrument(tracing::debug_span!("classify"))
            .await?;
        if let Some(a) = &adapter {
            facts.model = a.base.clone();
        }
        let may_be_local_only = facts.tags.contains(engine::PII_TAG) || has_require_local(&set);
        let states = self.pool_states(&set, router, req, may_be_local_only).await;
        facts.prompt_tokens = Some(req.tokens.size(req.prompt));
        let decision = engine::evaluate(&set, &facts, &states);
        let (policy, rule) = decision.rule().map_or((String::new(), String::new()), |r| {
            (r.policy.clone(), r.rule.clone())
        });
        let rule_name = if policy.is_empty() {
            DEFAULT_RULE.to_string()
        } else {
            format!("{policy}/{rule}")
        };
        let explain = req.debug.then(|| explain_line(&decision, &states));
        match decision.outcome {
            Outcome::Reject(r) => {
                self.count(policy.clone(), rule.clone(), "reject");
                self.metrics
                    .rejects
                    .get_or_create(&RejectLabels {
                        policy,
                        rule,
                        code: r.code,
                    })
                    .inc();
                tracing::info!(model = req.model, rule = %rule_name, code = r.code, status = r.status,
                    "request refused by policy");
                Err(Refused {
                    error: GatewayError::PolicyRejected {
                        status: http::StatusCode::from_u16(r.status)
                            .unwrap_or(http::StatusCode::FORBIDDEN),
                        code: r.code,
                        message: r.message,
                    },
                    explain,
                })
            }
            Outcome::Route(route) => {
                self.count(policy, rule, if route.burst { "burst" } else { "route" });
                // The engine's own PII guard already makes these local-only; checked again here.
                let local_only =
                    decision.local_only.is_some() || facts.tags.contains(engine::PII_TAG);
                let mut targets = Vec::with_capacity(route.targets.len());
                for t in &route.targets {
                    match &t.backend {
                        Backend::Pool(pool) => {
                            // Defence in depth: the engine already drops remote pools when local-only.
                            if local_only && t.locality != Locality::Local {
                                continue;
                            }
                            // A local-only request never goes to "any worker of the model".
                            let workers = if local_only {
                                Some(self.local_members(&set, pool, &t.model, router))
                            } else {
                                set.pools.get(pool).and_then(|p| self.members(&p.spec))
                            };
                            let model = match &adapter {
                                Some(a) if a.base == t.model => a.name.to_string(),
                                // A pool serving another model has no worker with the adapter.
                                Some(_) => continue,
                                None => t.model.clone(),
                            };
                            targets.push(PlanTarget::Pool {
                                pool: pool.clone(),
                                model,
                                workers,
                            });
                        }
                        Backend::Provider(name) => {
                            // Fail closed: a local-only request never reaches a provider; nor
                            // does an adapter's, which no provider has.
                            if local_only || adapter.is_some() {
                                continue;
                            }
                            if !set.providers.contains_key(name) {
                                continue;
                            }
                            targets.push(PlanTarget::Provider {
                                provider: name.clone(),
                                model: t.model.clone(),
                            });
                        }
                    }
                }
                Ok(Plan {
                    targets,
                    burst: route.burst,
                    local_only,
                    rule: rule_name,
                    set: Some(set),
                    explain,
                })
            }
        }
    }

    fn count(&self, policy: String, rule: String, outcome: &'static str) {
        self.metrics
            .decisions
            .get_or_create(&PolicyDecisionLabels {
                policy,
                rule,
                outcome,
            })
            .inc();
    }

    /// Every pool's state for this request. When it may be local-only, only the local pools'
    /// workers may be asked to tokenize it.
    async fn pool_states(
        &self,
        set: &PolicySet,
        router: &Router,
        req: StageRequest<'_>,
        may_be_local_only: bool,
    ) -> PoolStates {
        let requested = set.resolve(req.model);
        let wanted = set.candidate_models(&requested);
        // Each pool is estimated with the model it would serve this request with.
        let served_by_pool: Vec<(&String, String, Option<Vec<String>>)> = set
            .pools
            .iter()
            .filter_map(|(name, pool)| {
                let model = pool
                    .spec
                    .models
                    .iter()
                    .find(|m| wanted.contains(m))
                    .or_else(|| pool.spec.models.first())?;
                let served = set
                    .models
                    .get(model)
                    .map_or(model.as_str(), |m| m.spec.served_name.as_str())
                    .to_string();
                Some((name, served, self.members(&pool.spec)))
            })
            .collect();
        // One estimate per served model (each has its own tokenizer and workers).
        let mut by_model: HashMap<&str, Vec<WorkerEstimate>> = HashMap::new();
        for (_, served, _) in &served_by_pool {
            if by_model.contains_key(served.as_str()) {
                continue;
            }
            let local_workers: Vec<String>;
            let tokenize_via = if may_be_local_only {
                local_workers = set
                    .pools
                    .iter()
                    .filter(|(_, p)| p.spec.locality == Locality::Local)
                    .flat_map(|(name, _)| self.local_members(set, name, served, router))
                    .collect();
                Some(local_workers.as_slice())
            } else {
                None
            };
            let route = RouteRequest {
                model: served,
                prompt: req.prompt,
                debug: false,
                tokens: Some(req.tokens),
                salt: req.cache_salt,
                session: None,
                answers: Default::default(),
            };
            let estimates = router
                .estimate_workers(route, tokenize_via)
                .await
                .unwrap_or_default();
            by_model.insert(served.as_str(), estimates);
        }
        let mut pools = BTreeMap::new();
        for (name, served, members) in &served_by_pool {
            let workers: Vec<&WorkerEstimate> = by_model
                .get(served.as_str())
                .into_iter()
                .flatten()
                .filter(|e| members.as_ref().is_none_or(|m| m.contains(&e.worker)))
                .collect();
            pools.insert((*name).clone(), self.snapshot(&workers));
        }
        PoolStates { pools }
    }

    fn snapshot(&self, workers: &[&WorkerEstimate]) -> PoolSnapshot {
        if workers.is_empty() {
            return PoolSnapshot {
                available: false,
                queue_depth: Some(u32::MAX),
                kv_cache_usage: Some(1.0),
                estimated_ttft_ms: None,
                cached_tokens: None,
            };
        }
        let best = workers
            .iter()
            .filter(|w| w.ttft_s.is_some())
            .min_by(|a, b| a.ttft_s.unwrap_or(0.0).total_cmp(&b.ttft_s.unwrap_or(0.0)));
        let mut queue = None::<u32>;
        let mut kv_sum = 0.0;
        let mut kv_n = 0usize;
        for w in workers {
            let scraped = self.load.get(&w.worker);
            let waiting = w.waiting.or(scraped.map(|s| s.waiting));
            if let Some(q) = waiting {
                queue = Some(queue.unwrap_or(0).saturating_add(q));
            }
            if let Some(kv) = w
                .kv_usage
                .map(f64::from)
                .or(scraped.and_then(|s| s.kv_usage))
            {
                kv_sum += kv;
                kv_n += 1;
            }
        }
        PoolSnapshot {
            available: true,
            queue_depth: queue,
            kv_cache_usage: (kv_n > 0).then_some(kv_sum / kv_n as f64),
            estimated_ttft_ms: best.and_then(|b| b.ttft_s).map(|s| s * 1000.0),
            cached_tokens: best.map(|b| b.cached_tokens as u64),
        }
    }
}

/// A pool's static endpoints, without trailing slashes.
fn endpoints(pool: &Named<InferencePoolSpec>) -> Vec<String> {
    pool.spec
        .endpoints
        .iter()
        .map(|e| e.url.trim_end_matches('/').to_string())
        .collect()
}

/// Whether a rule of the set can make a request local-only (`requireLocal`).
fn has_require_local(set: &PolicySet) -> bool {
    set.policies
        .iter()
        .flat_map(|p| &p.spec.rules)
        .any(|r| r.action.require_local.is_some())
}

/// The workers local pool `pool` may use for `served` when the request must stay local: its
/// members ([`pool_members::members`]: endpoints, and with `discovered` the workers its selector
/// picks) that no remote pool has too; without a discovered view, for a pool found by selector,
/// every worker of `served` that no remote pool lists, none when a remote pool serving `served` is
/// found by selector too (its workers cannot be told apart from the local ones: fail closed). A
/// remote pool has none.
fn local_pool_workers(
    set: &PolicySet,
    pool: &str,
    served: &str,
    router: &Router,
    discovered: Option<&WorkerSet>,
) -> Vec<String> {
    let Some(p) = set.pools.get(pool) else {
        return Vec::new();
    };
    if p.spec.locality != Locality::Local {
        return Vec::new();
    }
    if let Some(members) = pool_members::members(&p.spec, discovered) {
        let remote: Vec<String> = set
            .pools
            .values()
            .filter(|r| r.spec.locality != Locality::Local)
            .filter_map(|r| pool_members::members(&r.spec, discovered))
            .flatten()
            .collect();
        return members
            .into_iter()
            .filter(|m| !remote.contains(m))
            .collect();
    }
    let served_by = |pool: &Named<InferencePoolSpec>| {
        pool.spec.models.iter().any(|m| {
            set.models
                .get(m)
                .map_or(m.as_str(), |m| m.spec.served_name.as_str())
                == served
        })
    };
    let remote = set
        .pools
        .values()
        .filter(|p| p.spec.locality != Locality::Local);
    let mut listed = Vec::new();
    for r in remote {
        if r.spec.endpoints.is_empty() {
            if served_by(r) {
                return Vec::new();
            }
        } else {
            listed.extend(endpoints(r));
        }
    }
    router
        .workers()
        .into_iter()
        .filter(|w| w.model == served && !listed.contains(&w.url))
        .map(|w| w.url)
        .collect()
}

/// A requested LoRA adapter and the served name of the model it adapts.
#[derive(Debug)]
struct Adapter<'a> {
    name: &'a str,
    base: String,
}

/// `requested` as a LoRA adapter some worker has loaded, when it names no model or class of the
/// set (an `InferenceModel` of the same name wins).
fn adapted_model<'a>(set: &PolicySet, router: &Router, requested: &'a str) -> Option<Adapter<'a>> {
    if !matches!(set.resolve(requested), Requested::Unknown(_)) {
        return None;
    }
    let (_, base) = router
        .adapters()
        .into_iter()
        .find(|(name, _)| name == requested)?;
    Some(Adapter {
        name: requested,
        base,
    })
}

/// The served names a requested model (name, alias or class) may be served as; the name itself
/// when the set does not know it.
fn served_names(set: &PolicySet, requested: &str) -> Vec<String> {
    let models = set.candidate_models(&set.resolve(requested));
    if models.is_empty() {
        return vec![requested.to_string()];
    }
    models
        .iter()
        .map(|m| {
            set.models
                .get(m)
                .map_or(m.clone(), |m| m.spec.served_name.clone())
        })
        .collect()
}

/// One line: the deciding rule, the targets, and every pool's figures.
fn explain_line(decision: &engine::PolicyDecision, states: &PoolStates) -> String {
    let mut s = String::new();
    match &decision.outcome {
        Outcome::Route(plan) => {
            let by = plan
                .rule
                .as_ref()
                .map_or("default".to_string(), |r| r.to_string());
            let _ = write!(
                s,
                "policy={by} outcome={} targets=[",
                if plan.burst { "burst" } else { "route" }
            );
            for (i, t) in plan.targets.iter().enumerate() {
                if i > 0 {
                    s.push_str(", ");
                }
                let _ = write!(s, "{} model={}", t.backend, t.model);
                if let Some(ms) = t.estimated_ttft_ms {
                    let _ = write!(s, " ttft={ms:.0}ms");
                }
                if let Some(c) = t.estimated_cost {
                    let _ = write!(s, " cost={c:.6}");
                }
            }
            let _ = write!(s, "] selection={}", plan.selection);
        }
        Outcome::Reject(r) => {
            let by = r
                .rule
                .as_ref()
                .map_or("engine".to_string(), |r| r.to_string());
            let _ = write!(
                s,
                "policy={by} outcome=reject status={} code={}",
                r.status, r.code
            );
        }
    }
    if let Some(l) = &decision.local_only {
        let _ = write!(s, "; local_only={}", l.reason);
    }
    s.push_str("; pools:");
    for (name, p) in &states.pools {
        let _ = write!(s, " {name}(");
        if !p.available {
            s.push_str("unavailable)");
            continue;
        }
        let _ = write!(
            s,
            "queue={} kv={} ttft={} cached={})",
            p.queue_depth.map_or("?".into(), |q| q.to_string()),
            p.kv_cache_usage.map_or("?".into(), |k| format!("{k:.2}")),
            p.estimated_ttft_ms
                .map_or("?".into(), |t| format!("{t:.0}ms")),
            p.cached_tokens.map_or("?".into(), |c| c.to_string()),
        );
    }
    header_safe(&s)
}

/// Visible ASCII only (header values), one line.
pub fn header_safe(text: &str) -> String {
    text.chars()
        .map(|c| if (' '..='~').contains(&c) { c } else { '?' })
        .collect()
}
