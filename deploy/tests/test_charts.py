"""Tests of the Helm charts in deploy/charts and the manifests in deploy/gateway-api and deploy/examples.

Offline (always): `helm lint` and `helm template` through helm-python-sdk (Helm v4's Go library), with default
values and with every optional feature on; the rendered built-in objects (and the CRDs) must pass
`kubernetes-validate --strict` for Kubernetes 1.33; the rendered objects must say what the charts promise
(probes, privileges, RBAC rules, ...); the chart's CRD copies must equal the generated `crds/*.yaml`.

Against a real kube-apiserver (only with KINFERENCE_TEST_APISERVER=1): every rendered object applies with
`kubectl apply --dry-run=server`, and the RBAC, applied for real, grants each service account exactly what
it needs (SubjectAccessReviews). The apiserver is built once by deploy/tests/kube-apiserver/build.sh
(3-4 minutes, cached under $KUBE_TEST_HOME, default ~/.cache/kube-test).

Needs the Python packages helm-python-sdk==0.2.2, kubernetes-validate==1.37.0 and pyyaml (`cargo xtask setup`).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

try:
    import helm_python as helm
    import yaml
except ImportError as exc:  # pragma: no cover - environment problem, said plainly
    raise ImportError(
        f"{exc}: the chart tests need helm-python-sdk==0.2.2, kubernetes-validate==1.37.0 and pyyaml "
        "in the test virtualenv; run `cargo xtask setup`"
    ) from exc

REPO = Path(__file__).resolve().parents[2]
CHARTS = REPO / "deploy" / "charts"
MAIN_CHART = CHARTS / "kinference"
CRD_CHART = CHARTS / "kinference-crds"
RELEASE = "kinference"
NAMESPACE = "kinference"
# The gateway's workload kind by default: a StatefulSet, each pod with its usage journal's claim.
GATEWAY = "StatefulSet"
WORKER_NAMESPACE = "inference"
KUBE_VERSION = "1.33.0"
# Kinds kubernetes-validate has no schema for (custom objects).
NOT_BUILT_IN = {"ServiceMonitor", "Certificate"}
KINFERENCE_PLURALS = [
    "inferencepools",
    "inferencemodels",
    "inferenceproviders",
    "inferencetenants",
    "inferencepolicies",
]

# Every optional feature on.
ALL_FEATURES: dict[str, Any] = {
    "watchNamespaces": [NAMESPACE, WORKER_NAMESPACE],
    "commonLabels": {"team": "inference"},
    "imagePullSecrets": [{"name": "registry"}],
    "gateway": {
        "replicas": 3,
        "secretNames": ["provider-keys", "tenant-keys"],
        "extraArgs": ["--body-limit-bytes=8388608"],
        "extraEnv": [{"name": "EXTRA", "value": "1"}],
        "extraVolumes": [{"name": "tokenizers", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": "tokenizers", "mountPath": "/tokenizers", "readOnly": True}],
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": None, "minAvailable": 2},
        "priorityClassName": "high",
        "logFormat": "json",
        "tracing": {"otlpEndpoint": "http://otel-collector.observability:4317"},
        "metrics": {"tenantHistograms": True, "tenantSpend": True},
        "service": {"annotations": {"a": "b"}},
        "workerApiKey": {"existingSecret": "vllm-key"},
        "config": {
            "routing": "kinference",
            "models": [{"name": "qwen2.5-7b", "tokenizer_dir": "/tokenizers/qwen2.5"}],
        },
    },
    "agent": {
        "hostPID": True,
        "runtimeClassName": "nvidia",
        "priorityClassName": "system-node-critical",
        "kvEvents": {"hostPort": True},
        "ebpf": {"sysResource": True},
        "staticWorkers": [{"url": "http://10.0.0.5:8000", "model": "qwen2.5-7b"}],
    },
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "mtls": {"agentSecret": "agent-mtls", "gatewaySecret": "gateway-mtls", "extproc": True},
}

VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "all-features": ALL_FEATURES,
    "cluster-wide": {"clusterWide": True, "gateway": {"secretNames": ["provider-keys"]}},
    "agent-without-ebpf": {"agent": {"ebpf": {"enabled": False}}},
    "gateway-only": {"agent": {"enabled": False}, "gateway": {"replicas": 1}},
    # Cluster mode (the five kinds from the API server, status written under a Lease), namespaced and cluster-wide.
    "cluster-mode": {
        "watchNamespaces": [NAMESPACE, WORKER_NAMESPACE],
        "gateway": {
            "config": {"routing": "kinference", "crds": {"namespaces": [NAMESPACE, WORKER_NAMESPACE]}},
            "tenancy": {"allowPerReplicaLimits": True},
        },
    },
    "cluster-wide-cluster-mode": {
        "clusterWide": True,
        "gateway": {
            "config": {"routing": "kinference", "crds": {"namespaces": [NAMESPACE]}},
            "tenancy": {"allowPerReplicaLimits": True},
        },
    },
}


# ---------------------------------------------------------------------------------------------- helpers


def render(values: dict[str, Any], chart: Path = MAIN_CHART) -> list[dict[str, Any]]:
    """Renders a chart like `helm template` and returns its objects (NOTES.txt left out)."""
    with helm.Chart.load(str(chart)) as loaded:
        manifests = loaded.render(values, name=RELEASE, namespace=NAMESPACE)
    objects: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def chart_crds() -> list[dict[str, Any]]:
    """The CRD objects the kinference-crds chart installs (Helm installs crds/ as they are)."""
    return [yaml.safe_load(p.read_text()) for p in sorted((CRD_CHART / "crds").glob("*.yaml"))]


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def kubernetes_validate(objects: list[dict[str, Any]], tmp_path: Path, name: str) -> None:
    """Runs `kubernetes-validate --strict -k 1.33.0` on the objects; fails with its output."""
    tool = Path(sys.executable).parent / "kubernetes-validate"
    exe = [str(tool)] if tool.exists() else [sys.executable, "-m", "kubernetes_validate"]
    file = tmp_path / f"{name}.yaml"
    file.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    result = subprocess.run(
        [*exe, "--strict", "-k", KUBE_VERSION, str(file)], capture_output=True, text=True, timeout=120
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"kubernetes-validate --strict -k {KUBE_VERSION} failed:\n{report}"
    passed = report.count(" passed for resource ")
    assert passed == len(objects), f"expected {len(objects)} objects to pass, report:\n{report}"


# ------------------------------------------------------------------------------------------ lint, render


@pytest.mark.parametrize("chart", [MAIN_CHART, CRD_CHART], ids=lambda p: p.name)
@pytest.mark.parametrize("variant", ["defaults", "all-features"])
def test_chart_lints_clean(chart: Path, variant: str) -> None:
    values = VARIANTS[variant] if chart == MAIN_CHART else {}
    report = helm.lint(str(chart), values, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, f"helm lint {chart.name}: {problems}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_objects_pass_kubernetes_validate(variant: str, tmp_path: Path) -> None:
    objects = [o for o in render(VARIANTS[variant]) if o["kind"] not in NOT_BUILT_IN]
    assert objects
    kubernetes_validate(objects, tmp_path, variant)


def test_crds_pass_kubernetes_validate(tmp_path: Path) -> None:
    kubernetes_validate(chart_crds(), tmp_path, "crds")


def test_kubernetes_validate_rejects_an_unknown_field(tmp_path: Path) -> None:
    """The validation above would catch a typo: a misspelt field in a rendered Deployment fails."""
    deployment = copy.deepcopy(one(render({}), GATEWAY))
    container(deployment)["readinesProbe"] = container(deployment).pop("readinessProbe")
    with pytest.raises(AssertionError, match="readinesProbe"):
        kubernetes_validate([deployment], tmp_path, "broken")


@pytest.mark.parametrize(
    "bad",
    [
        {"gateway": {"replica": 3}},
        {"agent": {"ebpf": {"sysresource": True}}},
        {"gateway": {"replicas": "3"}},
        {"serviceMonitor": {"enable": True}},
        {"agent": {"ebpf": {"btfPath": "sys/kernel/btf"}}},
        {"networkPolicy": {"workerNamespaces": ["*"]}},
    ],
    ids=["typo", "nested-typo", "wrong-type", "monitor-typo", "relative-host-path", "namespace-wildcard"],
)
def test_values_schema_refuses_mistakes(bad: dict[str, Any]) -> None:
    """values.schema.json turns a misspelt or mistyped value into an error instead of a silent default."""
    with pytest.raises(helm.HelmError, match="schema"):
        render(bad)


def test_bad_pdb_values_are_refused() -> None:
    with pytest.raises(helm.HelmError, match="only one of maxUnavailable and minAvailable"):
        render({"gateway": {"podDisruptionBudget": {"maxUnavailable": 1, "minAvailable": 1}}})


def test_replicas_with_tenants_on_the_embedded_store_are_refused() -> None:
    """N replicas on the embedded store would allow N times every limit: the chart fails loudly, unless
    told to accept it, the limits are in Redis, or there is one replica (or no tenants at all)."""
    tenants = {"config": {"tenancy": {"tenants_dir": "/etc/kinference/tenants"}}}
    with pytest.raises(helm.HelmError, match=r"gateway.replicas is 2 with tenants on the embedded store.*allowPerReplicaLimits"):
        render({"gateway": tenants})
    with pytest.raises(helm.HelmError, match="3 times each limit"):
        render({"gateway": {"replicas": 3, "config": {"crds": {"namespaces": ["a"]}}}})
    accepted = {"gateway": {**tenants, "tenancy": {"allowPerReplicaLimits": True}}}
    assert one(render(accepted), GATEWAY)["spec"]["replicas"] == 2
    redis = {"tenancy": {"tenants_dir": "/t", "store": "redis", "redis_url": "rediss://redis:6380/0"}}
    assert one(render({"gateway": {"config": redis}}), GATEWAY)["spec"]["replicas"] == 2
    assert one(render({"gateway": {**tenants, "replicas": 1}}), GATEWAY)["spec"]["replicas"] == 1
    assert one(render({}), GATEWAY)["spec"]["replicas"] == 2


def test_admin_key_from_a_secret() -> None:
    """The admin key reaches the gateway from a Secret; with forMetrics Prometheus presents it too."""
    values = {
        "gateway": {"adminKey": {"existingSecret": "kinference-admin", "forMetrics": True}},
        "serviceMonitor": {"enabled": True},
    }
    objects = render(values)
    assert not find(objects, "Secret", "kinference-gateway-admin"), "no key generated when one is given"
    c = container(one(objects, GATEWAY))
    assert env_of(c)["KINFERENCE_ADMIN_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "kinference-admin", "key": "admin-key"}
    }
    assert "--admin-key-for-metrics" in c["args"]
    monitor = one(objects, "ServiceMonitor", "kinference-gateway")
    assert monitor["spec"]["endpoints"][0]["authorization"]["credentials"] == {
        "name": "kinference-admin",
        "key": "admin-key",
    }


def test_an_admin_key_is_generated_by_default() -> None:
    """Without a key every loopback caller is an admin, and behind a mesh sidecar every caller is loopback:
    by default the chart generates a key in a Secret of its own, which the gateway reads."""
    objects = render({})
    secret = one(objects, "Secret", "kinference-gateway-admin")
    key = base64.b64decode(secret["data"]["admin-key"]).decode()
    assert len(key) >= 32 and key.isalnum(), "a random key, well over the gateway's 16-character minimum"
    again = one(render({}), "Secret", "kinference-gateway-admin")
    assert key != base64.b64decode(again["data"]["admin-key"]).decode(), "random"
    assert env_of(container(one(objects, GATEWAY)))["KINFERENCE_ADMIN_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "kinference-gateway-admin", "key": "admin-key"}
    }
    # forMetrics works with the generated key too.
    objects = render({"gateway": {"adminKey": {"forMetrics": True}}, "serviceMonitor": {"enabled": True}})
    assert "--admin-key-for-metrics" in container(one(objects, GATEWAY))["args"]
    monitor = one(objects, "ServiceMonitor", "kinference-gateway")
    assert monitor["spec"]["endpoints"][0]["authorization"]["credentials"]["name"] == "kinference-gateway-admin"
    # Loopback admins only on request.
    objects = render({"gateway": {"adminKey": {"generate": False}}})
    assert not find(objects, "Secret", "kinference-gateway-admin")
    assert "KINFERENCE_ADMIN_KEY" not in env_of(container(one(objects, GATEWAY)))


def test_a_cache_salt_key_is_generated_and_mounted_by_default() -> None:
    """Every replica salts the tenants' prompts with the same key (issue 32): by default the chart generates
    one in a Secret of its own, mounts it, and names the file in gateway.yaml."""
    objects = render({})
    secret = one(objects, "Secret", "kinference-gateway-cache-salt")
    key = base64.b64decode(secret["data"]["cache-salt-key"]).decode()
    assert len(key) >= 32 and key.isalnum(), "at least the gateway's 32-byte minimum"
    gateway = one(objects, GATEWAY, "kinference-gateway")
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cache-salt"]["secret"]["secretName"] == "kinference-gateway-cache-salt"
    mounts = {m["name"]: m for m in container(gateway)["volumeMounts"]}
    assert mounts["cache-salt"]["mountPath"] == "/var/run/kinference/cache-salt" and mounts["cache-salt"]["readOnly"]
    config = yaml.safe_load(one(objects, "ConfigMap", "kinference-gateway")["data"]["gateway.yaml"])
    assert config["tenancy"]["cache_salt_key_file"] == "/var/run/kinference/cache-salt/cache-salt-key"
    # A Secret of one's own, under one's own key name.
    objects = render({"gateway": {"cacheSaltKey": {"existingSecret": "salts", "secretKey": "k"}}})
    assert not find(objects, "Secret", "kinference-gateway-cache-salt")
    gateway = one(objects, GATEWAY, "kinference-gateway")
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cache-salt"]["secret"]["secretName"] == "salts"
    config = yaml.safe_load(one(objects, "ConfigMap", "kinference-gateway")["data"]["gateway.yaml"])
    assert config["tenancy"]["cache_salt_key_file"] == "/var/run/kinference/cache-salt/k"
    # Each pod its own key, on request.
    objects = render({"gateway": {"cacheSaltKey": {"generate": False}}})
    assert not find(objects, "Secret", "kinference-gateway-cache-salt")
    config = yaml.safe_load(one(objects, "ConfigMap", "kinference-gateway")["data"]["gateway.yaml"])
    assert "cache_salt_key_file" not in config.get("tenancy", {})


def test_tenant_spend_on_the_metrics_page_only_when_asked() -> None:
    assert "--metrics-tenant-spend" not in container(one(render({}), GATEWAY))["args"]
    asked = {"gateway": {"metrics": {"tenantSpend": True}}}
    assert "--metrics-tenant-spend" in container(one(render(asked), GATEWAY))["args"]


def test_worker_api_key_from_a_secret() -> None:
    """The workers' API key (vLLM's --api-key) reaches the gateway from a Secret, as the variable it reads."""
    assert "KINFERENCE_WORKER_API_KEY" not in env_of(container(one(render({}), GATEWAY)))
    c = container(one(render({"gateway": {"workerApiKey": {"existingSecret": "vllm-key"}}}), GATEWAY))
    assert env_of(c)["KINFERENCE_WORKER_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "vllm-key", "key": "api-key"}
    }


TLS_DIR = "/var/run/kinference/tls"


def mtls_mounts(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The Secret each workload mounts at the TLS directory, by kind (checked read-only)."""
    mounted = {}
    for kind in ("DaemonSet", GATEWAY):
        workload = one(objects, kind)
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["name"]: m for m in container(workload)["volumeMounts"]}
        assert mounts["mtls"]["mountPath"] == TLS_DIR and mounts["mtls"]["readOnly"]
        mounted[kind] = volumes["mtls"]["secret"]["secretName"]
    return mounted


