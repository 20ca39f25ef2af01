//! The policy engine: ordered rules -> a [`PolicyDecision`], explained rule by rule.
//!
//! Semantics (also in `deploy/examples/policies/README.md`):
//! 1. The requested model is resolved (name, served name, alias, or class). A known tenant with
//!    `allowedModels`/`allowedClasses` may only request those (403 otherwise).
//! 2. A request tagged `pii` is local-only, whatever the policies say (built-in, fail closed).
//! 3. Policies run by ascending priority (ties by name), rules in order. A matching rule:
//!    - `requireLocal`: from here on only local backends count; evaluation continues;
//!    - `reject`: refuses the request; done;
//!    - `route`: its targets, minus unavailable pools and (when local-only) remote ones, ordered
//!      by `select`; done, unless nothing is left, then the rule is skipped;
//!    - `burst`: when `when` holds, the providers (then local fallbacks); done. Skipped when
//!      local-only or when no provider model can stand in for the requested one.
//! 4. Nothing decided: the pools serving the requested model (or class), under the same filters.
//! 5. No candidate left: refused, with the reason (unknown model, local-only with no local pool).
//!
//! Pure: a function of the policy set, the request facts and the pool state.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use kinference_crds::{
    BurstAction, Complexity, ConditionMode, Locality, PoolCondition, RouteAction, RuleMatch,
    Selection, TokenPrices,
};
use serde::{Deserialize, Serialize};

use super::model::{PolicySet, Requested};

#[cfg(test)]
pub(crate) mod tests;

/// The tag the PII classifier sets (with `pii:<kind>` for each kind found).
pub const PII_TAG: &str = "pii";
/// Default `minTtftGainMs` of `CheaperUnlessFaster`.
pub const DEFAULT_MIN_TTFT_GAIN_MS: u32 = 100;
/// Token counts assumed for cost estimates when the request does not say.
const ASSUMED_PROMPT_TOKENS: u64 = 1000;
const ASSUMED_OUTPUT_TOKENS: u64 = 256;

/// What the engine knows about a request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub struct RequestFacts {
    /// Authenticated tenant (`None`: no or unknown API key).
    #[serde(default)]
    pub tenant: Option<String>,
    /// The `model` field of the request.
    pub model: String,
    /// Tags from the classifiers, headers and metadata (`pii`, `pii:email`, custom ones).
    #[serde(default)]
    pub tags: BTreeSet<String>,
    /// Prompt complexity.
    #[serde(default)]
    pub complexity: Option<Complexity>,
    /// Prompt length in tokens, when known (cost estimates).
    #[serde(default)]
    pub prompt_tokens: Option<u64>,
    /// `max_tokens` of the request, when given (cost estimates).
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
}

/// The state of every pool, as the routing engine sees it for this request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolStates {
    /// Pool name -> snapshot. A pool without an entry is assumed available with unknown load.
    #[serde(default)]
    pub pools: BTreeMap<String, PoolSnapshot>,
}

/// One pool's state. Estimates are for this request on the pool's best worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub struct PoolSnapshot {
    /// At least one healthy worker.
    #[serde(default = "yes")]
    pub available: bool,
    /// Requests waiting in the pool's worker queues.
    #[serde(default)]
    pub queue_depth: Option<u32>,
    /// KV-cache usage, 0 to 1 (the pool's busiest worker, or its mean: the router decides).
    #[serde(default)]
    pub kv_cache_usage: Option<f64>,
    /// Estimated TTFT of this request on the pool's best worker, in milliseconds.
    #[serde(default)]
    pub estimated_ttft_ms: Option<f64>,
    /// Prompt tokens of this request already cached on that worker.
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

fn yes() -> bool {
    true
}

impl Default for PoolSnapshot {
    fn default() -> Self {
        PoolSnapshot {
            available: true,
            queue_depth: None,
            kv_cache_usage: None,
            estimated_ttft_ms: None,
            cached_tokens: None,
        }
    }
}

