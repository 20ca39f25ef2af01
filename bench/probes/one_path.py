"""The probes of the "one governed path" issue, as a new user would run them against a release build.

A local pool (one `vllm-sim`), a `locality: Remote` pool of the same model (an in-process stand-in
that counts every body byte it receives), the `pii-stays-local` rule of
`deploy/examples/policies/00-data-protection.yaml` and a rule that sends tagged requests to the
Remote pool; tenant `probe` limited to 300 output tokens a minute. Then:

1. a prompt with a card number and an e-mail address, 12 times on `/v1/chat/completions`,
   `/v1/embeddings` and `/tokenize`, tagged for the Remote pool: how many the Remote pool served
   (bytes it received);
2. 10 concurrent chats with `max_tokens: 1, max_completion_tokens: 400`: how many answered, output
   tokens generated;
3. 160 concurrent `/v1/messages/count_tokens` of 3.9 MB each: the gateway's RSS before and at its peak;
4. 64 concurrent 4 MB chat bodies of `[0,0,...]`: RSS before and at its peak.

    cargo build --release -p kinference-gateway -p kinference-bench --bins
    .venv/bin/python bench/probes/one_path.py [--bin-dir target/release]
"""

import argparse
import concurrent.futures as futures
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
MODEL = "qwen2-sim"
KEY = "sk-probe-0123456789abcdef"
PERSONAL = "Charge 4111 1111 1111 1111 and mail the receipt to jane.doe@example.com please."


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Counter(http.server.BaseHTTPRequestHandler):
    """The Remote pool: counts body bytes, answers every endpoint's shape."""

    received = 0
    requests = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.end_headers()
        self.wfile.write(b"")

    def do_POST(self):
        n = int(self.headers.get("content-length") or 0)
        self.rfile.read(n)
        with Counter.lock:
            Counter.received += n
            Counter.requests += 1
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        path = self.path
        if path.endswith("/embeddings"):
            body = {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.0]}],
                    "usage": {"prompt_tokens": 3, "total_tokens": 3}}
        elif path.endswith("/tokenize"):
            body = {"tokens": [1, 2, 3], "count": 3, "max_model_len": 4096}
        else:
            body = {"id": "r", "object": "chat.completion", "created": 0, "model": MODEL, "usage": usage,
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "remote"}}]}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class PeakRss:
    """Samples a process's RSS every 20 ms while in use."""

    def __init__(self, pid):
        self.pid, self.peak, self.stop = pid, 0.0, False

    def __enter__(self):
        self.before = rss_mib(self.pid)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(0.02)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()


