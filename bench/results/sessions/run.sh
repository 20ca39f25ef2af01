#!/bin/bash
# multi-turn c=32: kinference with x-session-id and the oracle (one invocation per seed); then
# kinference without the header (the same build: no request names a session), per seed.
set -u
B=/tmp/sess-bin
export KINFERENCE_BIN_DIR=$B KINFERENCE_TOKENIZER_DIR=/work/main/.assets/qwen2
for seed in 42 43 44; do
  $B/routing-bench --workloads multi-turn --concurrency 32 --policies kinference,oracle --session-header \
    --seed $seed --out-dir /tmp/sess-bench/on-$seed > /tmp/sess-bench/on-$seed.log 2>&1
  echo "on seed $seed rc=$? $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
done
for seed in 42 43 44; do
  $B/routing-bench --workloads multi-turn --concurrency 32 --policies kinference \
    --seed $seed --out-dir /tmp/sess-bench/off-$seed > /tmp/sess-bench/off-$seed.log 2>&1
  echo "off seed $seed rc=$? $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
done
