//! Embeds the eBPF object when `cargo xtask build-ebpf` has built it (`target/ebpf/kinference.bpf.o`, or
//! `$KINFERENCE_EBPF_OBJECT`): sets `cfg(kinference_ebpf_object)` and `KINFERENCE_EBPF_OBJECT_PATH`.
//! Without it the agent still builds and reports eBPF as "not built" at run time.

use std::path::PathBuf;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kinference_ebpf_object)");
    println!("cargo::rerun-if-env-changed=KINFERENCE_EBPF_OBJECT");
    println!("cargo::rerun-if-env-changed=CARGO_TARGET_DIR");
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let object = std::env::var_os("KINFERENCE_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let target = std::env::var_os("CARGO_TARGET_DIR")
                .filter(|v| !v.is_empty())
                .map_or_else(|| PathBuf::from("target"), PathBuf::from);
            manifest
                .join("..")
                .join(target)
                .join("ebpf/kinference.bpf.o")
        });
    // Watch the object's (small) directory, created here if needed, so the object appearing later is noticed
    // without rerunning on every build (cargo treats a missing watched path as always changed).
    if let Some(dir) = object.parent() {
        let _ = std::fs::create_dir_all(dir);
        if dir.is_dir() {
            println!("cargo::rerun-if-changed={}", dir.display());
        }
    }
    if object.is_file() {
        println!("cargo::rerun-if-changed={}", object.display());
    }
    if object.is_file() {
        let path = object.canonicalize().unwrap_or(object);
        println!("cargo::rustc-cfg=kinference_ebpf_object");
        println!(
            "cargo::rustc-env=KINFERENCE_EBPF_OBJECT_PATH={}",
            path.display()
        );
    }
}
