//! The loaded policy set: the five resources' specs, cross-checked, indexed for the engine.
//!
//! [`PolicySet::build`] validates each object on its own (references, exactly one action per rule,
//! ...). An invalid object is not applied; if a previous set had a valid version of it, that
//! version keeps serving ("rolled back"), so one broken policy never takes the others down.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;

use kinference_crds::{
    InferenceModelSpec, InferencePolicySpec, InferencePoolSpec, InferenceProviderSpec,
    InferenceTenantSpec, Locality, PoolCondition, RuleAction,
};
use serde::Serialize;

#[cfg(test)]
mod tests;

/// Where an object came from, for messages with file and line.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Origin {
    /// File it was read from (empty for objects from the Kubernetes API).
    pub file: PathBuf,
    /// 1-based line of the document's start (its `apiVersion` or first line).
    pub line: usize,
    /// For policies: the 1-based line of each rule, in order (0 when unknown).
    pub rule_lines: Vec<usize>,
}

impl Origin {
    /// Line of rule `index`, falling back to the document's line.
    pub fn rule_line(&self, index: usize) -> usize {
        self.rule_lines
            .get(index)
            .copied()
            .filter(|l| *l > 0)
            .unwrap_or(self.line)
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file.display(), self.line)
    }
}

/// The spec of one of the five kinds.
#[derive(Debug, Clone, PartialEq)]
pub enum Spec {
    Model(InferenceModelSpec),
    Pool(InferencePoolSpec),
    Provider(InferenceProviderSpec),
    Tenant(InferenceTenantSpec),
    Policy(InferencePolicySpec),
}

impl Spec {
    /// The CRD kind.
    pub fn kind(&self) -> &'static str {
        match self {
            Spec::Model(_) => "InferenceModel",
            Spec::Pool(_) => "InferencePool",
            Spec::Provider(_) => "InferenceProvider",
            Spec::Tenant(_) => "InferenceTenant",
            Spec::Policy(_) => "InferencePolicy",
        }
    }
    fn rank(&self) -> u8 {
        match self {
            Spec::Model(_) => 0,
            Spec::Pool(_) => 1,
            Spec::Provider(_) => 2,
            Spec::Tenant(_) => 3,
            Spec::Policy(_) => 4,
        }
    }
}

/// One parsed object (schema-valid, not yet cross-checked).
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    pub name: String,
    pub generation: Option<i64>,
    pub spec: Spec,
    pub origin: Origin,
}

impl Manifest {
    /// `Kind/name`.
    pub fn key(&self) -> ObjectKey {
        ObjectKey {
            kind: self.spec.kind(),
            name: self.name.clone(),
        }
    }
}

/// Identity of an object: kind and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ObjectKey {
    pub kind: &'static str,
    pub name: String,
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.kind, self.name)
    }
}

/// A named, validated object of the set.
#[derive(Debug, Clone, PartialEq)]
pub struct Named<T> {
    pub name: String,
    pub spec: T,
    pub origin: Origin,
    pub generation: Option<i64>,
}

/// A problem with one object, found while building the set (the object is not applied).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    pub object: ObjectKey,
    pub file: PathBuf,
    pub line: usize,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: {}: {}",
            self.file.display(),
            self.line,
            self.object,
            self.message
        )
    }
}

/// What happened to each object when a set was built.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum ApplyState {
    /// The new version is serving.
    Applied,
    /// The new version is invalid; the previous version keeps serving.
    RolledBack { reason: String },
    /// The new version is invalid and there is no previous one: the object is not serving.
    Rejected { reason: String },
}

/// The requested model, resolved against the set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Requested {
    /// An `InferenceModel` (by name, served name or alias).
    Model(String),
    /// A model class.
    Class(String),
    /// Nothing by that name.
    Unknown(String),
}

/// The validated, indexed policy set the engine evaluates. Cheap to share (`Arc`), immutable.
#[derive(Debug, Clone, Default)]
pub struct PolicySet {
    pub models: BTreeMap<String, Named<InferenceModelSpec>>,
    pub pools: BTreeMap<String, Named<InferencePoolSpec>>,
    pub providers: BTreeMap<String, Named<InferenceProviderSpec>>,
    pub tenants: BTreeMap<String, Named<InferenceTenantSpec>>,
    /// Policies in evaluation order: ascending priority, then name.
    pub policies: Vec<Named<InferencePolicySpec>>,
    /// Model name, served name and aliases -> model name.
    names: BTreeMap<String, String>,
    /// Class -> model names (local models only; provider classes are in `provider_classes`).
    classes: BTreeMap<String, BTreeSet<String>>,
    provider_classes: BTreeSet<String>,
}

