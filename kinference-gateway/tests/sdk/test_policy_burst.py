"""Cloud bursting under load: while the local worker is saturated, the share of requests sent to the
provider rises; when the worker drains, it falls back.

One slow simulated worker (`l40s-27b-fp8` preset, `--max-num-seqs 2`: it runs two requests at a time and
queues the rest) and the stand-in provider (150 ms per answer). The policy bursts while the local pool's
queue is deeper than 2 requests (the gateway reads the queue from the worker's `/metrics`). Three
phases: idle (one request at a time), saturated (24 concurrent clients), drained (one at a time
again). Requests with personal data sent during the saturated phase must still be served locally.
The figures are printed (`pytest -s` shows them).
"""

from __future__ import annotations

import statistics
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from conftest import MODEL, Cluster
from policy_cluster import (model_yaml, pool_yaml, provider_yaml, sim_waiting, start_gateway, start_sim,
                            start_standin, write_dir)

POLICY = textwrap.dedent("""\
    apiVersion: kinference.ai/v1alpha1
    kind: InferencePolicy
    metadata: {name: cloud-burst}
    spec:
      priority: 20
      rules:
        - name: burst-when-queued
          action:
            burst:
              providers: [standin]
              when: {mode: All, queueDepthAbove: 2}
    """)


def one_request(gw, i: int, pii: bool = False) -> dict:
    content = (f"Request {i}: please reply to jane.doe{i}@example.com about the order." if pii
               else f"Request {i}: summarize the shipping policy in one line.")
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    started = time.monotonic()
    r = requests.post(f"{gw.openai_base}/chat/completions", json=body, timeout=120)
    elapsed = time.monotonic() - started
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text, r.text
    return {"provider": "x-kinference-provider" in r.headers, "worker": r.headers.get("x-kinference-worker"),
            "latency": elapsed, "pii": pii}


def run_phase(gw, name: str, concurrency: int, count: int, pii_every: int = 0) -> list[dict]:
    results: list[dict] = []
    lock = threading.Lock()
    counter = iter(range(count))

    def client():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            result = one_request(gw, i, pii=bool(pii_every) and i % pii_every == 0)
            with lock:
                results.append(result)

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    plain = [r for r in results if not r["pii"]]
    to_provider = sum(r["provider"] for r in plain)
    share = to_provider / len(plain)
    p50 = statistics.median(r["latency"] for r in plain)
    print(f"{name:>10}: concurrency {concurrency:2d}, {len(plain):3d} requests, "
          f"{to_provider:3d} to the provider, share {share:5.1%}, median latency {p50 * 1000:6.0f} ms")
    return results


def share(results: list[dict]) -> float:
    plain = [r for r in results if not r["pii"]]
    return sum(r["provider"] for r in plain) / len(plain)


def test_bursting_share_rises_under_saturation_and_falls_back():
    with tempfile.TemporaryDirectory(prefix="kinference-burst-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            worker = start_sim(cluster, "l40s-27b-fp8", "--max-num-seqs", "2")
            standin = start_standin(cluster, delay_ms=150)
            policy_dir = Path(tmp) / "policies"
            write_dir(policy_dir, {
                "models.yaml": model_yaml(),
                "pools.yaml": pool_yaml("local", [worker]),
                "providers.yaml": provider_yaml("standin", standin, "OpenAI"),
                "policies.yaml": POLICY,
            })
            gw = start_gateway(cluster, policy_dir, load_interval_ms=100)

            print()
            idle = run_phase(gw, "idle", 1, 10)
            saturated = run_phase(gw, "saturated", 24, 120, pii_every=10)
            deadline = time.monotonic() + 30
            while sim_waiting(worker) > 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)  # a few scrape intervals: the gateway sees the drained queue
            drained = run_phase(gw, "drained", 1, 10)

            assert share(idle) == 0.0
            assert share(saturated) >= 0.3, "the provider took too small a share while saturated"
            assert share(drained) <= 0.1, "bursting did not stop after the worker drained"
            pii = [r for r in saturated if r["pii"]]
            assert pii and all(not r["provider"] and r["worker"] == worker for r in pii), \
                "a request with personal data was not served locally"
            sent = standin.requests()
            assert not any("@example.com" in str(s["body"]) for s in sent)
            provider_count = sum(r["provider"] for r in idle + saturated + drained)
            assert len(sent) == provider_count
            assert gw.metric("kinference_gateway_policy_backend_requests_total", backend="provider/standin",
                             burst="true") == provider_count
        finally:
            cluster.close()
