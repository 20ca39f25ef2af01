//! Runs the real `kinfctl` binary on the example policy set and on purpose-made broken sets
//! (`tests/policies-broken/<class>/`, one per class of mistake), checking exit codes and that each
//! mistake is reported with its file and line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn kinfctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kinfctl"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("run kinfctl")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn the_examples_lint_clean() {
    let o = kinfctl(&["lint", "deploy/examples/policies"]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    assert!(stdout(&o).contains("0 error(s)"), "{}", stdout(&o));
}

#[test]
fn the_example_cases_pass() {
    let o = kinfctl(&[
        "test",
        "deploy/examples/policies",
        "--cases",
        "deploy/examples/policy-tests.yaml",
    ]);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(out.contains(" passed, 0 failed"), "{out}");
    assert!(!out.contains("FAIL"), "{out}");
}

#[test]
fn a_wrong_expectation_fails_with_its_line_and_the_explanation() {
    let o = kinfctl(&[
        "test",
        "deploy/examples/policies",
        "--cases",
        "kinference-gateway/tests/policies-broken/failing-cases.yaml",
    ]);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("FAIL kinference-gateway/tests/policies-broken/failing-cases.yaml:7: wrong expectation: outcome: expected burst, got route"),
        "{out}"
    );
    assert!(
        out.contains("local only: the request contains personal data (email)"),
        "{out}"
    );
    assert!(out.contains("1 passed, 1 failed"), "{out}");
}

#[test]
fn explain_shows_the_deciding_rule_and_every_other_rule() {
    let o = kinfctl(&[
        "explain",
        "deploy/examples/policies",
        "--request",
        "deploy/examples/requests/pii-chat.yaml",
        "--state",
        "deploy/examples/requests/saturated.yaml",
    ]);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(out.contains("tags={\"pii\", \"pii:email\"}"), "{out}");
    assert!(
        out.contains("rule cloud-burst/burst-when-queues-are-deep: skipped"),
        "{out}"
    );
    assert!(out.contains("providers are remote"), "{out}");
    assert!(
        !out.contains("provider/cloud-openai"),
        "a PII request must not list a provider: {out}"
    );
    let o = kinfctl(&[
        "explain",
        "deploy/examples/policies",
        "--request",
        "deploy/examples/requests/pii-chat.yaml",
        "--format",
        "json",
    ]);
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert!(json["decision"]["local_only"].is_object(), "{json}");
}

#[test]
fn usage_and_io_errors_exit_2() {
    assert_eq!(
        kinfctl(&["lint", "/no/such/kinference/dir"]).status.code(),
        Some(2)
    );
    assert_eq!(kinfctl(&["frobnicate"]).status.code(), Some(2));
    let o = kinfctl(&[
        "test",
        "deploy/examples/policies",
        "--cases",
        "/no/such/cases.yaml",
    ]);
    assert_eq!(o.status.code(), Some(2));
}

/// Each broken set: (directory, check, file, line, a phrase of the message).
const BROKEN: &[(&str, &str, &str, usize, &str)] = &[
    ("yaml-syntax", "yaml", "policy.yaml", 9, "invalid YAML"),
    (
        "schema-range",
        "schema",
        "policy.yaml",
        13,
        "spec.rules[1].action.reject.status: 200 is below the minimum 400",
    ),
    (
        "objective-range",
        "schema",
        "tenant.yaml",
        9,
        "spec.flowControl.objectives.minTtftMs: 0 is below the minimum 1",
    ),
    (
        "schema-unknown-field",
        "schema",
        "policy.yaml",
        9,
        "spec.rules[0].match.tenant: unknown field",
    ),
    (
        "unknown-reference",
        "unknown-reference",
        "policy.yaml",
        10,
        "unknown InferencePool \"pool-h100\"",
    ),
    (
        "multiple-actions",
        "invalid",
        "policy.yaml",
        7,
        "exactly one of route, reject, burst, requireLocal",
    ),
    (
        "shadowed-rule",
        "shadowed-rule",
        "policy.yaml",
        10,
        "decided first by rule p/everything-general-to-small",
    ),
    (
        "unreachable-rule",
        "unreachable-rule",
        "policy.yaml",
        7,
        "both required and excluded",
    ),
    (
        "conflicting-rules",
        "conflicting-rules",
        "policy.yaml",
        17,
        "both policies have priority 10",
    ),
    (
        "pii-rule-bursts",
        "pii-fail-open",
        "policy.yaml",
        7,
        "matches PII requests but sends them to remote provider/cloud",
    ),
    (
        "pii-burst-before-guard",
        "pii-fail-open",
        "policy.yaml",
        7,
        "before the requireLocal rule guard/pii-local",
    ),
    (
        "pii-no-require-local",
        "pii-fail-open",
        "policy.yaml",
        1,
        "no active policy has an unconditional `requireLocal`",
    ),
];

