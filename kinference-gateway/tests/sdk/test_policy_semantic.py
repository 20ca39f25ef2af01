"""Semantic routing: the cheap model unless the expensive one is faster for this very prompt.

Two pools: `small-pool` (model `small`, cheap) and `big-pool` (model `big`, ten times the price per
uncached token), one simulated worker each. The rule routes requests for `small` to either, cheapest
first unless the dearer pool's estimated TTFT is at least 50 ms lower (`CheaperUnlessFaster`). The
router's estimate counts the prompt tokens each worker already holds: a long prompt the big pool has
just served is warm there and cold on the small pool, so it goes to the big pool; a new long prompt is
cold everywhere and goes to the cheap one. The decision header says why.
"""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

import requests

from conftest import Cluster
from policy_cluster import model_yaml, pool_yaml, start_gateway, start_sim, write_dir

POLICY = textwrap.dedent("""\
    apiVersion: kinference.ai/v1alpha1
    kind: InferencePolicy
    metadata: {name: semantic-routing}
    spec:
      priority: 30
      rules:
        - name: small-unless-big-is-faster
          match: {models: [small]}
          action:
            route:
              targets: [{pool: small-pool}, {pool: big-pool}]
              select: CheaperUnlessFaster
              minTtftGainMs: 50
    """)


def ask(gw, model: str, prompt: str) -> requests.Response:
    # Non-streaming: the estimate stays at the router's prior rates (5,000 prompt tokens/s), which
    # keeps the figures of this test independent of the machine's speed.
    r = requests.post(f"{gw.openai_base}/chat/completions", timeout=60, headers={"x-kinference-debug": "1"},
                      json={"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r


def long_prompt(topic: str) -> str:
    return (f"Background on {topic}. " + "The warehouse ships orders in the order they arrive, "
            "and every order is checked twice before it leaves the building. " * 80)


def test_cheap_model_unless_the_warm_expensive_one_is_faster():
    with tempfile.TemporaryDirectory(prefix="kinference-semantic-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            small = start_sim(cluster, model="small-sim")
            big = start_sim(cluster, model="big-sim")
            policy_dir = Path(tmp) / "policies"
            write_dir(policy_dir, {
                "models.yaml": model_yaml("small", ("general",), served="small-sim") + "---\n"
                + model_yaml("big", ("general",), served="big-sim"),
                "pools.yaml": pool_yaml("small-pool", [small], model="small", uncached=0.1) + "---\n"
                + pool_yaml("big-pool", [big], model="big", uncached=1.0, cached=1.0),
            # (no discount for cached tokens on the big pool: even with `warm` cached there it stays the
            # dearer one, so choosing it must come from the TTFT gain, not from its cost)
                "policies.yaml": POLICY,
            })
            gw = start_gateway(cluster, policy_dir)

            warm = long_prompt("shipping")
            # Cold everywhere: the cheap pool.
            r = ask(gw, "small", long_prompt("returns"))
            assert r.headers["x-kinference-worker"] == small, r.headers.get("x-kinference-decision")
            assert r.json()["model"] == "small-sim"
            assert "pool/small-pool is cheapest" in r.headers["x-kinference-decision"]

            # The big pool serves `warm` once (asked for by name: no rule matches `big`).
            r = ask(gw, "big", warm)
            assert r.headers["x-kinference-worker"] == big

            # Now `warm` is cached on the big pool only: it is faster there by far more than 50 ms.
            r = ask(gw, "small", warm)
            decision = r.headers["x-kinference-decision"]
            print(f"\nwarm prompt decision: {decision}")
            assert r.headers["x-kinference-worker"] == big, decision
            assert r.json()["model"] == "big-sim"
            assert "pool/big-pool is dearer but faster" in decision
            assert "policy=semantic-routing/small-unless-big-is-faster outcome=route" in decision

            # A new prompt is cold on both again: back to the cheap pool.
            r = ask(gw, "small", long_prompt("invoices"))
            assert r.headers["x-kinference-worker"] == small, r.headers.get("x-kinference-decision")
            assert gw.metric("kinference_gateway_policy_backend_requests_total", backend="pool/big-pool") == 2
        finally:
            cluster.close()
