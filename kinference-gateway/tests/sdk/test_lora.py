"""LoRA adapters end to end (issue 22 item 6), with the official `openai` SDK: two `vllm-sim` workers
publishing KV events to a real `kinference-agent`, only the first with the adapter `sql-lora` loaded
(`--lora-modules`), behind a gateway in `kinference` routing mode.

Requests for the adapter go only to the worker that lists it in `/v1/models`; the router's cached-prefix
figure for a prompt counts only the blocks cached for the requested model: a prompt the base model has
cached is no hit for the adapter, and one the adapter has cached is no hit for the base model.
"""

from __future__ import annotations

import re
import textwrap
import time

import openai
import requests

from conftest import BIN_DIR, MODEL, TOKENIZER_DIR, Cluster, Gateway, Worker, free_port, wait_for

ADAPTER = "sql-lora"
DEBUG = {"x-kinference-debug": "1"}
# Long enough for several 16-token blocks; each test prompt is distinct.
FILLER = "List the tables, their columns and the keys that join them, then write the query. " * 6


def start_worker(cluster: Cluster, *, lora: bool) -> tuple[Worker, str]:
    """A worker publishing its KV events (connect mode: the agent binds) and its agent YAML entry."""
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    extra = ["--block-size", "16", "--kv-events-endpoint", events, "--kv-replay-endpoint", replay]
    if lora:
        extra += ["--lora-modules", f"{ADAPTER}=/adapters/{ADAPTER}"]
    worker = cluster.worker(*extra)
    entry = (f"  - url: {worker.url}\n    model: {MODEL}\n    kv_events_endpoint: {events}\n"
             f"    kv_events_bind: true\n    kv_replay_endpoint: {replay}\n")
    return worker, entry


def start_agent(cluster: Cluster, entries: list[str]) -> str:
    grpc = free_port()
    workers = cluster.workdir / "agent-workers.yaml"
    workers.write_text("workers:\n" + "".join(entries))
    process = cluster._spawn("kinference-agent", [
        str(BIN_DIR / "kinference-agent"), "--grpc-listen", f"127.0.0.1:{grpc}",
        "--metrics-listen", f"127.0.0.1:{free_port()}", "--workers", str(workers), "--node", "lora-test",
    ])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.proc.poll() is None, f"agent exited:\n{process.log_tail()}"
        try:
            import socket
            with socket.create_connection(("127.0.0.1", grpc), timeout=1):
                return f"http://127.0.0.1:{grpc}"
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"agent not listening:\n{process.log_tail()}")


