//! The generated CRDs against a real kube-apiserver (v1.20, built by
//! `tests/kube-apiserver/build.sh`): they apply and become Established, the example policy set is
//! accepted, invalid objects are rejected by the server's schema, and the status subresource and
//! printer columns work.
//!
//! Runs only with `KINFERENCE_TEST_APISERVER=1` (it builds the apiserver on first use, minutes);
//! otherwise it says it was skipped.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kube-apiserver")
}

/// etcd + kube-apiserver started by `start.sh`; stopped (and its directory removed) on drop.
struct Apiserver {
    dir: PathBuf,
    kubeconfig: String,
}

impl Drop for Apiserver {
    fn drop(&mut self) {
        let pids: Vec<String> = ["apiserver.pid", "etcd.pid"]
            .iter()
            .filter_map(|f| std::fs::read_to_string(self.dir.join(f)).ok())
            .map(|p| p.trim().to_string())
            .collect();
        let _ = Command::new("bash")
            .arg(scripts().join("stop.sh"))
            .arg(&self.dir)
            .status();
        // The apiserver shuts down gracefully for a few seconds: wait for it, then kill what
        // this test started (by pid) if it is still there.
        for pid in &pids {
            let proc_dir = Path::new("/proc").join(pid);
            // A zombie (state Z) has exited; only its parent can reap it.
            let alive = || {
                std::fs::read_to_string(proc_dir.join("stat")).is_ok_and(|st| {
                    st.rsplit(')')
                        .next()
                        .is_some_and(|r| !r.trim_start().starts_with('Z'))
                })
            };
            for _ in 0..100 {
                if !alive() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            if alive() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn port_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// A port P with P, P-4064 and P-4063 free (start.sh puts etcd on the latter two).
fn free_port() -> u16 {
    let seed = std::process::id() as u16 % 2000;
    (0..2000u16)
        .map(|i| 20000 + (seed + i) % 20000)
        .find(|p| port_free(*p) && port_free(p - 4064) && port_free(p - 4063))
        .expect("no free port triple")
}

fn start() -> Apiserver {
    let build = Command::new("bash")
        .arg(scripts().join("build.sh"))
        .output()
        .expect("build.sh");
    assert!(
        build.status.success(),
        "build.sh failed: {}",
        String::from_utf8_lossy(&build.stderr)
    );
    let dir = std::env::temp_dir().join(format!("kinference-apiserver-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let port = free_port();
    let out = Command::new("bash")
        .arg(scripts().join("start.sh"))
        .arg(&dir)
        .arg(port.to_string())
        .output()
        .expect("start.sh");
    // Construct the guard first so a failed start still stops what did start.
    let server = Apiserver {
        dir,
        kubeconfig: String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .unwrap_or_default()
            .to_string(),
    };
    assert!(
        out.status.success(),
        "start.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    server
}

impl Apiserver {
    fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Output {
        use std::io::Write;
        let mut cmd = Command::new("kubectl");
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .current_dir(repo());
        cmd.stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().expect("kubectl");
        if let Some(mut pipe) = child.stdin.take() {
            let _ = pipe.write_all(stdin.unwrap_or_default().as_bytes());
        }
        child.wait_with_output().expect("kubectl output")
    }
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
    if std::env::var("KINFERENCE_TEST_APISERVER").as_deref() != Ok("1") {
        eprintln!(
            "SKIPPED: set KINFERENCE_TEST_APISERVER=1 to run the CRDs against a real kube-apiserver"
        );
        return;
    }
    let server = start();
    let crds: Vec<String> = kinference_crds::all_crds()
        .iter()
        .map(|(f, _)| format!("crds/{f}"))
        .collect();
    let mut args = vec!["apply"];
    for c in &crds {
        args.extend(["-f", c.as_str()]);
    }
    let o = server.kubectl(&args, None);
    assert!(o.status.success(), "applying CRDs: {}", text(&o));
    let mut wait = vec!["wait", "--for=condition=Established", "--timeout=60s"];
    let names: Vec<String> = kinference_crds::all_crds()
        .iter()
        .map(|(_, crd)| format!("crd/{}", crd.metadata.name.as_deref().unwrap_or_default()))
        .collect();
    wait.extend(names.iter().map(String::as_str));
    let o = server.kubectl(&wait, None);
    assert!(o.status.success(), "waiting for Established: {}", text(&o));

    // Right after Established, discovery may not list the new kinds yet: retry briefly.
    let mut o = server.kubectl(&["apply", "-f", "deploy/examples/policies/"], None);
    for _ in 0..20 {
        if o.status.success() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
        o = server.kubectl(&["apply", "-f", "deploy/examples/policies/"], None);
    }
    assert!(o.status.success(), "applying the examples: {}", text(&o));
    let o = server.kubectl(
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
        let o = server.kubectl(&["create", "-f", "-"], Some(&doc));
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
    let patch = r#"{"status":{"observedGeneration":1,"conditions":[{"type":"Active","status":"True","reason":"Applied","message":"serving"}]}}"#;
    let o = server.kubectl(
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
    let o = server.kubectl(&["get", "inferencepolicy", "tenancy"], None);
    let table = text(&o);
    assert!(
        table.contains("PRIORITY") && table.contains("ACTIVE"),
        "{table}"
    );
    assert!(
        table.lines().nth(1).is_some_and(|l| l.contains("True")),
        "{table}"
    );
}
