"""Kinference in a real one-node Kubernetes: the charts installed, traffic through the official SDKs.

Run it with `deploy/tests/cluster/e2e.sh` (root; about 2 GB of disk; 3 minutes once built), which builds what
is missing and runs this file with `KINFERENCE_TEST_CLUSTER=1`. Its name is not `test_*.py`, so the suite's
pytest run over deploy/tests does not collect it (a skip there would fail CI); CI runs e2e.sh as its own step.

What runs (deploy/tests/cluster/start.sh): Kubernetes v1.20.2 built from Debian's source package (etcd,
kube-apiserver, kube-controller-manager, kube-scheduler, a kubelet on containerd + runc + bridge CNI), all
inside a network namespace of its own (`kinf-e2e`); this test process joins that namespace to talk to the
pods, so no traffic leaves it. The images are the ones `cargo xtask images` builds (target/images), imported
into containerd; `imagePullPolicy: Never`.

The install is a real `helm install` done by hand: both charts rendered with helm-python-sdk (no helm binary
here) and applied with kubectl, CRD chart first. Test values: small CPU requests (the node has 2 cores), no
PodDisruptionBudget (policy/v1 is 1.21+), the gateway's in-cluster API address pointed at the node (no
kube-proxy, so Service ClusterIPs do not route: clients use the gateway Service's endpoints).

Workload: three vllm-sim worker pods on the node, each binding its KV-event publisher in its own pod
(annotation kinference.ai/kv-events-port); the agent DaemonSet (eBPF with the chart's capabilities, not
privileged) follows them; the gateway Deployment with two replicas. Shared-prefix requests with the `openai`
and `anthropic` SDKs, alternating between the two gateway replicas, then the same shape of workload sent by
the test to a random worker directly; the workers' own prefix-cache counters compare the two.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import os
import random
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
CLUSTER = REPO / "deploy" / "tests" / "cluster"
CHARTS = REPO / "deploy" / "charts"
IMAGES = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "images"
KUBE_TEST_HOME = Path(os.environ.get("KUBE_TEST_HOME", Path.home() / ".cache" / "kube-test"))
NETNS = os.environ.get("KINF_NETNS", "kinf-e2e")
NODE_IP = "10.250.0.1"
NS = "kinference"
RELEASE = "kinference"
MODEL = "qwen2-sim"
WORKERS = 3
# Cluster mode (gateway.config.crds): tenants, keys, the model and its pool are objects in the namespace.
# The workload's tenant, and a second one whose key the CRD test rotates and whose routing it pins.
API_KEY = "sk-e2e-workload"
PROBE_KEY_OLD = "sk-e2e-probe-1"
PROBE_KEY_NEW = "sk-e2e-probe-2"
SECRETS = {"e2e-workload-key": API_KEY, "e2e-probe-key": PROBE_KEY_OLD}
# A third tenant and its Secret, applied by the CRD test while the gateways run (the chart grants the
# gateway this Secret by name from the start).
LATE_SECRET, LATE_KEY = "e2e-late-key", "sk-e2e-late-1"
# The gateway answers `x-kinference-worker` and `/healthz/workers` (worker addresses) only to an admin:
# the key comes from a Secret (gateway.adminKey) and the test presents it.
ADMIN_KEY = "sk-e2e-admin-0123456789"
ADMIN = {"x-kinference-admin-key": ADMIN_KEY}
GATEWAY_API_CRDS = REPO / "deploy" / "gateway-api" / "crds"
STANDARD_POOL_CRD = GATEWAY_API_CRDS / "inference.networking.k8s.io_inferencepools.yaml"
# The gateway's usage journals: one hostPath PersistentVolume per replica (no provisioner in this cluster).
USAGE_CLASS = "e2e-usage"
GATEWAY = f"statefulset/{RELEASE}-gateway"

if os.environ.get("KINFERENCE_TEST_CLUSTER") != "1":
    pytest.skip(
        "cluster e2e skipped: set KINFERENCE_TEST_CLUSTER=1 (or run deploy/tests/cluster/e2e.sh) to start a "
        "real one-node Kubernetes and install the charts",
        allow_module_level=True,
    )

import helm_python as helm  # noqa: E402
import yaml  # noqa: E402

TIMINGS: dict[str, float] = {}
FIGURES: dict[str, float] = {}


def log(msg: str) -> None:
    print(f"[cluster-e2e] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ netns


_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000


def setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path})")
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------ helpers


class Kube:
    def __init__(self, kubeconfig: str):
        self.kubeconfig = kubeconfig
        # Host directory of the gateways' usage volumes (set by the fixture).
        self.usage_dir = Path()

    def run(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        cmd = ["kubectl", f"--kubeconfig={self.kubeconfig}", *args]
        p = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
        return p.stdout

    def apply(self, objects: list[dict[str, Any]]) -> None:
        # --validate=false: kubectl 1.32 validates against its own schemas, which know fields 1.20 lacks.
        self.run("apply", "--validate=false", "-f", "-", input=yaml.safe_dump_all(objects))

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json"))

    def pods(self, selector: str) -> list[dict[str, Any]]:
        return self.json("get", "pods", "-n", NS, "-l", selector)["items"]

    def wait_ready(self, selector: str, count: int, timeout: float = 180) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            pods = [p for p in self.pods(selector) if not p["metadata"].get("deletionTimestamp")]
            ready = [p for p in pods if is_ready(p)]
            if len(ready) == count and len(pods) == count:
                return ready
            if time.monotonic() > deadline:
                detail = self.run("describe", "pods", "-n", NS, "-l", selector, check=False)
                raise TimeoutError(f"{selector}: {len(ready)}/{count} ready after {timeout}s\n{detail[-4000:]}")
            time.sleep(1)


def is_ready(pod: dict[str, Any]) -> bool:
    for c in pod.get("status", {}).get("conditions", []):
        if c["type"] == "Ready":
            return c["status"] == "True"
    return False


def render(chart: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(str(chart)) as loaded:
        manifests = loaded.render(values, name=RELEASE, namespace=NS)
    objects: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def get(url: str, timeout: float = 5) -> str:
    import requests

    r = requests.get(url, timeout=timeout, headers={"authorization": f"Bearer {ADMIN_KEY}"})
    r.raise_for_status()
    return r.text


def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if labels and any(got.get(k) != v for k, v in labels.items()):
            continue
        total += float(m.group(3))
    return total


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and m.group(1) == name:
            out.append((dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")), float(m.group(3))))
    return out


# ------------------------------------------------------------------------------------------ values


def worker_deployment() -> dict[str, Any]:
    """Three vllm-sim pods, each binding its KV-event publisher and replay socket in its own pod."""
    kv = {"kv-events": 5557, "kv-replay": 5558}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm-sim", "namespace": NS},
        "spec": {
            "replicas": WORKERS,
            "selector": {"matchLabels": {"app": "vllm-sim"}},
            "template": {
                "metadata": {
                    "labels": {"app": "vllm-sim", "kinference.ai/worker": "true", "kinference.ai/model": MODEL},
                    "annotations": {
                        "kinference.ai/http-port": "8000",
                        "kinference.ai/kv-events-port": str(kv["kv-events"]),
                        "kinference.ai/kv-replay-port": str(kv["kv-replay"]),
                    },
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "ghcr.io/kinference/vllm-sim:0.1.0",
                            "imagePullPolicy": "Never",
                            "args": [
                                "--host=0.0.0.0",
                                "--port=8000",
                                f"--model={MODEL}",
                                "--time-scale=0.05",
                                f"--kv-events-endpoint=tcp://*:{kv['kv-events']}",
                                f"--kv-replay-endpoint=tcp://*:{kv['kv-replay']}",
                                f"--kv-topic=kv@$(POD_NAME)@{MODEL}",
                            ],
                            "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                            "ports": [
                                {"name": "http", "containerPort": 8000},
                                {"name": "kv-events", "containerPort": kv["kv-events"]},
                                {"name": "kv-replay", "containerPort": kv["kv-replay"]},
                            ],
                            "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2},
                            "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]},
                            },
                        }
                    ],
                },
            },
        },
    }


def chart_values(tokenizer_dir: Path) -> dict[str, Any]:
    # No kube-proxy in this harness: in-cluster clients reach the API server at the node's address.
    api_env = [
        {"name": "KUBERNETES_SERVICE_HOST", "value": NODE_IP},
        {"name": "KUBERNETES_SERVICE_PORT", "value": "16443"},
    ]
    small = {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "1Gi"}}
    return {
        "gateway": {
            "replicas": 2,
            "image": {"pullPolicy": "Never"},
            "resources": small,
            "podDisruptionBudget": {"enabled": False},
            "terminationGracePeriodSeconds": 30,
            "extraEnv": api_env,
            "adminKey": {"existingSecret": "e2e-admin-key", "secretKey": "api-key"},
            "config": {
                "routing": "kinference",
                "models": [{"name": MODEL, "tokenizer_dir": "/tokenizers/qwen2"}],
                # Cluster mode: the five kinds watched in the namespace, status written by the Lease holder.
                "crds": {"namespaces": [NS], "lease_duration_s": 5},
            },
            "secretNames": sorted([*SECRETS, LATE_SECRET]),
            # The test's tenants have no limits: each replica enforcing them on its own changes nothing.
            "tenancy": {"allowPerReplicaLimits": True},
            # Each pod's usage journal on its own claim, bound to the hostPath volumes the test makes.
            "usage": {"persistence": {"storageClassName": USAGE_CLASS, "size": "64Mi"}},
            "extraVolumes": [
                {"name": "tokenizers", "hostPath": {"path": str(tokenizer_dir), "type": "Directory"}}
            ],
            "extraVolumeMounts": [{"name": "tokenizers", "mountPath": "/tokenizers/qwen2", "readOnly": True}],
            "readinessProbe": {"periodSeconds": 2, "initialDelaySeconds": 1},
            # Picker mode: standard InferencePools naming the extproc Service are served too.
            "extproc": {"servesStandardPools": True},
        },
        "agent": {
            "image": {"pullPolicy": "Never"},
            "resources": small,
            "extraEnv": api_env,
            # The workers bind their own publishers (annotation kinference.ai/kv-events-port): no shared
            # KV Service (its internalTrafficPolicy field is 1.21+ anyway).
            "kvEvents": {"service": False},
            "readinessProbe": {"periodSeconds": 2, "initialDelaySeconds": 1},
        },
    }


def kinference_objects() -> list[dict[str, Any]]:
    """What the gateway serves in cluster mode: the model, one pool of every worker pod (selector), and
    two tenants whose keys live in Secrets."""
    return [
        *(secret(name, key) for name, key in {**SECRETS, "e2e-admin-key": ADMIN_KEY}.items()),
        {
            "apiVersion": "kinference.ai/v1alpha1",
            "kind": "InferenceModel",
            "metadata": {"name": MODEL, "namespace": NS},
            "spec": {"servedName": MODEL},
        },
        pool("sim", selector={"matchLabels": {"kinference.ai/worker": "true"}, "targetPort": 8000}),
        tenant("workload", "e2e-workload-key"),
        tenant("probe", "e2e-probe-key"),
    ]


def secret(name: str, key: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NS},
        "stringData": {"api-key": key},
    }


def tenant(name: str, secret_name: str) -> dict[str, Any]:
    """An InferenceTenant whose one API key is `api-key` in the Secret `secret_name`."""
    return {
        "apiVersion": "kinference.ai/v1alpha1",
        "kind": "InferenceTenant",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"apiKeys": [{"secretRef": {"name": secret_name, "key": "api-key"}}]},
    }


def usage_volumes(root: Path) -> list[dict[str, Any]]:
    """One PersistentVolume per gateway replica for the chart's usage claims, on host directories the
    gateway's user (65532) can write."""
    volumes = []
    for i in range(2):
        path = root / f"usage-{i}"
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, 65532, 65532)
        volumes.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": f"e2e-usage-{i}"},
                "spec": {
                    "capacity": {"storage": "64Mi"},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": USAGE_CLASS,
                    "persistentVolumeReclaimPolicy": "Retain",
                    "hostPath": {"path": str(path), "type": "Directory"},
                },
            }
        )
    return volumes