def wait_ok(url, proc, what):
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    sys.exit(f"{what}: {url} not ready in 60 s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", default=str(ROOT / "target/release"))
    parser.add_argument("--tokenizer-dir", default=str(ROOT / ".assets/qwen2"))
    args = parser.parse_args()
    bins, tokenizer = Path(args.bin_dir), args.tokenizer_dir
    work = Path(tempfile.mkdtemp(prefix="one-path-probe-"))
    procs = []
    try:
        remote = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Counter)
        threading.Thread(target=remote.serve_forever, daemon=True).start()
        sim_port, api, admin = free_port(), free_port(), free_port()
        sim = subprocess.Popen([bins / "vllm-sim", "--host", "127.0.0.1", "--port", str(sim_port),
                                "--model", MODEL, "--preset", "fast", "--tokenizer-dir", tokenizer],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(sim)
        policies = work / "policies"
        policies.mkdir()
        rules = (ROOT / "deploy/examples/policies/00-data-protection.yaml").read_text()
        (policies / "00-data-protection.yaml").write_text(rules)
        (policies / "10-probe.yaml").write_text(f"""apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {{name: {MODEL}}}
spec: {{servedName: {MODEL}, tokenizer: {{dir: "{tokenizer}"}}}}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {{name: local}}
spec: {{models: [{MODEL}], prices: {{cachedInputPerMillion: 0.01, uncachedInputPerMillion: 0.06, outputPerMillion: 0.24, currency: EUR}}, gpuClass: sim, locality: Local, endpoints: [{{url: "http://127.0.0.1:{sim_port}"}}]}}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {{name: rented}}
spec: {{models: [{MODEL}], prices: {{cachedInputPerMillion: 0.01, uncachedInputPerMillion: 0.06, outputPerMillion: 0.24, currency: EUR}}, gpuClass: rented, locality: Remote, endpoints: [{{url: "http://127.0.0.1:{remote.server_port}"}}]}}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePolicy
metadata: {{name: away}}
spec:
  priority: 50
  rules:
    - name: rented
      match: {{tags: [rented]}}
      action: {{route: {{targets: [{{pool: rented}}]}}}}
""")
        (work / "secrets/probe").mkdir(parents=True)
        (work / "secrets/probe/api-key").write_text(KEY)
        (work / "tenants.yaml").write_text("""apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata: {name: probe}
spec:
  apiKeys: [{secretRef: {name: probe, key: api-key}}]
  limits: {outputTokensPerMinute: 300}
""")
        config = work / "gateway.yaml"
        config.write_text(f"""routing: kinference
policy_dir: {policies}
tenancy:
  tenants_dir: {work / 'tenants.yaml'}
  secrets_dir: {work / 'secrets'}
  usage_journal: {work / 'usage.jsonl'}
""")
        gateway = subprocess.Popen([bins / "kinference-gateway", "--listen", f"127.0.0.1:{api}",
                                    "--admin-listen", f"127.0.0.1:{admin}", "--config", str(config)],
                                   stdout=open(work / "gateway.out", "wb"), stderr=open(work / "gateway.log", "wb"),
                                   env={**os.environ, "RUST_LOG": "warn"})
        procs.append(gateway)
        wait_ok(f"http://127.0.0.1:{sim_port}/health", sim, "vllm-sim")
        wait_ok(f"http://127.0.0.1:{admin}/readyz", gateway, "the gateway")
        deadline = time.time() + 30
        while requests.get(f"http://127.0.0.1:{admin}/healthz/workers").json().get("healthy", 0) < 2:
            if time.time() > deadline:
                sys.exit("the gateway never saw both pools' workers healthy: "
                         + requests.get(f"http://127.0.0.1:{admin}/healthz/workers").text
                         + "\ngateway log:\n" + (work / "gateway.log").read_text()[-3000:] + (work / "gateway.out").read_text()[-3000:])
            time.sleep(0.2)
        base = f"http://127.0.0.1:{api}"
        auth = {"authorization": f"Bearer {KEY}"}
        print(f"probes against {bins} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n")
        print("| probe | result |\n|---|---|")

        # 1. Personal data, tagged for the Remote pool, on three endpoints.
        bodies = {
            "/v1/chat/completions": {"model": MODEL, "max_tokens": 2,
                                     "messages": [{"role": "user", "content": PERSONAL}]},
            "/v1/embeddings": {"model": MODEL, "input": PERSONAL},
            "/tokenize": {"model": MODEL, "prompt": PERSONAL},
        }
        for path, body in bodies.items():
            before = (Counter.requests, Counter.received)
            statuses = [requests.post(base + path, json=body,
                                      headers={**auth, "x-kinference-tags": "rented"}).status_code
                        for _ in range(12)]
            remote_n = Counter.requests - before[0]
            ok = sum(1 for s in statuses if s == 200)
            print(f"| a card number and an e-mail address, 12 times on `{path}` | "
                  f"{ok - remote_n} local, {remote_n} remote ({Counter.received - before[1]} bytes at "
                  f"the Remote pool); statuses {sorted(set(statuses))} |")
        control = requests.post(base + "/v1/embeddings", json={"model": MODEL, "input": "hello"},
                                headers={**auth, "x-kinference-tags": "rented"})
        print(f"| control: the same tag without personal data on `/v1/embeddings` | "
              f"{control.status_code}, {Counter.requests} request(s) at the Remote pool in all |")

        # 2. The output limit dodge: asking more than the limit at all, then within it.
        for asked in (400, 100):
            dodge = {"model": MODEL, "max_tokens": 1, "max_completion_tokens": asked,
                     "messages": [{"role": "user", "content": "write at length"}]}
            with futures.ThreadPoolExecutor(10) as pool:
                answers = list(pool.map(lambda _: requests.post(
                    base + "/v1/chat/completions", json=dodge, headers=auth), range(10)))
            served = [a for a in answers if a.status_code == 200]
            tokens = sum(a.json()["usage"]["completion_tokens"] for a in served)
            print(f"| 10 concurrent chats with `max_tokens: 1, max_completion_tokens: {asked}` "
                  f"(limit 300/min) | {len(served)} answered, "
                  f"{sum(a.status_code == 429 for a in answers)} refused (429), {tokens} output tokens |")
            time.sleep(1)

        # 3. count_tokens of 3.9 MB, 160 at once.
        big = {"model": MODEL, "messages": [{"role": "user", "content": "word " * (3_900_000 // 5)}]}
        data = json.dumps(big).encode()
        with PeakRss(gateway.pid) as rss, futures.ThreadPoolExecutor(160) as pool:
            statuses = list(pool.map(lambda _: requests.post(
                base + "/v1/messages/count_tokens", data=data,
                headers={**auth, "content-type": "application/json", "x-api-key": KEY}).status_code,
                range(160)))
        counts = {s: statuses.count(s) for s in sorted(set(statuses))}
        print(f"| 160 concurrent `/v1/messages/count_tokens` of {len(data) / 1e6:.1f} MB | RSS "
              f"{rss.before:.0f} -> peak {rss.peak:.0f} MiB (chart limit 2048); statuses {counts} |")

        # 4. 4 MB of [0,0,...], 64 at once.
        zeros = b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":"hi"}],"padding":[' \
            + b"0," * (2 * 1024 * 1024 - 1) + b"0]}"
        with PeakRss(gateway.pid) as rss, futures.ThreadPoolExecutor(64) as pool:
            statuses = list(pool.map(lambda _: requests.post(
                base + "/v1/chat/completions", data=zeros,
                headers={**auth, "content-type": "application/json"}).status_code, range(64)))
        counts = {s: statuses.count(s) for s in sorted(set(statuses))}
        print(f"| 64 concurrent 4 MB chat bodies of `[0,0,...]` | RSS {rss.before:.0f} -> peak "
              f"{rss.peak:.0f} MiB; statuses {counts} |")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
