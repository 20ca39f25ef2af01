"""Tenancy end to end: API keys (both SDKs), token rate limits through 2 gateway replicas sharing a real
Redis, usage that equals the workers' own counters across a gateway restart, and no key anywhere in logs,
metrics or error bodies.

Real processes only: `vllm-sim` workers, `kinference-gateway` replicas and Debian's `redis-server`
(tests that need Redis skip with the reason when it is not installed). Figures of the rate-limit test are
printed (run with `-s` to see them).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest
import requests

from conftest import BIN_DIR, MODEL, TOKENIZER_DIR, Cluster, Gateway, Worker, free_port, wait_for

KEYS = {
    "acme": "sk-acme-7f3c9a1e5b2d4c6f8a0b1c2d3e4f5a6b",
    "limited": "sk-limited-0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d",
    "tokens": "sk-tokens-1122334455667788990011223344aabb",
    "strict": "sk-strict-deadbeefdeadbeefdeadbeefdeadbeef",
}
# Keys clients try that are not valid (they must not leak either).
WRONG_KEYS = ["sk-acme-7f3c9a1e5b2d4c6f8a0b1c2d3e4f5a6c", "sk-wrong-key-123456789"]

TENANTS_YAML = """
apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata: {name: acme}
spec:
  apiKeys:
    - secretRef: {name: acme, key: api-key}
---
apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata: {name: limited}
spec:
  apiKeys:
    - secretRef: {name: limited, key: api-key}
  limits:
    requestsPerMinute: 600
---
apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata: {name: tokens}
spec:
  apiKeys:
    - secretRef: {name: tokens, key: api-key}
  limits:
    outputTokensPerMinute: 1200
---
apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata: {name: strict}
spec:
  apiKeys:
    - secretRef: {name: strict, key: api-key}
  limits:
    requestsPerMinute: 100000
