"""A time-per-output-token objective through the gateway, with the official `openai` SDK: once the gateway has
learned each worker's decode speed from its streams, a request naming `x-kinference-tpot-objective-ms` goes only
to the workers decoding within it, and one no worker meets is refused at once where the tenant says `Refuse`.
Real processes only: two `vllm-sim` workers of different speeds (`--slowdown`) and `kinference-gateway`.
"""
from __future__ import annotations

import openai
import pytest
import requests

from conftest import MODEL, Cluster
from test_tenancy import start_gateway

KEY = "sk-latency-5c0ffee5c0ffee5c0ffee5c0ffee5c0f"
TENANT = """apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata: {name: latency}
spec:
  apiKeys:
    - secretRef: {name: latency, key: api-key}
  flowControl:
    objectives: {onMiss: Refuse}
"""


def served(worker) -> int:
    return requests.get(f"{worker.url}/sim/state", timeout=10).json()["data_parallel"]["served_by_rank"][0]


def stream(client: openai.OpenAI, text: str, **extra) -> str:
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                            max_tokens=12, stream=True, **extra)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_tpot_objective_goes_to_the_workers_decoding_within_it(tmp_path):
    c = Cluster(tmp_path)
    try:
        # About 2 ms and 20 ms per output token.
        quick, slow = c.worker("--slowdown", "4"), c.worker("--slowdown", "40")
        (tmp_path / "tenants").mkdir()
        (tmp_path / "tenants" / "latency.yaml").write_text(TENANT)
        (tmp_path / "secrets" / "latency").mkdir(parents=True)
        (tmp_path / "secrets" / "latency" / "api-key").write_text(KEY + "\n")
        gw = start_gateway(c, [quick, slow], f"tenants_dir: {tmp_path / 'tenants'}\n"
                           f"secrets_dir: {tmp_path / 'secrets'}", "tpot")
        client = openai.OpenAI(base_url=gw.openai_base, api_key=KEY, max_retries=0, timeout=60)
        # Streams through the gateway until each worker has served some: the gateway learns their speeds.
        for i in range(40):
            if min(served(quick), served(slow)) >= 2:
                break
            stream(client, f"Warm-up question number {i} about something else entirely.")
        assert min(served(quick), served(slow)) >= 2, "both workers served streams"

        # 8 ms per token: only the quick worker meets it, whatever the prompt would otherwise prefer.
        before = (served(quick), served(slow))
        for i in range(5):
            assert stream(client, f"Objective question {i}.",
                          extra_headers={"x-kinference-tpot-objective-ms": "8"})
        assert (served(quick) - before[0], served(slow) - before[1]) == (5, 0)

        # 1 ms per token: neither meets it, and the tenant says Refuse: 503 objective_unmet at once.
        with pytest.raises(openai.APIStatusError) as e:
            stream(client, "Too tight.", extra_headers={"x-kinference-tpot-objective-ms": "1"})
        assert e.value.status_code == 503 and e.value.body["code"] == "objective_unmet", e.value.body
    finally:
        c.close()
