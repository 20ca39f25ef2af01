#!/usr/bin/env bash
# Runs every fuzz target of the agent for a fixed budget each, seeded from the committed corpus.
#   kinference-agent/fuzz/run.sh [seconds per target, default 30] [target...]
# Needs nightly and cargo-fuzz (`rustup toolchain install nightly; cargo install cargo-fuzz`).
# New inputs go to fuzz/target/work-corpus/<target>/ (not committed); a crash is written to
# fuzz/artifacts/<target>/ and fails the run. To keep one as a regression input: minimise it
# (`cargo +nightly fuzz tmin <target> <file>`), fix the parser, and copy it into corpus/<target>/,
# which `cargo test -p kinference-agent --test fuzz_corpus` replays on stable.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
secs="${1:-30}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(kv_batch zmtp_stream zmq_frames vllm_metrics)
fi
cd "$here/.."
# The agent forbids unsafe code, so the default is no sanitizer (several times faster on a small
# machine); FUZZ_SANITIZER=address puts ASan back for the unsafe code in dependencies.
san="${FUZZ_SANITIZER:-none}"
# FUZZ_TARGET_DIR: where the instrumented build goes (CI keeps it under ~/.cache between runs).
target_dir="${FUZZ_TARGET_DIR:-$here/target}"
# Build every target first, so the budget is spent fuzzing, not compiling.
cargo +nightly fuzz build -O -s "$san" --target-dir "$target_dir"
for t in "${targets[@]}"; do
    work="$here/target/work-corpus/$t"
    mkdir -p "$work"
    echo "== $t: ${secs}s (seeds: $(ls "$here/corpus/$t" | wc -l) files)"
    cargo +nightly fuzz run -O -s "$san" --target-dir "$target_dir" "$t" "$work" "$here/corpus/$t" -- \
        -max_total_time="$secs" -max_len=65536 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
done