/// A backend that may serve the request.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// An `InferencePool`.
    Pool(String),
    /// An `InferenceProvider`.
    Provider(String),
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::Pool(p) => write!(f, "pool/{p}"),
            Backend::Provider(p) => write!(f, "provider/{p}"),
        }
    }
}

/// One candidate of a routing decision.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Target {
    pub backend: Backend,
    /// Model name to send upstream (the served name on a pool, the provider's model name).
    pub model: String,
    /// The `InferenceModel` behind it (pools only).
    pub model_ref: Option<String>,
    pub locality: Locality,
    /// Estimated cost of this request (prices x estimated tokens), when prices are known.
    pub estimated_cost: Option<f64>,
    /// The router's TTFT estimate for this request, in milliseconds.
    pub estimated_ttft_ms: Option<f64>,
}

/// A rule's identity in decisions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RuleRef {
    pub policy: String,
    pub rule: String,
}

impl std::fmt::Display for RuleRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.policy, self.rule)
    }
}

/// A decision to route.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuleRoute {
    /// Candidates, most preferred first; the router tries them in order (or scores within).
    pub targets: Vec<Target>,
    /// The request goes to providers because local pools are saturated.
    pub burst: bool,
    /// The rule that decided (`None`: the default route).
    pub rule: Option<RuleRef>,
    /// Why the first target comes first.
    pub selection: String,
}

/// A decision to refuse.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rejection {
    /// HTTP status.
    pub status: u16,
    /// Machine-readable code: `policy_rejected`, `model_not_found`, `model_not_allowed`,
    /// `local_processing_required`.
    pub code: &'static str,
    /// Message for the client.
    pub message: String,
    /// The rule that decided, if any.
    pub rule: Option<RuleRef>,
}

/// Route or reject.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Route(RuleRoute),
    Reject(Rejection),
}

/// What a rule did for this request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "verdict", content = "reason")]
pub enum RuleVerdict {
    /// Matched and decided the outcome.
    Decided(String),
    /// Matched and added a constraint (`requireLocal`).
    Constrained(String),
    /// Matched but could not act (e.g. every target excluded); evaluation went on.
    Skipped(String),
    /// Did not match, and why.
    NoMatch(String),
    /// Not evaluated: an earlier rule decided.
    NotReached,
    /// Its policy is suspended.
    Suspended,
}

/// A rule's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RuleTrace {
    pub rule: RuleRef,
    #[serde(flatten)]
    pub verdict: RuleVerdict,
}

/// Why the request may only go to local backends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LocalOnly {
    /// `None`: the built-in PII guard.
    pub rule: Option<RuleRef>,
    pub reason: String,
}

/// The engine's answer, with its explanation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyDecision {
    pub outcome: Outcome,
    /// How the requested model resolved.
    pub requested: Requested,
    /// Set when the request may only go to local backends.
    pub local_only: Option<LocalOnly>,
    /// Every rule, in evaluation order, with its verdict.
    pub trace: Vec<RuleTrace>,
    /// Notes from steps outside the rules (tenant allow-lists, the default route).
    pub notes: Vec<String>,
}

impl PolicyDecision {
    /// The deciding rule, if a rule decided.
    pub fn rule(&self) -> Option<&RuleRef> {
        match &self.outcome {
            Outcome::Route(r) => r.rule.as_ref(),
            Outcome::Reject(r) => r.rule.as_ref(),
        }
    }

