"""Reloading policies while serving under load loses no request.

Two pools (one simulated worker each) and the stand-in provider. While 8 clients send requests
continuously (OpenAI chat streamed and not, Anthropic messages), the policy directory is rewritten
every 50-150 ms, cycling through: everything to pool A, everything to pool B, burst to the provider,
an invalid policy (not applied: the previous version keeps serving), and the policy file removed. Every
request must get a complete, valid answer; each variant must have taken effect at least once.
"""

from __future__ import annotations

import itertools
import random
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import anthropic
import openai

from conftest import MODEL, Cluster, free_port
from policy_cluster import (model_yaml, pool_yaml, provider_yaml, start_gateway, start_sim, start_standin,
                            write_dir)
from standin_provider import REPLY_WORDS


def route_to(pool: str) -> str:
    return textwrap.dedent(f"""\
        apiVersion: kinference.ai/v1alpha1
        kind: InferencePolicy
        metadata: {{name: switch}}
        spec:
          priority: 10
          rules:
            - name: to-{pool}
              action:
                route:
                  targets: [{{pool: {pool}}}]
        """)


BURST = textwrap.dedent("""\
    apiVersion: kinference.ai/v1alpha1
    kind: InferencePolicy
    metadata: {name: switch}
    spec:
      priority: 10
      rules:
        - name: burst
          action:
            burst:
              providers: [standin]
              when: {pools: [down], queueDepthAbove: 0}
    """)

# Schema-valid YAML, semantically invalid (unknown pool): rejected, the previous version keeps serving.
INVALID = route_to("no-such-pool")

VARIANTS = [("pool-a", route_to("pool-a")), ("pool-b", route_to("pool-b")), ("burst", BURST),
            ("invalid", INVALID), ("removed", None), ("truncated", route_to("pool-a")[:70])]


def test_rewriting_policies_under_load_loses_no_request():
    with tempfile.TemporaryDirectory(prefix="kinference-reload-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            a, b = start_sim(cluster), start_sim(cluster)
            standin = start_standin(cluster)
            dead = f"http://127.0.0.1:{free_port()}"
            policy_dir = Path(tmp) / "policies"
            write_dir(policy_dir, {
                "models.yaml": model_yaml(),
                "pools.yaml": pool_yaml("pool-a", [a]) + "---\n" + pool_yaml("pool-b", [b]) + "---\n"
                + pool_yaml("down", [dead]),
                "providers.yaml": provider_yaml("standin", standin, "OpenAI"),
                "policy.yaml": route_to("pool-a"),
            })
            gw = start_gateway(cluster, policy_dir, reload_interval_ms=20)

            stop = threading.Event()
            lock = threading.Lock()
            served: dict[str, int] = {}
            failures: list[str] = []
            total = [0]

            def record(where: str | None) -> None:
                with lock:
                    total[0] += 1
                    served[where or "?"] = served.get(where or "?", 0) + 1

            def load(seed: int) -> None:
                rng = random.Random(seed)
                oai = openai.OpenAI(base_url=gw.openai_base, api_key="unused", max_retries=0, timeout=60)
                ant = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)
                messages = [{"role": "user", "content": f"Client {seed}: tell me about prefix caching."}]
                while not stop.is_set():
                    kind = rng.choice(["chat", "stream", "anthropic"])
                    try:
                        if kind == "chat":
                            raw = oai.chat.completions.with_raw_response.create(
                                model=MODEL, messages=messages, max_tokens=6)
                            text = raw.parse().choices[0].message.content
                            where = raw.headers.get("x-kinference-worker")
                        elif kind == "stream":
                            with oai.chat.completions.with_streaming_response.create(
                                    model=MODEL, messages=messages, max_tokens=6, stream=True) as resp:
                                where = resp.headers.get("x-kinference-worker")
                                chunks = list(resp.parse())
                            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                            assert any(c.choices and c.choices[0].finish_reason for c in chunks)
                        else:
                            raw = ant.messages.with_raw_response.create(
                                model=MODEL, max_tokens=6, messages=messages)
                            message = raw.parse()
                            text = message.content[0].text
                            assert message.stop_reason in ("max_tokens", "end_turn")
                            where = raw.headers.get("x-kinference-worker")
                        assert text, f"{kind}: empty answer"
                        if where == standin.base:
                            assert text == "".join(REPLY_WORDS)
                        record(where)
                    except Exception as e:  # noqa: BLE001 - every failure is collected and reported
                        with lock:
                            failures.append(f"{kind}: {type(e).__name__}: {e}")

            threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            rewrites = 0
            deadline = time.monotonic() + 12
            rng = random.Random(7)
            for name, text in itertools.cycle(VARIANTS):
                if time.monotonic() > deadline:
                    break
                path = policy_dir / "policy.yaml"
                if text is None:
                    path.unlink(missing_ok=True)
                else:
                    path.write_text(text)  # not atomic on purpose: readers may see a partial file
                rewrites += 1
                time.sleep(rng.uniform(0.05, 0.15))
            stop.set()
            for t in threads:
                t.join(timeout=90)

            print(f"\n{rewrites} rewrites, {total[0]} requests, served by: {served}")
            assert not failures, f"{len(failures)} of {total[0] + len(failures)} requests failed: {failures[:5]}"
            assert total[0] >= 100
            assert served.get(a, 0) > 0 and served.get(b, 0) > 0 and served.get(standin.base, 0) > 0, served
            assert set(served) <= {a, b, standin.base}, served
        finally:
            cluster.close()
