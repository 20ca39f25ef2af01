use std::path::Path;

use super::{Finding, lint_set};
use crate::policy::engine::tests::{POLICIES, RESOURCES, set_from};

fn lint(policies: &str) -> Vec<Finding> {
    lint_set(&set_from(&[RESOURCES, policies]))
}

fn checks(findings: &[Finding]) -> Vec<&'static str> {
    findings.iter().map(|f| f.check).collect()
}

const GUARD: &str = "apiVersion: kinference.ai/v1alpha1\nkind: InferencePolicy\nmetadata: {name: guard}\nspec:\n  priority: 0\n  rules:\n    - name: pii-local\n      match: {tags: [pii]}\n      action: {requireLocal: {}}\n";

fn policy(name: &str, priority: i32, rules: &str) -> String {
    format!(
        "apiVersion: kinference.ai/v1alpha1\nkind: InferencePolicy\nmetadata: {{name: {name}}}\nspec:\n  priority: {priority}\n  rules:\n{rules}"
    )
}

#[test]
fn the_fixture_is_clean() {
    assert!(lint(POLICIES).is_empty(), "{:?}", lint(POLICIES));
}

#[test]
fn shadowed_rules_are_found_with_their_line() {
    let p = policy(
        "p",
        5,
        "    - name: all-small\n      action: {route: {targets: [{pool: pool-small}]}}\n    - name: coding\n      match: {classes: [coding]}\n      action: {route: {targets: [{pool: pool-large}]}}\n",
    );
    let f = lint(&format!("{GUARD}---\n{p}"));
    assert_eq!(checks(&f), ["shadowed-rule"], "{f:?}");
    assert_eq!(f[0].line, 19);
    assert_eq!(f[0].file, Path::new("t1.yaml"));
    assert!(f[0].message.contains("p/all-small"));
}

#[test]
fn contradictory_rules_are_unreachable() {
    let p = policy(
        "p",
        5,
        "    - name: never\n      match: {tags: [batch], withoutTags: [batch]}\n      action: {reject: {status: 400, message: x}}\n",
    );
    assert_eq!(
        checks(&lint(&format!("{GUARD}---\n{p}"))),
        ["unreachable-rule"]
    );
}

#[test]
fn equal_priority_overlaps_conflict() {
    let a = policy(
        "a",
        5,
        "    - name: to-small\n      match: {classes: [general]}\n      action: {route: {targets: [{pool: pool-small}]}}\n",
    );
    let b = policy(
        "b",
        5,
        "    - name: refuse\n      match: {tenants: [acme]}\n      action: {reject: {status: 403, message: no}}\n",
    );
    assert_eq!(
        checks(&lint(&format!("{GUARD}---\n{a}---\n{b}"))),
        ["conflicting-rules"]
    );
    let b2 = b.replace("priority: 5", "priority: 6");
    assert!(lint(&format!("{GUARD}---\n{a}---\n{b2}")).is_empty());
}

#[test]
fn pii_fail_open_is_caught() {
    // A rule for PII that bursts.
    let p = policy(
        "p",
        5,
        "    - name: pii-burst\n      match: {tags: [pii]}\n      action: {burst: {providers: [cloud], when: {queueDepthAbove: 1}}}\n",
    );
    let f = lint(&format!("{GUARD}---\n{p}"));
    assert_eq!(checks(&f), ["pii-fail-open"], "{f:?}");
    // A burst before the guard.
    let early = policy(
        "early",
        -1,
        "    - name: burst\n      action: {burst: {providers: [cloud], when: {queueDepthAbove: 1}}}\n",
    );
    let f = lint(&format!("{GUARD}---\n{early}"));
    assert_eq!(checks(&f), ["pii-fail-open"], "{f:?}");
    assert!(
        f[0].message
            .contains("before the requireLocal rule guard/pii-local")
    );
    // ... unless it excludes PII.
    let excl = early.replace(
        "    - name: burst\n",
        "    - name: burst\n      match: {withoutTags: [pii]}\n",
    );
    assert!(lint(&format!("{GUARD}---\n{excl}")).is_empty());
    // No guard at all.
    let f = lint(&policy(
        "p",
        5,
        "    - name: r\n      match: {tenants: [acme]}\n      action: {route: {targets: [{pool: pool-small}]}}\n",
    ));
    assert_eq!(checks(&f), ["pii-fail-open"]);
    assert!(f[0].message.contains("no active policy"));
}
