#!/bin/bash
# usage: gateway-profile.sh BIN_DIR OUT_PREFIX  -- runs gateway-overhead at c=64 and perf-records the gateway
BIN=$1; OUT=$2
cd "$(git rev-parse --show-toplevel)"
KINFERENCE_TOKENIZER_DIR=${KINFERENCE_TOKENIZER_DIR:-.assets/qwen2} KINFERENCE_BIN_DIR=$BIN ${GATEWAY_OVERHEAD:-target/release/gateway-overhead} --concurrency 64 --rounds ${ROUNDS:-20} --requests 400 > $OUT.log 2>&1 &
GO=$!
for i in $(seq 1 100); do GW=""; for p in $(pgrep -P $GO); do [ "$(cat /proc/$p/comm 2>/dev/null)" = "kinference-gate" ] && GW=$p; done; [ -n "$GW" ] && break; sleep 0.2; done
echo "gateway pid $GW"
sleep 1
perf record -F 1999 --call-graph dwarf,16384 -o $OUT.data -p $GW > $OUT.perf.log 2>&1
wait $GO
tail -6 $OUT.log
