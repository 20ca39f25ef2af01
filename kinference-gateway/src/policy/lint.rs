//! Offline checks of a policy directory, for `kinfctl lint` and CI.
//!
//! Besides everything that stops an object from being applied (YAML, schema, unknown references,
//! rules without exactly one action), it finds:
//! - `unreachable-rule`: a rule whose conditions contradict each other;
//! - `shadowed-rule`: a rule every request of which an earlier rule always decides first;
//! - `conflicting-rules`: overlapping rules with different actions in policies of equal priority
//!   (their order then hangs on policy names alone);
//! - `pii-fail-open`: a rule matching PII that routes or bursts to a remote backend, a rule that
//!   may send PII remote before the `requireLocal` rule for PII applies, or no unconditional
//!   `requireLocal` rule for the `pii` tag at all.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use kinference_crds::{Locality, RuleAction, RuleMatch};
use serde::Serialize;

use super::engine::PII_TAG;
use super::model::PolicySet;
use super::source::{SourceError, load_dir};

#[cfg(test)]
mod tests;

/// How bad a finding is. Errors fail `kinfctl lint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

/// One finding, with its place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub severity: Severity,
    /// Which check: `yaml`, `schema`, `kind`, `spec`, `unknown-reference`, `invalid`,
    /// `unreachable-rule`, `shadowed-rule`, `conflicting-rules`, `pii-fail-open`.
    pub check: &'static str,
    pub file: PathBuf,
    pub line: usize,
    /// `Kind/name` or `policy/rule`.
    pub object: Option<String>,
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        write!(
            f,
            "{}:{}: {sev}[{}]: ",
            self.file.display(),
            self.line,
            self.check
        )?;
        if let Some(o) = &self.object {
            write!(f, "{o}: ")?;
        }
        f.write_str(&self.message)
    }
}

/// Loads `dir` and runs every check.
pub fn lint_dir(dir: &Path) -> Result<(PolicySet, Vec<Finding>), SourceError> {
    let loaded = load_dir(dir, None)?;
    let mut findings: Vec<Finding> = loaded
        .problems
        .iter()
        .map(|p| Finding {
            severity: Severity::Error,
            check: p.check,
            file: p.file.clone(),
            line: p.line,
            object: p.object.as_ref().map(ToString::to_string),
            message: p.message.clone(),
        })
        .collect();
    findings.extend(loaded.outcome.problems.iter().map(|p| Finding {
        severity: Severity::Error,
        check: if p.message.contains("unknown ") {
            "unknown-reference"
        } else {
            "invalid"
        },
        file: p.file.clone(),
        line: p.line,
        object: Some(p.object.to_string()),
        message: p.message.clone(),
    }));
    let set = loaded.outcome.set;
    findings.extend(lint_set(&set));
    findings.sort_by(|a, b| (&a.file, a.line, a.check).cmp(&(&b.file, b.line, b.check)));
    Ok((set, findings))
}

/// A rule in evaluation order, with what lint needs.
struct Flat<'a> {
    policy: &'a str,
    priority: i32,
    rule: &'a kinference_crds::PolicyRule,
    file: &'a Path,
    line: usize,
}

impl Flat<'_> {
    fn id(&self) -> String {
        format!("{}/{}", self.policy, self.rule.name)
    }
    fn finding(&self, check: &'static str, message: String) -> Finding {
        Finding {
            severity: Severity::Error,
            check,
            file: self.file.to_path_buf(),
            line: self.line,
            object: Some(self.id()),
            message,
        }
    }
    fn place(&self) -> String {
        format!("{}:{}", self.file.display(), self.line)
    }
}

