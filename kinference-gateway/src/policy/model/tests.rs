use std::collections::BTreeMap;
use std::path::Path;

use super::{ApplyState, ObjectKey, PolicySet, Requested};
use crate::policy::engine::tests::{POLICIES, RESOURCES, set_from};
use crate::policy::source::parse_file;

fn key(kind: &'static str, name: &str) -> ObjectKey {
    ObjectKey {
        kind,
        name: name.to_string(),
    }
}

#[test]
fn names_aliases_and_classes_resolve() {
    let set = set_from(&[RESOURCES]);
    assert_eq!(set.resolve("small"), Requested::Model("small".into()));
    assert_eq!(set.resolve("org/large"), Requested::Model("large".into()));
    assert_eq!(set.resolve("s"), Requested::Model("small".into()));
    assert_eq!(set.resolve("coding"), Requested::Class("coding".into()));
    assert_eq!(set.resolve("nope"), Requested::Unknown("nope".into()));
}

#[test]
fn policies_are_ordered_by_priority_then_name() {
    let set = set_from(&[RESOURCES, POLICIES]);
    let names: Vec<&str> = set.policies.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["guard", "burst", "semantic"]);
}

const BAD_POLICY: &str = r#"
apiVersion: kinference.ai/v1alpha1
kind: InferencePolicy
metadata: {name: semantic}
spec:
  priority: 20
  rules:
    - name: to-nowhere
      action: {route: {targets: [{pool: no-such-pool}]}}
"#;

#[test]
fn an_invalid_policy_is_rolled_back_and_others_still_apply() {
    let first = set_from(&[RESOURCES, POLICIES]);
    let mut manifests = parse_file(Path::new("a.yaml"), RESOURCES).manifests;
    manifests.extend(
        parse_file(Path::new("b.yaml"), POLICIES)
            .manifests
            .into_iter()
            .filter(|m| m.name != "semantic"),
    );
    manifests.extend(parse_file(Path::new("c.yaml"), BAD_POLICY).manifests);
    let out = PolicySet::build(&manifests, Some(&first), &BTreeMap::new());
    assert!(matches!(
        out.states[&key("InferencePolicy", "semantic")],
        ApplyState::RolledBack { .. }
    ));
    assert_eq!(
        out.states[&key("InferencePolicy", "guard")],
        ApplyState::Applied
    );
    let serving = out
        .set
        .policies
        .iter()
        .find(|p| p.name == "semantic")
        .expect("previous version");
    assert_eq!(serving.spec.rules[0].name, "simple-cheap");
    assert!(
        out.problems[0]
            .message
            .contains("unknown InferencePool \"no-such-pool\""),
        "{:?}",
        out.problems
    );
    // Without a previous version it is rejected and absent.
    let out = PolicySet::build(&manifests, None, &BTreeMap::new());
    assert!(matches!(
        out.states[&key("InferencePolicy", "semantic")],
        ApplyState::Rejected { .. }
    ));
    assert!(out.set.policies.iter().all(|p| p.name != "semantic"));
}

#[test]
fn duplicates_and_multiple_actions_are_invalid() {
    let dup = format!(
        "{POLICIES}\n---\n{}",
        POLICIES.split("---").next().unwrap_or_default()
    );
    let mut manifests = parse_file(Path::new("a.yaml"), RESOURCES).manifests;
    manifests.extend(parse_file(Path::new("b.yaml"), &dup).manifests);
    let out = PolicySet::build(&manifests, None, &BTreeMap::new());
    assert!(
        out.problems
            .iter()
            .any(|p| p.message.contains("duplicate InferencePolicy/guard")),
        "{:?}",
        out.problems
    );
    let two = POLICIES.replace(
        "action: {requireLocal: {}}",
        "action: {requireLocal: {}, reject: {status: 403, message: x}}",
    );
    let mut manifests = parse_file(Path::new("a.yaml"), RESOURCES).manifests;
    manifests.extend(parse_file(Path::new("b.yaml"), &two).manifests);
    let out = PolicySet::build(&manifests, None, &BTreeMap::new());
    assert!(
        out.problems
            .iter()
            .any(|p| p.message.contains("exactly one of") && p.line == 8),
        "{:?}",
        out.problems
    );
}