    /// A multi-line human explanation (for `kinfctl explain` and debug logs).
    pub fn explain(&self) -> String {
        let mut s = String::new();
        match &self.outcome {
            Outcome::Route(plan) => {
                let by = plan
                    .rule
                    .as_ref()
                    .map_or("the default route".to_string(), |r| format!("rule {r}"));
                let _ = writeln!(
                    s,
                    "decision: {} by {by}",
                    if plan.burst { "BURST" } else { "ROUTE" }
                );
                for (i, t) in plan.targets.iter().enumerate() {
                    let _ = writeln!(
                        s,
                        "  {}. {} model={} locality={:?} cost={} ttft={}",
                        i + 1,
                        t.backend,
                        t.model,
                        t.locality,
                        t.estimated_cost.map_or("?".into(), |c| format!("{c:.6}")),
                        t.estimated_ttft_ms
                            .map_or("?".into(), |c| format!("{c:.0}ms")),
                    );
                }
                let _ = writeln!(s, "  selection: {}", plan.selection);
            }
            Outcome::Reject(r) => {
                let by = r
                    .rule
                    .as_ref()
                    .map_or("the engine".to_string(), |r| format!("rule {r}"));
                let _ = writeln!(
                    s,
                    "decision: REJECT {} {} by {by}: {}",
                    r.status, r.code, r.message
                );
            }
        }
        let _ = writeln!(s, "requested: {:?}", self.requested);
        if let Some(l) = &self.local_only {
            let by = l
                .rule
                .as_ref()
                .map_or("built-in PII guard".to_string(), |r| format!("rule {r}"));
            let _ = writeln!(s, "local only: {} ({by})", l.reason);
        }
        for n in &self.notes {
            let _ = writeln!(s, "note: {n}");
        }
        for t in &self.trace {
            let v = match &t.verdict {
                RuleVerdict::Decided(r) => format!("DECIDED: {r}"),
                RuleVerdict::Constrained(r) => format!("constrained: {r}"),
                RuleVerdict::Skipped(r) => format!("skipped: {r}"),
                RuleVerdict::NoMatch(r) => format!("no match: {r}"),
                RuleVerdict::NotReached => "not reached (an earlier rule decided)".into(),
                RuleVerdict::Suspended => "policy suspended".into(),
            };
            let _ = writeln!(s, "  rule {}: {v}", t.rule);
        }
        s
    }
}

/// Evaluates the policy set for one request. See the module documentation for the semantics.
pub fn evaluate(set: &PolicySet, facts: &RequestFacts, state: &PoolStates) -> PolicyDecision {
    let requested = set.resolve(&facts.model);
    let mut ev = Evaluation {
        set,
        facts,
        state,
        requested: requested.clone(),
        classes: set.requested_classes(&requested),
        local_only: None,
        notes: Vec::new(),
    };
    let mut trace = Vec::new();
    if facts.tags.contains(PII_TAG) {
        let kinds: Vec<&str> = facts
            .tags
            .iter()
            .filter_map(|t| t.strip_prefix("pii:"))
            .collect();
        ev.local_only = Some(LocalOnly {
            rule: None,
            reason: if kinds.is_empty() {
                "the request contains personal data".into()
            } else {
                format!("the request contains personal data ({})", kinds.join(", "))
            },
        });
    }
    if let Some(rejection) = ev.tenant_allows() {
        return ev.finish(Outcome::Reject(rejection), all_not_reached(set));
    }
    let mut decided: Option<Outcome> = None;
    for policy in &set.policies {
        for rule in &policy.spec.rules {
            let rref = RuleRef {
                policy: policy.name.clone(),
                rule: rule.name.clone(),
            };
            let verdict = if decided.is_some() {
                RuleVerdict::NotReached
            } else if policy.spec.suspend {
                RuleVerdict::Suspended
            } else if let Err(why) = ev.matches(&rule.match_) {
                RuleVerdict::NoMatch(why)
            } else {
                let (verdict, outcome) = ev.act(&rref, &rule.action);
                decided = outcome;
                verdict
            };
            trace.push(RuleTrace {
                rule: rref,
                verdict,
            });
        }
    }
    let outcome = decided.unwrap_or_else(|| ev.default_route());
    ev.finish(outcome, trace)
}

fn all_not_reached(set: &PolicySet) -> Vec<RuleTrace> {
    set.policies
        .iter()
        .flat_map(|p| {
            p.spec.rules.iter().map(|r| RuleTrace {
                rule: RuleRef {
                    policy: p.name.clone(),
                    rule: r.name.clone(),
                },
                verdict: RuleVerdict::NotReached,
            })
        })
        .collect()
}