/// The result of [`PolicySet::build`].
#[derive(Debug, Clone, Default)]
pub struct BuildOutcome {
    pub set: PolicySet,
    /// Problems of objects that were not applied.
    pub problems: Vec<Problem>,
    /// The state of every object that was offered.
    pub states: BTreeMap<ObjectKey, ApplyState>,
}

impl PolicySet {
    /// Builds a set from `manifests`. Objects that fail validation are left out, or replaced by
    /// their version in `previous` when there is one. `kept` names objects whose documents could
    /// not even be read this time (YAML errors): their previous versions are kept as well.
    pub fn build(
        manifests: &[Manifest],
        previous: Option<&PolicySet>,
        kept: &BTreeMap<ObjectKey, String>,
    ) -> BuildOutcome {
        let mut out = BuildOutcome::default();
        let mut sorted: Vec<&Manifest> = manifests.iter().collect();
        sorted.sort_by_key(|m| m.spec.rank());
        let mut seen: BTreeMap<ObjectKey, Origin> = BTreeMap::new();
        for m in sorted {
            let key = m.key();
            if let Some(first) = seen.get(&key) {
                let msg = format!("duplicate {key}: already defined at {first}");
                out.reject(m, vec![(m.origin.line, msg)], None);
                continue;
            }
            seen.insert(key.clone(), m.origin.clone());
            let errors = out.set.check(m);
            if errors.is_empty() {
                out.set.insert(m.clone());
                out.states.insert(key, ApplyState::Applied);
            } else {
                out.reject(m, errors, previous);
            }
        }
        // Objects whose new version did not even parse: keep the previous version if valid.
        for (key, reason) in kept {
            if out.states.contains_key(key) {
                continue;
            }
            match previous.and_then(|p| p.manifest(key)) {
                Some(old) if out.set.check(&old).is_empty() => {
                    out.set.insert(old);
                    out.states.insert(
                        key.clone(),
                        ApplyState::RolledBack {
                            reason: reason.clone(),
                        },
                    );
                }
                _ => {
                    out.states.insert(
                        key.clone(),
                        ApplyState::Rejected {
                            reason: reason.clone(),
                        },
                    );
                }
            }
        }
        out.set
            .policies
            .sort_by(|a, b| (a.spec.priority, &a.name).cmp(&(b.spec.priority, &b.name)));
        out
    }

    fn insert(&mut self, m: Manifest) {
        let (name, origin, generation) = (m.name, m.origin, m.generation);
        match m.spec {
            Spec::Model(spec) => {
                for n in std::iter::once(&name)
                    .chain(std::iter::once(&spec.served_name))
                    .chain(spec.aliases.iter())
                {
                    self.names.entry(n.clone()).or_insert_with(|| name.clone());
                }
                for c in &spec.classes {
                    self.classes
                        .entry(c.clone())
                        .or_default()
                        .insert(name.clone());
                }
                self.models.insert(
                    name.clone(),
                    Named {
                        name,
                        spec,
                        origin,
                        generation,
                    },
                );
            }
            Spec::Pool(spec) => {
                self.pools.insert(
                    name.clone(),
                    Named {
                        name,
                        spec,
                        origin,
                        generation,
                    },
                );
            }
            Spec::Provider(spec) => {
                for pm in &spec.models {
                    self.provider_classes.extend(pm.classes.iter().cloned());
                }
                self.providers.insert(
                    name.clone(),
                    Named {
                        name,
                        spec,
                        origin,
                        generation,
                    },
                );
            }
            Spec::Tenant(spec) => {
                self.tenants.insert(
                    name.clone(),
                    Named {
                        name,
                        spec,
                        origin,
                        generation,
                    },
                );
            }
            Spec::Policy(spec) => self.policies.push(Named {
                name,
                spec,
                origin,
                generation,
            }),
        }
    }

    /// The manifest of an object currently in the set.
    pub fn manifest(&self, key: &ObjectKey) -> Option<Manifest> {
        fn m<T: Clone>(n: &Named<T>, f: fn(T) -> Spec) -> Manifest {
            Manifest {
                name: n.name.clone(),
                generation: n.generation,
                spec: f(n.spec.clone()),
                origin: n.origin.clone(),
            }
        }
        match key.kind {
            "InferenceModel" => self.models.get(&key.name).map(|n| m(n, Spec::Model)),
            "InferencePool" => self.pools.get(&key.name).map(|n| m(n, Spec::Pool)),
            "InferenceProvider" => self.providers.get(&key.name).map(|n| m(n, Spec::Provider)),
            "InferenceTenant" => self.tenants.get(&key.name).map(|n| m(n, Spec::Tenant)),
            "InferencePolicy" => self
                .policies
                .iter()
                .find(|p| p.name == key.name)
                .map(|n| m(n, Spec::Policy)),
            _ => None,
        }
    }