def start_gateway(cluster: Cluster, workers: list[Worker], agent: str) -> Gateway:
    port, admin = free_port(), free_port()
    config = cluster.workdir / "gateway-lora.yaml"
    lines = [f"models:\n  - name: {MODEL}\n    tokenizer_dir: {TOKENIZER_DIR}", "workers:"]
    lines += [f"  - url: {w.url}\n    model: {MODEL}" for w in workers]
    lines += [f"agents:\n  - {agent}", "routing: kinference"]
    config.write_text("\n".join(lines) + "\n")
    process = cluster._spawn("gateway-lora", [
        str(BIN_DIR / "kinference-gateway"), "--listen", f"127.0.0.1:{port}",
        "--admin-listen", f"127.0.0.1:{admin}", "--config", str(config),
    ])
    gw = Gateway(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", process, workers)
    try:
        wait_for(f"{gw.admin}/readyz", proc=process.proc)
    except Exception:
        raise RuntimeError(f"gateway did not start:\n{process.log_tail()}")
    return gw


def chat(gw: Gateway, model: str, prompt: str) -> tuple[str, dict[str, int], int | None]:
    """One request through the SDK: the worker it went to, the router's cached tokens per candidate
    (from the decision explanation) and the worker's own cached-token count."""
    client = openai.OpenAI(base_url=gw.openai_base, api_key="unused", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=4, extra_headers=DEBUG)
    explain = raw.headers.get("x-kinference-decision", "")
    per_worker = {url: int(n) for url, n in re.findall(r"\*?(http://\S+) cached=(\d+)", explain)}
    usage = raw.parse().usage
    details = getattr(usage, "prompt_tokens_details", None)
    return raw.headers["x-kinference-worker"], per_worker, getattr(details, "cached_tokens", None)


def wait_until_cached(gw: Gateway, model: str, prompt: str, worker: str) -> dict[str, int]:
    """Sends `prompt` for `model` until the router counts a cached prefix on `worker` (the agent's
    events reach the gateway asynchronously); the last decision's figures."""
    deadline = time.monotonic() + 30
    while True:
        _, per_worker, _ = chat(gw, model, prompt)
        if per_worker.get(worker, 0) > 0:
            return per_worker
        assert time.monotonic() < deadline, f"{model}: no cached prefix on {worker} after 30 s: {per_worker}"
        time.sleep(0.2)


def test_adapter_requests_go_to_its_worker_and_hits_count_per_adapter(cluster):
    with_lora, entry_a = start_worker(cluster, lora=True)
    plain, entry_b = start_worker(cluster, lora=False)
    agent = start_agent(cluster, [entry_a, entry_b])
    gw = start_gateway(cluster, [with_lora, plain], agent)

    # The workers say which adapters they have, as vLLM does.
    listed = requests.get(f"{with_lora.url}/v1/models", timeout=5).json()["data"]
    assert {"id": ADAPTER, "parent": MODEL}.items() <= next(m for m in listed if m["id"] == ADAPTER).items()
    # The gateway lists it too, with the model it adapts (once it has read the workers' lists: it
    # starts serving before that, and an adapter it has not seen yet is an unknown model).
    wait_for_adapter(gw)
    served = requests.get(f"{gw.url}/v1/models", timeout=5).json()["data"]
    assert {"id": ADAPTER, "parent": MODEL, "kind": "adapter"}.items() <= next(
        m for m in served if m["id"] == ADAPTER).items()

    # Every adapter request goes to the worker that has it; the other is no candidate at all.
    for i in range(6):
        worker, per_worker, _ = chat(gw, ADAPTER, f"Question {i}: {FILLER}")
        assert worker == with_lora.url
        assert set(per_worker) == {with_lora.url}, per_worker
    # The base model is served by both workers.
    base_workers = {chat(gw, MODEL, f"Base question {i}: {FILLER}")[0] for i in range(8)}
    assert with_lora.url in base_workers or plain.url in base_workers

    # A prompt the base model has cached on the adapter's worker is no hit for the adapter.
    base_prompt = f"Base-model prompt. {FILLER}"
    requests.post(f"{with_lora.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": base_prompt}], "max_tokens": 1})
    assert wait_until_cached(gw, MODEL, base_prompt, with_lora.url)[with_lora.url] >= 16
    worker, per_worker, worker_cached = chat(gw, ADAPTER, base_prompt)
    assert worker == with_lora.url
    assert per_worker == {with_lora.url: 0}, "the base model's blocks counted for the adapter"
    assert worker_cached == 0, "the worker itself found no adapter blocks either"

    # Once the adapter has cached it, it is a hit for the adapter, and the worker agrees.
    per_worker = wait_until_cached(gw, ADAPTER, base_prompt, with_lora.url)
    assert per_worker[with_lora.url] >= 16
    assert chat(gw, ADAPTER, base_prompt)[2] > 0

    # And a prompt only the adapter has cached is no hit for the base model.
    adapter_prompt = f"Adapter-only prompt. {FILLER}"
    chat(gw, ADAPTER, adapter_prompt)
    wait_until_cached(gw, ADAPTER, adapter_prompt, with_lora.url)
    client = openai.OpenAI(base_url=gw.openai_base, api_key="unused", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": adapter_prompt}], max_tokens=4, extra_headers=DEBUG)
    per_worker = {url: int(n) for url, n in re.findall(
        r"\*?(http://\S+) cached=(\d+)", raw.headers.get("x-kinference-decision", ""))}
    assert per_worker == {with_lora.url: 0, plain.url: 0}, per_worker


def test_adapter_requests_are_routed_under_a_policy_directory(cluster, tmp_path):
    """Policies name models, not adapters: a request for an adapter is decided as the model it adapts
    (here pinned to the pool of both workers) and served by the worker that has the adapter loaded."""
    from policy_cluster import model_yaml, pool_yaml, start_gateway as start_policy_gateway, start_sim, write_dir

    with_lora = start_sim(cluster, "fast", "--lora-modules", f"{ADAPTER}=/adapters/{ADAPTER}")
    plain = start_sim(cluster, "fast")
    policies = tmp_path / "policies"
    write_dir(policies, {
        "model.yaml": model_yaml(),
        "pool.yaml": pool_yaml("sims", [with_lora, plain]),
        "policy.yaml": textwrap.dedent(f"""\
            apiVersion: kinference.ai/v1alpha1
            kind: InferencePolicy
            metadata: {{name: pin}}
            spec:
              priority: 10
              rules:
                - name: base-to-sims
                  match: {{models: [{MODEL}]}}
                  action: {{route: {{targets: [{{pool: sims}}]}}}}
            """),
    })
    gw = start_policy_gateway(cluster, policies)
    wait_for_adapter(gw)
    client = openai.OpenAI(base_url=gw.openai_base, api_key="unused", max_retries=0, timeout=60)
    for i in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model=ADAPTER, messages=[{"role": "user", "content": f"Adapter question {i}"}], max_tokens=4,
            extra_headers=DEBUG)
        explain = raw.headers.get("x-kinference-decision", "")
        assert raw.headers["x-kinference-worker"] == with_lora, explain
        assert "policy=pin/base-to-sims" in explain, explain
        # The router's candidates are the workers with the adapter, not every worker of the pool.
        candidates = {url for url, _ in re.findall(r"\*?(http://\S+) cached=(\d+)", explain)}
        assert candidates == {with_lora}, explain
        assert raw.parse().choices[0].message.content
    # A name that is neither a model, a class nor a loaded adapter is still unknown.
    try:
        client.chat.completions.create(
            model="no-such-adapter", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        raise AssertionError("an unknown model was served")
    except openai.NotFoundError as e:
        assert e.code == "model_not_found", e.body


def wait_for_adapter(gw: Gateway) -> None:
    """Until the gateway's `/v1/models` lists the adapter (read from the workers when it starts)."""
    deadline = time.monotonic() + 30
    while True:
        ids = {m["id"] for m in requests.get(f"{gw.url}/v1/models", timeout=5).json()["data"]}
        if ADAPTER in ids:
            return
        assert time.monotonic() < deadline, f"the gateway never listed {ADAPTER}: {sorted(ids)}"
        time.sleep(0.2)