struct Evaluation<'a> {
    set: &'a PolicySet,
    facts: &'a RequestFacts,
    state: &'a PoolStates,
    requested: Requested,
    classes: BTreeSet<String>,
    local_only: Option<LocalOnly>,
    notes: Vec<String>,
}

impl Evaluation<'_> {
    fn finish(self, outcome: Outcome, trace: Vec<RuleTrace>) -> PolicyDecision {
        PolicyDecision {
            outcome,
            requested: self.requested,
            local_only: self.local_only,
            trace,
            notes: self.notes,
        }
    }

    fn known_tenant(&self) -> Option<&str> {
        self.facts
            .tenant
            .as_deref()
            .filter(|t| self.set.tenants.contains_key(*t))
    }

    fn tenant_allows(&mut self) -> Option<Rejection> {
        let tenant = self.set.tenants.get(self.known_tenant()?)?;
        let spec = &tenant.spec;
        if spec.allowed_models.is_empty() && spec.allowed_classes.is_empty() {
            return None;
        }
        let model_ok = match &self.requested {
            Requested::Model(m) => spec
                .allowed_models
                .iter()
                .any(|a| self.set.model_named(a).is_some_and(|n| &n.name == m)),
            _ => false,
        };
        let class_ok = spec
            .allowed_classes
            .iter()
            .any(|c| self.classes.contains(c));
        if model_ok || class_ok {
            self.notes.push(format!(
                "tenant {} may request {:?}",
                tenant.name, self.facts.model
            ));
            return None;
        }
        Some(Rejection {
            status: 403,
            code: "model_not_allowed",
            message: format!(
                "tenant {:?} may not use model {:?} (allowed models: {:?}, classes: {:?})",
                tenant.name, self.facts.model, spec.allowed_models, spec.allowed_classes
            ),
            rule: None,
        })
    }

    /// `Ok` when every condition holds, else the first that does not.
    fn matches(&self, m: &RuleMatch) -> Result<(), String> {
        let tenant = self.known_tenant();
        if !m.tenants.is_empty() && !tenant.is_some_and(|t| m.tenants.iter().any(|x| x == t)) {
            return Err(format!(
                "tenant {:?} is not in {:?}",
                tenant.unwrap_or("<unknown>"),
                m.tenants
            ));
        }
        match (m.unknown_tenant, tenant) {
            (Some(true), Some(t)) => {
                return Err(format!(
                    "tenant {t:?} is known (rule wants unknown tenants)"
                ));
            }
            (Some(false), None) => {
                return Err("the tenant is unknown (rule wants known tenants)".into());
            }
            _ => {}
        }
        if !m.models.is_empty() {
            let hit = match &self.requested {
                Requested::Model(model) => m
                    .models
                    .iter()
                    .any(|x| self.set.model_named(x).is_some_and(|n| &n.name == model)),
                _ => false,
            };
            if !hit {
                return Err(format!(
                    "requested model {:?} is not in {:?}",
                    self.facts.model, m.models
                ));
            }
        }
        if !m.classes.is_empty() && !m.classes.iter().any(|c| self.classes.contains(c)) {
            return Err(format!(
                "requested model {:?} (classes {:?}) is not in classes {:?}",
                self.facts.model, self.classes, m.classes
            ));
        }
        if let Some(missing) = m.tags.iter().find(|t| !self.facts.tags.contains(*t)) {
            return Err(format!("tag {missing:?} is absent"));
        }
        if !m.any_tags.is_empty() && !m.any_tags.iter().any(|t| self.facts.tags.contains(t)) {
            return Err(format!("none of the tags {:?} is present", m.any_tags));
        }
        if let Some(present) = m.without_tags.iter().find(|t| self.facts.tags.contains(*t)) {
            return Err(format!("tag {present:?} is present"));
        }
        if !m.complexity.is_empty() {
            match self.facts.complexity {
                Some(c) if m.complexity.contains(&c) => {}
                Some(c) => return Err(format!("complexity {c:?} is not in {:?}", m.complexity)),
                None => return Err("the prompt's complexity is unknown".into()),
            }
        }
        if let Some(cond) = &m.pool_state {
            let (holds, why) = self.condition(cond);
            if !holds {
                return Err(format!("pool state: {why}"));
            }
        }
        Ok(())
    }

    /// Whether a pool condition holds, and the figures behind the answer.
    fn condition(&self, cond: &PoolCondition) -> (bool, String) {
        let pools: Vec<String> = if cond.pools.is_empty() {
            let mut v: Vec<String> = self
                .set
                .candidate_models(&self.requested)
                .iter()
                .flat_map(|m| {
                    self.set
                        .pools_serving(m)
                        .map(|p| p.name.clone())
                        .collect::<Vec<_>>()
                })
                .filter(|p| self.set.pool_locality(p) == Some(Locality::Local))
                .collect();
            v.sort();
            v.dedup();
            v
        } else {
            cond.pools.clone()
        };
        if pools.is_empty() {
            return (false, "no local pool serves the requested model".into());
        }
        let mut parts = Vec::new();
        let mut hits = 0;
        for pool in &pools {
            let (hit, why) = match self.state.pools.get(pool) {
                None => (false, "no state reported".to_string()),
                Some(s) => pool_exceeds(cond, s),
            };
            hits += usize::from(hit);
            parts.push(format!("{pool}: {why}"));
        }
        let holds = match cond.mode {
            ConditionMode::All => hits == pools.len(),
            ConditionMode::Any => hits > 0,
        };
        let mode = match cond.mode {
            ConditionMode::All => "all",
            ConditionMode::Any => "any",
        };
        (
            holds,
            format!(
                "{hits}/{} pools over the thresholds ({mode} needed): {}",
                pools.len(),
                parts.join("; ")
            ),
        )
    }

    fn act(
        &mut self,
        rref: &RuleRef,
        action: &kinference_crds::RuleAction,
    ) -> (RuleVerdict, Option<Outcome>) {
        if let Some(req) = &action.require_local {
            if self.local_only.is_none() {
                self.local_only = Some(LocalOnly {
                    rule: Some(rref.clone()),
                    reason: req
                        .message
                        .clone()
                        .unwrap_or_else(|| "required by policy".into()),
                });
            }
            return (
                RuleVerdict::Constrained("only local backends from here on".into()),
                None,
            );
        }
        if let Some(rej) = &action.reject {
            let outcome = Outcome::Reject(Rejection {
                status: rej.status,
                code: "policy_rejected",
                message: rej.message.clone(),
                rule: Some(rref.clone()),
            });
            return (
                RuleVerdict::Decided(format!("reject {}", rej.status)),
                Some(outcome),
            );
        }
        if let Some(route) = &action.route {
            return match self.route_targets(route) {
                Ok(plan_targets) => {
                    let (targets, selection) = order(route, plan_targets);
                    let verdict = RuleVerdict::Decided(format!("route: {selection}"));
                    let plan = RuleRoute {
                        targets,
                        burst: false,
                        rule: Some(rref.clone()),
                        selection,
                    };
                    (verdict, Some(Outcome::Route(plan)))
                }
                Err(why) => (RuleVerdict::Skipped(why), None),
            };
        }
        if let Some(burst) = &action.burst {
            return match self.burst(burst) {
                Ok((targets, why)) => {
                    let plan = RuleRoute {
                        targets,
                        burst: true,
                        rule: Some(rref.clone()),
                        selection: why.clone(),
                    };
                    (
                        RuleVerdict::Decided(format!("burst: {why}")),
                        Some(Outcome::Route(plan)),
                    )
                }
                Err(NotBurst::ConditionFalse(why)) => (
                    RuleVerdict::NoMatch(format!("burst condition: {why}")),
                    None,
                ),
                Err(NotBurst::Skipped(why)) => (RuleVerdict::Skipped(why), None),
            };
        }
        (RuleVerdict::Skipped("no action".into()), None)
    }

    fn route_targets(&self, route: &RouteAction) -> Result<Vec<Target>, String> {
        let mut targets = Vec::new();
        let mut dropped = Vec::new();
        for t in &route.targets {
            if let Some(pool) = &t.pool {
                let Some(p) = self.set.pools.get(pool) else {
                    continue;
                };
                let model = t
                    .model
                    .as_ref()
                    .and_then(|m| self.set.model_named(m).map(|n| n.name.clone()))
                    .or_else(|| {
                        self.set
                            .candidate_models(&self.requested)
                            .into_iter()
                            .find(|m| p.spec.models.contains(m))
                    })
                    .or_else(|| p.spec.models.first().cloned());
                if let Some(model) = model {
                    self.push_pool(&mut targets, &mut dropped, pool, &model);
                }
            } else if let Some(class) = &t.model_class {
                for model in self.set.models_in_class(class) {
                    let pools: Vec<String> = self
                        .set
                        .pools_serving(model)
                        .map(|p| p.name.clone())
                        .collect();
                    for pool in pools {
                        self.push_pool(&mut targets, &mut dropped, &pool, model);
                    }
                }
            }
        }
        if targets.is_empty() {
            return Err(if dropped.is_empty() {
                "no target serves the request".into()
            } else {
                format!("every target was excluded: {}", dropped.join("; "))
            });
        }
        Ok(targets)
    }

    /// Adds a pool target unless it is unavailable or remote under local-only.
    fn push_pool(
        &self,
        targets: &mut Vec<Target>,
        dropped: &mut Vec<String>,
        pool: &str,
        model: &str,
    ) {
        let Some(p) = self.set.pools.get(pool) else {
            return;
        };
        if targets.iter().any(|t| {
            t.backend == Backend::Pool(pool.to_string()) && t.model_ref.as_deref() == Some(model)
        }) {
            return;
        }
        if self.local_only.is_some() && p.spec.locality != Locality::Local {
            dropped.push(format!(
                "pool/{pool} is remote and the request is local-only"
            ));
            return;
        }
        let snap = self.state.pools.get(pool).cloned().unwrap_or_default();
        if !snap.available {
            dropped.push(format!("pool/{pool} has no available worker"));
            return;
        }
        let served = self
            .set
            .models
            .get(model)
            .map_or(model.to_string(), |m| m.spec.served_name.clone());
        targets.push(Target {
            backend: Backend::Pool(pool.to_string()),
            model: served,
            model_ref: Some(model.to_string()),
            locality: p.spec.locality,
            estimated_cost: Some(self.cost(&p.spec.prices, snap.cached_tokens.unwrap_or(0))),
            estimated_ttft_ms: snap.estimated_ttft_ms,
        });
    }

    fn cost(&self, prices: &TokenPrices, cached: u64) -> f64 {
        let prompt = self.facts.prompt_tokens.unwrap_or(ASSUMED_PROMPT_TOKENS);
        let output = self
            .facts
            .max_output_tokens
            .unwrap_or(ASSUMED_OUTPUT_TOKENS);
        let cached = cached.min(prompt);
        (cached as f64 * prices.cached_input_per_million
            + (prompt - cached) as f64 * prices.uncached_input_per_million
            + output as f64 * prices.output_per_million)
            / 1e6
    }

    fn burst(&self, burst: &BurstAction) -> Result<(Vec<Target>, String), NotBurst> {
        let (holds, why) = self.condition(&burst.when);
        if !holds {
            return Err(NotBurst::ConditionFalse(why));
        }
        if let Some(l) = &self.local_only {
            return Err(NotBurst::Skipped(format!(
                "saturated ({why}), but the request is local-only ({}); providers are remote",
                l.reason
            )));
        }
        let requested_model = match &self.requested {
            Requested::Model(m) => Some(m.as_str()),
            _ => None,
        };
        let mut targets = Vec::new();
        for name in &burst.providers {
            let Some(provider) = self.set.providers.get(name) else {
                continue;
            };
            // Best fit first: a declared substitute, the same name, then a shared class.
            let models = &provider.spec.models;
            let fit = models
                .iter()
                .find(|pm| {
                    requested_model.is_some_and(|m| {
                        pm.substitutes
                            .iter()
                            .any(|s| self.set.model_named(s).is_some_and(|n| n.name == m))
                    })
                })
                .or_else(|| models.iter().find(|pm| pm.name == self.facts.model))
                .or_else(|| {
                    models
                        .iter()
                        .find(|pm| pm.classes.iter().any(|c| self.classes.contains(c)))
                });
            if let Some(pm) = fit {
                let prices = pm.prices.as_ref().or(provider.spec.prices.as_ref());
                targets.push(Target {
                    backend: Backend::Provider(name.clone()),
                    model: pm.name.clone(),
                    model_ref: None,
                    locality: Locality::Remote,
                    estimated_cost: prices.map(|p| self.cost(p, 0)),
                    estimated_ttft_ms: None,
                });
            }
        }
        if targets.is_empty() {
            return Err(NotBurst::Skipped(format!(
                "saturated, but no model of providers {:?} can stand in for {:?}",
                burst.providers, self.facts.model
            )));
        }
        // Local pools stay as fallbacks should every provider fail.
        let mut dropped = Vec::new();
        for model in self.set.candidate_models(&self.requested) {
            let pools: Vec<String> = self
                .set
                .pools_serving(&model)
                .map(|p| p.name.clone())
                .collect();
            for pool in pools {
                self.push_pool(&mut targets, &mut dropped, &pool, &model);
            }
        }
        Ok((targets, format!("saturated: {why}")))
    }

    fn default_route(&mut self) -> Outcome {
        if let Requested::Unknown(name) = &self.requested {
            return Outcome::Reject(Rejection {
                status: 404,
                code: "model_not_found",
                message: format!(
                    "model {name:?} is not served here (no model, alias or class by that name)"
                ),
                rule: None,
            });
        }
        let mut targets = Vec::new();
        let mut dropped = Vec::new();
        let mut any_local = false;
        for model in self.set.candidate_models(&self.requested) {
            let pools: Vec<String> = self
                .set
                .pools_serving(&model)
                .map(|p| p.name.clone())
                .collect();
            for pool in pools {
                any_local |= self.set.pool_locality(&pool) == Some(Locality::Local);
                self.push_pool(&mut targets, &mut dropped, &pool, &model);
            }
        }
        if !targets.is_empty() {
            self.notes
                .push("no rule decided: the pools serving the requested model".into());
            return Outcome::Route(RuleRoute {
                targets,
                burst: false,
                rule: None,
                selection: "default route: pools serving the requested model, the router picks"
                    .into(),
            });
        }
        match &self.local_only {
            Some(l) => {
                let (status, state) = if any_local {
                    (503, "no local pool serving it is available right now")
                } else {
                    (403, "no local pool serves it")
                };
                let by = l
                    .rule
                    .as_ref()
                    .map_or(String::new(), |r| format!(" (policy rule {r})"));
                Outcome::Reject(Rejection {
                    status,
                    code: "local_processing_required",
                    message: format!(
                        "{} and must be processed on local infrastructure{by}, but for model {:?} {state}; the request was not sent anywhere",
                        l.reason, self.facts.model
                    ),
                    rule: l.rule.clone(),
                })
            }
            None => Outcome::Reject(Rejection {
                status: 503,
                code: "no_backend_available",
                message: format!(
                    "no backend can serve model {:?} right now: {}",
                    self.facts.model,
                    if dropped.is_empty() {
                        "no pool serves it".into()
                    } else {
                        dropped.join("; ")
                    }
                ),
                rule: None,
            }),
        }
    }
}