def pool(name: str, **where: Any) -> dict[str, Any]:
    """An InferencePool of the model; `where` is `selector=` or `endpoints=`."""
    return {
        "apiVersion": "kinference.ai/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "models": [MODEL],
            "gpuClass": "sim",
            "locality": "Local",
            **where,
            "prices": {"cachedInputPerMillion": 0.0, "uncachedInputPerMillion": 0.1, "outputPerMillion": 0.2},
        },
    }


# ------------------------------------------------------------------------------------------ fixture


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the cluster e2e needs root (network namespace, containerd, kubelet)")
    archives = sorted(IMAGES.glob("*.oci.tar"))
    names = {a.name for a in archives}
    missing = {f"{n}.oci.tar" for n in ("kinference-gateway", "kinference-agent", "vllm-sim")} - names
    if missing:
        pytest.fail(f"images missing in {IMAGES}: {sorted(missing)}; run `cargo xtask images`")
    tokenizer = Path(os.environ.get("KINFERENCE_TOKENIZER_DIR", REPO / ".assets" / "qwen2")).resolve()
    t0 = time.monotonic()
    subprocess.run(["bash", str(CLUSTER / "build.sh")], check=True, capture_output=True)
    TIMINGS["build (cached check)"] = time.monotonic() - t0
    d = tmp_path_factory.mktemp("cluster")
    t0 = time.monotonic()
    p = subprocess.run(
        ["bash", str(CLUSTER / "start.sh"), str(d), *map(str, archives)], capture_output=True, text=True
    )
    if p.returncode != 0:
        subprocess.run(["bash", str(CLUSTER / "stop.sh"), str(d)])
        pytest.fail(f"cluster did not start:\n{p.stderr[-3000:]}")
    TIMINGS["cluster start"] = time.monotonic() - t0
    kubeconfig = p.stdout.strip().splitlines()[-1]
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        setns(f"/var/run/netns/{NETNS}")
        kube = Kube(kubeconfig)
        t0 = time.monotonic()
        install(kube, tokenizer, d / "usage")
        TIMINGS["install"] = time.monotonic() - t0
        kube.usage_dir = d / "usage"
        yield kube
    finally:
        try:
            if _libc.setns(own, CLONE_NEWNET) != 0:
                log("could not return to the original network namespace")
        finally:
            os.close(own)
            if os.environ.get("KINFERENCE_KEEP_CLUSTER") != "1":
                subprocess.run(["bash", str(CLUSTER / "stop.sh"), str(d)])
            log("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items()))
            log("figures: " + ", ".join(f"{k} {v:.3f}" for k, v in FIGURES.items()))


def install(kube: Kube, tokenizer: Path, usage: Path) -> None:
    crds = render(CHARTS / "kinference-crds", {})
    crds += [yaml.safe_load(p.read_text()) for p in sorted((CHARTS / "kinference-crds" / "crds").glob("*.yaml"))]
    kube.apply(crds)
    for c in crds:
        if c["kind"] == "CustomResourceDefinition":
            kube.run("wait", "--for=condition=Established", "--timeout=60s", f"crd/{c['metadata']['name']}")
    # The standard InferencePool's CRD, as a Gateway with the Inference Extension has it installed.
    standard = for_kubernetes_1_20(yaml.safe_load(STANDARD_POOL_CRD.read_text()))
    kube.apply([standard])
    kube.run("wait", "--for=condition=Established", "--timeout=60s", f"crd/{standard['metadata']['name']}")
    kube.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}])
    # ServiceAccount admission needs the namespace's default account's token before pods can be created.
    deadline = time.monotonic() + 60
    while "default-token" not in kube.run("get", "secrets", "-n", NS, check=False):
        assert time.monotonic() < deadline, "no default ServiceAccount token in the namespace"
        time.sleep(0.5)
    kube.apply([worker_deployment(), *kinference_objects(), *usage_volumes(usage)])
    objects = render(CHARTS / "kinference", chart_values(tokenizer))
    gateway = [o for o in objects if o["kind"] == "StatefulSet"]
    rest = [o for o in objects if o["kind"] != "StatefulSet"]
    kube.apply(rest)
    kube.wait_ready("app=vllm-sim", WORKERS)
    kube.wait_ready("app.kubernetes.io/component=agent", 1)
    # Gateways follow agents at runtime; starting them once the agent is Ready keeps the first routed
    # requests cache-aware.
    kube.apply(gateway)
    kube.wait_ready("app.kubernetes.io/component=gateway", 2)


