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

if os.environ.get("KINFERENCE_TEST_CLUSTER") != "1":
    pytest.skip(
        "cluster e2e skipped: set KINFERENCE_TEST_CLUSTER=1 (or run deploy/tests/cluster/e2e.sh) to start a "
        "real one-node Kubernetes and install the charts",
        allow_module_level=True,
    )

import helm_python as helm  # noqa: E402
import yaml  # noqa: E402

TIMINGS: dict[str, float] = {}


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

    r = requests.get(url, timeout=timeout)
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
            "config": {
                "routing": "kinference",
                "models": [{"name": MODEL, "tokenizer_dir": "/tokenizers/qwen2"}],
            },
            "extraVolumes": [
                {"name": "tokenizers", "hostPath": {"path": str(tokenizer_dir), "type": "Directory"}}
            ],
            "extraVolumeMounts": [{"name": "tokenizers", "mountPath": "/tokenizers/qwen2", "readOnly": True}],
            "readinessProbe": {"periodSeconds": 2, "initialDelaySeconds": 1},
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
        install(kube, tokenizer)
        TIMINGS["install"] = time.monotonic() - t0
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


def install(kube: Kube, tokenizer: Path) -> None:
    crds = render(CHARTS / "kinference-crds", {})
    crds += [yaml.safe_load(p.read_text()) for p in sorted((CHARTS / "kinference-crds" / "crds").glob("*.yaml"))]
    kube.apply(crds)
    for c in crds:
        if c["kind"] == "CustomResourceDefinition":
            kube.run("wait", "--for=condition=Established", "--timeout=60s", f"crd/{c['metadata']['name']}")
    kube.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}])
    # ServiceAccount admission needs the namespace's default account's token before pods can be created.
    deadline = time.monotonic() + 60
    while "default-token" not in kube.run("get", "secrets", "-n", NS, check=False):
        assert time.monotonic() < deadline, "no default ServiceAccount token in the namespace"
        time.sleep(0.5)
    kube.apply([worker_deployment()])
    objects = render(CHARTS / "kinference", chart_values(tokenizer))
    gateway = [o for o in objects if o["kind"] == "Deployment"]
    rest = [o for o in objects if o["kind"] != "Deployment"]
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


def send_openai(base: str, system: str, question: str) -> str:
    import openai

    client = openai.OpenAI(base_url=f"http://{base}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=8,
    )
    raw.parse()
    return raw.headers.get("x-kinference-worker", "")


def send_anthropic(base: str, system: str, question: str) -> str:
    import anthropic

    client = anthropic.Anthropic(base_url=f"http://{base}", api_key="unused", max_retries=0, timeout=60)
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


# ------------------------------------------------------------------------------------------ life cycle


def stream_once(base: str, i: int) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://{base}/v1", api_key="unused", max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"stream {i}: " + "tell me a story " * 20}],
        max_tokens=32,
        stream=True,
    )
    chunks = sum(1 for _ in stream)
    assert chunks > 1, f"stream {i} had {chunks} chunks"


def test_rollout_restart_under_streaming_load_fails_no_request(cluster: Kube):
    """`kubectl rollout restart` of the gateway while 4 clients stream without pause. Like kube-proxy, the
    clients follow the Service's ready endpoints (re-read every 0.5 s); no request may fail."""
    kube = cluster
    old = {p["metadata"]["name"] for p in gateway_pods(kube)}
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
        t0 = time.monotonic()
        kube.run("rollout", "restart", "-n", NS, f"deployment/{RELEASE}-gateway")
        kube.run("rollout", "status", "-n", NS, f"deployment/{RELEASE}-gateway", "--timeout=200s", timeout=210)
        while time.monotonic() < stop:
            names = {p["metadata"]["name"] for p in kube.pods("app.kubernetes.io/component=gateway")}
            if not names & old:
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
