//! `cargo xtask demo` and `cargo xtask test`: the two commands the README gives.

use crate::setup::{self, run_checked, step};
use anyhow::bail;
use std::path::{Path, PathBuf};
use std::process::Command;
use testkit::repo_root;

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Extra arguments passed to the demo binary (see `target/release/demo --help`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub demo_args: Vec<String>,
}

#[derive(clap::Args)]
pub struct TestArgs {
    /// Skip `cargo xtask build-ebpf` (the kernel-level tests then say they were skipped). Refused under
    /// `CI=true`, where a skipped test is a failed one.
    #[arg(long)]
    pub no_ebpf: bool,
    /// Run only the Rust tests.
    #[arg(long)]
    pub rust_only: bool,
    /// Run only the Python end-to-end tests (binaries must already be built).
    #[arg(long)]
    pub python_only: bool,
}

/// The pytest plugin (in `testkit/python/`) that turns every skip into a failure under `CI=true`.
const PYTEST_CI_PLUGIN: &str = "kinference_ci";

/// Python end-to-end test folders, relative to the repository root.
const PYTHON_TEST_DIRS: &[&str] = &[
    "kinference-gateway/tests/sdk",
    "bench/tests/python",
    "deploy/tests",
];

pub fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let root = repo_root();
    let tokenizer = setup::tokenizer()?;
    step("building the simulator, agent, gateway and demo (release)");
    run_checked(cargo(&root).args([
        "build",
        "--release",
        "-p",
        "kinference-bench",
        "-p",
        "kinference-agent",
        "-p",
        "kinference-gateway",
        "--bins",
    ]))?;
    let bin_dir = target_dir(&root).join("release");
    step("running the demo");
    run_checked(
        Command::new(bin_dir.join("demo"))
            .args(&args.demo_args)
            .current_dir(&root)
            .env("KINFERENCE_TOKENIZER_DIR", &tokenizer)
            .env("KINFERENCE_BIN_DIR", &bin_dir),
    )
}

pub fn test(args: TestArgs) -> anyhow::Result<()> {
    let root = repo_root();
    let ci = testkit::in_ci();
    if ci && args.no_ebpf {
        bail!("--no-ebpf under CI=true would skip the eBPF tests; CI must run them");
    }
    let prepared = setup::run()?;
    let bin_dir = target_dir(&root).join("debug");
    let mut failures = Vec::new();

    if !args.python_only {
        if !args.no_ebpf {
            step("building the eBPF object (cargo xtask build-ebpf)");
            // A machine that cannot build eBPF still runs every other test; the eBPF tests then
            // report that the object is missing and skip that part only. Not in CI: there it fails.
            if let Err(e) = run_checked(cargo(&root).args(["xtask", "build-ebpf"])) {
                if ci {
                    bail!("eBPF object not built under CI=true: {e:#}");
                }
                eprintln!("warning: eBPF object not built: {e:#}");
            }
        }
        step("building every binary");
        run_checked(cargo(&root).args(["build", "--workspace", "--bins"]))?;
        step("running the Rust tests");
        if let Err(e) = run_checked(
            cargo(&root)
                .args(["test", "--workspace", "--no-fail-fast"])
                .env("KINFERENCE_TOKENIZER_DIR", &prepared.tokenizer_dir)
                .env("KINFERENCE_BIN_DIR", &bin_dir),
        ) {
            failures.push(format!("Rust tests: {e:#}"));
        }
    }

    if !args.rust_only {
        let dirs: Vec<&str> = PYTHON_TEST_DIRS
            .iter()
            .copied()
            .filter(|d| root.join(d).is_dir())
            .collect();
        if !dirs.is_empty() {
            step(&format!(
                "running the Python end-to-end tests: {}",
                dirs.join(" ")
            ));
            let plugins = root.join("testkit/python");
            let python_path = match std::env::var_os("PYTHONPATH") {
                Some(old) if !old.is_empty() => {
                    let mut paths = vec![plugins];
                    paths.extend(std::env::split_paths(&old));
                    std::env::join_paths(paths)?
                }
                _ => plugins.into_os_string(),
            };
            // `-rs` lists every skip with its reason; the plugin fails them under CI=true.
            let status = Command::new(&prepared.python)
                .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"])
                .args(["-p", PYTEST_CI_PLUGIN])
                .args(&dirs)
                .env("PYTHONPATH", python_path)
                .current_dir(&root)
                .env("KINFERENCE_TOKENIZER_DIR", &prepared.tokenizer_dir)
                .env("KINFERENCE_BIN_DIR", &bin_dir)
                .env("PYTHONUNBUFFERED", "1")
                .status()?;
            // pytest exits 5 when it collected nothing: that is a failure of the suite, not a pass.
            if !status.success() {
                failures.push(format!("Python end-to-end tests: pytest {status}"));
            }
        }
    }

    if failures.is_empty() {
        step("all tests passed");
        Ok(())
    } else {
        bail!("test failures:\n  {}", failures.join("\n  "))
    }
}

/// Cargo's target directory: `CARGO_TARGET_DIR` when set, else `target/` in the repository.
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
}

fn cargo(root: &Path) -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root);
    cmd
}