# ------------------------------------------------------------------------------------------ views


def gateway_pods(kube: Kube) -> list[dict[str, Any]]:
    return kube.wait_ready("app.kubernetes.io/component=gateway", 2)


def gateway_endpoints(kube: Kube) -> list[str]:
    """The gateway Service's ready endpoints (host:port of the http port)."""
    svc = f"{RELEASE}-gateway"
    ep = kube.json("get", "endpoints", "-n", NS, svc)
    out = []
    for subset in ep.get("subsets", []):
        port = next(p["port"] for p in subset["ports"] if p.get("name") == "http")
        out += [f"{a['ip']}:{port}" for a in subset.get("addresses", [])]
    return sorted(out)


def worker_pods(kube: Kube) -> list[dict[str, Any]]:
    return kube.wait_ready("app=vllm-sim", WORKERS)


def agent_metrics(kube: Kube) -> str:
    pod = kube.wait_ready("app.kubernetes.io/component=agent", 1)[0]
    return get(f"http://{pod['status']['podIP']}:9091/metrics")


def worker_hits(kube: Kube) -> dict[str, tuple[float, float]]:
    out = {}
    for p in worker_pods(kube):
        text = get(f"http://{p['status']['podIP']}:8000/metrics")
        out[p["status"]["podIP"]] = (
            metric(text, "vllm:prefix_cache_hits_total"),
            metric(text, "vllm:prefix_cache_queries_total"),
        )
    return out


def hit_rate(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> float:
    hits = sum(after[k][0] - before[k][0] for k in after)
    queries = sum(after[k][1] - before[k][1] for k in after)
    return hits / queries if queries else 0.0


# ------------------------------------------------------------------------------------------ workload


def system_prompt(group: int, salt: str) -> str:
    rng = random.Random(f"{salt}-{group}")
    words = [rng.choice(["policy", "ledger", "orbit", "cobalt", "harbor", "meadow", "signal", "quartz"]) for _ in range(400)]
    return f"You are assistant {salt}-{group}. " + " ".join(words)


def send_openai(base: str, system: str, question: str, key: str = API_KEY) -> str:
    import openai

    client = openai.OpenAI(
        base_url=f"http://{base}/v1", api_key=key, max_retries=0, timeout=60, default_headers=ADMIN
    )
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=8,
    )
    raw.parse()
    return raw.headers.get("x-kinference-worker", "")


def send_anthropic(base: str, system: str, question: str, key: str = API_KEY) -> str:
    import anthropic

    client = anthropic.Anthropic(
        base_url=f"http://{base}", api_key=key, max_retries=0, timeout=60, default_headers=ADMIN
    )
    raw = client.messages.with_raw_response.create(
        model=MODEL, system=system, messages=[{"role": "user", "content": question}], max_tokens=8
    )
    raw.parse()
    return raw.headers.get("x-kinference-worker", "")


GROUPS = 6
PER_GROUP = 8


def run_workload(targets: list[str], salt: str, sdk_by_group: bool) -> list[tuple[int, str]]:
    """Each prefix group: one request, a pause (events reach the agent and the gateways), then the rest
    concurrently. Request i of a group goes to targets[i % len(targets)]. Returns (group, worker) pairs."""
    results: list[tuple[int, str]] = []

    def one(group: int, i: int) -> tuple[int, str]:
        send = send_anthropic if (sdk_by_group and group % 2) else send_openai
        return group, send(targets[i % len(targets)], system_prompt(group, salt), f"question {i} of {group}?")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for g in range(GROUPS):
            results.append(one(g, 0))
        time.sleep(1.5)
        futures = [pool.submit(one, g, i) for g in range(GROUPS) for i in range(1, PER_GROUP)]
        results += [f.result() for f in futures]
    return results


# ------------------------------------------------------------------------------------------ tests


def test_agent_loaded_ebpf_without_privilege(cluster: Kube):
    pod = cluster.wait_ready("app.kubernetes.io/component=agent", 1)[0]
    sc = pod["spec"]["containers"][0]["securityContext"]
    assert sc.get("privileged") in (None, False)
    assert "ALL" in sc["capabilities"]["drop"]
    text = agent_metrics(cluster)
    states = samples(text, "kinference_agent_ebpf_program_state")
    log(f"agent eBPF programs attached: {sorted(s[0]['program'] for s in states if s[1] == 1 and s[0].get('state') == 'attached')}")
    assert states, "the agent reports no eBPF program state"
    loaded = [s for s in states if s[1] == 1 and s[0].get("state") == "attached"]
    assert loaded, f"no eBPF program attached in the agent's container: {states}"


def test_routing_through_both_replicas_beats_random(cluster: Kube):
    kube = cluster
    endpoints = gateway_endpoints(kube)
    assert len(endpoints) == 2, f"gateway Service endpoints: {endpoints}"
    workers = [f"{p['status']['podIP']}:8000" for p in worker_pods(kube)]

    t0 = time.monotonic()
    before = worker_hits(kube)
    routed = run_workload(endpoints, "kinference", sdk_by_group=True)
    middle = worker_hits(kube)
    random_run = run_workload(random.Random(7).sample(workers, len(workers)), "random", sdk_by_group=False)
    # Random routing: the test itself sends each request to a worker picked at random.
    after = worker_hits(kube)
    TIMINGS["workload"] = time.monotonic() - t0
    del random_run

    kinference_rate = hit_rate(before, middle)
    random_rate = hit_rate(middle, after)
    log(f"prefix-cache hit rate: Kinference {kinference_rate:.3f}, random {random_rate:.3f}")
    FIGURES["hit rate, random routing"] = random_rate

    # Every request reports its worker; follow-ups land on the worker that holds their prefix.
    assert all(w for _, w in routed), routed
    first = {g: w for g, w in routed[:GROUPS]}
    follow = routed[GROUPS:]
    on_holder = sum(1 for g, w in follow if w == first[g])
    log(f"follow-up requests on the worker holding their prefix: {on_holder}/{len(follow)}")
    assert on_holder >= 0.8 * len(follow), (first, follow)
    assert len(set(first.values())) >= 2, f"all prefixes on one worker: {first}"
    assert kinference_rate > random_rate + 0.05, (kinference_rate, random_rate)


def test_every_workers_events_reach_the_agent(cluster: Kube):
    text = agent_metrics(cluster)
    batches = samples(text, "kinference_agent_kv_batches_total")
    by_worker: dict[str, float] = {}
    for labels, v in batches:
        key = labels.get("worker", "")
        by_worker[key] = by_worker.get(key, 0) + v
    ips = [p["status"]["podIP"] for p in worker_pods(cluster)]
    log(f"KV batches per worker at the agent: {by_worker}")
    for ip in ips:
        got = sum(v for k, v in by_worker.items() if ip in k)
        assert got > 0, f"no KV events from the worker at {ip}: {by_worker}"


