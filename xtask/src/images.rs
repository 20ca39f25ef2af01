//! `cargo xtask images`: the container images of the gateway (with `kinfctl`), the agent (with its eBPF
//! object embedded) and `vllm-sim`, built without a daemon by `buildah` and written as archives.
//!
//! Each image is `scratch` plus the release binaries, the few shared libraries `ldd` lists for them (and
//! the dynamic loader), `/etc/passwd` with the non-root user 65532, and the CA bundle. `vllm-sim` also
//! carries the Qwen2 tokenizer files (`cargo xtask setup` fetches them). The gateway and `vllm-sim` run as
//! UID 65532; the agent's image runs as UID 0 because Kubernetes gives added capabilities (CAP_BPF,
//! CAP_PERFMON) to root only; the chart drops every other capability.
//!
//! Output: `<target dir>/images/<name>.oci.tar`, one OCI archive per image, named and tagged as the chart's
//! defaults (`ghcr.io/kinference/<name>:<version>`). `skopeo copy oci-archive:FILE docker://REGISTRY/NAME:TAG`
//! pushes one; `ctr -n k8s.io images import FILE` loads it into containerd under its name.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::setup::{self, run_checked, step};
use testkit::repo_root;

/// Registry and namespace of the chart's default image repositories (deploy/charts/kinference/values.yaml).
pub const REGISTRY: &str = "ghcr.io/kinference";
/// Non-root user and group of the gateway and simulator images.
const NONROOT: u32 = 65532;
/// Where `vllm-sim`'s image keeps the tokenizer files.
const SIM_TOKENIZER_DIR: &str = "/usr/share/kinference/qwen2";

#[derive(clap::Args)]
pub struct ImagesArgs {
    /// Reuse the release binaries already in the target directory (no cargo build, no eBPF build).
    #[arg(long)]
    pub no_build: bool,
    /// Package the debug binaries instead (the ones `cargo xtask test` builds; a quicker image for tests).
    #[arg(long)]
    pub debug: bool,
    /// Tag of the images (default: the workspace version, which is the chart's appVersion).
    #[arg(long)]
    pub tag: Option<String>,
    /// Output directory (default: <target dir>/images).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

struct Image {
    /// Repository name under [`REGISTRY`].
    name: &'static str,
    binaries: &'static [&'static str],
    entrypoint: &'static str,
    user: u32,
    ports: &'static [u16],
}

const IMAGES: &[Image] = &[
    Image {
        name: "kinference-gateway",
        binaries: &["kinference-gateway", "kinfctl"],
        entrypoint: "/usr/local/bin/kinference-gateway",
        user: NONROOT,
        ports: &[8080, 9090],
    },
    Image {
        name: "kinference-agent",
        binaries: &["kinference-agent"],
        entrypoint: "/usr/local/bin/kinference-agent",
        user: 0,
        ports: &[7070, 9091, 5557],
    },
    Image {
        name: "vllm-sim",
        binaries: &["vllm-sim"],
        entrypoint: "/usr/local/bin/vllm-sim",
        user: NONROOT,
        ports: &[8000],
    },
];

pub fn build(args: ImagesArgs) -> anyhow::Result<()> {
    let root = repo_root();
    let target = target_dir(&root);
    let tag = args
        .tag
        .unwrap_or_else(|| env!("CARGO_PKG_VERSION").to_string());
    let out = args.out.unwrap_or_else(|| target.join("images"));
    ensure_buildah()?;
    let tokenizer = setup::tokenizer()?;
    if !args.no_build {
        step("building the eBPF object the agent embeds (cargo xtask build-ebpf)");
        run_checked(cargo(&root).args(["xtask", "build-ebpf"]))?;
        step("building the release binaries");
        let mut cmd = cargo(&root);
        cmd.args(["build", "--locked"]);
        if !args.debug {
            cmd.arg("--release");
        }
        for p in ["kinference-gateway", "kinference-agent", "kinference-bench"] {
            cmd.args(["-p", p]);
        }
        for image in IMAGES {
            for b in image.binaries {
                cmd.args(["--bin", b]);
            }
        }
        run_checked(&mut cmd)?;
    }
    let bin_dir = target.join(if args.debug { "debug" } else { "release" });
    std::fs::create_dir_all(&out)?;
    let mut report = Vec::new();
    for image in IMAGES {
        let reference = format!("{REGISTRY}/{}:{tag}", image.name);
        step(&format!("building {reference}"));
        let rootfs = out.join(format!("rootfs-{}", image.name));
        stage_rootfs(&rootfs, image, &bin_dir, &tokenizer)?;
        let container = capture(Command::new("buildah").args(["from", "scratch"]))?;
        let result = commit(&container, &rootfs, image, &reference, &out);
        let _ = Command::new("buildah").args(["rm", &container]).output();
        let _ = std::fs::remove_dir_all(&rootfs);
        let size = result?;
        report.push(format!(
            "{reference}: {} (oci archive {})",
            mib(size),
            out.join(format!("{}.oci.tar", image.name)).display()
        ));
    }
    step("images written");
    for line in &report {
        eprintln!("  {line}");
    }
    Ok(())
}

