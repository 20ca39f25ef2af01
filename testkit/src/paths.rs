//! Where tests find the repository, the built binaries and the tokenizer.

use std::path::{Path, PathBuf};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit sits in the repository root")
        .to_path_buf()
}

/// The folder of the workspace's binaries: `KINFERENCE_BIN_DIR`, else the profile folder this test binary
/// was built into (`target/debug` for `target/debug/deps/<test>`).
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KINFERENCE_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("current test binary");
    let dir = exe.parent().expect("test binary folder");
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().unwrap_or(dir).to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

/// The Qwen2 tokenizer folder: `KINFERENCE_TOKENIZER_DIR`, else `<repo>/.assets/qwen2`. Panics when it holds
/// no `tokenizer.json` (`cargo xtask setup` downloads it; every test run prepares it first).
pub fn tokenizer_dir() -> PathBuf {
    let dir = std::env::var_os("KINFERENCE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".assets/qwen2"));
    assert!(
        dir.join("tokenizer.json").exists(),
        "no tokenizer at {}: run `cargo xtask setup` (or set KINFERENCE_TOKENIZER_DIR)",
        dir.display()
    );
    dir
}