def test_mtls_is_on_by_default_with_a_role_per_port() -> None:
    """By default the agent serves its gRPC port over mTLS and admits the gateways' role only; the gateway dials
    with its certificate and checks the agents' role; certificates generated by the chart."""
    objects = render({})
    agent, gateway = one(objects, "DaemonSet"), one(objects, GATEWAY)
    assert {f"--grpc-tls-cert={TLS_DIR}/tls.crt", f"--grpc-tls-key={TLS_DIR}/tls.key",
            f"--grpc-tls-client-ca={TLS_DIR}/ca.crt",
            "--grpc-tls-client-names=kinference-gateway"} <= set(container(agent)["args"])
    assert {f"--agent-tls-ca={TLS_DIR}/ca.crt", f"--agent-tls-cert={TLS_DIR}/tls.crt",
            f"--agent-tls-key={TLS_DIR}/tls.key",
            "--agent-tls-server-name=kinference-agent"} <= set(container(gateway)["args"])
    assert not any(a.startswith("--extproc-tls") for a in container(gateway)["args"]), "ext_proc mTLS is opt-in"
    assert mtls_mounts(objects) == {"DaemonSet": "kinference-agent-mtls", GATEWAY: "kinference-gateway-mtls"}
    # Off: plaintext, nothing mounted, nothing generated.
    plain = render({"mtls": {"enabled": False}})
    assert not any(a.startswith(("--grpc-tls", "--agent-tls", "--extproc-tls"))
                   for kind in ("DaemonSet", GATEWAY) for a in container(one(plain, kind))["args"])
    assert not [s for s in find(plain, "Secret") if s["metadata"]["name"].endswith("-mtls")]