/// The semantic checks over a built set.
pub fn lint_set(set: &PolicySet) -> Vec<Finding> {
    let rules: Vec<Flat<'_>> = set
        .policies
        .iter()
        .filter(|p| !p.spec.suspend)
        .flat_map(|p| {
            p.spec.rules.iter().enumerate().map(move |(i, rule)| Flat {
                policy: &p.name,
                priority: p.spec.priority,
                rule,
                file: &p.origin.file,
                line: p.origin.rule_line(i),
            })
        })
        .collect();
    let mut out = Vec::new();
    for (j, b) in rules.iter().enumerate() {
        if let Some(why) = contradiction(&b.rule.match_) {
            out.push(b.finding("unreachable-rule", format!("can never match: {why}")));
            continue;
        }
        if let Some(a) = rules[..j].iter().find(|a| {
            always_decides(set, &a.rule.action) && covers(set, &a.rule.match_, &b.rule.match_)
        }) {
            out.push(b.finding(
                "shadowed-rule",
                format!(
                    "never applies: every request it matches is decided first by rule {} ({})",
                    a.id(),
                    a.place()
                ),
            ));
        }
        for a in &rules[..j] {
            if a.policy != b.policy
                && a.priority == b.priority
                && decides(&a.rule.action)
                && decides(&b.rule.action)
                && a.rule.action != b.rule.action
                && overlap(&a.rule.match_, &b.rule.match_)
            {
                out.push(b.finding(
                    "conflicting-rules",
                    format!(
                        "overlaps rule {} ({}) with a different action, and both policies have priority {}: \
                         which one wins depends only on policy names; give them different priorities",
                        a.id(),
                        a.place(),
                        a.priority
                    ),
                ));
            }
        }
    }
    out.extend(pii_checks(set, &rules));
    out
}

fn decides(action: &RuleAction) -> bool {
    action.require_local.is_none()
}

/// Whether a matching rule with this action always ends evaluation: `reject`, or `route` with a
/// local target (a route whose targets are all remote is skipped for local-only requests, and a
/// burst only acts while its condition holds).
fn always_decides(set: &PolicySet, action: &RuleAction) -> bool {
    if action.reject.is_some() {
        return true;
    }
    action.route.as_ref().is_some_and(|r| {
        r.targets.iter().any(|t| {
            t.model_class.is_some()
                || t.pool
                    .as_ref()
                    .is_some_and(|p| set.pool_locality(p) == Some(Locality::Local))
        })
    })
}

fn contradiction(m: &RuleMatch) -> Option<String> {
    if let Some(t) = m.tags.iter().find(|t| m.without_tags.contains(t)) {
        return Some(format!("tag {t:?} is both required and excluded"));
    }
    if !m.any_tags.is_empty() && m.any_tags.iter().all(|t| m.without_tags.contains(t)) {
        return Some(format!(
            "every tag of anyTags {:?} is excluded by withoutTags",
            m.any_tags
        ));
    }
    if m.unknown_tenant == Some(true) && !m.tenants.is_empty() {
        return Some("unknownTenant: true with named tenants".into());
    }
    None
}

fn subset<T: Ord>(inner: &[T], outer: &[T]) -> bool {
    inner.iter().all(|x| outer.contains(x))
}

fn model_names(set: &PolicySet, names: &[String]) -> BTreeSet<String> {
    names
        .iter()
        .map(|n| set.model_named(n).map_or(n.clone(), |m| m.name.clone()))
        .collect()
}

/// Whether every request `b` matches is also matched by `a`.
fn covers(set: &PolicySet, a: &RuleMatch, b: &RuleMatch) -> bool {
    let tenants = a.tenants.is_empty() || (!b.tenants.is_empty() && subset(&b.tenants, &a.tenants));
    let unknown = a.unknown_tenant.is_none()
        || a.unknown_tenant == b.unknown_tenant
        || (a.unknown_tenant == Some(false) && !b.tenants.is_empty());
    let (am, bm) = (model_names(set, &a.models), model_names(set, &b.models));
    let models = am.is_empty() || (!bm.is_empty() && bm.is_subset(&am));
    let classes = a.classes.is_empty()
        || (!b.classes.is_empty() && subset(&b.classes, &a.classes))
        || (!bm.is_empty()
            && bm.iter().all(|m| {
                set.models
                    .get(m)
                    .is_some_and(|md| md.spec.classes.iter().any(|c| a.classes.contains(c)))
            }));
    let tags = subset(&a.tags, &b.tags);
    let any_tags = a.any_tags.is_empty()
        || b.tags.iter().any(|t| a.any_tags.contains(t))
        || (!b.any_tags.is_empty() && subset(&b.any_tags, &a.any_tags));
    let without = subset(&a.without_tags, &b.without_tags);
    let complexity = a.complexity.is_empty()
        || (!b.complexity.is_empty() && subset(&b.complexity, &a.complexity));
    let pool_state = a.pool_state.is_none() || a.pool_state == b.pool_state;
    tenants
        && unknown
        && models
        && classes
        && tags
        && any_tags
        && without
        && complexity
        && pool_state
}

