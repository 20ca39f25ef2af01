//! `cargo xtask build-ebpf`: builds the eBPF object that the agent embeds.
//!
//! The program crate (`kinference-ebpf/`, its own cargo workspace) builds with a pinned nightly for
//! `bpfel-unknown-none` and links with `bpf-linker` (LLVM 22). This task finds those pieces, installs what
//! is missing when it can (nightly's `rust-src`, LLVM 22 through apt when root, bpf-linker through
//! `cargo install`), says exactly what is missing when it cannot, builds, and copies the object to
//! `target/ebpf/kinference.bpf.o`, where the agent's build script picks it up.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use testkit::repo_root;

/// Where the object lands; the agent's build.rs reads the same path (or `KINFERENCE_EBPF_OBJECT`).
pub const OBJECT_RELATIVE: &str = "target/ebpf/kinference.bpf.o";
const BPF_LINKER_VERSION: &str = "0.13.0";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
const LLVM_APT_PACKAGES: [&str; 2] = ["llvm-22-dev", "libpolly-22-dev"];
/// The nightly that builds the program, pinned: rustc's LLVM must be the one bpf-linker links (22), and a
/// floating `nightly` moves to LLVM 23 (bpf-linker then fails with "Invalid record"). `rustup toolchain
/// install nightly` elsewhere (the fuzz step) no longer changes the eBPF build.
const NIGHTLY: &str = "nightly-2026-06-15";

#[derive(clap::Args)]
pub struct BuildArgs {
    /// Only check for the toolchain pieces; never install anything (report what is missing instead).
    #[arg(long)]
    no_install: bool,
    /// Where to copy the object (default: $KINFERENCE_EBPF_OBJECT, else <target dir>/ebpf/kinference.bpf.o).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn build(args: BuildArgs) -> anyhow::Result<()> {
    let root = repo_root();
    let mut missing = Vec::new();
    ensure_nightly(&args, &mut missing)?;
    ensure_bpf_linker(&args, &mut missing)?;
    if !missing.is_empty() {
        bail!(
            "build-ebpf: cannot build the eBPF object; missing:\n  - {}",
            missing.join("\n  - ")
        );
    }

    let crate_dir = root.join("kinference-ebpf");
    let arch = bpf_target_arch();
    eprintln!(
        "build-ebpf: building {} (bpf_target_arch={arch})",
        crate_dir.display()
    );
    let mut cmd = Command::new("cargo");
    cmd.current_dir(&crate_dir)
        .args([
            &format!("+{NIGHTLY}"),
            "build",
            "-Z",
            "build-std=core",
            "--target",
            "bpfel-unknown-none",
            "--release",
        ])
        .env(
            "RUSTFLAGS",
            format!("--cfg=bpf_target_arch=\"{arch}\" -C debuginfo=2 -C link-arg=--btf"),
        )
        .env("PATH", path_with_cargo_bin());
    // The outer `cargo xtask` runs on stable and exports its own settings; none of them apply to this build.
    for var in [
        "RUSTUP_TOOLCHAIN",
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_RUSTFLAGS",
    ] {
        cmd.env_remove(var);
    }
    run(&mut cmd).context("building kinference-ebpf")?;

    let built = crate_dir.join("target/bpfel-unknown-none/release/kinference");
    let out = args
        .out
        .or_else(|| std::env::var_os("KINFERENCE_EBPF_OBJECT").map(PathBuf::from))
        .unwrap_or_else(|| default_object(&root));
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::copy(&built, &out)
        .with_context(|| format!("copying {} to {}", built.display(), out.display()))?;
    let size = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
    eprintln!("build-ebpf: wrote {} ({size} bytes)", out.display());
    eprintln!("build-ebpf: rebuild the agent (`cargo build -p kinference-agent`) to embed it");
    Ok(())
}

/// `$CARGO_TARGET_DIR/ebpf/kinference.bpf.o` when set (relative to the repository root), else
/// `target/ebpf/kinference.bpf.o`; the agent's build.rs computes the same path.
fn default_object(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => root.join(dir).join("ebpf/kinference.bpf.o"),
        None => root.join(OBJECT_RELATIVE),
    }
}

/// The `bpf_target_arch` cfg aya-ebpf uses for architecture-specific helpers (pt_regs layouts).
fn bpf_target_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "x86_64",
        "aarch64" => "aarch64",
        "riscv64" => "riscv64",
        "powerpc64" => "powerpc64",
        "s390x" => "s390x",
        "mips" => "mips",
        other => other,
    }
}