def test_both_replicas_hold_the_same_cache_view(cluster: Kube):
    views = []
    deadline = time.monotonic() + 20
    while True:
        views = []
        for p in gateway_pods(cluster):
            text = get(f"http://{p['status']['podIP']}:9090/metrics")
            views.append(
                (
                    metric(text, "kinference_routing_index_pairs"),
                    metric(text, "kinference_routing_agent_connected"),
                )
            )
        if views[0][0] > 0 and views[0][0] == views[1][0]:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(1)
    log(f"gateway views (index pairs, agents connected): {views}")
    assert all(v[1] >= 1 for v in views), f"a replica has no agent stream: {views}"
    assert views[0][0] > 0 and views[0][0] == views[1][0], views


def test_agent_port_is_mutual_tls_by_default(cluster: Kube):
    """The default install generates certificates and the agents serve gRPC over mTLS: the gateways above hold
    their streams over it, and a plaintext HTTP/2 client is refused during the handshake (and counted)."""
    pod = cluster.wait_ready("app.kubernetes.io/component=agent", 1)[0]
    args = pod["spec"]["containers"][0]["args"]
    assert "--grpc-tls-client-names=kinference-gateway" in args, args
    port = next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "grpc")
    with socket.create_connection((pod["status"]["podIP"], port), timeout=5) as conn:
        conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        conn.settimeout(5)
        try:
            answer = conn.recv(64)
        except OSError:
            answer = b""
    assert not answer.startswith(b"\x00\x00"), f"the agent spoke plaintext HTTP/2: {answer!r}"
    deadline = time.monotonic() + 15
    while True:
        refused = samples(agent_metrics(cluster), "kinference_tls_handshakes_refused_total")
        if any(s[1] >= 1 for s in refused):
            break
        assert time.monotonic() < deadline, f"the plaintext attempt was not counted: {refused}"
        time.sleep(1)
    log(f"agent TLS refusals: {refused}")


# ------------------------------------------------------------------------------------------ life cycle


def stream_once(base: str, i: int) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://{base}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"stream {i}: " + "tell me a story " * 20}],
        max_tokens=32,
        stream=True,
    )
    chunks = sum(1 for _ in stream)
    assert chunks > 1, f"stream {i} had {chunks} chunks"


def accounted(kube: Kube) -> dict[str, int]:
    """Requests each gateway pod has accounted for the workload's tenant (`/admin/usage`), by pod name."""
    return {pod: requests for pod, (requests, _) in billed(kube).items()}


def test_rollout_restart_under_streaming_load_fails_no_request(cluster: Kube):
    """`kubectl rollout restart` of the gateway while 4 clients stream without pause. Like kube-proxy, the
    clients follow the Service's ready endpoints (re-read every 0.5 s); no request may fail. Each new pod
    replays the usage journal its predecessor wrote on the pod's claim: its usage report keeps the requests."""
    kube = cluster
    old = {p["metadata"]["uid"] for p in gateway_pods(kube)}
    endpoints = {"list": gateway_endpoints(kube)}
    stop = time.monotonic() + 240
    done = {"flag": False}
    failures: list[str] = []
    count = {"n": 0}

    def refresh() -> None:
        while not done["flag"]:
            try:
                eps = gateway_endpoints(kube)
                if eps:
                    endpoints["list"] = eps
            except Exception:  # noqa: BLE001 - a failed read keeps the last list
                pass
            time.sleep(0.5)

    def client(k: int) -> None:
        i = 0
        while not done["flag"]:
            eps = endpoints["list"]
            base = eps[(k + i) % len(eps)]
            try:
                stream_once(base, i)
                count["n"] += 1
            except Exception as e:  # noqa: BLE001 - every failure is recorded
                failures.append(f"{base}: {type(e).__name__}: {e}")
            i += 1

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        pool.submit(refresh)
        clients = [pool.submit(client, k) for k in range(4)]
        time.sleep(3)
        before, streamed_before = accounted(kube), count["n"]
        t0 = time.monotonic()
        kube.run("rollout", "restart", "-n", NS, GATEWAY)
        kube.run("rollout", "status", "-n", NS, GATEWAY, "--timeout=200s", timeout=210)
        while time.monotonic() < stop:
            uids = {p["metadata"]["uid"] for p in kube.pods("app.kubernetes.io/component=gateway")}
            if not uids & old:
                break
            time.sleep(1)
        TIMINGS["rollout restart"] = time.monotonic() - t0
        time.sleep(3)
        done["flag"] = True
        for c in clients:
            c.result()
    log(f"rollout restart: {count['n']} streams, {len(failures)} failed: {failures[:5]}")
    assert count["n"] > 20
    assert not failures, failures[:10]

    # The usage journals survived the restart: the new pods (same names, same claims) account for every
    # request of the workload's tenant, those their predecessors served included. Without the journals they
    # would hold only what they served themselves since they started.
    time.sleep(1)
    after = accounted(kube)
    streamed = count["n"] - streamed_before
    journals = list(kube.usage_dir.glob("usage-*/*.jsonl"))
    records = sum(len(j.read_bytes().splitlines()) for j in journals)
    size = sum(j.stat().st_size for j in journals)
    log(f"requests accounted per pod before the restart {before}, after {after}; streamed since: {streamed}")
    log(f"usage journals on the claims: {records} lines, {size} bytes")
    assert sum(after.values()) >= sum(before.values()) + streamed - CLIENTS, (before, after, streamed)
    FIGURES["usage journal bytes per record"] = size / max(records, 1)


def test_agent_pod_replaced_gateways_follow(cluster: Kube):
    kube = cluster
    old = kube.wait_ready("app.kubernetes.io/component=agent", 1)[0]
    kube.run("delete", "pod", "-n", NS, old["metadata"]["name"], "--wait=true", timeout=90)
    new = kube.wait_ready("app.kubernetes.io/component=agent", 1)[0]
    assert new["metadata"]["name"] != old["metadata"]["name"]
    # Connected to the new pod's address (the old one is gone), by the same gateway processes.
    agent = {"agent": f"http://{new['status']['podIP']}:7070"}
    gateways = {p["metadata"]["name"]: p["status"]["podIP"] for p in gateway_pods(kube)}
    t0 = time.monotonic()
    deadline = t0 + 30
    while True:
        connected = [
            metric(get(f"http://{ip}:9090/metrics"), "kinference_routing_agent_connected", agent)
            for ip in gateways.values()
        ]
        if all(c >= 1 for c in connected):
            break
        assert time.monotonic() < deadline, f"gateways not connected to the new agent pod {agent}: {connected}"
        time.sleep(1)
    TIMINGS["gateways follow the new agent pod"] = time.monotonic() - t0
    restarts = [p["status"]["containerStatuses"][0]["restartCount"] for p in gateway_pods(kube)]
    assert {p["metadata"]["name"] for p in gateway_pods(kube)} == set(gateways) and restarts == [0, 0], restarts


def test_replicas_find_each_other_and_share_dispatches(cluster: Kube):
    """gateway.replicaSharing (the chart's default): each replica finds the other from the gateway
    Service's endpoints and hears from it (`replica_peers` counts peers whose batches arrived: found,
    reachable at the admin port through the NetworkPolicy-free test network, admin key accepted)."""
    admin = [f"http://{p['status']['podIP']}:9090" for p in gateway_pods(cluster)]
    assert len(admin) == 2, admin
    started = time.monotonic()
    while (peers := [metric(get(f"{a}/metrics"), "kinference_routing_replica_peers") for a in admin]) != [1, 1]:
        assert time.monotonic() < started + 30, f"replicas' peers after 30 s: {peers}"
        time.sleep(0.5)
    dropped = [metric(get(f"{a}/metrics"), "kinference_routing_replica_notes_dropped_total") for a in admin]
    log(f"replica sharing: each replica hears from {peers} peer(s); notes dropped {dropped}")


def test_extproc_picker_port_is_served(cluster: Kube):
    """The chart's ext_proc picker: its Service selects the gateway pods and each one listens on it (the
    gRPC protocol itself is tested by the gateway's own ext_proc tests; no Envoy binary can run here)."""
    import socket

    ep = cluster.json("get", "endpoints", "-n", NS, f"{RELEASE}-gateway-extproc")
    addresses = [(a["ip"], s["ports"][0]["port"]) for s in ep.get("subsets", []) for a in s.get("addresses", [])]
    assert len(addresses) == 2, ep
    for ip, port in addresses:
        with socket.create_connection((ip, port), timeout=5):
            pass


