//! Replaying a crate's saved fuzz corpus (`fuzz/corpus/<target>/`) in the normal `cargo test`, through the
//! same entry points the fuzz targets call: an input a fuzzer once found stays fixed.

use std::path::Path;

/// Runs `run(target, bytes)` on every file of `corpus/<target>/` for each of `targets`; panics naming the
/// first input that panics, or a target with fewer than `min_files` saved inputs.
pub fn replay_corpus(
    corpus: &Path,
    targets: &[&str],
    min_files: usize,
    run: impl Fn(&str, &[u8]) + std::panic::RefUnwindSafe,
) {
    for target in targets {
        let dir = corpus.join(target);
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("corpus of {target} missing at {}: {e}", dir.display()));
        let mut n = 0;
        for entry in entries {
            let path = entry.expect("corpus entry").path();
            let data = std::fs::read(&path).expect("corpus file");
            let result = std::panic::catch_unwind(|| run(target, &data));
            assert!(result.is_ok(), "{target}: {} panics", path.display());
            n += 1;
        }
        assert!(n >= min_files, "{target}: only {n} saved inputs");
    }
}
