#!/bin/bash
# usage: gateway-syscalls.sh BIN_DIR OUT -- counts the gateway's syscalls during a gateway-overhead run at c=64
BIN=$1; OUT=$2
cd "$(git rev-parse --show-toplevel)"
KINFERENCE_TOKENIZER_DIR=${KINFERENCE_TOKENIZER_DIR:-.assets/qwen2} KINFERENCE_BIN_DIR=$BIN ${GATEWAY_OVERHEAD:-target/release/gateway-overhead} --concurrency 64 --rounds ${ROUNDS:-6} --requests 400 > $OUT.log 2>&1 &
GO=$!
for i in $(seq 1 100); do GW=""; for p in $(pgrep -P $GO); do [ "$(cat /proc/$p/comm 2>/dev/null)" = "kinference-gate" ] && GW=$p; done; [ -n "$GW" ] && break; sleep 0.2; done
perf stat -e 'syscalls:sys_enter_writev,syscalls:sys_enter_write,syscalls:sys_enter_sendto,syscalls:sys_enter_recvfrom,syscalls:sys_enter_read,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_futex,context-switches,task-clock' -p $GW -o $OUT.stat
wait $GO
tail -3 $OUT.log; cat $OUT.stat
