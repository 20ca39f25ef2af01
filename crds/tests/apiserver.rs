//! The generated CRDs against a real kube-apiserver (v1.20, built by
//! `deploy/tests/kube-apiserver/build.sh`): they apply and become Established, the example policy set is
//! accepted, invalid objects are rejected by the server's schema, and the status subresource and
//! printer columns work.
//!
//! Runs only with `KINFERENCE_TEST_APISERVER=1` (it builds the apiserver on first use, minutes);
//! otherwise it says it was skipped (and fails under `CI=true`).

use std::process::{Command, Output};

use testkit::Apiserver;

fn kubectl(server: &Apiserver, args: &[&str], stdin: Option<&str>) -> Output {
    use std::io::Write;
    let mut cmd = Command::new("kubectl");
    cmd.arg("--kubeconfig")
        .arg(server.kubeconfig())
        .args(args)
        .current_dir(testkit::repo_root());
    cmd.stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("kubectl");
    if let Some(mut pipe) = child.stdin.take() {
        let _ = pipe.write_all(stdin.unwrap_or_default().as_bytes());
    }
    child.wait_with_output().expect("kubectl output")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Invalid objects and a phrase the server's rejection must contain.
const INVALID: &[(&str, &str)] = &[
    (
        "kind: InferencePolicy\nmetadata: {name: bad-status}\nspec:\n  priority: 1\n  rules:\n    - name: r\n      action: {reject: {status: 200, message: x}}\n",
        "status",
    ),
    (
        "kind: InferencePolicy\nmetadata: {name: no-rules}\nspec:\n  priority: 1\n",
        "rules",
    ),
    (
        "kind: InferencePolicy\nmetadata: {name: bad-fraction}\nspec:\n  priority: 1\n  rules:\n    - name: r\n      action: {burst: {providers: [p], when: {kvCacheUsageAbove: 1.5}}}\n",
        "kvCacheUsageAbove",
    ),
    (
        "kind: InferenceProvider\nmetadata: {name: bad-style}\nspec:\n  baseUrl: https://x.invalid\n  apiStyle: Grpc\n  credentials: {env: K}\n  models: [{name: m}]\n",
        "apiStyle",
    ),
    (
        "kind: InferenceProvider\nmetadata: {name: bad-url}\nspec:\n  baseUrl: ftp-nope\n  apiStyle: OpenAI\n  credentials: {env: K}\n  models: [{name: m}]\n",
        "baseUrl",
    ),
    (
        "kind: InferencePool\nmetadata: {name: no-models}\nspec:\n  models: []\n  gpuClass: l4\n  prices: {cachedInputPerMillion: 0, uncachedInputPerMillion: 1, outputPerMillion: 1}\n",
        "models",
    ),
    (
        "kind: InferenceTenant\nmetadata: {name: no-keys}\nspec: {}\n",
        "apiKeys",
    ),
];

#[test]
fn crds_apply_examples_are_accepted_and_invalid_objects_rejected() {
    let Some(server) = Apiserver::start("crds") else {
        return;
    };
    let crds: Vec<String> = kinference_crds::all_crds()
        .iter()
        .map(|(f, _)| format!("crds/{f}"))
        .collect();
    let mut args = vec!["apply"];
    for c in &crds {
        args.extend(["-f", c.as_str()]);
    }
    let o = kubectl(&server, &args, None);
    assert!(o.status.success(), "applying CRDs: {}", text(&o));
    let mut wait = vec!["wait", "--for=condition=Established", "--timeout=60s"];
    let names: Vec<String> = kinference_crds::all_crds()
        .iter()
        .map(|(_, crd)| format!("crd/{}", crd.metadata.name.as_deref().unwrap_or_default()))
        .collect();
    wait.extend(names.iter().map(String::as_str));
    let o = kubectl(&server, &wait, None);
    assert!(o.status.success(), "waiting for Established: {}", text(&o));

    // Right after Established, discovery may not list the new kinds yet: retry briefly.
    let mut o = kubectl(&server, &["apply", "-f", "deploy/examples/policies/"], None);
    for _ in 0..20 {
        if o.status.success() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
        o = kubectl(&server, &["apply", "-f", "deploy/examples/policies/"], None);
    }
    assert!(o.status.success(), "applying the examples: {}", text(&o));
    let o = kubectl(
        &server,
        &[
            "get",
            "inferencepolicies,inferencepools,inferencemodels,inferenceproviders,inferencetenants",
            "-o",
            "name",
        ],
        None,
    );
    assert_eq!(text(&o).lines().count(), 11, "{}", text(&o));

    for (manifest, phrase) in INVALID {
        let doc = format!("apiVersion: kinference.ai/v1alpha1\n{manifest}");
        let o = kubectl(&server, &["create", "-f", "-"], Some(&doc));
        assert!(!o.status.success(), "accepted an invalid object:\n{doc}");
        assert!(
            text(&o).contains(phrase),
            "rejection of\n{doc}\nshould mention {phrase:?}: {}",
            text(&o)
        );
        // And kinfctl's offline schema check agrees.
        let value: serde_json::Value = serde_yaml::from_str(&doc).expect("yaml");
        let kind = value["kind"].as_str().unwrap_or_default();
        assert!(
            !kinference_crds::schema::validate(kind, &value).is_empty(),
            "offline check accepted\n{doc}"
        );
    }

    // Status subresource and printer columns.
    let patch = r#"{"status":{"observedGeneration":1,"conditions":[{"type":"Ready","status":"True","reason":"Serving","message":"serving"}]}}"#;
    let o = kubectl(
        &server,
        &[
            "patch",
            "inferencepolicy",
            "tenancy",
            "--subresource=status",
            "--type=merge",
            "-p",
            patch,
        ],
        None,
    );
    assert!(o.status.success(), "status patch: {}", text(&o));
    let o = kubectl(&server, &["get", "inferencepolicy", "tenancy"], None);
    let table = text(&o);
    assert!(
        table.contains("PRIORITY") && table.contains("READY") && table.contains("ROLLEDBACK"),
        "{table}"
    );
    assert!(
        table.lines().nth(1).is_some_and(|l| l.contains("True")),
        "{table}"
    );
}