def replay(picker: str, body: dict[str, Any], subset: list[str]) -> dict[str, Any]:
    """One request as a Gateway's Envoy sends it through the picker at `picker` (ext_proc,
    `FULL_DUPLEX_STREAMED`, the standard's mode): `bench/src/bin/extproc-replay`, the gateway tests'
    proxy's-eye client, forwards it to the endpoint picked and replays the response phases."""
    binary = Path(os.environ.get("KINFERENCE_BIN_DIR", REPO / "target" / "debug")) / "extproc-replay"
    if not binary.exists():
        pytest.fail(f"{binary} missing: cargo build -p kinference-bench --bin extproc-replay")
    args = [str(binary), "--picker", picker, "--header", f"authorization: Bearer {API_KEY}", "--body", json.dumps(body)]
    for endpoint in subset:
        args += ["--subset", endpoint]
    p = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def billed(kube: Kube) -> dict[str, tuple[int, int]]:
    """(requests, output tokens) each gateway pod has billed to the workload's tenant, by pod name."""
    out = {}
    for p in gateway_pods(kube):
        report = json.loads(get(f"http://{p['status']['podIP']}:9090/admin/usage"))
        rows = [r for r in report["usage"] if r["tenant"] == "workload"]
        out[p["metadata"]["name"]] = (sum(r["requests"] for r in rows), sum(r["output_tokens"] for r in rows))
    return out


def gateway_logs(kube: Kube, needle: str) -> str:
    """The gateway pods' log lines that contain `needle` (the last 20 of each)."""
    out = []
    for p in gateway_pods(kube):
        lines = kube.run("logs", "-n", NS, p["metadata"]["name"], check=False).splitlines()
        out += [f"{p['metadata']['name']}: {line}" for line in lines if needle in line][-20:]
    return "\n".join(out)


def standard_worker() -> dict[str, Any]:
    """One vllm-sim pod only a standard InferencePool selects: not labelled for the chart's worker
    discovery (`kinference.ai/worker=true`), so the gateways can know it from the pool alone."""
    d = json.loads(json.dumps(worker_deployment()))
    d["metadata"]["name"] = "vllm-sim-standard"
    d["spec"]["replicas"] = 1
    d["spec"]["selector"] = {"matchLabels": {"app": "vllm-sim-standard"}}
    d["spec"]["template"]["metadata"]["labels"] = {"app": "vllm-sim-standard", "kinference.ai/model": MODEL}
    return d


def standard_pool(picker_service: str) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "standard", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm-sim-standard"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": picker_service, "port": {"number": 9002}, "failureMode": "FailClose"},
        },
    }


def test_standard_inference_pool_is_served_by_the_picker(cluster: Kube):
    """Kinference as the endpoint picker of a standard `inference.networking.k8s.io/v1` InferencePool
    (the chart's `gateway.extproc.servesStandardPools`): a pool whose `endpointPickerRef` names the
    picker Service brings its pod's `podIP:port` into both replicas' routing within seconds; requests
    replayed through each replica's ext_proc port as Envoy sends them (full duplex, a stream, the
    subset hint naming the pool's endpoint) are routed there, served and billed to the tenant. Before
    the pool, and once it names another picker, the same request is refused (503, no eligible
    endpoint): the endpoint came from the standard pool alone (Kinference's pool of the same pods
    gives it prices and locality, not membership)."""
    kube = cluster
    picker_service = f"{RELEASE}-gateway-extproc"
    ep = kube.json("get", "endpoints", "-n", NS, picker_service)
    pickers = [f"{a['ip']}:{s['ports'][0]['port']}" for s in ep.get("subsets", []) for a in s.get("addresses", [])]
    assert len(pickers) == 2, ep
    # Kinference's own pool of the same pods (prices, locality: what governance needs), as
    # deploy/examples/standard-pool.yaml pairs them. It only selects among discovered workers: alone,
    # it finds none.
    members = pool("standard-members", selector={"matchLabels": {"app": "vllm-sim-standard"}, "targetPort": 8000})
    kube.apply([standard_worker(), members])
    kube.wait_ready("app=vllm-sim-standard", 1)
    pod = kube.json("get", "pods", "-n", NS, "-l", "app=vllm-sim-standard")["items"][0]
    endpoint = f"{pod['status']['podIP']}:8000"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "standard pool: " + "route me " * 30}],
        "max_tokens": 8,
        "stream": True,
    }

    def answers() -> list[tuple[int, str | None]]:
        return [(a["status"], a["destination"]) for a in (replay(p, body, [endpoint]) for p in pickers)]

    try:
        assert answers() == [(503, None)] * 2, "the pool's endpoint is unknown before the pool exists"
        applied = time.monotonic()
        kube.apply([standard_pool(picker_service)])
        while (got := answers()) != [(200, endpoint)] * 2:
            assert time.monotonic() < applied + 30, (
                f"standard pool applied 30 s ago, replicas answer {got}; gateway logs:\n{gateway_logs(kube, 'tandard')}"
            )
            time.sleep(0.5)
        TIMINGS["standard pool applied -> both pickers route to it"] = time.monotonic() - applied
        # What the client gets: the stream as the worker sent it, through the response phases; each
        # replica bills its own stream, output tokens included (read from the usage chunk the picker
        # asked the worker for).
        before = billed(kube)
        routed = [replay(p, body, [endpoint]) for p in pickers]
        for a in routed:
            assert a["served"] == endpoint and "data: [DONE]" in a["body"], a
            assert json.loads(a["sent_body"])["stream_options"]["include_usage"] is True, a["sent_body"]
        deadline = time.monotonic() + 10
        while not all(billed(kube)[pod][0] == before[pod][0] + 1 for pod in before):
            assert time.monotonic() < deadline, f"routed streams not billed: {before} -> {billed(kube)}"
            time.sleep(0.2)
        after = billed(kube)
        assert all(after[pod][1] > before[pod][1] for pod in before), (before, after)
        log(f"standard pool: {endpoint} served through both pickers; (requests, output tokens) {before} -> {after}")
        # The pool now names another picker: Kinference stops serving it.
        changed = time.monotonic()
        kube.apply([standard_pool("someone-else")])
        while (got := answers()) != [(503, None)] * 2:
            assert time.monotonic() < changed + 30, f"pool handed to another picker 30 s ago: {got}"
            time.sleep(0.5)
        TIMINGS["standard pool handed to another picker -> endpoint gone"] = time.monotonic() - changed
    finally:
        kube.run(
            "delete", "-n", NS, "deployment/vllm-sim-standard", "inferencepools.inference.networking.k8s.io/standard",
            "inferencepools.kinference.ai/standard-members", check=False,
        )


# ------------------------------------------------------------------------------------------ Gateway API


def for_kubernetes_1_20(schema: Any) -> Any:
    """The schema less what this 1.20 apiserver cannot take: `x-kubernetes-validations` (CEL rules,
    1.25+) and `default: ""` (1.20 turns it into null, then refuses null for a string)."""
    if isinstance(schema, dict):
        return {
            k: for_kubernetes_1_20(v)
            for k, v in schema.items()
            if k != "x-kubernetes-validations" and not (k == "default" and v == "")
        }
    if isinstance(schema, list):
        return [for_kubernetes_1_20(v) for v in schema]
    return schema


