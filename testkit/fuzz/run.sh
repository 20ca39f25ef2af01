#!/usr/bin/env bash
# Runs every cargo-fuzz target of one crate for a fixed budget each, seeded from its committed corpus.
#   testkit/fuzz/run.sh CRATE [seconds per target, default 30] [target...]
#   CRATE: kinference-agent or kinference-gateway (any crate with a `fuzz/` cargo-fuzz project)
# Needs nightly and cargo-fuzz (`rustup toolchain install nightly; cargo install cargo-fuzz`).
# New inputs go to CRATE/fuzz/target/work-corpus/<target>/ (not committed); a crash, a timeout or a
# run past the RSS limit is written to CRATE/fuzz/artifacts/<target>/ and fails the run. To keep one
# as a regression input: minimise it (`cargo +nightly fuzz tmin <target> <file>`), fix the parser,
# and copy it into corpus/<target>/, which `cargo test -p CRATE --test fuzz_corpus` replays on stable.
#
# With teeth:
# - AddressSanitizer by default (cargo fuzz's own default): the crates forbid unsafe code, but their
#   dependencies (bytes, hashbrown, serde_json, zeromq...) do not. FUZZ_SANITIZER=none is faster by hand.
# - an RSS limit (FUZZ_RSS_LIMIT_MB, default 2048, also the largest single allocation): an input that
#   makes a parser reserve or hold gigabytes is a finding, not a slow run.
# - inputs as large as the ports let in where that matters: CRATE/fuzz/options/<target> holds the
#   target's own libFuzzer flags (a larger -max_len; default 64 KiB), and the crate's corpus test
#   writes seeds of that size (`write_large_seeds`, too large to commit) before the targets run.
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
san="${FUZZ_SANITIZER:-address}"
rss_mb="${FUZZ_RSS_LIMIT_MB:-2048}"
# FUZZ_TARGET_DIR: where the instrumented build goes (CI keeps it under ~/.cache between runs).
target_dir="${FUZZ_TARGET_DIR:-$here/target}"
# Build every target first, so the budget is spent fuzzing, not compiling.
cargo +nightly fuzz build -O -s "$san" --target-dir "$target_dir"
# The large seeds, fresh each run (stable toolchain, the workspace's own target directory).
large="$here/target/large-seeds"
rm -rf "$large"
mkdir -p "$large"
(cd "$root" && KINFERENCE_FUZZ_LARGE_SEEDS="$large" cargo test -q -p "$crate" --test fuzz_corpus \
    -- --ignored --exact write_large_seeds >/dev/null)
for t in "${targets[@]}"; do
    work="$here/target/work-corpus/$t"
    mkdir -p "$work"
    seeds=("$here/corpus/$t")
    [ -d "$large/$t" ] && seeds+=("$large/$t")
    opts="-max_len=65536"
    [ -f "$here/options/$t" ] && opts="$(cat "$here/options/$t")"
    echo "== $crate/$t: ${secs}s, sanitizer $san, RSS limit ${rss_mb} MB, $opts (seeds: $(find "${seeds[@]}" -type f | wc -l) files)"
    # shellcheck disable=SC2086 # $opts is a list of flags
    cargo +nightly fuzz run -O -s "$san" --target-dir "$target_dir" "$t" "$work" "${seeds[@]}" -- \
        -max_total_time="$secs" $opts -timeout=10 -rss_limit_mb="$rss_mb" -malloc_limit_mb="$rss_mb" \
        -print_final_stats=1
done
