"""Cloud-burst traffic is billed and limited like any other: a provider's answer goes through the
tenant's settlement.

The only local pool points at a port where nothing listens (no local pool is available), and a burst
policy sends everything to the stand-in provider (which reports usage: 11 prompt tokens, 6 generated).
Tenants live in the policy directory. Then:
- a tenant's burst shows in `/admin/usage` under the provider's name, with the provider's token counts
  and the cost at the provider's price, streamed or not;
- its token limit (output tokens per minute) stops the next burst with 429: the provider's tokens were
  counted;
- a tenant whose budget is spent with `onExceeded: LocalOnly` is kept on local pools: the provider gets
  nothing more (and with the local pool down, the answer is 503).
"""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

import pytest
import requests

from conftest import MODEL, Cluster, free_port
from policy_cluster import model_yaml, pool_yaml, provider_yaml, start_gateway, start_standin, write_dir

PROVIDER = "standin-openai"
# The stand-in's usage and the provider's prices (policy_cluster.provider_yaml).
PROMPT_TOKENS, OUTPUT_TOKENS = 11, 6
COST = (PROMPT_TOKENS * 1.0 + OUTPUT_TOKENS * 4.0) / 1e6

KEYS = {
    "bursty": "sk-bursty-5f0e1d2c3b4a59687766554433221100",
    "streamer": "sk-streamer-00112233445566778899aabbccddeeff",
    "frugal": "sk-frugal-ffeeddccbbaa99887766554433221100",
}

TENANTS = textwrap.dedent("""\
    apiVersion: kinference.ai/v1alpha1
    kind: InferenceTenant
    metadata: {name: bursty}
    spec:
      apiKeys: [{secretRef: {name: bursty, key: api-key}}]
      limits: {outputTokensPerMinute: 12}
    ---
    apiVersion: kinference.ai/v1alpha1
    kind: InferenceTenant
    metadata: {name: streamer}
    spec:
      apiKeys: [{secretRef: {name: streamer, key: api-key}}]
    ---
    apiVersion: kinference.ai/v1alpha1
    kind: InferenceTenant
    metadata: {name: frugal}
    spec:
      apiKeys: [{secretRef: {name: frugal, key: api-key}}]
      budget: {monthlyLimit: 0.00001, onExceeded: LocalOnly}
    """)

POLICIES = textwrap.dedent("""\
    apiVersion: kinference.ai/v1alpha1
    kind: InferencePolicy
    metadata: {name: cloud-burst}
    spec:
      priority: 20
      rules:
        - name: saturated
          action:
            burst:
              providers: [standin-openai]
              when: {queueDepthAbove: 0}
    """)


@pytest.fixture(scope="module")
def env():
    with tempfile.TemporaryDirectory(prefix="kinference-billing-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            standin = start_standin(cluster)
            dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the local pool is unavailable
            policy_dir = Path(tmp) / "policies"
            write_dir(policy_dir, {
                "models.yaml": model_yaml(),
                "pools.yaml": pool_yaml("local", [dead]),
                "providers.yaml": provider_yaml(PROVIDER, standin, "OpenAI"),
                "policies.yaml": POLICIES,
                "tenants.yaml": TENANTS,
            })
            secrets = Path(tmp) / "secrets"
            for name, key in KEYS.items():
                (secrets / name).mkdir(parents=True)
                (secrets / name / "api-key").write_text(key + "\n")
            tenancy = textwrap.dedent(f"""\
                tenancy:
                  tenants_dir: {policy_dir}
                  secrets_dir: {secrets}
                  usage_journal: {Path(tmp) / "usage.jsonl"}
                """)
            gw = start_gateway(cluster, policy_dir, wait_ready=False, extra_yaml=tenancy)
            yield gw, standin
        finally:
            cluster.close()


def chat(gw, tenant: str, stream: bool = False) -> requests.Response:
    body = {"model": MODEL, "max_tokens": 9, "messages": [{"role": "user", "content": "Say hello."}]}
    if stream:
        body["stream"] = True
    return requests.post(f"{gw.openai_base}/chat/completions", json=body, timeout=30,
                         headers={"authorization": f"Bearer {KEYS[tenant]}"}, stream=stream)


def usage_rows(gw, tenant: str) -> list[dict]:
    r = requests.get(f"{gw.admin}/admin/usage", params={"tenant": tenant}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_a_burst_is_billed_at_the_providers_price_and_its_tokens_count_against_the_limit(env):
    gw, standin = env
    standin.reset()
    r = chat(gw, "bursty")
    assert r.status_code == 200, r.text
    assert r.headers.get("x-kinference-provider") == PROVIDER
    rows = usage_rows(gw, "bursty")
    assert len(rows) == 1, rows
    row = rows[0]
    assert row["provider"] == PROVIDER and row["pool"] == "", row
    assert row["requests"] == 1
    assert row["input_uncached_tokens"] == PROMPT_TOKENS
    assert row["output_tokens"] == OUTPUT_TOKENS
    assert row["cost"] == pytest.approx(COST)

    # 12 output tokens a minute: 9 reserved, 6 used, so 6 left; the next 9 do not fit. Were the
    # provider's tokens not counted, the bucket would be full again.
    again = chat(gw, "bursty")
    assert again.status_code == 429, again.text
    assert again.json()["error"]["type"] == "rate_limit_error"
    assert len(standin.requests()) == 1, "the limited burst reached the provider"
    assert usage_rows(gw, "bursty")[0]["requests"] == 1


def test_a_streamed_burst_is_billed_too(env):
    gw, standin = env
    r = chat(gw, "streamer", stream=True)
    assert r.status_code == 200, r.text
    text = r.text  # the whole stream: settled at its end
    assert "[DONE]" in text
    assert '"usage"' not in text, "the client did not ask for the usage chunk"
    rows = usage_rows(gw, "streamer")
    assert len(rows) == 1, rows
    assert rows[0]["provider"] == PROVIDER
    assert rows[0]["output_tokens"] == OUTPUT_TOKENS
    assert rows[0]["cost"] == pytest.approx(COST)


def test_a_spent_budget_with_local_only_keeps_the_tenant_off_providers(env):
    gw, standin = env
    standin.reset()
    first = chat(gw, "frugal")
    assert first.status_code == 200, first.text
    assert first.headers.get("x-kinference-provider") == PROVIDER
    assert len(standin.requests()) == 1
    # The budget (0.00001) is spent by that one burst: local pools only, and the only one is down.
    second = chat(gw, "frugal")
    assert second.status_code == 503, second.text
    assert "x-kinference-provider" not in second.headers
    assert len(standin.requests()) == 1, "a tenant past its budget reached the provider"
    rows = usage_rows(gw, "frugal")
    assert sum(r["requests"] for r in rows if r["provider"] == PROVIDER) == 1, rows