def test_gateway_api_example_applies_against_the_gateway_api_crds(cluster: Kube):
    """deploy/gateway-api/ (the Gateway and HTTPRoute install.md applies) against the vendored Gateway API
    v1.5.1 Standard CRDs: the apiserver accepts it, refuses a broken route, and the route's backend is
    the gateway Service the chart created, on its client port."""
    kube = cluster
    crds = [for_kubernetes_1_20(yaml.safe_load(p.read_text())) for p in sorted(GATEWAY_API_CRDS.glob("*.yaml"))]
    kube.apply(crds)
    for c in crds:
        kube.run("wait", "--for=condition=Established", "--timeout=60s", f"crd/{c['metadata']['name']}")
    example = [
        doc
        for name in ("gateway.yaml", "httproute.yaml")
        for doc in yaml.safe_load_all((REPO / "deploy" / "gateway-api" / name).read_text())
        if doc
    ]
    out = kube.run("apply", "-f", "-", input=yaml.safe_dump_all(example))
    log(f"Gateway API example applied: {out.strip()}")
    route = kube.json("get", "httproute", "-n", NS, "kinference")
    service = kube.json("get", "service", "-n", NS, f"{RELEASE}-gateway")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert backend["name"] == service["metadata"]["name"]
    assert backend["port"] in [p["port"] for p in service["spec"]["ports"] if p["name"] == "http"], service
    # The schema is enforced: a path match type the API does not have is refused.
    broken = [o for o in example if o["kind"] == "HTTPRoute"][0]
    broken = json.loads(json.dumps(broken))
    broken["metadata"]["name"] = "broken"
    broken["spec"]["rules"][0]["matches"][0]["path"]["type"] = "Prefix"
    p = subprocess.run(
        ["kubectl", f"--kubeconfig={kube.kubeconfig}", "apply", "--dry-run=server", "-f", "-"],
        input=yaml.safe_dump(broken),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0 and "Prefix" in p.stderr, (p.returncode, p.stderr)
    # Picker mode's examples: each Gateway implementation's Gateway, and both pools with the HTTPRoute to
    # the standard one, taken by the apiserver (server-side dry run: nothing is created).
    for name in ("gateways/envoy-gateway.yaml", "gateways/istio.yaml", "standard-pool.yaml"):
        docs = [d for d in yaml.safe_load_all((REPO / "deploy" / "examples" / name).read_text()) if d]
        p = subprocess.run(
            ["kubectl", f"--kubeconfig={kube.kubeconfig}", "apply", "-n", NS, "--dry-run=server", "-f", "-"],
            input=yaml.safe_dump_all(docs),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, (name, p.stderr)


# ------------------------------------------------------------------------------------------ scaling

CLIENTS = 4


def scaling_prompt(n: int, salt: str) -> tuple[str, str]:
    """Request n of the scaling workload: four prefix groups at a time, each asked six times, then the
    next four begin, so new prefixes keep arriving while the worker set changes."""
    active, repeats = 4, 6
    group = (n // (active * repeats)) * active + n % active
    return system_prompt(group, salt), f"question {n} of {group}?"


def pod_urls(kube: Kube) -> set[str]:
    """vllm-sim pods that are ready and not terminating, as the gateways name them."""
    return {
        f"http://{p['status']['podIP']}:8000"
        for p in kube.pods("app=vllm-sim")
        if is_ready(p) and not p["metadata"].get("deletionTimestamp")
    }


def gateway_worker_sets(kube: Kube) -> list[set[str]]:
    """Each gateway's candidate workers: the healthy ones it lists (a worker that left is no longer listed)."""
    sets = []
    for p in gateway_pods(kube):
        body = json.loads(get(f"http://{p['status']['podIP']}:9090/healthz/workers"))
        sets.append({w["url"] for w in body["workers"] if w["healthy"]})
    return sets


def gateway_listed(kube: Kube) -> list[set[str]]:
    """Every worker each gateway lists in `/healthz/workers`, healthy or not."""
    return [
        {w["url"] for w in json.loads(get(f"http://{p['status']['podIP']}:9090/healthz/workers"))["workers"]}
        for p in gateway_pods(kube)
    ]


def wait_workers(kube: Kube, count: int, timeout: float = 90) -> tuple[set[str], float]:
    """Waits until `count` workers are ready and every gateway's worker set is exactly them."""
    t0 = time.monotonic()
    while True:
        urls = pod_urls(kube)
        sets = gateway_worker_sets(kube) if len(urls) == count else []
        if sets and all(s == urls for s in sets):
            return urls, time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"workers {urls}, gateways see {sets}"
        time.sleep(0.5)


class Counters:
    """The workers' prefix-cache counters, read every second while pods come and go: a pod's last reading
    counts after it is gone, a new pod counts from zero."""

    def __init__(self, kube: Kube):
        self.kube = kube
        self.start = {u: c for u, c in self.read().items()}
        self.last = dict(self.start)
        self.stop = False

    def read(self) -> dict[str, tuple[float, float]]:
        out = {}
        for url in pod_urls(self.kube):
            try:
                text = get(f"{url}/metrics", timeout=2)
            except Exception:  # noqa: BLE001 - a pod going away
                continue
            out[url] = (metric(text, "vllm:prefix_cache_hits_total"), metric(text, "vllm:prefix_cache_queries_total"))
        return out

    def follow(self) -> None:
        while not self.stop:
            self.last.update(self.read())
            time.sleep(1)

    def hit_rate(self) -> float:
        self.last.update(self.read())
        hits = sum(c[0] - self.start.get(u, (0.0, 0.0))[0] for u, c in self.last.items())
        queries = sum(c[1] - self.start.get(u, (0.0, 0.0))[1] for u, c in self.last.items())
        return hits / queries if queries else 0.0


def test_workers_scaled_up_and_down_under_load(cluster: Kube):
    """vllm-sim 3 -> 5 -> 2 while four clients send a shared-prefix workload through the gateway Service:
    both gateways' worker sets follow the pods (no restart), the new workers get traffic, no request fails
    beyond those the removed workers held, and the prefix-cache hit rate beats random routing of the same
    workload on the three workers the test started with."""
    kube = cluster
    deployment = "deployment/vllm-sim"
    urls, _ = wait_workers(kube, WORKERS)

    # Random routing, the same workload shape: the test picks a worker at random for each request.
    rng = random.Random(11)
    counters = Counters(kube)
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        picks = [(n, rng.choice(sorted(urls))) for n in range(96)]
        direct = [(url.removeprefix("http://"), *scaling_prompt(n, "scale-random")) for n, url in picks]
        list(pool.map(lambda args: send_openai(*args), direct))
    random_rate = counters.hit_rate()

    counters = Counters(kube)
    done = {"flag": False, "n": 0}
    results: list[tuple[float, str]] = []
    failures: list[tuple[float, str]] = []
    targets = {"list": gateway_endpoints(kube)}

    def client() -> None:
        while not done["flag"]:
            n = done["n"]
            done["n"] += 1
            eps = targets["list"]
            started = time.monotonic()
            try:
                results.append((started, send_openai(eps[n % len(eps)], *scaling_prompt(n, "scale"))))
            except Exception as e:  # noqa: BLE001 - every failure is recorded
                failures.append((time.monotonic(), f"{type(e).__name__}: {e}"))

    with concurrent.futures.ThreadPoolExecutor(CLIENTS + 1) as pool:
        follow = pool.submit(counters.follow)
        clients = [pool.submit(client) for _ in range(CLIENTS)]
        try:
            time.sleep(2)
            kube.run("scale", "-n", NS, deployment, "--replicas=5")
            up, TIMINGS["gateways follow 3 -> 5 workers"] = wait_workers(kube, 5)
            time.sleep(4)
            scaled_up = time.monotonic()
            kube.run("scale", "-n", NS, deployment, "--replicas=2")
            down, TIMINGS["gateways follow 5 -> 2 workers"] = wait_workers(kube, 2)
            followed_down = time.monotonic()
            time.sleep(3)
        finally:
            done["flag"] = True
            counters.stop = True
        for c in [*clients, follow]:
            c.result()
    rate = counters.hit_rate()

    by_worker: dict[str, int] = {}
    for _, w in results:
        by_worker[w] = by_worker.get(w, 0) + 1
    log(f"scaling: {len(results)} requests ok, {len(failures)} failed {[f[1][:120] for f in failures[:4]]}")
    log(f"scaling: requests per worker {by_worker}")
    log(f"scaling: prefix-cache hit rate Kinference {rate:.3f}, random on {WORKERS} workers {random_rate:.3f}")
    FIGURES["hit rate while scaling 3 -> 5 -> 2"] = rate
    FIGURES["hit rate, random routing, scaling workload"] = random_rate
    new = up - urls
    assert all(by_worker.get(u, 0) > 0 for u in new), f"new workers {new} got no request: {by_worker}"
    # Once both gateways dropped the removed workers, nothing goes to them.
    late = {w for t, w in results if t > followed_down}
    assert late and late <= down, (late, down)
    # A removed worker may fail what it held when it stopped (the gateway retries only what failed before
    # the worker answered): failures only once scale-down began, at most one request per client.
    assert all(t > scaled_up for t, _ in failures), failures
    assert len(failures) <= CLIENTS, failures
    assert rate > random_rate + 0.05, (rate, random_rate)


# ------------------------------------------------------------------------------------------ CRDs


def printer_table(kube: Kube, resource: str) -> list[dict[str, str]]:
    """`kubectl get RESOURCE -o wide` as rows of {column: cell}, cut at the header's column starts."""
    lines = kube.run("get", resource, "-n", NS, "-o", "wide").splitlines()
    header = lines[0]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    names = header.split()
    rows = []
    for line in lines[1:]:
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], len(line) + 1])]
        rows.append(dict(zip(names, cells)))
    return rows


