#!/bin/bash
# Stops what start.sh DIR started (by recorded PIDs), removes its pods' containers and mounts and the
# network namespace, and restores the sysctls the kubelet changed. Idempotent.
D=${1:?usage: stop.sh DIR}
NS=${KINF_NETNS:-kinf-e2e}
HERE=$(cd "$(dirname "$0")" && pwd)
stop() { # name: SIGTERM, then SIGKILL after 5 s
  local f="$D/$1.pid"; [ -f "$f" ] || return 0
  local p; p=$(cat "$f")
  if kill "$p" 2>/dev/null; then
    for i in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null
  fi
  rm -f "$f"
}
stop kubelet; stop scheduler; stop controller-manager
# The pods' processes: containerd-shims (children of nobody once containerd stops) hold the containers.
if [ -S "$D/containerd/containerd.sock" ]; then
  CTR="ctr -a $D/containerd/containerd.sock -n k8s.io"
  for t in $($CTR tasks ls -q 2>/dev/null); do $CTR tasks kill -s SIGKILL "$t" >/dev/null 2>&1; done
  sleep 1
  for t in $($CTR tasks ls -q 2>/dev/null); do $CTR tasks delete -f "$t" >/dev/null 2>&1; done
fi
stop containerd
# Shims left behind (their command line names this directory's containerd socket).
for p in $(pgrep -f "containerd-shim-runc-v2 -namespace k8s.io .*-address $D/containerd/containerd.sock" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
bash "$HERE/../kube-apiserver/stop.sh" "$D"
# Mounts under the directory (the kubelet's volumes, containerd's rootfs and netns) go before the files.
grep -o " $D/[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
# The pods' network namespaces containerd made since start.sh (the bridge and veths go with $NS).
for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^cni-'); do
  grep -qx "$n" "$D/netns.before" 2>/dev/null || ip netns del "$n" 2>/dev/null
done
ip netns del "$NS" 2>/dev/null
# Container logs the kubelet wrote outside DIR.
for d in pods containers; do
  [ -f "$D/${d%s}logs.before" ] || continue
  for f in $(ls "/var/log/$d" 2>/dev/null); do grep -qxF "$f" "$D/${d%s}logs.before" || rm -rf "/var/log/$d/$f"; done
  rm -f "$D/${d%s}logs.before"
done
if [ -f "$D/sysctls.saved" ]; then
  while IFS= read -r kv; do sysctl -qw "$kv" 2>/dev/null; done < "$D/sysctls.saved"
  rm -f "$D/sysctls.saved"
fi
exit 0