def openssl(*args: str, stdin: str | None = None) -> str:
    result = subprocess.run(["openssl", *args], input=stdin, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"openssl {args}: {result.stderr}"
    return result.stdout


@pytest.mark.skipif(shutil.which("openssl") is None and os.environ.get("CI") not in ("true", "1"),
                    reason="openssl not installed")
def test_generated_certificates_share_one_ca_and_carry_their_roles(tmp_path: Path) -> None:
    """The generated Secrets: one CA signs all, each certificate is valid for its role's DNS names (the gateway's
    for its ext_proc Service too), and the proxy's exists only with mtls.extproc."""
    objects = render({"mtls": {"extproc": True}})
    secrets = {s["metadata"]["name"]: s for s in find(objects, "Secret") if s["metadata"]["name"].endswith("-mtls")}
    assert set(secrets) == {"kinference-agent-mtls", "kinference-gateway-mtls", "kinference-proxy-mtls"}
    cas = {base64.b64decode(s["data"]["ca.crt"]) for s in secrets.values()}
    assert len(cas) == 1, "one CA for every role"
    ca = tmp_path / "ca.crt"
    ca.write_bytes(cas.pop())
    expected = {
        "kinference-agent-mtls": ["kinference-agent"],
        "kinference-gateway-mtls": ["kinference-gateway", "kinference-gateway-extproc",
                                    f"kinference-gateway-extproc.{NAMESPACE}.svc",
                                    f"kinference-gateway-extproc.{NAMESPACE}.svc.cluster.local"],
        "kinference-proxy-mtls": ["kinference-envoy"],
    }
    for name, secret in secrets.items():
        assert secret["type"] == "kubernetes.io/tls"
        cert = tmp_path / f"{name}.crt"
        cert.write_bytes(base64.b64decode(secret["data"]["tls.crt"]))
        assert "OK" in openssl("verify", "-CAfile", str(ca), str(cert))
        text = openssl("x509", "-in", str(cert), "-noout", "-ext", "subjectAltName,extendedKeyUsage")
        assert re.findall(r"DNS:([^,\s]+)", text) == expected[name], text
        assert "TLS Web Server Authentication" in text and "TLS Web Client Authentication" in text
        key = base64.b64decode(secret["data"]["tls.key"]).decode()
        assert openssl("pkey", "-pubout", stdin=key) == openssl("x509", "-in", str(cert), "-noout", "-pubkey")
    gateway = container(one(objects, GATEWAY))["args"]
    assert {f"--extproc-tls-cert={TLS_DIR}/tls.crt", f"--extproc-tls-client-ca={TLS_DIR}/ca.crt",
            "--extproc-tls-client-names=kinference-envoy"} <= set(gateway)
    assert "kinference-proxy-mtls" not in {s["metadata"]["name"] for s in find(render({}), "Secret")}


def test_mtls_from_secrets() -> None:
    """Secrets of the operator's: mounted as they are, nothing generated."""
    values = {"mtls": {"agentSecret": "agent-mtls", "gatewaySecret": "gateway-mtls", "extproc": True,
                       "gatewayName": "gw.example", "proxyName": "envoy.example"}}
    objects = render(values)
    assert mtls_mounts(objects) == {"DaemonSet": "agent-mtls", GATEWAY: "gateway-mtls"}
    assert not [s for s in find(objects, "Secret") if s["metadata"]["name"].endswith("-mtls")]
    assert "--grpc-tls-client-names=gw.example" in container(one(objects, "DaemonSet"))["args"]
    assert "--extproc-tls-client-names=envoy.example" in container(one(objects, GATEWAY))["args"]
    with pytest.raises(helm.HelmError, match="set both mtls.agentSecret and mtls.gatewaySecret"):
        render({"mtls": {"agentSecret": "agent-mtls"}})
    with pytest.raises(helm.HelmError, match="mtls.extproc needs mtls.enabled"):
        render({"mtls": {"enabled": False, "extproc": True}})


def test_mtls_from_cert_manager() -> None:
    """With an issuer, cert-manager Certificates (renewed by cert-manager, read again by the pods) instead of
    generated Secrets, for the same names and roles."""
    issuer = {"name": "kinference-ca", "kind": "Issuer", "group": "cert-manager.io"}
    objects = render({"mtls": {"certManager": {"issuerRef": issuer}, "extproc": True}})
    certificates = {c["metadata"]["name"]: c for c in find(objects, "Certificate")}
    assert set(certificates) == {"kinference-agent-mtls", "kinference-gateway-mtls", "kinference-proxy-mtls"}
    for name, certificate in certificates.items():
        spec = certificate["spec"]
        assert spec["secretName"] == name and spec["issuerRef"] == issuer
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert spec["privateKey"]["rotationPolicy"] == "Always"
    assert certificates["kinference-agent-mtls"]["spec"]["dnsNames"] == ["kinference-agent"]
    assert certificates["kinference-proxy-mtls"]["spec"]["dnsNames"] == ["kinference-envoy"]
    assert not [s for s in find(objects, "Secret") if s["metadata"]["name"].endswith("-mtls")]
    assert mtls_mounts(objects) == {"DaemonSet": "kinference-agent-mtls", GATEWAY: "kinference-gateway-mtls"}


# ------------------------------------------------------------------------------------------------ CRDs


def test_crd_chart_holds_the_five_kinference_crds() -> None:
    crds = chart_crds()
    assert sorted(c["spec"]["names"]["plural"] for c in crds) == sorted(KINFERENCE_PLURALS)
    for crd in crds:
        assert crd["kind"] == "CustomResourceDefinition"
        assert crd["spec"]["group"] == "kinference.ai"
        assert [v["name"] for v in crd["spec"]["versions"]] == ["v1alpha1"]
        assert crd["spec"]["versions"][0]["subresources"].get("status") == {}, "status is patched by the gateway"
    with helm.Chart.load(str(CRD_CHART)) as loaded:
        assert len(loaded.crds) == 5, "Helm sees the files in crds/"
        rendered = loaded.render({}, name=RELEASE, namespace=NAMESPACE)
        assert set(rendered) == {"kinference-crds/templates/NOTES.txt"}, "the chart renders nothing but its notes"


def test_crd_chart_copies_equal_the_generated_crds() -> None:
    generated = sorted((REPO / "crds").glob("*.yaml"))
    if not generated:
        pytest.skip("crds/*.yaml are not generated yet (cargo xtask gen-crds)")
    copies = sorted((CRD_CHART / "crds").glob("*.yaml"))
    fix = "run: cargo xtask gen-crds"
    assert [p.name for p in copies] == [p.name for p in generated], fix
    for gen, cop in zip(generated, copies):
        assert cop.read_bytes() == gen.read_bytes(), f"{cop} differs from {gen}; {fix}"


# ------------------------------------------------------------------------------------------- gateway


def test_gateway_deployment() -> None:
    objects = render({})
    deployment = one(objects, GATEWAY, "kinference-gateway")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    c = container(deployment)
    assert c["args"][:3] == [
        "--listen=0.0.0.0:8080",
        "--admin-listen=0.0.0.0:9090",
        "--config=/etc/kinference/gateway.yaml",
    ]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8080, "admin": 9090, "extproc": 9002}
    # The ext_proc endpoint picker: its own port and Service.
    assert "--extproc-listen=0.0.0.0:9002" in c["args"]
    picker = one(objects, "Service", "kinference-gateway-extproc")
    assert picker["spec"]["ports"] == [
        {"name": "grpc", "port": 9002, "targetPort": "extproc", "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}
    ]
    off = container(one(render({"gateway": {"extproc": {"enabled": False}}}), GATEWAY, "kinference-gateway"))
    assert not [a for a in off["args"] if a.startswith("--extproc")]
    assert {p["name"] for p in off["ports"]} == {"http", "admin"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert c["resources"]["requests"] and c["resources"]["limits"]
    security = c["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["serviceAccountName"] == "kinference-gateway"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/etc/kinference"]["readOnly"] is True and "/tmp" in mounts
    assert "hostPID" not in pod and "hostNetwork" not in pod


def test_gateway_overload_limits_become_flags() -> None:
    args = container(one(render({}), GATEWAY, "kinference-gateway"))["args"]
    assert "--max-in-flight=4096" in args and "--max-connections=20000" in args
    assert "--body-read-timeout-ms=30000" in args and "--client-write-timeout-ms=30000" in args
    assert "--upstream-max-connections-per-worker=1024" in args
    tuned = {"gateway": {"overload": {"maxInFlight": 64, "queueTimeoutMs": 100}}}
    args = container(one(render(tuned), GATEWAY, "kinference-gateway"))["args"]
    assert "--max-in-flight=64" in args and "--overload-queue-timeout-ms=100" in args
    # A reserve of half or more would leave low-priority tenants no slot at all.
    with pytest.raises(helm.HelmError, match="schema"):
        render({"gateway": {"overload": {"priorityReservePercent": 50}}})


def test_gateway_logs_and_traces() -> None:
    """Text logs and no trace export by default; JSON logs and an OTLP endpoint when set; an endpoint
    that is not an http(s) URL is refused."""
    env = {e["name"]: e.get("value") for e in container(one(render({}), GATEWAY))["env"]}
    assert env["KINFERENCE_LOG_FORMAT"] == "text"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
    on = {"gateway": {"logFormat": "json", "tracing": {"otlpEndpoint": "http://collector:4317"}}}
    env = {e["name"]: e.get("value") for e in container(one(render(on), GATEWAY))["env"]}
    assert env["KINFERENCE_LOG_FORMAT"] == "json"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4317"
    assert env["OTEL_SERVICE_NAME"] == "kinference-gateway"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    http = {"gateway": {"tracing": {"otlpEndpoint": "http://collector:4318", "otlpProtocol": "http"}}}
    env = {e["name"]: e.get("value") for e in container(one(render(http), GATEWAY))["env"]}
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http"
    for bad in ({"logFormat": "xml"}, {"tracing": {"otlpEndpoint": "collector:4317"}},
                {"tracing": {"otlpProtocol": "http/json"}}):
        with pytest.raises(helm.HelmError, match="schema"):
            render({"gateway": bad})


def test_gateway_config_map_is_the_gateway_yaml() -> None:
    config_map = one(render(ALL_FEATURES), "ConfigMap", "kinference-gateway")
    config = yaml.safe_load(config_map["data"]["gateway.yaml"])
    assert config["routing"] == "kinference"
    assert config["models"] == [{"name": "qwen2.5-7b", "tokenizer_dir": "/tokenizers/qwen2.5"}]
    assert config["kubernetes"] == {
        "namespaces": [NAMESPACE, WORKER_NAMESPACE],
        "all_namespaces": False,
        "worker_selector": {"kinference.ai/worker": "true"},
        "agent_service": "kinference-agent",
        "agent_namespace": NAMESPACE,
        "agent_grpc_port": 7070,
        "peer_service": "kinference-gateway",
    }
    # The pods roll when the file changes.
    deployment = one(render(ALL_FEATURES), GATEWAY, "kinference-gateway")
    before = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    changed = copy.deepcopy(ALL_FEATURES)
    changed["gateway"]["config"]["routing"] = "least-outstanding"
    after = one(render(changed), GATEWAY)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    assert before != after


def test_usage_journal_on_a_claim_per_pod_by_default() -> None:
    """The usage journal is never an unbounded emptyDir: by default each gateway pod gets its own claim (a
    StatefulSet), of the configured size; without persistence it is a size-limited emptyDir, refused when
    tenants' budgets are on the embedded store."""
    journal = "/var/lib/kinference/usage/kinference-usage.jsonl"
    objects = render({"gateway": {"usage": {"persistence": {"size": "5Gi", "storageClassName": "fast"}}}})
    gateway = one(objects, "StatefulSet", "kinference-gateway")
    assert gateway["spec"]["serviceName"] == "kinference-gateway"
    [claim] = gateway["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "usage"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert claim["spec"]["storageClassName"] == "fast" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    mounts = {m["name"]: m["mountPath"] for m in container(gateway)["volumeMounts"]}
    assert mounts["usage"] == "/var/lib/kinference/usage"
    assert "usage" not in {v["name"] for v in gateway["spec"]["template"]["spec"]["volumes"]}
    config = yaml.safe_load(one(objects, "ConfigMap", "kinference-gateway")["data"]["gateway.yaml"])
    assert config["tenancy"]["usage_journal"] == journal

    # An explicit journal path is kept.
    own = {"gateway": {"config": {"tenancy": {"usage_journal": "/data/u.jsonl"}}}}
    config = yaml.safe_load(one(render(own), "ConfigMap", "kinference-gateway")["data"]["gateway.yaml"])
    assert config["tenancy"]["usage_journal"] == "/data/u.jsonl"

    # Without persistence: a Deployment, the journal on an emptyDir limited to the size.
    off = {"usage": {"persistence": {"enabled": False, "size": "2Gi"}}}
    deployment = one(render({"gateway": off}), "Deployment", "kinference-gateway")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["usage"]["emptyDir"] == {"sizeLimit": "2Gi"}
    assert not find(render({"gateway": off}), "StatefulSet")
    # ... refused with tenants on the embedded store (budgets lost at every restart), allowed with Redis.
    tenants = {"tenancy": {"tenants_dir": "/etc/kinference/tenants"}}
    with pytest.raises(helm.HelmError, match="usage journal .* would be lost at every restart"):
        render({"gateway": {**off, "replicas": 1, "config": tenants}})
    redis = {"tenancy": {"tenants_dir": "/t", "store": "redis", "redis_url": "redis://redis:6379/0"}}
    assert one(render({"gateway": {**off, "config": redis}}), "Deployment")["spec"]["replicas"] == 2


def test_gateway_service_pdb_and_replicas() -> None:
    objects = render(ALL_FEATURES)
    assert one(objects, GATEWAY)["spec"]["replicas"] == 3
    service = one(objects, "Service", "kinference-gateway")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "http": (80, "http"),
        "admin": (9090, "admin"),
    }
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["minAvailable"] == 2 and "maxUnavailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert one(render({}), "PodDisruptionBudget")["spec"] == {
        "maxUnavailable": 1,
        "selector": pdb["spec"]["selector"],
    }
    assert not find(render({"gateway": {"podDisruptionBudget": {"enabled": False}}}), "PodDisruptionBudget")


# --------------------------------------------------------------------------------------------- agent


def test_agent_daemonset_runs_on_gpu_nodes_with_only_the_ebpf_capabilities() -> None:
    daemonset = one(render({}), "DaemonSet", "kinference-agent")
    pod = daemonset["spec"]["template"]["spec"]
    c = container(daemonset)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    security = c["securityContext"]
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    # Only what its programs need: BTF tracepoints and a ring buffer (no sock_ops, so no CAP_NET_ADMIN).
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["BPF", "PERFMON"]}
    assert "hostPID" not in pod and "hostNetwork" not in pod and "runtimeClassName" not in pod
    # The host paths eBPF needs, read-only.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert volumes["btf"]["hostPath"] == {"path": "/sys/kernel/btf", "type": "Directory"}
    assert mounts["btf"] == {"name": "btf", "mountPath": "/sys/kernel/btf", "readOnly": True}
    host_paths = [v for v in pod["volumes"] if "hostPath" in v]
    assert len(host_paths) == 1, "no host path beyond BTF"
    # Its node name from the downward API, passed as --node.
    env = env_of(c)
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "--node=$(NODE_NAME)" in c["args"]
    assert "--workers=/etc/kinference/agent-workers.yaml" in c["args"]
    assert env["KINFERENCE_AGENT_WORKER_SELECTOR"]["value"] == "kinference.ai/worker=true"
    assert env["KINFERENCE_AGENT_NAMESPACES"]["value"] == NAMESPACE
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 7070, "metrics": 9091, "kv-events": 5557}
    assert all("hostPort" not in p for p in c["ports"])