def status_code(send: Any) -> int:
    """The HTTP status of an SDK call (200 when it succeeds)."""
    try:
        send()
        return 200
    except Exception as e:  # noqa: BLE001 - the SDKs' status errors carry the code
        code = getattr(e, "status_code", None)
        if code is None:
            raise
        return int(code)


def test_crds_take_effect_through_the_gateway_service(cluster: Kube):
    """Cluster mode, as a platform team uses it: kubectl applies a tenant with its Secret, InferencePolicy /
    InferencePool objects, and rotates a tenant's Secret; through the gateway Service (both replicas)
    authentication and routing follow within seconds, status.conditions are written (printer columns), a
    broken edit is refused with the old generation still serving."""
    import requests

    kube = cluster
    endpoints = gateway_endpoints(kube)
    assert len(endpoints) == 2, endpoints

    # Authentication is the InferenceTenants' keys from their Secrets: no key or a wrong one is refused in
    # each client's protocol, on every replica.
    for base in endpoints:
        r = requests.post(f"http://{base}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = requests.post(f"http://{base}/v1/messages", json={"model": MODEL, "messages": []}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        assert status_code(lambda: send_anthropic(base, "hello", "hi", key="sk-wrong")) == 401

    # A tenant and its Secret applied now: its key goes from 401 to served on both replicas.
    system = system_prompt(99, "crd")

    def late() -> list[int]:
        return [status_code(lambda b=b: send_openai(b, system, "late", key=LATE_KEY)) for b in endpoints]

    assert late() == [401, 401]
    applied = time.monotonic()
    kube.apply([secret(LATE_SECRET, LATE_KEY), tenant("late", LATE_SECRET)])
    while (got := late()) != [200, 200]:
        assert time.monotonic() < applied + 10, f"the new tenant's key after 10 s: {got}"
        time.sleep(0.1)
    TIMINGS["tenant + Secret applied -> key served"] = time.monotonic() - applied

    # The probe tenant's prompt lands where the router puts it; a policy pins that tenant to another worker.
    home = send_openai(endpoints[0], system, "first", key=PROBE_KEY_OLD)
    target = sorted(gateway_worker_sets(kube)[0] - {home})[0]
    policy = {
        "apiVersion": "kinference.ai/v1alpha1",
        "kind": "InferencePolicy",
        "metadata": {"name": "pin-probe", "namespace": NS},
        "spec": {
            "priority": 10,
            "rules": [
                {"name": "pin", "match": {"tenants": ["probe"]}, "action": {"route": {"targets": [{"pool": "pinned"}]}}}
            ],
        },
    }
    kube.apply([pool("pinned", endpoints=[{"url": target}])])
    applied = time.monotonic()
    kube.apply([policy])
    deadline = applied + 10
    while True:
        landed = [send_openai(base, system, "pinned?", key=PROBE_KEY_OLD) for base in endpoints]
        if all(w == target for w in landed):
            break
        if time.monotonic() > deadline:
            states = kube.run("get", "inferencepolicies,inferencepools.kinference.ai", "-n", NS, "-o", "yaml")
            raise AssertionError(f"routing did not follow the policy: {landed}, want {target}\n{states[-3000:]}")
    took = TIMINGS["policy applied -> both replicas route by it"] = time.monotonic() - applied
    log(f"policy pin-probe: {home} -> {target} on both replicas in {took:.2f} s")

    def policy_status(want: dict[str, str], generation: int) -> dict[str, Any]:
        deadline = time.monotonic() + 15
        while True:
            obj = kube.json("get", "inferencepolicy", "-n", NS, "pin-probe")
            st = obj.get("status", {})
            got = {c["type"]: c["status"] for c in st.get("conditions", [])}
            if st.get("observedGeneration") == generation and all(got.get(k) == v for k, v in want.items()):
                return obj
            assert time.monotonic() < deadline, f"status of pin-probe: {st}, want {want} at generation {generation}"
            time.sleep(0.5)

    # Status, written by the Lease holder (one of the two gateway pods); the printer columns show it.
    policy_status({"Accepted": "True"}, 1)
    holder = kube.json("get", "lease", "-n", NS, "kinference-gateway-status")["spec"]["holderIdentity"]
    assert any(holder.startswith(p["metadata"]["name"]) for p in gateway_pods(kube)), holder
    row = next(r for r in printer_table(kube, "inferencepolicies") if r["NAME"] == "pin-probe")
    log(f"kubectl get inferencepolicies -o wide: {row}")
    assert row["ACCEPTED"] == "True" and row["SERVING"] == "1", row

    # A broken edit (a route to a pool that does not exist) is refused: generation 1 keeps serving.
    broken = json.loads(json.dumps(policy))
    broken["spec"]["rules"][0]["action"]["route"]["targets"] = [{"pool": "no-such-pool"}]
    kube.apply([broken])
    obj = policy_status({"RolledBack": "True"}, 2)
    message = next(c["message"] for c in obj["status"]["conditions"] if c["type"] == "RolledBack")
    log(f"broken edit: RolledBack: {message}")
    assert "no-such-pool" in message and obj["status"]["activeGeneration"] == 1, obj["status"]
    row = next(r for r in printer_table(kube, "inferencepolicies") if r["NAME"] == "pin-probe")
    assert row["ROLLEDBACK"] == "True" and row["SERVING"] == "1" and row["OBSERVED"] == "2", row
    assert [send_openai(base, system, "still pinned?", key=PROBE_KEY_OLD) for base in endpoints] == [target] * 2

    # A rotated Secret key: the new key works and the old one is refused on both replicas, no restart.
    restarts = [p["status"]["containerStatuses"][0]["restartCount"] for p in gateway_pods(kube)]
    rotated = time.monotonic()
    kube.apply(
        [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "e2e-probe-key", "namespace": NS},
          "stringData": {"api-key": PROBE_KEY_NEW}}]
    )
    deadline = rotated + 10
    while True:
        new = [status_code(lambda b=b: send_openai(b, system, "new key", key=PROBE_KEY_NEW)) for b in endpoints]
        old = [status_code(lambda b=b: send_openai(b, system, "old key", key=PROBE_KEY_OLD)) for b in endpoints]
        if new == [200, 200] and old == [401, 401]:
            break
        assert time.monotonic() < deadline, f"after the rotation: new key {new}, old key {old}"
        time.sleep(0.2)
    TIMINGS["Secret rotated -> new key accepted, old refused"] = time.monotonic() - rotated
    assert [p["status"]["containerStatuses"][0]["restartCount"] for p in gateway_pods(kube)] == restarts

    # Deleting the policy and the pool gives the pinned worker back to the router's own choice: it is still
    # a discovered worker pod, so it stays a candidate.
    kube.run("delete", "-n", NS, "inferencepolicy/pin-probe", "inferencepools.kinference.ai/pinned")
    time.sleep(2)
    urls = pod_urls(kube)
    sets = gateway_worker_sets(kube)
    log(f"after deleting the pinned pool: pods {urls}, gateways' healthy workers {sets}")
    assert all(s == urls for s in sets), (urls, sets)


