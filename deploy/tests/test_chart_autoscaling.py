"""The kinference chart's autoscaling and per-tenant histogram values, rendered like `helm template`.

Off by default; on, a HorizontalPodAutoscaler (External metrics, validated by kubernetes-validate) or a
KEDA ScaledObject per pool, on the gateway's per-model gauges; both on is refused. The prometheus-adapter
example serves the metric names the HPA asks for. Helpers come from test_charts.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from test_charts import REPO, find, kubernetes_validate, one, render

POOL = {"name": "qwen-workers", "namespace": "inference", "model": "qwen2.5-7b", "maxReplicas": 6}


def scaling(autoscaler: str, **pool: Any) -> dict[str, Any]:
    return {"autoscaling": {autoscaler: {"enabled": True}, "pools": [{**POOL, **pool}]}}


def gateway_yaml(objects: list[dict[str, Any]]) -> dict[str, Any]:
    config_maps = [o for o in find(objects, "ConfigMap") if "gateway.yaml" in o.get("data", {})]
    assert len(config_maps) == 1
    return yaml.safe_load(config_maps[0]["data"]["gateway.yaml"])


def test_no_autoscaler_and_no_tenant_histograms_by_default() -> None:
    objects = render({})
    assert not find(objects, "HorizontalPodAutoscaler")
    assert not find(objects, "ScaledObject")
    assert "per_tenant_histograms" not in gateway_yaml(objects)["tenancy"]


def test_tenant_histograms_value_turns_them_on_in_gateway_yaml() -> None:
    tenancy = gateway_yaml(render({"gateway": {"metrics": {"tenantHistograms": True}}}))["tenancy"]
    assert tenancy["per_tenant_histograms"] is True
    # The chart's own default for the journal stays.
    assert tenancy["usage_journal"].startswith("/var/lib/kinference/usage/")


def test_hpa_scales_the_pool_on_queue_depth_and_estimated_ttft(tmp_path: Path) -> None:
    objects = render(scaling("hpa", ttftSeconds=0.5, inFlightPerReplica=16))
    hpa = one(objects, "HorizontalPodAutoscaler", "qwen-workers")
    assert hpa["metadata"]["namespace"] == "inference"
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "qwen-workers"}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 6)
    queue, ttft = (m["external"] for m in spec["metrics"])
    assert queue["metric"] == {
        "name": "kinference_gateway_pool_requests_in_flight",
        "selector": {"matchLabels": {"model": "qwen2.5-7b"}},
    }
    assert queue["target"] == {"type": "AverageValue", "averageValue": "16"}
    assert ttft["metric"]["name"] == "kinference_gateway_pool_estimated_ttft_seconds"
    assert ttft["target"] == {"type": "Value", "value": "0.5"}
    kubernetes_validate([hpa], tmp_path, "hpa")


def test_keda_scaled_object_queries_the_same_gauges() -> None:
    objects = render(scaling("keda", ttftSeconds=0.5, kind="StatefulSet"))
    assert not find(objects, "HorizontalPodAutoscaler")
    scaled = one(objects, "ScaledObject", "qwen-workers")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 6)
    queue, ttft = scaled["spec"]["triggers"]
    assert queue["type"] == "prometheus" and queue["metricType"] == "AverageValue"
    assert queue["metadata"]["query"] == 'sum(kinference_gateway_pool_requests_in_flight{model="qwen2.5-7b"})'
    assert queue["metadata"]["threshold"] == "8"
    assert queue["metadata"]["serverAddress"].startswith("http://")
    assert ttft["metricType"] == "Value"
    assert ttft["metadata"]["query"] == 'max(kinference_gateway_pool_estimated_ttft_seconds{model="qwen2.5-7b"})'
    # Without ttftSeconds, only the queue depth.
    plain = one(render(scaling("keda")), "ScaledObject")
    assert len(plain["spec"]["triggers"]) == 1


@pytest.mark.parametrize(
    "values",
    [
        {"autoscaling": {"hpa": {"enabled": True}, "keda": {"enabled": True}, "pools": [POOL]}},
        {"autoscaling": {"hpa": {"enabled": True}, "pools": [{"name": "w", "model": "m"}]}},
        {"autoscaling": {"pools": [{**POOL, "kind": "ReplicaSet"}]}},
        {"autoscaling": {"pools": [{**POOL, "inFlightPerReplica": 0}]}},
        {"gateway": {"metrics": {"tenantHistogram": True}}},
    ],
    ids=["hpa-and-keda", "no-max-replicas", "unknown-kind", "zero-target", "misspelt-value"],
)
def test_autoscaling_mistakes_are_refused(values: dict[str, Any]) -> None:
    with pytest.raises(Exception):
        render(values)


def test_prometheus_adapter_example_serves_what_the_hpa_asks_for() -> None:
    adapter = yaml.safe_load((REPO / "deploy" / "examples" / "prometheus-adapter.yaml").read_text())
    served = {rule["name"]["as"]: rule for rule in adapter["rules"]["external"]}
    hpa = one(render(scaling("hpa", ttftSeconds=0.5)), "HorizontalPodAutoscaler")
    asked = {m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert asked <= served.keys(), f"{asked - served.keys()} not served"
    # Replicas add their in-flight counts; the estimate is the highest replica's.
    assert served["kinference_gateway_pool_requests_in_flight"]["metricsQuery"].startswith("sum by (model, pool)")
    assert served["kinference_gateway_pool_estimated_ttft_seconds"]["metricsQuery"].startswith("max by (model, pool)")
    assert all(rule["resources"] == {"namespaced": False} for rule in served.values())


def test_an_inference_pool_narrows_the_gauges_to_its_workers() -> None:
    hpa = one(render(scaling("hpa", ttftSeconds=0.5, inferencePool="near")), "HorizontalPodAutoscaler")
    for metric in hpa["spec"]["metrics"]:
        assert metric["external"]["metric"]["selector"]["matchLabels"] == {"model": "qwen2.5-7b", "pool": "near"}
    scaled = one(render(scaling("keda", ttftSeconds=0.5, inferencePool="near")), "ScaledObject")
    queue, ttft = scaled["spec"]["triggers"]
    assert queue["metadata"]["query"] == \
        'sum(kinference_gateway_pool_requests_in_flight{model="qwen2.5-7b",pool="near"})'
    assert ttft["metadata"]["query"] == \
        'max(kinference_gateway_pool_estimated_ttft_seconds{model="qwen2.5-7b",pool="near"})'
