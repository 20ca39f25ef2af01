use std::path::{Path, PathBuf};

use super::{load_dir, parse_file};
use crate::policy::engine::tests::{POLICIES, RESOURCES};
use crate::policy::model::{ApplyState, ObjectKey};

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p =
            std::env::temp_dir().join(format!("kinference-policy-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("mkdir");
        TempDir(p)
    }
    fn write(&self, name: &str, text: &str) {
        std::fs::write(self.0.join(name), text).expect("write");
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn yaml_errors_carry_file_and_line() {
    let text = "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {name: a}\nspec:\n  apiKeys: [\n---\n";
    let parsed = parse_file(Path::new("t.yaml"), text);
    assert_eq!(parsed.problems.len(), 1, "{:?}", parsed.problems);
    assert_eq!(parsed.problems[0].check, "yaml");
    assert!(parsed.problems[0].line >= 5, "{:?}", parsed.problems[0]);
    assert!(parsed.unreadable);
}

#[test]
fn schema_errors_point_at_the_field_line_and_rule_lines_are_recorded() {
    let text = "# comment\n---\napiVersion: kinference.ai/v1alpha1\nkind: InferencePolicy\nmetadata: {name: p}\nspec:\n  priority: 1\n  rules:\n    - name: a\n      action: {requireLocal: {}}\n    - name: b\n      action:\n        reject:\n          status: 200\n          message: x\n";
    let parsed = parse_file(Path::new("t.yaml"), text);
    assert_eq!(parsed.problems.len(), 1, "{:?}", parsed.problems);
    assert_eq!(parsed.problems[0].line, 14, "{:?}", parsed.problems[0]);
    assert_eq!(
        parsed.problems[0]
            .object
            .as_ref()
            .map(ToString::to_string)
            .as_deref(),
        Some("InferencePolicy/p")
    );
    let fixed = text.replace("status: 200", "status: 403");
    let parsed = parse_file(Path::new("t.yaml"), &fixed);
    assert_eq!(parsed.manifests[0].origin.rule_lines, [9, 11]);
    assert_eq!(parsed.manifests[0].origin.line, 3);
}

#[test]
fn other_api_groups_are_ignored() {
    let text = "apiVersion: v1\nkind: Secret\nmetadata: {name: s}\n";
    let parsed = parse_file(Path::new("t.yaml"), text);
    assert!(parsed.problems.is_empty() && parsed.manifests.is_empty());
}

#[test]
fn a_broken_file_keeps_the_previous_versions_of_its_objects() {
    let dir = TempDir::new("rollback");
    dir.write("resources.yaml", RESOURCES);
    dir.write("policies.yaml", POLICIES);
    let first = load_dir(&dir.0, None).expect("load");
    assert!(first.problems.is_empty() && first.outcome.problems.is_empty());
    dir.write("policies.yaml", "apiVersion: [broken\n");
    let second = load_dir(&dir.0, Some(&first.outcome.set)).expect("load");
    assert_eq!(second.outcome.set.policies.len(), 3);
    let key = ObjectKey {
        kind: "InferencePolicy",
        name: "burst".into(),
    };
    assert!(matches!(
        second.outcome.states[&key],
        ApplyState::RolledBack { .. }
    ));
}

#[test]
fn a_misspelt_key_in_a_policy_or_tenant_file_names_its_line_and_the_nearest_key() {
    let text = "apiVersion: kinference.ai/v1alpha1\nkind: InferencePolicy\nmetadata: {name: p}\nspec:\n  priorty: 1\n  rules: [{name: r, action: {requireLocal: {}}}]\n---\napiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {name: t, labels: {team: a}}\nstatus: {observedGeneration: 1}\nspec:\n  apiKeys: [{env: K}]\n  allowedModel: [m]\n";
    let parsed = parse_file(Path::new("p.yaml"), text);
    let problems: Vec<String> = parsed.problems.iter().map(ToString::to_string).collect();
    // The misspelt key is also a missing required one.
    assert_eq!(problems.len(), 3, "{problems:?}");
    assert_eq!(
        problems[1],
        "p.yaml:5: InferencePolicy/p: spec.priorty: unknown field `priorty`; did you mean `priority`?"
    );
    // `metadata` and `status` stay accepted on the objects; only the spec's key is refused.
    assert_eq!(
        problems[2],
        "p.yaml:14: InferenceTenant/t: spec.allowedModel: unknown field `allowedModel`; did you mean `allowedModels`?"
    );
}