# ------------------------------------------------------------------------------------------ a second agent

# One kubelet only (see README.md): the "new node" is a second agent Pod on this node, selected by the agent
# Service like the DaemonSet's, with one vllm-sim worker that only it follows (a worker label the DaemonSet's
# selector does not match). To the gateways that is what a new GPU node is: a new agent endpoint whose
# workers no other agent reports.
SECOND = "kinference.ai/worker=second"


def second_worker() -> dict[str, Any]:
    """One vllm-sim pod labelled for the second agent only (the DaemonSet's agent and the gateways' pod
    discovery select `kinference.ai/worker=true`); the gateways know it from an InferencePool by URL."""
    d = json.loads(json.dumps(worker_deployment()))
    d["metadata"]["name"] = "vllm-sim-second"
    d["spec"]["replicas"] = 1
    d["spec"]["selector"] = {"matchLabels": {"app": "vllm-sim-second"}}
    d["spec"]["template"]["metadata"]["labels"] = {
        "app": "vllm-sim-second",
        "kinference.ai/worker": "second",
        "kinference.ai/model": MODEL,
    }
    return d


def second_agent(kube: Kube) -> dict[str, Any]:
    """The chart's agent pod (the live DaemonSet's template) as a one-replica Deployment following only
    the second worker. A Deployment's pods have their ReplicaSet as controller, so the DaemonSet, whose
    selector they also match, does not adopt (and delete) them. eBPF is off: the DaemonSet's agent
    already loads the node's programs."""
    ds = kube.json("get", "daemonsets", "-n", NS, "-l", "app.kubernetes.io/component=agent")["items"][0]
    template = ds["spec"]["template"]
    labels = {**template["metadata"]["labels"], "e2e.kinference.ai/agent": "second"}
    container = template["spec"]["containers"][0]
    env = [e for e in container["env"] if e["name"] != "KINFERENCE_AGENT_WORKER_SELECTOR"]
    container["env"] = [
        *env,
        {"name": "KINFERENCE_AGENT_WORKER_SELECTOR", "value": SECOND},
        {"name": "KINFERENCE_DISABLE_EBPF", "value": "1"},
    ]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "kinference-agent-second", "namespace": NS},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": template["spec"]},
        },
    }


def gateway_views(kube: Kube, agent: str) -> list[tuple[float, float]]:
    """Each gateway's (connected to `agent`: 1, 0, or -1 when it does not know it; index pairs)."""
    out = []
    for p in gateway_pods(kube):
        text = get(f"http://{p['status']['podIP']}:9090/metrics")
        known = samples(text, "kinference_routing_agent_connected")
        connected = next((v for labels, v in known if labels.get("agent") == agent), -1.0)
        out.append((connected, metric(text, "kinference_routing_index_pairs")))
    return out


def agent_live(kube: Kube, worker: str) -> list[bool]:
    """Whether each gateway has a live agent reporting `worker`'s cache and load (`/healthz/workers`)."""
    out = []
    for p in gateway_pods(kube):
        body = json.loads(get(f"http://{p['status']['podIP']}:9090/healthz/workers"))
        out.append(any(w["url"] == worker and w["agent_live"] for w in body["workers"]))
    return out


def test_second_agent_endpoint_joins_and_leaves(cluster: Kube):
    """A second agent endpoint appears while the gateways run: both replicas connect to it within seconds,
    no restart, and take its worker (which only it reports) as agent-reported; prompts cached on that
    worker reach both replicas' indexes and route there through both; deleting the agent disconnects both
    replicas, which forget its worker's keys and its agent."""
    kube = cluster
    restarts = [p["status"]["containerStatuses"][0]["restartCount"] for p in gateway_pods(kube)]
    kube.apply([second_worker()])
    ip = kube.wait_ready("app=vllm-sim-second", 1, timeout=60)[0]["status"]["podIP"]
    worker = f"http://{ip}:8000"
    kube.apply([pool("second", endpoints=[{"url": worker}])])
    deadline = time.monotonic() + 20
    while not all(worker in s for s in gateway_worker_sets(kube)):
        assert time.monotonic() < deadline, f"the gateways do not list {worker}: {gateway_worker_sets(kube)}"
        time.sleep(0.5)
    assert agent_live(kube, worker) == [False, False], "an agent reports the second worker before its own"

    t0 = time.monotonic()
    kube.apply([second_agent(kube)])
    agent = f"http://{kube.wait_ready('e2e.kinference.ai/agent=second', 1, timeout=60)[0]['status']['podIP']}:7070"
    ready = time.monotonic()
    while (views := gateway_views(kube, agent)) and not all(c == 1 for c, _ in views):
        assert time.monotonic() < ready + 15, f"gateways not connected to the second agent {agent}: {views}"
        time.sleep(0.2)
    TIMINGS["second agent Ready -> both gateways connected"] = time.monotonic() - ready
    log(f"second agent {agent}: pod created -> both gateways connected in {time.monotonic() - t0:.1f} s")
    deadline = time.monotonic() + 5
    while (live := agent_live(kube, worker)) != [True, True]:
        assert time.monotonic() < deadline, f"the second agent's worker is not agent-reported: {live}"
        time.sleep(0.2)

    # Prompts cached on the new worker directly (the gateways have not seen them): its events reach only the
    # second agent, and from it both gateways' indexes.
    primed = [system_prompt(g, "second-agent") for g in range(3)]
    for system in primed:
        send_openai(f"{ip}:8000", system, "prime")
    deadline = time.monotonic() + 10
    while not all(pairs > before for (_, pairs), (_, before) in zip(gateway_views(kube, agent), views)):
        assert time.monotonic() < deadline, f"the new worker's keys did not reach both gateways: {views}"
        time.sleep(0.2)
    endpoints = gateway_endpoints(kube)
    landed = [send_openai(base, system, "routed?") for system in primed for base in endpoints]
    # The idle new worker also gets prompts cached nowhere (measured: six of six), so this alone does not
    # show cache-aware routing; the index check above shows the cache view.
    log(f"second agent: primed prompts on {landed}")
    assert landed == [worker] * len(landed), (worker, landed)

    # The agent deleted: both gateways retire it (the metric goes) and forget its worker's keys.
    with_agent = gateway_views(kube, agent)
    deleted = time.monotonic()
    kube.run("delete", "-n", NS, "deployment/kinference-agent-second")
    while (views := gateway_views(kube, agent)) and not all(c == -1 for c, _ in views):
        assert time.monotonic() < deleted + 15, f"gateways still know the deleted agent {agent}: {views}"
        time.sleep(0.2)
    TIMINGS["second agent deleted -> both gateways dropped it"] = time.monotonic() - deleted
    assert all(pairs < before for (_, pairs), (_, before) in zip(views, with_agent)), (with_agent, views)
    assert agent_live(kube, worker) == [False, False]
    # The worker and its pool deleted too: both gateways stop listing it (no stale unhealthy entry).
    removed = time.monotonic()
    kube.run("delete", "-n", NS, "deployment/vllm-sim-second", "inferencepools.kinference.ai/second")
    while any(worker in listed for listed in gateway_listed(kube)):
        assert time.monotonic() < removed + 15, f"a gateway still lists {worker}: {gateway_listed(kube)}"
        time.sleep(0.2)
    TIMINGS["second worker deleted -> no gateway lists it"] = time.monotonic() - removed
    assert [p["status"]["containerStatuses"][0]["restartCount"] for p in gateway_pods(kube)] == restarts