    /// Resolves a requested model name: model name, served name, alias, then class.
    pub fn resolve(&self, requested: &str) -> Requested {
        if let Some(model) = self.names.get(requested) {
            Requested::Model(model.clone())
        } else if self.classes.contains_key(requested) || self.provider_classes.contains(requested)
        {
            Requested::Class(requested.to_string())
        } else {
            Requested::Unknown(requested.to_string())
        }
    }

    /// The model a name or alias refers to.
    pub fn model_named(&self, name: &str) -> Option<&Named<InferenceModelSpec>> {
        self.names.get(name).and_then(|m| self.models.get(m))
    }

    /// Whether any local model or provider model has this class.
    pub fn class_exists(&self, class: &str) -> bool {
        self.classes.contains_key(class) || self.provider_classes.contains(class)
    }

    /// Models of a class.
    pub fn models_in_class(&self, class: &str) -> impl Iterator<Item = &str> {
        self.classes
            .get(class)
            .into_iter()
            .flatten()
            .map(String::as_str)
    }

    /// Classes of the requested model (its own classes, or the class asked for).
    pub fn requested_classes(&self, requested: &Requested) -> BTreeSet<String> {
        match requested {
            Requested::Model(m) => self
                .models
                .get(m)
                .map(|n| n.spec.classes.iter().cloned().collect())
                .unwrap_or_default(),
            Requested::Class(c) => BTreeSet::from([c.clone()]),
            Requested::Unknown(_) => BTreeSet::new(),
        }
    }

    /// Models that can serve the request: the model itself, or every member of the class.
    pub fn candidate_models(&self, requested: &Requested) -> Vec<String> {
        match requested {
            Requested::Model(m) => vec![m.clone()],
            Requested::Class(c) => self.models_in_class(c).map(str::to_string).collect(),
            Requested::Unknown(_) => Vec::new(),
        }
    }