/// Whether some request could match both (false only when provably disjoint).
fn overlap(a: &RuleMatch, b: &RuleMatch) -> bool {
    let disjoint = |x: &[String], y: &[String]| {
        !x.is_empty() && !y.is_empty() && !x.iter().any(|v| y.contains(v))
    };
    if disjoint(&a.tenants, &b.tenants)
        || disjoint(&a.models, &b.models)
        || disjoint(&a.classes, &b.classes)
    {
        return false;
    }
    if a.tags.iter().any(|t| b.without_tags.contains(t))
        || b.tags.iter().any(|t| a.without_tags.contains(t))
    {
        return false;
    }
    if !a.complexity.is_empty()
        && !b.complexity.is_empty()
        && !a.complexity.iter().any(|c| b.complexity.contains(c))
    {
        return false;
    }
    if let (Some(x), Some(y)) = (a.unknown_tenant, b.unknown_tenant)
        && x != y
    {
        return false;
    }
    if (a.unknown_tenant == Some(true) && !b.tenants.is_empty())
        || (b.unknown_tenant == Some(true) && !a.tenants.is_empty())
    {
        return false;
    }
    true
}

fn is_pii_tag(t: &str) -> bool {
    t == PII_TAG || t.starts_with("pii:")
}

/// The rule only matches requests carrying PII.
fn requires_pii(m: &RuleMatch) -> bool {
    m.tags.iter().any(|t| is_pii_tag(t))
        || (!m.any_tags.is_empty() && m.any_tags.iter().all(|t| is_pii_tag(t)))
}

/// The rule can match a request carrying PII.
fn may_match_pii(m: &RuleMatch) -> bool {
    !m.without_tags.iter().any(|t| t == PII_TAG)
}

/// Remote backends the action can send to.
fn remote_targets(set: &PolicySet, action: &RuleAction) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(b) = &action.burst {
        out.extend(b.providers.iter().map(|p| format!("provider/{p}")));
    }
    if let Some(r) = &action.route {
        for t in &r.targets {
            if let Some(p) = &t.pool
                && set.pool_locality(p) == Some(Locality::Remote)
            {
                out.push(format!("pool/{p}"));
            }
            if let Some(c) = &t.model_class {
                for m in set.models_in_class(c) {
                    for p in set.pools_serving(m) {
                        if p.spec.locality == Locality::Remote {
                            out.push(format!("pool/{}", p.name));
                        }
                    }
                }
            }
        }
    }
    out
}

fn pii_checks(set: &PolicySet, rules: &[Flat<'_>]) -> Vec<Finding> {
    let mut out = Vec::new();
    // The unconditional requireLocal rule for PII: matches on the pii tag and nothing else.
    let guard = rules.iter().position(|r| {
        let m = &r.rule.match_;
        r.rule.action.require_local.is_some()
            && (m.tags.iter().all(|t| t == PII_TAG) && m.tags.len() == 1 && m.any_tags.is_empty()
                || m.tags.is_empty() && m.any_tags.iter().any(|t| t == PII_TAG))
            && m.tenants.is_empty()
            && m.unknown_tenant.is_none()
            && m.models.is_empty()
            && m.classes.is_empty()
            && m.without_tags.is_empty()
            && m.complexity.is_empty()
            && m.pool_state.is_none()
    });
    for (i, r) in rules.iter().enumerate() {
        let remote = remote_targets(set, &r.rule.action);
        if remote.is_empty() {
            continue;
        }
        if requires_pii(&r.rule.match_) {
            out.push(r.finding(
                "pii-fail-open",
                format!(
                    "matches PII requests but sends them to remote {}",
                    remote.join(", ")
                ),
            ));
        } else if may_match_pii(&r.rule.match_) && guard.is_none_or(|g| i < g) {
            let when = match guard {
                Some(g) => format!(
                    "before the requireLocal rule {} ({}) applies",
                    rules[g].id(),
                    rules[g].place()
                ),
                None => "and no requireLocal rule covers PII".into(),
            };
            out.push(r.finding(
                "pii-fail-open",
                format!(
                    "may send PII requests to remote {} {when}; put the PII requireLocal rule first or add withoutTags: [pii]",
                    remote.join(", ")
                ),
            ));
        }
    }
    if guard.is_none() {
        let (file, line) = set.policies.first().map_or((PathBuf::new(), 0), |p| {
            (p.origin.file.clone(), p.origin.line)
        });
        out.push(Finding {
            severity: Severity::Error,
            check: "pii-fail-open",
            file,
            line,
            object: None,
            message: "no active policy has an unconditional `requireLocal` rule for tag `pii` \
                      (match: {tags: [pii]}); PII would be kept local only by the gateway's built-in guard"
                .into(),
        });
    }
    out
}
