#!/usr/bin/env bash
# Runs every cargo-fuzz target of one crate for a fixed budget each, seeded from its committed corpus.
#   testkit/fuzz/run.sh CRATE [seconds per target, default 30] [target...]
#   CRATE: kinference-agent or kinference-gateway (any crate with a `fuzz/` cargo-fuzz project)
# Needs nightly and cargo-fuzz (`rustup toolchain install nightly; cargo install cargo-fuzz`).
# New inputs go to CRATE/fuzz/target/work-corpus/<target>/ (not committed); a crash is written to
# CRATE/fuzz/artifacts/<target>/ and fails the run. To keep one as a regression input: minimise it
# (`cargo +nightly fuzz tmin <target> <file>`), fix the parser, and copy it into corpus/<target>/,
# which `cargo test -p CRATE --test fuzz_corpus` replays on stable.
set -euo pipefail
crate="${1:?usage: testkit/fuzz/run.sh CRATE [seconds per target] [target...]}"
shift
secs="${1:-30}"
shift || true
root="$(cd "$(dirname "$0")/../.." && pwd)"
here="$root/$crate/fuzz"
if [ ! -f "$here/Cargo.toml" ]; then
    echo "no cargo-fuzz project at $here" >&2
    exit 2
fi
cd "$root/$crate"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    # Every target the crate declares: a new one is fuzzed without touching this script.
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
# The crates forbid unsafe code, so the default is no sanitizer (several times faster on a small
# machine); FUZZ_SANITIZER=address puts ASan back for the unsafe code in dependencies.
san="${FUZZ_SANITIZER:-none}"
# FUZZ_TARGET_DIR: where the instrumented build goes (CI keeps it under ~/.cache between runs).
target_dir="${FUZZ_TARGET_DIR:-$here/target}"
# Build every target first, so the budget is spent fuzzing, not compiling.
cargo +nightly fuzz build -O -s "$san" --target-dir "$target_dir"
for t in "${targets[@]}"; do
    work="$here/target/work-corpus/$t"
    mkdir -p "$work"
    echo "== $crate/$t: ${secs}s (seeds: $(ls "$here/corpus/$t" | wc -l) files)"
    cargo +nightly fuzz run -O -s "$san" --target-dir "$target_dir" "$t" "$work" "$here/corpus/$t" -- \
        -max_total_time="$secs" -max_len=65536 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
done
