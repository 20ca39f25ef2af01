#!/bin/bash
# Starts a real one-node Kubernetes (v1.20.2, built by build.sh) inside a network namespace of its own:
# etcd + kube-apiserver + kube-controller-manager + kube-scheduler + containerd (runc, bridge CNI) + kubelet.
# Nothing listens outside that namespace: the node's IP (10.250.0.1) is a veth end inside it, pods get
# 10.88.0.0/16 addresses on a bridge inside it, and run commands there with `ip netns exec kinf-e2e ...`.
# Usage: start.sh DIR [IMAGE_ARCHIVE...]
#   Prints the kubeconfig path (API at https://127.0.0.1:16443 inside the namespace) on its last line once
#   node1 is Ready. The archives (docker or OCI) are imported into containerd's k8s.io namespace.
#   Stop with stop.sh DIR (stops every process, removes the namespace, restores the kubelet's sysctls).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
W=${KUBE_TEST_HOME:-$HOME/.cache/kube-test}
D=$(mkdir -p "$1" && cd "$1" && pwd); shift
NS=${KINF_NETNS:-kinf-e2e}
NODE_IP=10.250.0.1
PORT=16443
X="nsenter --net=/var/run/netns/$NS"
for b in kube-apiserver kubelet kube-scheduler kube-controller-manager runc-clamp-oom; do
  [ -x "$W/bin/$b" ] || { echo "missing $W/bin/$b: run deploy/tests/cluster/build.sh" >&2; exit 1; }
done
[ -f "$W/images/pause.tar" ] || { echo "missing the pause image: run deploy/tests/cluster/build.sh" >&2; exit 1; }
# A previous run that was not stopped: stop it first (idempotent).
[ -f "$D/sysctls.saved" ] && bash "$HERE/stop.sh" "$D" >/dev/null 2>&1 || true
ip netns del "$NS" 2>/dev/null || true
t0=$(date +%s.%N)

# The kubelet changes these, as on every node; stop.sh puts them back.
for k in vm.overcommit_memory kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes; do
  echo "$k=$(sysctl -n $k)"
done > "$D/sysctls.saved"

# The namespace: loopback, and the node's address on one end of a veth pair (both ends inside).
ip netns list | awk '{print $1}' > "$D/netns.before"
# The kubelet writes container logs under /var/log/pods and /var/log/containers (not configurable in 1.20).
mkdir -p /var/log/pods /var/log/containers
ls /var/log/pods > "$D/podlogs.before"; ls /var/log/containers > "$D/containerlogs.before"
ip netns add "$NS"
$X ip link set lo up
$X ip link add node0 type veth peer name node0p
$X ip addr add "$NODE_IP/24" dev node0
$X ip link set node0 up; $X ip link set node0p up
$X ip route add default dev node0
$X sysctl -qw net.ipv4.ip_forward=1

# containerd with its own state, socket and CNI configuration (a bridge for the pods, inside the namespace).
# Pods get no outside resolver (nothing outside the namespace is reachable anyway).
echo "nameserver 127.0.0.1" > "$D/resolv.conf"
C=$D/containerd; mkdir -p "$C/root" "$C/state" "$D/cni/net.d" "$D/kubelet" "$D/logs"
cat > "$D/cni/net.d/10-kinf.conflist" <<EOC
{"cniVersion":"0.4.0","name":"kinf","plugins":[
 {"type":"bridge","bridge":"cni0","isGateway":true,"ipMasq":false,"hairpinMode":true,
  "ipam":{"type":"host-local","ranges":[[{"subnet":"10.88.0.0/16","gateway":"10.88.0.1"}]],"routes":[{"dst":"0.0.0.0/0"}],
          "dataDir":"$D/cni/ipam"}},
 {"type":"portmap","capabilities":{"portMappings":true}}]}
EOC
cat > "$C/config.toml" <<EOC
version = 2
root = "$C/root"
state = "$C/state"
[grpc]
  address = "$C/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.6"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$D/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      BinaryName = "$W/bin/runc-clamp-oom"
      SystemdCgroup = false
EOC
$X setsid containerd --config "$C/config.toml" > "$D/logs/containerd.log" 2>&1 &
echo $! > "$D/containerd.pid"
for i in $(seq 1 50); do [ -S "$C/containerd.sock" ] && break; sleep 0.2; done
CTR="ctr -a $C/containerd.sock -n k8s.io"
for a in "$W/images/pause.tar" "$@"; do $CTR images import --all-platforms "$a" >/dev/null; done

# etcd + kube-apiserver (pods reach it at $NODE_IP; ServiceAccount tokens mounted into pods).
KUBE_APISERVER_ADVERTISE=$NODE_IP KUBE_APISERVER_SA_ADMISSION=1 $X bash "$HERE/../kube-apiserver/start.sh" "$D" "$PORT" > "$D/logs/apiserver-start.log"
KC=$D/kubeconfig
$X setsid "$W/bin/kube-controller-manager" --kubeconfig="$KC" --leader-elect=false \
  --service-account-private-key-file="$D/pki/sa.key" --root-ca-file="$D/pki/ca.crt" --use-service-account-credentials=false \
  --controllers='*,-nodeipam,-cloud-node-lifecycle' --bind-address=127.0.0.1 --secure-port=10257 --port=0 \
  > "$D/logs/controller-manager.log" 2>&1 &
echo $! > "$D/controller-manager.pid"
$X setsid "$W/bin/kube-scheduler" --kubeconfig="$KC" --leader-elect=false --bind-address=127.0.0.1 --secure-port=10259 --port=0 \
  > "$D/logs/scheduler.log" 2>&1 &
echo $! > "$D/scheduler.pid"
$X setsid "$W/bin/kubelet" --kubeconfig="$KC" --container-runtime=remote \
  --container-runtime-endpoint="unix://$C/containerd.sock" --cgroup-driver=cgroupfs --fail-swap-on=false \
  --cgroups-per-qos=false --enforce-node-allocatable= --hostname-override=node1 --node-ip="$NODE_IP" \
  --node-labels=nvidia.com/gpu.present=true --root-dir="$D/kubelet" --anonymous-auth=false \
  --authentication-token-webhook=false --read-only-port=0 --port=10250 --healthz-port=10248 \
  --image-gc-high-threshold=100 --eviction-hard= --eviction-soft= --max-pods=30 \
  --client-ca-file="$D/pki/ca.crt" --serialize-image-pulls=false --pod-infra-container-image=registry.k8s.io/pause:3.6 --resolv-conf="$D/resolv.conf" \
  > "$D/logs/kubelet.log" 2>&1 &
echo $! > "$D/kubelet.pid"
K="kubectl --kubeconfig=$KC"
for i in $(seq 1 90); do
  if $X $K get node node1 -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -q True; then
    # The default ServiceAccount (and its token) exists before pods are created in "default".
    for j in $(seq 1 30); do $X $K get secrets -n default 2>/dev/null | grep -q '^default-token' && break; sleep 1; done
    echo "node1 Ready after $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s" >&2
    echo "$KC"; exit 0
  fi
  sleep 1
done
echo "node1 did not become Ready; see $D/logs/kubelet.log" >&2; exit 1