enum NotBurst {
    ConditionFalse(String),
    Skipped(String),
}

fn pool_exceeds(cond: &PoolCondition, s: &PoolSnapshot) -> (bool, String) {
    let mut hit = true;
    let mut parts = Vec::new();
    if let Some(limit) = cond.queue_depth_above {
        match s.queue_depth {
            Some(q) => {
                hit &= q > limit;
                parts.push(format!(
                    "queue {q} {} {limit}",
                    if q > limit { ">" } else { "<=" }
                ));
            }
            None => {
                hit = false;
                parts.push("queue unknown".into());
            }
        }
    }
    if let Some(limit) = cond.kv_cache_usage_above {
        match s.kv_cache_usage {
            Some(k) => {
                hit &= k > limit;
                parts.push(format!(
                    "kv {k:.2} {} {limit:.2}",
                    if k > limit { ">" } else { "<=" }
                ));
            }
            None => {
                hit = false;
                parts.push("kv unknown".into());
            }
        }
    }
    if let Some(limit) = cond.estimated_ttft_above_ms {
        match s.estimated_ttft_ms {
            Some(t) => {
                let over = t > f64::from(limit);
                hit &= over;
                parts.push(format!(
                    "ttft {t:.0}ms {} {limit}ms",
                    if over { ">" } else { "<=" }
                ));
            }
            None => {
                hit = false;
                parts.push("ttft unknown".into());
            }
        }
    }
    (hit, parts.join(", "))
}