    /// Pools (by name) serving `model`.
    pub fn pools_serving<'a>(
        &'a self,
        model: &'a str,
    ) -> impl Iterator<Item = &'a Named<InferencePoolSpec>> {
        self.pools
            .values()
            .filter(move |p| p.spec.models.iter().any(|m| m == model))
    }

    /// Every validation error of one object against what is already in the set.
    fn check(&self, m: &Manifest) -> Vec<(usize, String)> {
        let line = m.origin.line;
        let mut errors: Vec<(usize, String)> = Vec::new();
        match &m.spec {
            Spec::Model(spec) => {
                for n in std::iter::once(&spec.served_name).chain(spec.aliases.iter()) {
                    if let Some(other) = self.names.get(n).filter(|o| **o != m.name) {
                        errors.push((
                            line,
                            format!(
                                "name or alias {n:?} is already used by InferenceModel/{other}"
                            ),
                        ));
                    }
                }
                if let Some(other) = self.names.get(&m.name) {
                    errors.push((
                        line,
                        format!(
                            "name {:?} is already an alias of InferenceModel/{other}",
                            m.name
                        ),
                    ));
                }
            }
            Spec::Pool(spec) => {
                for model in &spec.models {
                    if !self.models.contains_key(model) {
                        errors.push((
                            line,
                            format!("unknown InferenceModel {model:?} in spec.models"),
                        ));
                    }
                }
                if spec.selector.is_none() && spec.endpoints.is_empty() {
                    errors.push((
                        line,
                        "needs spec.selector or spec.endpoints to find its workers".into(),
                    ));
                }
            }
            Spec::Provider(spec) => {
                if spec.credentials.secret_ref.is_none() && spec.credentials.env.is_none() {
                    errors.push((line, "spec.credentials needs secretRef or env".into()));
                }
                for pm in &spec.models {
                    for s in &pm.substitutes {
                        if self.model_named(s).is_none() {
                            errors.push((
                                line,
                                format!(
                                    "model {:?}: unknown InferenceModel {s:?} in substitutes",
                                    pm.name
                                ),
                            ));
                        }
                    }
                }
            }
            Spec::Tenant(spec) => {
                for (i, key) in spec.api_keys.iter().enumerate() {
                    if key.secret_ref.is_none() && key.env.is_none() {
                        errors.push((line, format!("spec.apiKeys[{i}] needs secretRef or env")));
                    }
                }
                for model in &spec.allowed_models {
                    if self.model_named(model).is_none() {
                        errors.push((
                            line,
                            format!("unknown model {model:?} in spec.allowedModels"),
                        ));
                    }
                }
                for class in &spec.allowed_classes {
                    if !self.class_exists(class) {
                        errors.push((
                            line,
                            format!("unknown model class {class:?} in spec.allowedClasses"),
                        ));
                    }
                }
            }
            Spec::Policy(spec) => {
                let mut names = BTreeSet::new();
                for (i, rule) in spec.rules.iter().enumerate() {
                    let at = m.origin.rule_line(i);
                    if !names.insert(&rule.name) {
                        errors.push((at, format!("rule {:?}: duplicate rule name", rule.name)));
                    }
                    for e in self.check_rule(&rule.match_, &rule.action) {
                        errors.push((at, format!("rule {:?}: {e}", rule.name)));
                    }
                }
            }
        }
        errors
    }

    fn check_rule(&self, m: &kinference_crds::RuleMatch, action: &RuleAction) -> Vec<String> {
        let mut errors = Vec::new();
        for t in &m.tenants {
            if !self.tenants.contains_key(t) {
                errors.push(format!("unknown InferenceTenant {t:?} in match.tenants"));
            }
        }
        if m.unknown_tenant == Some(true) && !m.tenants.is_empty() {
            errors
                .push("match.unknownTenant: true contradicts match.tenants (never matches)".into());
        }
        for model in &m.models {
            if self.model_named(model).is_none() {
                errors.push(format!("unknown InferenceModel {model:?} in match.models"));
            }
        }
        for class in &m.classes {
            if !self.class_exists(class) {
                errors.push(format!("unknown model class {class:?} in match.classes"));
            }
        }
        if let Some(cond) = &m.pool_state {
            errors.extend(self.check_condition(cond, "match.poolState"));
        }
        let count = [
            action.route.is_some(),
            action.reject.is_some(),
            action.burst.is_some(),
            action.require_local.is_some(),
        ]
        .iter()
        .filter(|x| **x)
        .count();
        if count != 1 {
            errors.push(format!(
                "action must have exactly one of route, reject, burst, requireLocal (has {count})"
            ));
        }
        if let Some(route) = &action.route {
            for (i, t) in route.targets.iter().enumerate() {
                match (&t.pool, &t.model_class) {
                    (Some(pool), None) => match self.pools.get(pool) {
                        None => errors.push(format!(
                            "unknown InferencePool {pool:?} in route.targets[{i}]"
                        )),
                        Some(p) => {
                            if let Some(model) = &t.model {
                                match self.model_named(model) {
                                    None => errors.push(format!("unknown InferenceModel {model:?} in route.targets[{i}]")),
                                    Some(md) if !p.spec.models.contains(&md.name) => errors.push(format!(
                                        "InferencePool {pool:?} does not serve model {model:?} (route.targets[{i}])"
                                    )),
                                    Some(_) => {}
                                }
                            }
                        }
                    },
                    (None, Some(class)) => {
                        if !self.classes.contains_key(class) {
                            errors.push(format!(
                                "no local model has class {class:?} (route.targets[{i}])"
                            ));
                        }
                        if t.model.is_some() {
                            errors.push(format!("route.targets[{i}].model only applies with pool"));
                        }
                    }
                    _ => errors.push(format!(
                        "route.targets[{i}] needs exactly one of pool, modelClass"
                    )),
                }
            }
        }
        if let Some(burst) = &action.burst {
            for p in &burst.providers {
                if !self.providers.contains_key(p) {
                    errors.push(format!(
                        "unknown InferenceProvider {p:?} in burst.providers"
                    ));
                }
            }
            errors.extend(self.check_condition(&burst.when, "burst.when"));
        }
        errors
    }

    fn check_condition(&self, cond: &PoolCondition, at: &str) -> Vec<String> {
        let mut errors = Vec::new();
        for pool in &cond.pools {
            if !self.pools.contains_key(pool) {
                errors.push(format!("unknown InferencePool {pool:?} in {at}.pools"));
            }
        }
        if cond.queue_depth_above.is_none()
            && cond.kv_cache_usage_above.is_none()
            && cond.estimated_ttft_above_ms.is_none()
        {
            errors.push(format!(
                "{at} needs at least one of queueDepthAbove, kvCacheUsageAbove, estimatedTtftAboveMs"
            ));
        }
        errors
    }

    /// Locality of a pool (providers are always remote).
    pub fn pool_locality(&self, pool: &str) -> Option<Locality> {
        self.pools.get(pool).map(|p| p.spec.locality)
    }
}

impl BuildOutcome {
    fn reject(&mut self, m: &Manifest, errors: Vec<(usize, String)>, previous: Option<&PolicySet>) {
        let key = m.key();
        let reason = errors
            .iter()
            .map(|(_, e)| e.as_str())
            .collect::<Vec<_>>()
            .join("; ");
        for (line, message) in errors {
            self.problems.push(Problem {
                object: key.clone(),
                file: m.origin.file.clone(),
                line,
                message,
            });
        }
        if self.states.contains_key(&key) {
            return; // a duplicate: the first definition stays
        }
        match previous.and_then(|p| p.manifest(&key)) {
            Some(old) if self.set.check(&old).is_empty() => {
                self.set.insert(old);
                self.states.insert(key, ApplyState::RolledBack { reason });
            }
            _ => {
                self.states.insert(key, ApplyState::Rejected { reason });
            }
        }
    }
}