/// The image's root filesystem: binaries, their libraries, passwd/group, CA bundle, /tmp.
fn stage_rootfs(
    rootfs: &Path,
    image: &Image,
    bin_dir: &Path,
    tokenizer: &Path,
) -> anyhow::Result<()> {
    let _ = std::fs::remove_dir_all(rootfs);
    let bin = rootfs.join("usr/local/bin");
    std::fs::create_dir_all(&bin)?;
    std::fs::create_dir_all(rootfs.join("etc/ssl/certs"))?;
    std::fs::create_dir_all(rootfs.join("tmp"))?;
    let mut libs = BTreeSet::new();
    for name in image.binaries {
        let src = bin_dir.join(name);
        if !src.is_file() {
            bail!(
                "{} is missing (run without --no-build, or cargo build --release)",
                src.display()
            );
        }
        let dest = bin.join(name);
        std::fs::copy(&src, &dest).with_context(|| format!("copying {}", src.display()))?;
        // The release profile keeps line tables (debug = 1) for profiling; the image does not need them.
        if Command::new("strip")
            .arg("--strip-debug")
            .arg(&dest)
            .status()
            .is_err()
        {
            eprintln!("warning: `strip` not found; {name} keeps its debug line tables");
        }
        libs.extend(shared_libraries(&src)?);
    }
    for lib in libs {
        // Copy the file a library path resolves to, under the path the loader looks for.
        let real = std::fs::canonicalize(&lib).with_context(|| format!("resolving {lib}"))?;
        let dest = rootfs.join(lib.trim_start_matches('/'));
        std::fs::create_dir_all(dest.parent().expect("absolute library path"))?;
        std::fs::copy(&real, &dest).with_context(|| format!("copying {}", real.display()))?;
    }
    std::fs::write(
        rootfs.join("etc/passwd"),
        format!(
            "root:x:0:0:root:/:/sbin/nologin\nnonroot:x:{NONROOT}:{NONROOT}:nonroot:/:/sbin/nologin\n"
        ),
    )?;
    std::fs::write(
        rootfs.join("etc/group"),
        format!("root:x:0:\nnonroot:x:{NONROOT}:\n"),
    )?;
    std::fs::write(rootfs.join("etc/nsswitch.conf"), "hosts: files dns\n")?;
    let ca = Path::new("/etc/ssl/certs/ca-certificates.crt");
    if ca.is_file() {
        std::fs::copy(ca, rootfs.join("etc/ssl/certs/ca-certificates.crt"))?;
    }
    if image.name == "vllm-sim" {
        let dir = rootfs.join(SIM_TOKENIZER_DIR.trim_start_matches('/'));
        std::fs::create_dir_all(&dir)?;
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(tokenizer.join(f), dir.join(f))?;
        }
    }
    Ok(())
}

/// The absolute paths `ldd` prints for a binary (the loader included); none for a static binary.
fn shared_libraries(binary: &Path) -> anyhow::Result<Vec<String>> {
    let output = Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&output.stdout);
    let mut libs = Vec::new();
    for line in text.lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(p.to_string());
        }
    }
    if libs.is_empty() && !text.contains("statically linked") && !output.status.success() {
        bail!(
            "ldd {} failed: {}",
            binary.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(libs)
}

/// Commits the container and writes the OCI archive; returns its size.
fn commit(
    container: &str,
    rootfs: &Path,
    image: &Image,
    reference: &str,
    out: &Path,
) -> anyhow::Result<u64> {
    run_quiet(
        Command::new("buildah")
            .args(["copy", container])
            .arg(rootfs)
            .arg("/"),
    )?;
    let mut config = Command::new("buildah");
    config
        .arg("config")
        .arg(format!("--entrypoint=[\"{}\"]", image.entrypoint))
        .arg(format!("--user={}:{}", image.user, image.user))
        .arg("--workingdir=/")
        .arg("--env=PATH=/usr/local/bin")
        .arg("--env=SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt")
        .arg("--label=org.opencontainers.image.source=https://github.com/kinference/kinference")
        .arg(format!(
            "--label=org.opencontainers.image.version={}",
            reference.rsplit(':').next().unwrap_or_default()
        ));
    if image.name == "vllm-sim" {
        config.arg(format!(
            "--env=KINFERENCE_TOKENIZER_DIR={SIM_TOKENIZER_DIR}"
        ));
    }
    for port in image.ports {
        config.arg(format!("--port={port}"));
    }
    run_quiet(config.arg(container))?;
    run_quiet(Command::new("buildah").args([
        "commit",
        "--quiet",
        "--rm=false",
        container,
        reference,
    ]))?;
    let oci = out.join(format!("{}.oci.tar", image.name));
    let _ = std::fs::remove_file(&oci);
    run_quiet(Command::new("buildah").args([
        "push",
        "--quiet",
        reference,
        &format!("oci-archive:{}:{reference}", oci.display()),
    ]))?;
    Ok(std::fs::metadata(&oci)?.len())
}

fn ensure_buildah() -> anyhow::Result<()> {
    if Command::new("buildah").arg("--version").output().is_ok() {
        return Ok(());
    }
    if !is_root() {
        bail!("buildah is not installed (Debian: apt-get install buildah)");
    }
    step("installing buildah (apt-get install buildah)");
    run_checked(Command::new("apt-get").args(["update", "-qq"]))?;
    run_checked(
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends", "buildah"])
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn is_root() -> bool {
    capture(Command::new("id").arg("-u")).is_ok_and(|u| u == "0")
}

fn capture(cmd: &mut Command) -> anyhow::Result<String> {
    let shown = format!("{cmd:?}");
    let output = cmd
        .output()
        .with_context(|| format!("could not start {shown}"))?;
    if !output.status.success() {
        bail!(
            "{shown} failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

fn run_quiet(cmd: &mut Command) -> anyhow::Result<()> {
    capture(cmd).map(|_| ())
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(|d| root.join(d))
        .unwrap_or_else(|| root.join("target"))
}

fn cargo(root: &Path) -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root);
    cmd
}