/// Orders route candidates by the action's selection; returns them with the reason.
fn order(route: &RouteAction, mut targets: Vec<Target>) -> (Vec<Target>, String) {
    let by_cost = |a: &Target, b: &Target| {
        a.estimated_cost
            .unwrap_or(f64::INFINITY)
            .total_cmp(&b.estimated_cost.unwrap_or(f64::INFINITY))
    };
    let by_ttft = |a: &Target, b: &Target| {
        a.estimated_ttft_ms
            .unwrap_or(f64::INFINITY)
            .total_cmp(&b.estimated_ttft_ms.unwrap_or(f64::INFINITY))
    };
    match route.select {
        Selection::Ordered => (targets, "as listed".into()),
        Selection::Cheapest => {
            targets.sort_by(by_cost);
            (targets, "cheapest estimated cost first".into())
        }
        Selection::Fastest => {
            targets.sort_by(by_ttft);
            (targets, "lowest estimated TTFT first".into())
        }
        Selection::CheaperUnlessFaster => {
            targets.sort_by(by_cost);
            let gain = f64::from(route.min_ttft_gain_ms.unwrap_or(DEFAULT_MIN_TTFT_GAIN_MS));
            let cheap = &targets[0];
            let Some(cheap_ttft) = cheap.estimated_ttft_ms else {
                let why = format!("{} is cheapest; no TTFT estimate to compare", cheap.backend);
                return (targets, why);
            };
            let faster = targets
                .iter()
                .enumerate()
                .skip(1)
                .filter_map(|(i, t)| t.estimated_ttft_ms.map(|ttft| (i, ttft)))
                .filter(|(_, ttft)| cheap_ttft - ttft >= gain)
                .min_by(|a, b| a.1.total_cmp(&b.1));
            match faster {
                Some((i, ttft)) => {
                    let why = format!(
                        "{} is dearer but faster: est. TTFT {ttft:.0}ms vs {cheap_ttft:.0}ms on the cheaper {} (gain {:.0}ms >= {gain:.0}ms)",
                        targets[i].backend,
                        cheap.backend,
                        cheap_ttft - ttft
                    );
                    let t = targets.remove(i);
                    targets.insert(0, t);
                    (targets, why)
                }
                None => {
                    let why = format!(
                        "{} is cheapest (est. TTFT {cheap_ttft:.0}ms); no dearer target is {gain:.0}ms faster",
                        cheap.backend
                    );
                    (targets, why)
                }
            }
        }
    }
}
