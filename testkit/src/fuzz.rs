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

/// Where `testkit/fuzz/run.sh` wants the large seeds written (`$KINFERENCE_FUZZ_LARGE_SEEDS`), and the
/// entry each seed is replayed through as it is written, as the fuzzer will start with it.
pub struct LargeSeeds<F: Fn(&str, &[u8])> {
    dir: std::path::PathBuf,
    run: F,
}

impl<F: Fn(&str, &[u8])> LargeSeeds<F> {
    /// The folder named by `KINFERENCE_FUZZ_LARGE_SEEDS` (panics without it), replaying through `run`.
    pub fn from_env(run: F) -> Self {
        let dir =
            std::env::var_os("KINFERENCE_FUZZ_LARGE_SEEDS").expect("KINFERENCE_FUZZ_LARGE_SEEDS");
        Self {
            dir: dir.into(),
            run,
        }
    }

    /// Writes `bytes` as `<target>/<name>` and replays it through the entry, printing its size and time.
    pub fn write(&self, target: &str, name: &str, bytes: &[u8]) {
        let d = self.dir.join(target);
        std::fs::create_dir_all(&d).expect("seed folder");
        std::fs::write(d.join(name), bytes).expect("seed");
        let started = std::time::Instant::now();
        (self.run)(target, bytes);
        eprintln!(
            "{target}/{name}: {} bytes, {:?}",
            bytes.len(),
            started.elapsed()
        );
    }
}