fn path_with_cargo_bin() -> String {
    let path = std::env::var("PATH").unwrap_or_default();
    match cargo_bin_dir() {
        Some(bin) => format!("{}:{path}", bin.display()),
        None => path,
    }
}

fn cargo_bin_dir() -> Option<PathBuf> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))?;
    Some(home.join("bin"))
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn succeeds(cmd: &mut Command) -> bool {
    cmd.output().map(|o| o.status.success()).unwrap_or(false)
}

fn ensure_nightly(args: &BuildArgs, missing: &mut Vec<String>) -> anyhow::Result<()> {
    if !succeeds(Command::new("rustup").arg("--version")) {
        missing.push(
            "rustup (install from https://rustup.rs; the eBPF build needs a nightly toolchain)"
                .into(),
        );
        return Ok(());
    }
    let pinned = format!("+{NIGHTLY}");
    if !succeeds(Command::new("rustc").args([pinned.as_str(), "--version"])) {
        if args.no_install {
            missing.push(format!(
                "{NIGHTLY} toolchain: `rustup toolchain install {NIGHTLY} --profile minimal --component rust-src`"
            ));
            return Ok(());
        }
        eprintln!("build-ebpf: installing the {NIGHTLY} toolchain");
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            NIGHTLY,
            "--profile",
            "minimal",
        ]))?;
    }
    let sysroot = Command::new("rustc")
        .args([pinned.as_str(), "--print", "sysroot"])
        .output()
        .with_context(|| format!("rustc {pinned} --print sysroot"))?;
    let sysroot = PathBuf::from(String::from_utf8_lossy(&sysroot.stdout).trim());
    if !sysroot.join("lib/rustlib/src/rust/library/core").is_dir() {
        if args.no_install {
            missing.push(format!(
                "{NIGHTLY} rust-src: `rustup component add rust-src --toolchain {NIGHTLY}`"
            ));
            return Ok(());
        }
        eprintln!("build-ebpf: adding rust-src to {NIGHTLY}");
        run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", NIGHTLY]))?;
    }
    Ok(())
}

fn bpf_linker_ok() -> bool {
    if succeeds(Command::new("bpf-linker").arg("--version")) {
        return true;
    }
    cargo_bin_dir()
        .is_some_and(|bin| succeeds(Command::new(bin.join("bpf-linker")).arg("--version")))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn ensure_bpf_linker(args: &BuildArgs, missing: &mut Vec<String>) -> anyhow::Result<()> {
    if bpf_linker_ok() {
        return Ok(());
    }
    let install_linker = format!(
        "bpf-linker: `LLVM_PREFIX={LLVM_PREFIX} cargo install bpf-linker --version {BPF_LINKER_VERSION} \
         --locked --no-default-features --features llvm-22`"
    );
    let llvm_config = Path::new(LLVM_PREFIX).join("bin/llvm-config");
    if !llvm_config.exists() {
        let apt = format!(
            "LLVM 22: `apt-get install -y {}`",
            LLVM_APT_PACKAGES.join(" ")
        );
        if args.no_install || !is_root() || !succeeds(Command::new("apt-get").arg("--version")) {
            missing.push(format!(
                "{apt} (needs root and apt; not found: {})",
                llvm_config.display()
            ));
            missing.push(install_linker);
            return Ok(());
        }
        eprintln!("build-ebpf: installing {}", LLVM_APT_PACKAGES.join(" "));
        let mut install = Command::new("apt-get");
        install
            .args(["install", "-y"])
            .args(LLVM_APT_PACKAGES)
            .env("DEBIAN_FRONTEND", "noninteractive");
        if !succeeds(&mut install) {
            // The package lists may be missing or stale on a fresh machine.
            run(Command::new("apt-get").arg("update"))?;
            run(&mut install).context(apt)?;
        }
    }
    if args.no_install {
        missing.push(install_linker);
        return Ok(());
    }
    eprintln!("build-ebpf: installing bpf-linker {BPF_LINKER_VERSION} (about a minute)");
    run(Command::new("cargo")
        .args([
            "install",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--locked",
            "--no-default-features",
            "--features",
            "llvm-22",
        ])
        .env("LLVM_PREFIX", LLVM_PREFIX)
        .env_remove("RUSTUP_TOOLCHAIN"))
    .context(install_linker)?;
    Ok(())
}
