use super::*;

#[test]
fn ci_turns_a_skip_into_a_failure() {
    // `set_var` is unsafe with threads around: run the probe in child processes with their own `CI`.
    let exe = std::env::current_exe().expect("exe");
    let run = |ci: Option<&str>| {
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(["--exact", "prereq::tests::skip_probe", "--nocapture"])
            .env("TESTKIT_SKIP_PROBE", "1");
        match ci {
            Some(v) => cmd.env("CI", v),
            None => cmd.env_remove("CI"),
        };
        cmd.output().expect("run probe")
    };
    let local = run(None);
    assert!(local.status.success(), "{local:?}");
    assert!(String::from_utf8_lossy(&local.stderr).contains("SKIPPED: widget missing: build it"));
    let off = run(Some("false"));
    assert!(off.status.success(), "{off:?}");
    let ci = run(Some("true"));
    assert!(!ci.status.success(), "{ci:?}");
    let out = String::from_utf8_lossy(&ci.stdout) + String::from_utf8_lossy(&ci.stderr);
    assert!(
        out.contains("missing prerequisite under CI=true: widget: build it"),
        "{out}"
    );
}

/// Runs only as the child of the test above.
#[test]
fn skip_probe() {
    if std::env::var_os("TESTKIT_SKIP_PROBE").is_none() {
        return;
    }
    assert!(require(true, "present", "never printed"));
    assert!(!require(false, "widget", "build it"));
}