#[test]
fn every_class_of_mistake_is_caught_with_file_and_line() {
    let mut failures = Vec::new();
    for (dir, check, file, line, phrase) in BROKEN {
        let path = format!("kinference-gateway/tests/policies-broken/{dir}");
        let o = kinfctl(&["lint", &path]);
        let out = stdout(&o);
        let expected = format!("{path}/{file}:{line}: error[{check}]: ");
        let hit = out
            .lines()
            .any(|l| l.starts_with(&expected) && l.contains(phrase));
        if o.status.code() != Some(1) || !hit {
            failures.push(format!("{dir}: expected exit 1 and a line starting {expected:?} containing {phrase:?}; got exit {:?}:\n{out}", o.status.code()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_broken_set_is_listed_in_the_test() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/policies-broken");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .expect("policies-broken")
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = BROKEN.iter().map(|b| b.0.to_string()).collect();
    listed.sort();
    assert_eq!(on_disk, listed);
}

#[test]
fn explain_an_object_offline_shows_its_state_and_conditions() {
    let o = kinfctl(&["explain", "ipool/l4-qwen3-8b", "deploy/examples/policies"]);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(out.contains("InferencePool/l4-qwen3-8b"), "{out}");
    assert!(out.contains("state: Accepted"), "{out}");
    assert!(out.contains("Ready      True"), "{out}");

    let o = kinfctl(&[
        "explain",
        "InferencePolicy/p",
        "kinference-gateway/tests/policies-broken/unknown-reference",
        "--format",
        "json",
    ]);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    let json: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(json[0]["state"], "Rejected", "{out}");
    let accepted = &json[0]["conditions"][0];
    assert_eq!(accepted["type"], "Accepted");
    assert_eq!(accepted["status"], "False");
    assert!(
        accepted["message"]
            .as_str()
            .is_some_and(|m| m.contains("pool-h100")),
        "{out}"
    );

    // What the flow-control and objective fields do, in words.
    let o = kinfctl(&["explain", "itenant/acme", "deploy/examples/policies"]);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    for line in [
        "flow control:",
        "band medium",
        "weight 2:",
        "queue deadline: its band's (--flow-deadline-ms)",
        "may only lower its band",
        "TTFT no tighter than 100 ms",
        "the plan's next pool estimated to meet it, or its next provider",
    ] {
        assert!(out.contains(line), "{line:?} in {out}");
    }
    let o = kinfctl(&["explain", "itenant/trial", "deploy/examples/policies"]);
    assert!(
        stdout(&o).contains("latency objectives: not allowed"),
        "{}",
        stdout(&o)
    );
    let o = kinfctl(&["explain", "ipool/l4-qwen3-8b", "deploy/examples/policies"]);
    assert!(stdout(&o).contains("scheduling Fcfs"), "{}", stdout(&o));

    let o = kinfctl(&["explain", "pod/x", "deploy/examples/policies"]);
    assert_eq!(o.status.code(), Some(2));
    let o = kinfctl(&["explain", "ipol/none", "deploy/examples/policies"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn a_misspelt_key_in_a_cases_file_names_its_position_and_the_nearest_key() {
    let cases = std::env::temp_dir().join(format!("kinfctl-typo-{}.yaml", std::process::id()));
    std::fs::write(
        &cases,
        "cases:\n  - name: typo\n    request:\n      body: {model: m}\n    expct: {outcome: route}\n",
    )
    .expect("write cases");
    let o = kinfctl(&[
        "test",
        "deploy/examples/policies",
        "--cases",
        cases.to_str().expect("utf-8 path"),
    ]);
    let _ = std::fs::remove_file(&cases);
    let all = format!("{}{}", stdout(&o), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(2), "{all}");
    assert!(
        all.contains(&format!(
            "unknown key `expct` at {}:5:5; did you mean `expect`?",
            cases.display()
        )),
        "{all}"
    );
}

#[test]
fn serves_messages_on_a_model_lints_clean_and_a_misspelling_names_the_key() {
    let dir = std::env::temp_dir().join(format!("kinfctl-messages-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let pool = "apiVersion: kinference.ai/v1alpha1\nkind: InferencePool\nmetadata: {name: pool}\n\
        spec:\n  models: [chat]\n  gpuClass: l4\n  endpoints: [{url: \"http://127.0.0.1:8001\"}]\n  \
        prices: {cachedInputPerMillion: 0.0, uncachedInputPerMillion: 0.1, outputPerMillion: 0.2}\n";
    std::fs::write(dir.join("pool.yaml"), pool).expect("write pool");
    std::fs::copy(
        repo().join("kinference-gateway/tests/policies-broken/schema-unknown-field/guard.yaml"),
        dir.join("guard.yaml"),
    )
    .expect("copy guard");
    let model = |key: &str| {
        format!(
            "apiVersion: kinference.ai/v1alpha1\nkind: InferenceModel\nmetadata: {{name: chat}}\n\
             spec:\n  servedName: org/chat\n  {key}: true\n"
        )
    };
    let lint = |key: &str| {
        std::fs::write(dir.join("model.yaml"), model(key)).expect("write model");
        kinfctl(&["lint", dir.to_str().expect("utf-8 path")])
    };
    let clean = lint("servesMessages");
    let misspelt = lint("servesMessage");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(clean.status.code(), Some(0), "{}", stdout(&clean));
    let out = stdout(&misspelt);
    assert_eq!(misspelt.status.code(), Some(1), "{out}");
    assert!(
        out.lines()
            .any(|l| l.contains("model.yaml:6:") && l.contains("did you mean `servesMessages`?")),
        "{out}"
    );
}