def test_agent_optional_privileges_only_when_asked() -> None:
    daemonset = one(render(ALL_FEATURES), "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    c = container(daemonset)
    assert pod["hostPID"] is True
    assert pod["runtimeClassName"] == "nvidia"
    assert c["securityContext"]["capabilities"]["add"] == ["BPF", "PERFMON", "SYS_RESOURCE"]
    assert {p["name"]: p.get("hostPort") for p in c["ports"]}["kv-events"] == 5557
    workers = yaml.safe_load(one(render(ALL_FEATURES), "ConfigMap", "kinference-agent")["data"]["agent-workers.yaml"])
    assert workers == {"workers": [{"url": "http://10.0.0.5:8000", "model": "qwen2.5-7b"}]}


def test_agent_without_ebpf_is_unprivileged() -> None:
    daemonset = one(render(VARIANTS["agent-without-ebpf"]), "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    security = container(daemonset)["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    # The variable the agent reads to leave eBPF off.
    assert env_of(container(daemonset))["KINFERENCE_DISABLE_EBPF"]["value"] == "1"


def test_agent_services() -> None:
    objects = render({})
    headless = one(objects, "Service", "kinference-agent")
    assert headless["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in headless["spec"]["ports"]} == {"grpc", "metrics"}
    kv = one(objects, "Service", "kinference-agent-kv")
    assert kv["spec"]["internalTrafficPolicy"] == "Local", "workers must reach the agent on their own node"
    assert kv["spec"]["ports"] == [{"name": "kv-events", "port": 5557, "targetPort": "kv-events", "protocol": "TCP"}]
    gateway_only = render(VARIANTS["gateway-only"])
    assert not find(gateway_only, "DaemonSet") and not find(gateway_only, "Service", "kinference-agent")
    assert {o["metadata"]["name"] for o in find(gateway_only, "ServiceAccount")} == {"kinference-gateway"}


# ---------------------------------------------------------------------------------------------- RBAC


def rules_by_subject(objects: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(service account, namespace the grant applies in, "*" for cluster-wide) -> rules."""
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in objects
        if o["kind"] in ("Role", "ClusterRole")
    }
    grants: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        ns = binding["metadata"].get("namespace")
        ref = binding["roleRef"]
        role = roles[(ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])]
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["namespace"] == NAMESPACE
            key = (subject["name"], ns or "*")
            grants.setdefault(key, []).extend(role["rules"])
    return grants


def normalise(rules: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    """Rules as (apiGroup, resource, resourceName or "", verb) tuples."""
    out = set()
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for name in rule.get("resourceNames", [""]):
                    for verb in rule["verbs"]:
                        out.add((group, resource, name, verb))
    return out


READ = ("get", "list", "watch")
# What the code calls: kube::runtime::watcher (list + watch) on pods and EndpointSlices; nothing on kinference.ai.
WATCH = ("list", "watch")
GATEWAY_RULES = {("", "pods", "", v) for v in WATCH} | {("discovery.k8s.io", "endpointslices", "", v) for v in WATCH}
AGENT_RULES = {("", "pods", "", v) for v in WATCH}


def test_rbac_defaults_grant_exactly_what_each_component_reads() -> None:
    grants = rules_by_subject(render({}))
    assert set(grants) == {("kinference-gateway", NAMESPACE), ("kinference-agent", NAMESPACE)}
    assert normalise(grants[("kinference-gateway", NAMESPACE)]) == GATEWAY_RULES, "no Secret access by default"
    assert normalise(grants[("kinference-agent", NAMESPACE)]) == AGENT_RULES
    assert not find(render({}), "ClusterRole") and not find(render({}), "ClusterRoleBinding")


def test_rbac_watched_namespaces_and_secrets_by_name() -> None:
    grants = rules_by_subject(render(ALL_FEATURES))
    secrets = {("", "secrets", n, v) for n in ("provider-keys", "tenant-keys") for v in READ}
    for ns in (NAMESPACE, WORKER_NAMESPACE):
        assert normalise(grants[("kinference-gateway", ns)]) == GATEWAY_RULES | secrets
        assert normalise(grants[("kinference-agent", ns)]) == AGENT_RULES
    accounts = ("kinference-gateway", "kinference-agent")
    assert set(grants) == {(sa, ns) for sa in accounts for ns in (NAMESPACE, WORKER_NAMESPACE)}


def test_rbac_gateway_reads_agent_endpointslices_outside_watched_namespaces() -> None:
    grants = rules_by_subject(render({"watchNamespaces": [WORKER_NAMESPACE]}))
    assert normalise(grants[("kinference-gateway", NAMESPACE)]) == {
        ("discovery.k8s.io", "endpointslices", "", v) for v in WATCH
    }
    assert ("kinference-agent", NAMESPACE) not in grants


def test_picker_mode_serves_standard_pools_naming_the_extproc_service() -> None:
    """gateway.extproc.servesStandardPools: the gateway serves the standard InferencePools naming its
    `-extproc` Service (kubernetes.picker_service) and may list and watch them and the standard
    InferenceObjectives; off by default."""
    objects = render({"gateway": {"extproc": {"servesStandardPools": True}}})
    config = yaml.safe_load(one(objects, "ConfigMap", "kinference-gateway")["data"]["gateway.yaml"])
    assert config["kubernetes"]["picker_service"] == "kinference-gateway-extproc"
    assert one(objects, "Service", "kinference-gateway-extproc")
    grants = rules_by_subject(objects)
    pools = {("inference.networking.k8s.io", "inferencepools", "", v) for v in WATCH}
    objectives = {("inference.networking.x-k8s.io", "inferenceobjectives", "", v) for v in WATCH}
    assert normalise(grants[("kinference-gateway", NAMESPACE)]) == GATEWAY_RULES | pools | objectives
    default = yaml.safe_load(one(render({}), "ConfigMap", "kinference-gateway")["data"]["gateway.yaml"])
    assert "picker_service" not in default["kubernetes"]


CLUSTER_MODE_GATEWAY = {"config": {"routing": "kinference", "crds": {"namespaces": [NAMESPACE]}},
                        "tenancy": {"allowPerReplicaLimits": True}}
KINDS = ("inferencepolicies", "inferencepools", "inferencemodels", "inferenceproviders", "inferencetenants")
CLUSTER_MODE_KINDS = (
    {("kinference.ai", k, "", v) for k in KINDS for v in WATCH}
    | {("kinference.ai", f"{k}/status", "", "patch") for k in KINDS}
)


def lease_rules(name: str = "kinference-gateway-status") -> set[tuple[str, str, str, str]]:
    """Get and renew the one Lease by name; create cannot be narrowed by name (Kubernetes authorizes a
    create before the object has one), so it is granted alone, in the Lease's namespace only."""
    return {("coordination.k8s.io", "leases", name, v) for v in ("get", "update")} | {
        ("coordination.k8s.io", "leases", "", "create")
    }


def test_rbac_cluster_mode_grants_the_five_kinds_their_status_and_the_lease_by_name() -> None:
    grants = rules_by_subject(render({"gateway": CLUSTER_MODE_GATEWAY}))
    assert normalise(grants[("kinference-gateway", NAMESPACE)]) == GATEWAY_RULES | CLUSTER_MODE_KINDS | lease_rules()
    assert normalise(grants[("kinference-agent", NAMESPACE)]) == AGENT_RULES


def test_rbac_lease_follows_its_configured_name_and_namespace_only() -> None:
    crds = {"namespaces": [WORKER_NAMESPACE, NAMESPACE], "lease_name": "writer", "lease_namespace": "leases"}
    gateway = {**CLUSTER_MODE_GATEWAY, "config": {"routing": "kinference", "crds": crds}}
    grants = rules_by_subject(render({"watchNamespaces": [NAMESPACE, WORKER_NAMESPACE], "gateway": gateway}))
    assert normalise(grants[("kinference-gateway", "leases")]) == lease_rules("writer")
    for ns in (NAMESPACE, WORKER_NAMESPACE):
        assert not any(r[0] == "coordination.k8s.io" for r in normalise(grants[("kinference-gateway", ns)])), ns
    # The default namespace of the Lease is the first of crds.namespaces, as the gateway takes it.
    crds = {"namespaces": [WORKER_NAMESPACE, NAMESPACE]}
    gateway = {**CLUSTER_MODE_GATEWAY, "config": {"routing": "kinference", "crds": crds}}
    grants = rules_by_subject(render({"watchNamespaces": [NAMESPACE, WORKER_NAMESPACE], "gateway": gateway}))
    leases = {ns for (sa, ns), rules in grants.items() for r in normalise(rules) if r[0] == "coordination.k8s.io"}
    assert leases == {WORKER_NAMESPACE}
    # No status written, no Lease.
    crds = {"namespaces": [NAMESPACE], "write_status": False}
    gateway = {**CLUSTER_MODE_GATEWAY, "config": {"routing": "kinference", "crds": crds}}
    rules = normalise(rules_by_subject(render({"gateway": gateway}))[("kinference-gateway", NAMESPACE)])
    assert not any(r[0] == "coordination.k8s.io" for r in rules)


def test_rbac_cluster_wide_cluster_mode_keeps_the_lease_in_its_namespace() -> None:
    """clusterWide turns the watch grants into ClusterRoles; the Lease stays a Role in its namespace."""
    objects = render({"clusterWide": True, "gateway": CLUSTER_MODE_GATEWAY})
    grants = rules_by_subject(objects)
    assert normalise(grants[("kinference-gateway", "*")]) == GATEWAY_RULES | CLUSTER_MODE_KINDS
    assert normalise(grants[("kinference-gateway", NAMESPACE)]) == lease_rules()
    assert {o["kind"] for o in find(objects, "Role")} == {"Role"} and len(find(objects, "Role")) == 1


def test_rbac_cluster_wide() -> None:
    objects = render(VARIANTS["cluster-wide"])
    assert not find(objects, "Role") and not find(objects, "RoleBinding")
    grants = rules_by_subject(objects)
    secrets = {("", "secrets", "provider-keys", v) for v in READ}
    assert normalise(grants[("kinference-gateway", "*")]) == GATEWAY_RULES | secrets
    assert normalise(grants[("kinference-agent", "*")]) == AGENT_RULES


# ------------------------------------------------------------------------------------ ServiceMonitor


def test_service_monitor_only_when_enabled() -> None:
    assert not find(render({}), "ServiceMonitor")
    objects = render(ALL_FEATURES)
    monitors = {m["metadata"]["name"]: m for m in find(objects, "ServiceMonitor")}
    assert set(monitors) == {"kinference-gateway", "kinference-agent"}
    for name, port in (("kinference-gateway", "admin"), ("kinference-agent", "metrics")):
        monitor = monitors[name]
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        assert monitor["spec"]["endpoints"][0]["port"] == port
        service = one(objects, "Service", name)
        assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
        assert port in {p["name"] for p in service["spec"]["ports"]}


# ---------------------------------------------------------------------------- Gateway API and examples


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_httproute_sends_v1_to_the_gateway_service() -> None:
    gateway_api = [o for p in sorted((REPO / "deploy" / "gateway-api").glob("*.yaml")) for o in load_all(p)]
    gateway = one(gateway_api, "Gateway")
    route = one(gateway_api, "HTTPRoute")
    service = one(render({}), "Service", "kinference-gateway")
    assert route["metadata"]["namespace"] == gateway["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert route["spec"]["parentRefs"][0]["name"] == gateway["metadata"]["name"]
    listener = route["spec"]["parentRefs"][0]["sectionName"]
    assert listener in {lst["name"] for lst in gateway["spec"]["listeners"]}
    assert gateway["spec"]["gatewayClassName"] == one(gateway_api, "GatewayClass")["metadata"]["name"]
    [rule] = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    http_port = {p["name"]: p["port"] for p in service["spec"]["ports"]}["http"]
    assert rule["backendRefs"] == [{"name": service["metadata"]["name"], "port": http_port}]


def test_vllm_worker_example_matches_the_agent(tmp_path: Path) -> None:
    [deployment] = load_all(REPO / "deploy" / "examples" / "vllm-worker.yaml")
    kubernetes_validate([deployment], tmp_path, "vllm-worker")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    chart_values = yaml.safe_load((MAIN_CHART / "values.yaml").read_text())
    assert chart_values["workerSelector"].items() <= labels.items(), "the agent selects the worker"
    c = container(deployment)
    args = c["args"]
    assert "--enable-prompt-tokens-details" in args
    assert any(a.startswith("--prefix-caching-hash-algo") for a in args)
    kv = json.loads(args[args.index("--kv-events-config") + 1])
    # vLLM binds its publisher in its pod; the annotation tells the agent where to connect (one endpoint per pod).
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["kinference.ai/kv-events-port"] == "5557"
    assert kv == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "buffer_steps": 10000,
        "topic": "kv@$(POD_NAME)@qwen2.5-7b",
    }
    assert env_of(c)["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert {p["containerPort"] for p in c["ports"]} >= {8000, 5557, 5558}


# ------------------------------------------------------------------------------- real kube-apiserver

APISERVER_DIR = Path(__file__).resolve().parent / "kube-apiserver"
# A minimal ServiceMonitor CRD: the real one (prometheus-operator) is not available offline; this one lets the
# server accept the object's kind and envelope (its spec is not checked).
SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "names": {
            "kind": "ServiceMonitor",
            "listKind": "ServiceMonitorList",
            "plural": "servicemonitors",
            "singular": "servicemonitor",
        },
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }
        ],
    },
}


def strip_schema_for_1_20(schema: Any) -> Any:
    """Removes from a CRD schema what the 1.20 apiserver cannot take: `default: ""` (1.20 loses the empty
    string while converting the CRD and then rejects the default as `null`) and `x-kubernetes-validations`
    (CEL, 1.25+)."""
    if isinstance(schema, dict):
        return {
            k: strip_schema_for_1_20(v)
            for k, v in schema.items()
            if k != "x-kubernetes-validations" and not (k == "default" and v == "")
        }
    if isinstance(schema, list):
        return [strip_schema_for_1_20(v) for v in schema]
    return schema


def for_kubernetes_1_20(obj: dict[str, Any]) -> dict[str, Any]:
    """The test apiserver is 1.20; a few things went GA later. Rewritten here, each with its reason:
    - PodDisruptionBudget policy/v1 (GA in 1.21) -> policy/v1beta1, whose spec has the same fields;
    - Service spec.internalTrafficPolicy (1.22+, GA 1.26): unknown to 1.20, dropped;
    - CRD schemas: see strip_schema_for_1_20.
    Everything else is applied as rendered. kubernetes-validate checks the unmodified objects against 1.33."""
    obj = copy.deepcopy(obj)
    if obj["kind"] == "PodDisruptionBudget" and obj["apiVersion"] == "policy/v1":
        obj["apiVersion"] = "policy/v1beta1"
    if obj["kind"] == "Service":
        obj["spec"].pop("internalTrafficPolicy", None)
    if obj["kind"] == "CustomResourceDefinition":
        for version in obj["spec"]["versions"]:
            version["schema"] = strip_schema_for_1_20(version["schema"])
    return obj


def free_port_triple() -> int:
    """A port P such that P, P-4064 and P-4063 (the apiserver and etcd's two ports in start.sh) are free."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 5000:
            continue
        ok = True
        for p in (port - 4064, port - 4063):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return port
    raise RuntimeError("no free port triple")


class Kube:
    """kubectl against the test apiserver."""

    def __init__(self, kubeconfig: str) -> None:
        self.kubeconfig = kubeconfig

    def run(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["kubectl", "--kubeconfig", self.kubeconfig, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    def apply(self, objects: list[dict[str, Any]], *extra: str) -> str:
        return self.run("apply", *extra, "-f", "-", stdin=yaml.safe_dump_all(objects)).stdout

    def allowed(self, checks: list[tuple[str, str, str, str | None]]) -> list[bool]:
        """Asks the authorizer about many (service account, verb, resource, namespace) at once, with one
        SubjectAccessReview each in a single kubectl call. `resource` is `[group/]plural[/subresource]`,
        optionally `:name` (e.g. `secrets:provider-keys`); namespace None means cluster-wide."""
        reviews = []
        for sa, verb, resource, namespace in checks:
            resource, _, name = resource.partition(":")
            parts = resource.split("/")
            group = parts.pop(0) if "." in parts[0] else ""
            attributes = {"verb": verb, "group": group, "resource": parts[0]}
            if len(parts) > 1:
                attributes["subresource"] = parts[1]
            if name:
                attributes["name"] = name
            if namespace:
                attributes["namespace"] = namespace
            reviews.append(
                {
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SubjectAccessReview",
                    "spec": {
                        "user": f"system:serviceaccount:{NAMESPACE}:{sa}",
                        "groups": [
                            "system:serviceaccounts",
                            f"system:serviceaccounts:{NAMESPACE}",
                            "system:authenticated",
                        ],
                        "resourceAttributes": attributes,
                    },
                }
            )
        out = self.run("create", "-o", "json", "-f", "-", stdin=yaml.safe_dump_all(reviews)).stdout
        # kubectl prints one JSON document per created object, one after the other.
        decoder, items, pos = json.JSONDecoder(), [], 0
        while pos < len(out.rstrip()):
            item, pos = decoder.raw_decode(out, pos)
            items.extend(item["items"] if item.get("kind") == "List" else [item])
            while pos < len(out) and out[pos].isspace():
                pos += 1
        assert len(items) == len(checks)
        return [bool(item["status"].get("allowed")) for item in items]


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    if os.environ.get("KINFERENCE_TEST_APISERVER") != "1":
        pytest.skip("set KINFERENCE_TEST_APISERVER=1 to dry-run the charts against a real kube-apiserver")
    if shutil.which("kubectl") is None:
        pytest.fail("KINFERENCE_TEST_APISERVER=1 but kubectl is not installed")
    build = subprocess.run([str(APISERVER_DIR / "build.sh")], capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, f"kube-apiserver build failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"
    workdir = tmp_path_factory.mktemp("kube-apiserver")
    started = subprocess.run(
        [str(APISERVER_DIR / "start.sh"), str(workdir), str(free_port_triple())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert started.returncode == 0, f"kube-apiserver did not start:\n{started.stderr}"
        k = Kube(started.stdout.strip().splitlines()[-1])
        for ns in (NAMESPACE, WORKER_NAMESPACE):
            k.run("create", "namespace", ns)
        crds = [for_kubernetes_1_20(c) for c in chart_crds()] + [SERVICE_MONITOR_CRD]
        k.apply(crds)
        for crd in crds:
            k.run("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd['metadata']['name']}")
        yield k
    finally:
        subprocess.run([str(APISERVER_DIR / "stop.sh"), str(workdir)], timeout=60)


def test_apiserver_accepts_the_crds(kube: Kube) -> None:
    names = kube.run("get", "crd", "-o", "name").stdout.split()
    for plural in KINFERENCE_PLURALS:
        assert f"customresourcedefinition.apiextensions.k8s.io/{plural}.kinference.ai" in names


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_apiserver_dry_run_accepts_everything_rendered(kube: Kube, variant: str) -> None:
    objects = [for_kubernetes_1_20(o) for o in render(VARIANTS[variant])]
    out = kube.apply(objects, "--dry-run=server")
    assert out.count("(server dry run)") == len(objects), out


def test_apiserver_dry_run_accepts_the_vllm_worker_example(kube: Kube) -> None:
    objects = load_all(REPO / "deploy" / "examples" / "vllm-worker.yaml")
    out = kube.run("apply", "--dry-run=server", "-n", NAMESPACE, "-f", "-", stdin=yaml.safe_dump_all(objects)).stdout
    assert out.count("(server dry run)") == len(objects), out


def test_apiserver_rbac_grants_exactly_what_is_needed(kube: Kube) -> None:
    """Applies the all-features RBAC for real and asks the authorizer what each service account may do."""
    objects = render(ALL_FEATURES)
    kube.apply([o for o in objects if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")])
    gw, agent = "kinference-gateway", "kinference-agent"
    expect: list[tuple[tuple[str, str, str, str | None], bool]] = []
    for ns in (NAMESPACE, WORKER_NAMESPACE):
        for plural in KINFERENCE_PLURALS:
            resource = f"kinference.ai/{plural}"
            # The gateway reads its Kinference resources from files, never from the API.
            expect += [((gw, verb, resource, ns), False) for verb in READ]
            expect += [
                ((gw, "patch", f"{resource}/status", ns), False),
                ((agent, "get", resource, ns), False),
            ]
        expect += [
            ((gw, "watch", "pods", ns), True),
            ((gw, "get", "pods", ns), False),
            ((gw, "list", "discovery.k8s.io/endpointslices", ns), True),
            ((gw, "get", "secrets:provider-keys", ns), True),
            ((gw, "watch", "secrets:tenant-keys", ns), True),
            ((gw, "get", "secrets:other", ns), False),  # only the named Secrets
            ((gw, "list", "secrets", ns), False),
            ((gw, "delete", "pods", ns), False),
            ((agent, "watch", "pods", ns), True),
            ((agent, "list", "pods", ns), True),
            ((agent, "get", "secrets:provider-keys", ns), False),
            ((agent, "list", "discovery.k8s.io/endpointslices", ns), False),
            ((agent, "patch", "pods", ns), False),
        ]
    expect += [
        ((gw, "list", "pods", "default"), False),  # nothing outside the watched namespaces
        ((agent, "list", "pods", "default"), False),
        ((agent, "list", "pods", None), False),
        ((agent, "list", "nodes", None), False),
    ]
    answers = kube.allowed([check for check, _ in expect])
    wrong = [(check, want) for (check, want), got in zip(expect, answers) if got != want]
    assert not wrong, f"authorizer disagrees (check, expected): {wrong}"


def test_apiserver_rbac_grants_the_status_lease_by_name_only(kube: Kube) -> None:
    """Cluster mode, namespaced and cluster-wide, applied for real: the gateway gets and renews its own Lease
    and no other, creates Leases only in that Lease's namespace, and deletes none."""
    gw = "kinference-gateway"
    for variant in ("cluster-mode", "cluster-wide-cluster-mode"):
        objects = render(VARIANTS[variant])
        kinds = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
        for ns in {o["metadata"].get("namespace") for o in objects if o["kind"] in kinds} - {None}:
            kube.run("create", "namespace", ns, check=False)
        kube.apply([o for o in objects if o["kind"] in kinds])
        lease = "coordination.k8s.io/leases"
        expect = [
            ((gw, "get", f"{lease}:kinference-gateway-status", NAMESPACE), True),
            ((gw, "update", f"{lease}:kinference-gateway-status", NAMESPACE), True),
            ((gw, "create", lease, NAMESPACE), True),
            ((gw, "get", f"{lease}:kube-scheduler", NAMESPACE), False),
            ((gw, "update", f"{lease}:other", NAMESPACE), False),
            ((gw, "delete", f"{lease}:kinference-gateway-status", NAMESPACE), False),
            ((gw, "list", lease, NAMESPACE), False),
            ((gw, "get", f"{lease}:kinference-gateway-status", "kube-system"), False),
            ((gw, "update", f"{lease}:kube-controller-manager", "kube-system"), False),
            ((gw, "create", lease, "kube-system"), False),
            ((gw, "create", lease, WORKER_NAMESPACE), False),
            ((gw, "get", lease, None), False),
        ]
        answers = kube.allowed([check for check, _ in expect])
        wrong = [(check, want) for (check, want), got in zip(expect, answers) if got != want]
        assert not wrong, f"{variant}: authorizer disagrees (check, expected): {wrong}"
        kube.run("delete", "-f", "-", stdin=yaml.safe_dump_all([o for o in objects if o["kind"] in kinds[1:]]))


def test_apiserver_dry_run_rejects_a_broken_object(kube: Kube) -> None:
    """The dry run really validates: a Deployment whose selector does not match its pod labels is refused."""
    deployment = copy.deepcopy(one(render({}), GATEWAY))
    deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "other"
    result = kube.run("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(deployment), check=False)
    assert result.returncode != 0 and "selector" in result.stderr, result.stderr


# ------------------------------------------------------------------------------------------- README


def value_paths(values: Any, prefix: str = "") -> Iterator[str]:
    """Dotted paths of a values tree, down to leaves (scalars, lists, empty maps)."""
    if isinstance(values, dict) and values:
        for key, sub in values.items():
            yield from value_paths(sub, f"{prefix}{key}.")
    else:
        yield prefix.rstrip(".")


def documented_values(readme: Path) -> set[str]:
    """The backticked first cells of the README's value tables."""
    out = set()
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and cells[1].startswith("`") and cells[1].endswith("`"):
            out.add(cells[1].strip("`"))
    return out


def test_every_value_is_documented_in_the_readme() -> None:
    """Each value path, or a map above it documented as a whole (e.g. `gateway.resources`), has a README row,
    and every documented value exists."""
    values = yaml.safe_load((MAIN_CHART / "values.yaml").read_text())
    documented = documented_values(MAIN_CHART / "README.md")
    paths = list(value_paths(values))
    undocumented = [
        p for p in paths if not any(p == d or p.startswith(d + ".") for d in documented)
    ]
    assert not undocumented, f"values missing from {MAIN_CHART / 'README.md'}: {undocumented}"
    known = set(paths) | {p.rsplit(".", i)[0] for p in paths for i in range(1, p.count(".") + 1)}
    stale = sorted(d for d in documented if "." in d or d in values if d not in known)
    assert not stale, f"README documents values that do not exist: {stale}"


# ------------------------------------------------------------------------------- flags and env vs binaries

BIN_DIR = Path(os.environ.get("KINFERENCE_BIN_DIR", REPO / "target" / "debug"))
# Variables read by something other than the binary's own code, each with its reader.
READ_ELSEWHERE = {
    "RUST_LOG": "tracing's EnvFilter (both binaries)",
    "NVIDIA_VISIBLE_DEVICES": "the NVIDIA container runtime",
    "NVIDIA_DRIVER_CAPABILITIES": "the NVIDIA container runtime",
    "EXTRA": "the test's own extraEnv",
}


def help_text(binary: str) -> str:
    path = BIN_DIR / binary
    if not path.is_file():
        pytest.skip(f"{path} is not built (cargo build --workspace --bins; `cargo xtask test` builds it first)")
    return subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=30, check=True).stdout


def crate_source(crate: str) -> str:
    return "\n".join(p.read_text() for p in (REPO / crate / "src").rglob("*.rs") if "tests" not in p.parts)


@pytest.mark.parametrize("variant", ["defaults", "all-features", "agent-without-ebpf"])
@pytest.mark.parametrize(
    "kind,binary,crate",
    [(GATEWAY, "kinference-gateway", "kinference-gateway"), ("DaemonSet", "kinference-agent", "kinference-agent")],
)
def test_every_flag_and_variable_is_one_the_binary_reads(variant: str, kind: str, binary: str, crate: str) -> None:
    """Each arg is a flag of `<binary> --help`; each env var is a flag's `[env: ...]`, read by the crate's
    code (`std::env::var("NAME")`), used in an arg as `$(NAME)`, or read by a named other program."""
    values = VARIANTS[variant]
    found = find(render(values), kind)
    if not found:
        pytest.skip(f"no {kind} in {variant}")
    c = container(found[0])
    text = help_text(binary)
    flags = set(re.findall(r"--[a-z0-9][a-z0-9-]*", text))
    helped_env = set(re.findall(r"\[env: ([A-Z0-9_]+)=", text))
    source = crate_source(crate)
    extra_args = set(values.get("gateway" if kind == GATEWAY else "agent", {}).get("extraArgs", []))
    for arg in c.get("args", []):
        flag = arg.split("=", 1)[0]
        assert flag in flags, f"{binary} has no flag {flag} (chart arg {arg!r}; user extraArgs {extra_args})"
    args = " ".join(c.get("args", []))
    for e in c.get("env", []):
        name = e["name"]
        ok = (
            name in helped_env
            or f'"{name}"' in source
            or f"$({name})" in args
            or name in READ_ELSEWHERE
        )
        assert ok, f"{binary} never reads {name} (not in --help, not in its code, not used in an argument)"


def test_network_policies_limit_who_reaches_each_port() -> None:
    objects = render({})
    gateway = one(objects, "NetworkPolicy", "kinference-gateway")["spec"]
    agent = one(objects, "NetworkPolicy", "kinference-agent")["spec"]
    assert gateway["policyTypes"] == ["Ingress"] and agent["policyTypes"] == ["Ingress"]
    by_port = {r["ports"][0]["port"]: r.get("from") for r in agent["ingress"]}
    assert by_port["grpc"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "kinference", "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "gateway"}}}]
    workers = {"podSelector": {"matchLabels": {"kinference.ai/worker": "true"}}}
    # Worker pods of the release's own namespace only (a podSelector alone), not of every namespace.
    assert by_port["kv-events"] == [workers]
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert by_port["metrics"] == [monitoring]
    gw = {r["ports"][0]["port"]: r.get("from") for r in gateway["ingress"]}
    # Admin: monitoring, and the other gateway replicas (replicaSharing, on by default).
    assert gw == {"http": None, "admin": [monitoring, {"podSelector": by_port["grpc"][0]["podSelector"]}]}
    assert [p["port"] for p in gateway["ingress"][0]["ports"]] == ["http", "extproc"]
    assert not find(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


def kv_events_peers(values: dict[str, Any]) -> list[dict[str, Any]]:
    agent = one(render(values), "NetworkPolicy", "kinference-agent")["spec"]
    return next(r["from"] for r in agent["ingress"] if r["ports"][0]["port"] == "kv-events")


def test_agent_kv_port_admits_worker_pods_of_the_watched_and_listed_namespaces_only() -> None:
    """A worker-labelled pod in any namespace could once reach the agent's KV-event port; now the release
    namespace's, the watched namespaces' and those listed in networkPolicy.workerNamespaces only."""
    workers = {"matchLabels": {"kinference.ai/worker": "true"}}

    def in_ns(ns: str) -> dict[str, Any]:
        return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}, "podSelector": workers}

    assert kv_events_peers({}) == [{"podSelector": workers}]
    assert kv_events_peers(ALL_FEATURES) == [{"podSelector": workers}, in_ns(WORKER_NAMESPACE)]
    listed = {"networkPolicy": {"workerNamespaces": ["ml-a", "ml-b", NAMESPACE]}}
    assert kv_events_peers(listed) == [{"podSelector": workers}, in_ns("ml-a"), in_ns("ml-b")]
    # Cluster-wide discovery does not open the port to every namespace: only the listed ones.
    assert kv_events_peers({"clusterWide": True}) == [{"podSelector": workers}]
    assert kv_events_peers({"clusterWide": True, **listed}) == [{"podSelector": workers}, in_ns("ml-a"), in_ns("ml-b")]
    for peers in (kv_events_peers(v) for v in VARIANTS.values() if v.get("agent", {}).get("enabled", True)):
        assert all(p.get("namespaceSelector") != {} for p in peers), "never every namespace"


def test_replicas_share_dispatches_through_their_own_service() -> None:
    """gateway.replicaSharing (default on): each replica finds the others from the gateway Service's
    endpoints at its admin port (the Service names the port `admin`), leaves itself out by POD_IP, and the
    NetworkPolicy lets gateway pods reach each other's admin port; off, none of the three is there."""
    objects = render({"networkPolicy": {"enabled": True}})
    config = yaml.safe_load(one(objects, "ConfigMap", "kinference-gateway")["data"]["gateway.yaml"])
    service = one(objects, "Service", "kinference-gateway")
    assert config["kubernetes"]["peer_service"] == service["metadata"]["name"]
    assert "admin" in {p["name"] for p in service["spec"]["ports"]}
    env = {e["name"]: e for e in container(one(objects, GATEWAY, "kinference-gateway"))["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "KINFERENCE_ADMIN_KEY" in env, "peers post with the admin key"
    policy = one(objects, "NetworkPolicy", "kinference-gateway")
    [admin_rule] = [r for r in policy["spec"]["ingress"] if {"port": "admin", "protocol": "TCP"} in r["ports"]]
    gateway_labels = one(objects, GATEWAY, "kinference-gateway")["spec"]["selector"]["matchLabels"]
    assert {"podSelector": {"matchLabels": gateway_labels}} in admin_rule["from"], admin_rule

    off = render({"networkPolicy": {"enabled": True}, "gateway": {"replicaSharing": {"enabled": False}}})
    config = yaml.safe_load(one(off, "ConfigMap", "kinference-gateway")["data"]["gateway.yaml"])
    assert "peer_service" not in config["kubernetes"]
    [admin_rule] = [
        r for r in one(off, "NetworkPolicy", "kinference-gateway")["spec"]["ingress"]
        if {"port": "admin", "protocol": "TCP"} in r["ports"]
    ]
    assert all("podSelector" not in f for f in admin_rule["from"]), admin_rule
