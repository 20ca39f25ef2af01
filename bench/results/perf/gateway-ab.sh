#!/bin/bash
# Alternates gateway-overhead runs (c=64) of two gateway builds: gateway-ab.sh DIR_A DIR_B RUNS
cd "$(git rev-parse --show-toplevel)"
for i in $(seq 1 $3); do
  for d in $1 $2; do
    echo "== $d run $i ($(cut -d' ' -f1 /proc/loadavg))"
    KINFERENCE_TOKENIZER_DIR=${KINFERENCE_TOKENIZER_DIR:-.assets/qwen2} KINFERENCE_BIN_DIR=$d ${GATEWAY_OVERHEAD:-target/release/gateway-overhead} --concurrency 64 --rounds 4 --requests 400 2>&1 | grep -E "^(non-stream|stream-ttfb)"
  done
done
