#!/bin/bash
# Alternates gateway-overhead runs of two gateway builds at c=1 and c=64, streamed and not, then
# prints the medians per build: added-latency-ab.sh DIR_BEFORE DIR_AFTER RUNS > LOG
# Each DIR holds a kinference-gateway and the same vllm-sim; ROUNDS (4) x REQUESTS (400) per side.
cd "$(git rev-parse --show-toplevel)"
GO=${GATEWAY_OVERHEAD:-target/release/gateway-overhead}
for i in $(seq 1 "$3"); do
  for d in "$1" "$2"; do
    echo "== $d run $i (load $(cut -d' ' -f1 /proc/loadavg))"
    KINFERENCE_TOKENIZER_DIR=${KINFERENCE_TOKENIZER_DIR:-.assets/qwen2} KINFERENCE_BIN_DIR=$d "$GO" \
      --concurrency 1,64 --rounds "${ROUNDS:-4}" --requests "${REQUESTS:-400}" 2>&1 | grep -E "^(non-stream|stream-ttfb)"
  done
done