"""


# Everything the tests' gateways logged, exported and answered, for the leak check at the end.
GATEWAY_LOGS: list[Path] = []
METRICS_SNAPSHOTS: list[str] = []
ERROR_BODIES: list[str] = []


def snapshot_metrics(*gateways: Gateway) -> None:
    for gw in gateways:
        try:
            METRICS_SNAPSHOTS.append(gw.metrics())
            METRICS_SNAPSHOTS.append(requests.get(f"{gw.admin}/admin/usage", timeout=10).text)
        except requests.RequestException:
            pass


def write_tenants(workdir: Path) -> tuple[Path, Path]:
    tenants = workdir / "tenants.yaml"
    tenants.write_text(TENANTS_YAML)
    secrets = workdir / "secrets"
    for name, key in KEYS.items():
        (secrets / name).mkdir(parents=True, exist_ok=True)
        (secrets / name / "api-key").write_text(key + "\n")
    return tenants, secrets


def start_gateway(cluster: Cluster, workers: list[Worker], tenancy: str, name: str,
                  port: int | None = None, admin_port: int | None = None,
                  env: dict | None = None) -> Gateway:
    port, admin_port = port or free_port(), admin_port or free_port()
    config = cluster.workdir / f"{name}.yaml"
    lines = [f"models:\n  - name: {MODEL}\n    tokenizer_dir: {TOKENIZER_DIR}\nworkers:"]
    for w in workers:
        lines.append(f"  - url: {w.url}\n    model: {MODEL}")
    lines.append("routing: kinference")
    lines.append("tenancy:\n" + "\n".join("  " + l for l in tenancy.strip().splitlines()))
    config.write_text("\n".join(lines) + "\n")
    binary = BIN_DIR / "kinference-gateway"
    if not binary.exists():
        pytest.fail(f"{binary} not found: build it first (cargo build -p kinference-gateway)")
    log = cluster.workdir / f"{name}-{port}.log"
    GATEWAY_LOGS.append(log)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(binary), "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin_port}",
             "--config", str(config)],
            stdout=out, stderr=subprocess.STDOUT,
            env={"KINFERENCE_SHUTDOWN_DELAY_SECONDS": "0", **os.environ, **(env or {})})
    from conftest import Process
    process = Process(name, proc, log)
    cluster.processes.append(process)
    gw = Gateway(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", process, list(workers))
    try:
        wait_for(f"{gw.admin}/readyz", proc=proc)
    except Exception:
        raise RuntimeError(f"gateway did not start:\n{process.log_tail()}")
    return gw


@dataclass
class Redis:
    url: str
    proc: subprocess.Popen

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def start_redis(workdir: Path) -> Redis:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server): the shared-store tests need it")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=open(workdir / f"redis-{port}.log", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    import socket
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.skip(f"redis-server exited with {proc.returncode}; see {workdir}/redis-{port}.log")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return Redis(f"redis://127.0.0.1:{port}", proc)
        except OSError:
            time.sleep(0.05)
    proc.kill()
    pytest.skip("redis-server did not answer PING within 10 s")


# --- one tenanted gateway shared by the key tests and the leak check ----------------------------

@pytest.fixture(scope="module")
def tenanted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tenancy")
    cluster = Cluster(workdir)
    try:
        tenants, secrets = write_tenants(workdir)
        workers = [cluster.worker(), cluster.worker()]
        # Debug logs: the leak check also covers what the gateway logs at its most verbose.
        gw = start_gateway(cluster, workers, f"tenants_dir: {tenants}\nsecrets_dir: {secrets}\n"
                           f"usage_journal: {workdir}/usage.jsonl", "tenanted", env={"RUST_LOG": "debug"})
        yield gw
    finally:
        cluster.close()


def oai(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key=key, max_retries=0, timeout=60)


def ant(gw: Gateway, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=60)


MSG = [{"role": "user", "content": "Hello tenant"}]


def test_valid_keys_work_with_both_sdks(tenanted):
    c = oai(tenanted, KEYS["acme"]).chat.completions.create(model=MODEL, messages=MSG, max_tokens=5)
    assert c.usage.completion_tokens == 5
    m = ant(tenanted, KEYS["acme"]).messages.create(model=MODEL, max_tokens=4, messages=MSG)
    assert m.usage.output_tokens == 4
    # Anthropic SDKs send x-api-key, OpenAI ones Authorization: both are accepted on every endpoint.
    r = requests.post(f"{tenanted.url}/v1/completions", headers={"x-api-key": KEYS["acme"]},
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text


def test_missing_and_unknown_keys_are_401_in_each_protocol(tenanted):
    with pytest.raises(openai.AuthenticationError) as e:
        oai(tenanted, WRONG_KEYS[0]).chat.completions.create(model=MODEL, messages=MSG)
    assert e.value.body["code"] == "invalid_api_key"
    ERROR_BODIES.append(e.value.response.text)
    with pytest.raises(anthropic.AuthenticationError) as e2:
        ant(tenanted, WRONG_KEYS[1]).messages.create(model=MODEL, max_tokens=4, messages=MSG)
    assert e2.value.body["error"]["type"] == "authentication_error"
    ERROR_BODIES.append(e2.value.response.text)
    r = requests.post(f"{tenanted.url}/v1/chat/completions", json={"model": MODEL, "messages": MSG}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    ERROR_BODIES.append(r.text)
    r = requests.post(f"{tenanted.url}/v1/messages", headers={"x-api-key": ""},
                      json={"model": MODEL, "max_tokens": 3, "messages": MSG}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    ERROR_BODIES.append(r.text)
    # Errors after authentication must not echo the key either.
    r = requests.post(f"{tenanted.url}/v1/chat/completions", headers={"authorization": f"Bearer {KEYS['acme']}"},
                      json={"model": "no-such-model", "messages": MSG}, timeout=10)
    assert r.status_code == 404
    ERROR_BODIES.append(r.text)


def test_usage_api_reports_per_tenant(tenanted):
    r = requests.get(f"{tenanted.admin}/admin/usage", params={"tenant": "acme"}, timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["total"]["requests"] >= 3
    assert all(row["tenant"] == "acme" for row in body["usage"])
    ERROR_BODIES.append(r.text)
    bad = requests.get(f"{tenanted.admin}/admin/usage", params={"from": "not-a-time"}, timeout=10)
    assert bad.status_code == 400


# --- 2 replicas sharing Redis: the limit holds for the tenant as a whole --------------------------

def run_load(gateways: list[Gateway], key: str, seconds: float, threads: int, body: dict) -> dict:
    """Hammers the gateways round-robin; returns admitted requests, output tokens, 429s, span."""
    stop = time.monotonic() + seconds
    lock = threading.Lock()
    out = {"ok": 0, "tokens": 0, "limited": 0, "other": 0, "first": None, "last": None, "headers": None}

    def worker(i: int) -> None:
        session = requests.Session()
        n = i
        while time.monotonic() < stop:
            gw = gateways[n % len(gateways)]
            n += 1
            sent = time.monotonic()
            try:
                r = session.post(f"{gw.url}/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {key}"}, timeout=30)
            except requests.RequestException:
                with lock:
                    out["other"] += 1
                continue
            with lock:
                out["first"] = sent if out["first"] is None else min(out["first"], sent)
                out["last"] = sent if out["last"] is None else max(out["last"], sent)
                if r.status_code == 200:
                    out["ok"] += 1
                    out["tokens"] += r.json()["usage"]["completion_tokens"]
                elif r.status_code == 429:
                    out["limited"] += 1
                    if out["headers"] is None:
                        out["headers"] = dict(r.headers)
                        ERROR_BODIES.append(r.text)
                else:
                    out["other"] += 1

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return out


def test_limits_hold_within_5_percent_through_two_replicas_sharing_redis(tmp_path):
    redis = start_redis(tmp_path)
    cluster = Cluster(tmp_path)
    try:
        tenants, secrets = write_tenants(tmp_path)
        workers = [cluster.worker(), cluster.worker()]
        tenancy = (f"tenants_dir: {tenants}\nsecrets_dir: {secrets}\nstore: redis\nredis_url: {redis.url}\n"
                   "tenants:\n  limited: {burst_seconds: 1, on_store_unavailable: open}\n  tokens: {burst_seconds: 1}")
        gws = [start_gateway(cluster, workers, tenancy + f"\nusage_journal: {tmp_path}/usage-{i}.jsonl", f"replica{i}")
               for i in range(2)]
        results = {}

        def load(name: str, body: dict) -> None:
            results[name] = run_load(gws, KEYS[name], 12.0, 6, body)

        # Both tenants at once, each through both replicas.
        a = threading.Thread(target=load, args=("limited", {"model": MODEL, "messages": MSG, "max_tokens": 2}))
        b = threading.Thread(target=load, args=("tokens", {"model": MODEL, "messages": MSG, "max_tokens": 4}))
        a.start(), b.start()
        a.join(), b.join()

        req = results["limited"]
        span = req["last"] - req["first"]
        # Requests: 600/min = 10/s, bucket capacity 10 (burst 1 s).
        expected = 10 + 10 * span
        print(f"\n[tenancy] requests/min limit 600 through 2 replicas: admitted {req['ok']} in {span:.2f} s "
              f"(expected {expected:.1f}: {100 * (req['ok'] / expected - 1):+.2f}%), 429s {req['limited']}, "
              f"other {req['other']}")
        assert req["limited"] > req["ok"], "the load did not exceed the limit; the test proves nothing"
        assert abs(req["ok"] / expected - 1) <= 0.05
        assert req["other"] == 0
        h = {k.lower(): v for k, v in req["headers"].items()}
        assert int(h["retry-after"]) >= 1
        assert h["x-ratelimit-limit-requests"] == "600"
        assert "x-ratelimit-remaining-requests" in h and "x-ratelimit-reset-requests" in h

        tok = results["tokens"]
        span = tok["last"] - tok["first"]
        # Output tokens: 1200/min = 20/s, capacity 20; each request reserves exactly its max_tokens (4).
        expected = 20 + 20 * span
        print(f"[tenancy] output tokens/min limit 1200 through 2 replicas: admitted {tok['tokens']} tokens in "
              f"{span:.2f} s (expected {expected:.1f}: {100 * (tok['tokens'] / expected - 1):+.2f}%), "
              f"429s {tok['limited']}")
        assert tok["limited"] > 0
        assert abs(tok["tokens"] / expected - 1) <= 0.05
        h = {k.lower(): v for k, v in tok["headers"].items()}
        assert h["x-ratelimit-limit-output-tokens"] == "1200"

        # The shared usage: both replicas' requests, once each.
        deadline = time.monotonic() + 10
        while True:
            usage = requests.get(f"{gws[0].admin}/admin/usage", params={"tenant": "limited"}, timeout=10).json()
            if usage["total"]["requests"] == req["ok"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert usage["source"] == "redis"
        assert usage["total"]["requests"] == req["ok"]

        # Redis gone: a tenant set to fail open is served, one on the default (closed) gets 503.
        redis.stop()
        r = requests.post(f"{gws[1].url}/v1/chat/completions", headers={"authorization": f"Bearer {KEYS['limited']}"},
                          json={"model": MODEL, "messages": MSG, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        r = requests.post(f"{gws[1].url}/v1/chat/completions", headers={"authorization": f"Bearer {KEYS['strict']}"},
                          json={"model": MODEL, "messages": MSG, "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "limits_unavailable", r.text
        # Only the replica that served these saw the store fail.
        assert "limit_store_errors_total" in gws[1].metrics()
        snapshot_metrics(*gws)
    finally:
        cluster.close()
        redis.stop()


# --- usage equals the workers' own counters, across a gateway restart ------------------------------

def vllm_counter(worker: Worker, name: str) -> int:
    text = requests.get(f"{worker.url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and m.group(1) == name:
            total += float(m.group(3))
    return int(total)


def test_usage_equals_the_workers_counters_across_a_restart(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        tenants, secrets = write_tenants(tmp_path)
        workers = [cluster.worker(), cluster.worker()]
        tenancy = f"tenants_dir: {tenants}\nsecrets_dir: {secrets}\nusage_journal: {tmp_path}/usage.jsonl"
        port, admin_port = free_port(), free_port()
        gw = start_gateway(cluster, workers, tenancy, "usage", port, admin_port)
        state = {"gw": gw, "stop": False, "ok": 0}
        lock = threading.Lock()
        shared_prefix = "You are a helpful assistant. " * 20  # repeated: some prompt tokens are cached

        def client(i: int) -> None:
            n = 0
            while not state["stop"]:
                n += 1
                url = f"http://127.0.0.1:{port}"
                kind = (i + n) % 4
                try:
                    if kind == 0:
                        r = requests.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {KEYS['acme']}"},
                                          json={"model": MODEL, "max_tokens": 3 + n % 5,
                                                "messages": [{"role": "user", "content": shared_prefix + f"q{i}-{n}"}]},
                                          timeout=30)
                    elif kind == 1:
                        r = requests.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {KEYS['acme']}"},
                                          json={"model": MODEL, "max_tokens": 4, "stream": True,
                                                "messages": [{"role": "user", "content": f"stream {i} {n}"}]},
                                          timeout=30)
                        r.content  # read the whole stream
                    elif kind == 2:
                        r = requests.post(f"{url}/v1/completions", headers={"authorization": f"Bearer {KEYS['limited']}"},
                                          json={"model": MODEL, "max_tokens": 2, "prompt": shared_prefix + str(n)},
                                          timeout=30)
                    else:
                        r = requests.post(f"{url}/v1/messages", headers={"x-api-key": KEYS["acme"]},
                                          json={"model": MODEL, "max_tokens": 3, "stream": n % 2 == 0,
                                                "messages": [{"role": "user", "content": f"anthropic {i} {n}"}]},
                                          timeout=30)
                        r.content
                except requests.RequestException:
                    time.sleep(0.05)  # the gateway is restarting
                    continue
                if r.status_code == 200:
                    with lock:
                        state["ok"] += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(4)
        # Restart in the middle of the load: SIGTERM (graceful: requests in flight finish and are
        # journaled), then a new gateway on the same ports that replays the journal.
        gw.process.proc.send_signal(signal.SIGTERM)
        gw.process.proc.wait(timeout=30)
        ok_before = state["ok"]
        gw = start_gateway(cluster, workers, tenancy, "usage", port, admin_port)
        time.sleep(4)
        state["stop"] = True
        for t in threads:
            t.join()
        assert ok_before > 20 and state["ok"] > ok_before + 20, state

        usage = requests.get(f"{gw.admin}/admin/usage", timeout=10).json()["total"]
        prompt = sum(vllm_counter(w, "vllm:prompt_tokens_total") for w in workers)
        generated = sum(vllm_counter(w, "vllm:generation_tokens_total") for w in workers)
        cached = sum(vllm_counter(w, "vllm:prompt_tokens_cached_total") for w in workers)
        print(f"\n[tenancy] usage across a restart: gateway {usage}; workers prompt {prompt} cached {cached} "
              f"generated {generated}; client successes {state['ok']}")
        assert cached > 0, "no cached prompt tokens: the test should exercise the cache"
        assert usage["input_uncached_tokens"] + usage["input_cached_tokens"] == prompt
        assert usage["input_cached_tokens"] == cached
        assert usage["output_tokens"] == generated
        assert usage["requests"] == state["ok"]
        snapshot_metrics(gw)
    finally:
        cluster.close()


# --- last: the leak check over everything above ------------------------------------------------

def test_no_key_in_logs_metrics_or_error_bodies(tenanted):
    """Runs last: everything every gateway of this module printed (at debug level for the shared one),
    exported on /metrics and /admin/usage, and answered with an error."""
    snapshot_metrics(tenanted)
    haystacks = {
        "metrics": "\n".join(METRICS_SNAPSHOTS),
        "logs": "\n".join(p.read_text(errors="replace") for p in GATEWAY_LOGS if p.exists()),
        "error bodies": "\n".join(ERROR_BODIES),
    }
    assert len(ERROR_BODIES) >= 5
    assert "kinference_gateway_tenant_requests_total" in haystacks["metrics"]
    assert haystacks["logs"].count("\n") > 10, "the gateway logs are unexpectedly empty"
    for name, text in haystacks.items():
        for key in list(KEYS.values()) + WRONG_KEYS:
            assert key not in text, f"an API key appears in the {name}"
            # Nor a fragment long enough to be useful.
            assert key[-16:] not in text, f"part of an API key appears in the {name}"
