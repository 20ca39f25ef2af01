#!/usr/bin/env python3
"""vLLM 0.32 on CPU accepts the band Kinference sends as `priority` (opt-in, issue 34).

One vLLM worker started with `--scheduling-policy priority` (the tiny random Qwen2 of bench.py), one
gateway in front of it with `scheduling_policy: priority` and two tenants, `gold` (High: sent
`priority: -1`) and `bulk` (Low: sent `priority: 1`); what the gateway sends is checked byte for byte
by kinference-gateway/tests/flow_control.rs, this checks that the real engine takes it:

1. straight to the worker: chat completions with `priority` -1, 0 and 1 answer 200;
2. through the gateway: a request of each tenant answers 200.

Writes bench/results/flow-control/vllm-priority.json; exits non-zero on a failed check. Run (after
`cargo build -p kinference-gateway --bin kinference-gateway`):

    ~/.cache/kinference-bench/real-vllm/venv/bin/python bench/real-vllm/priority_probe.py \\
        --bin-dir target/debug --tokenizer-dir .assets/qwen2
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (MODEL, WORKER_ENV)

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("REAL_VLLM_CACHE", Path.home() / ".cache/kinference-bench/real-vllm"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited ({proc.returncode})")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise SystemExit(f"{url}: not ready in {timeout} s")


def chat(url: str, headers: dict, extra: dict) -> tuple[int, str]:
    body = {"model": bench.MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **extra}
    r = requests.post(f"{url}/v1/chat/completions", headers=headers, json=body, timeout=120)
    return r.status_code, r.text[:300]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin-dir", type=Path, default=REPO / "target/debug")
    p.add_argument("--tokenizer-dir", type=Path, default=REPO / ".assets/qwen2")
    p.add_argument("--model-dir", type=Path, default=CACHE / "model/tiny-qwen2")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--ready-timeout", type=float, default=400)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="priority-probe-"))
    worker_port, api, admin = free_port(), free_port(), free_port()
    procs = []
    checks = []
    try:
        env = {**os.environ, **bench.WORKER_ENV}
        worker = subprocess.Popen(
            [args.python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
             "--port", str(worker_port), "--model", str(args.model_dir), "--served-model-name", bench.MODEL,
             "--dtype", "bfloat16", "--max-model-len", "512", "--scheduling-policy", "priority"],
            env=env, stdout=open(work / "worker.log", "w"), stderr=subprocess.STDOUT)
        procs.append(worker)
        tenants = work / "tenants"
        secrets = work / "secrets"
        tenants.mkdir()
        for name, priority in [("gold", "High"), ("bulk", "Low")]:
            (secrets / name).mkdir(parents=True)
            (secrets / name / "api-key").write_text(f"sk-probe-{name}-0123456789abcdef")
            (tenants / f"{name}.yaml").write_text(
                "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\n"
                f"metadata: {{name: {name}}}\nspec:\n  apiKeys: [{{secretRef: {{name: {name}, key: api-key}}}}]\n"
                f"  priority: {priority}\n")
        config = work / "gateway.yaml"
        config.write_text(
            f"models:\n  - name: {bench.MODEL}\n    tokenizer_dir: {args.tokenizer_dir.resolve()}\n"
            f"workers:\n  - url: http://127.0.0.1:{worker_port}\n    model: {bench.MODEL}\n"
            f"scheduling_policy: priority\ntenancy:\n  tenants_dir: {tenants}\n  secrets_dir: {secrets}\n"
            f"  usage_journal: {work / 'usage.jsonl'}\n")
        gateway = subprocess.Popen(
            [str(args.bin_dir / "kinference-gateway"), "--listen", f"127.0.0.1:{api}",
             "--admin-listen", f"127.0.0.1:{admin}", "--config", str(config)],
            stdout=open(work / "gateway.log", "w"), stderr=subprocess.STDOUT)
        procs.append(gateway)
        started = time.time()
        wait(f"http://127.0.0.1:{worker_port}/health", worker, args.ready_timeout)
        wait(f"http://127.0.0.1:{admin}/readyz", gateway, 60)
        print(f"worker ready after {time.time() - started:.0f} s", flush=True)
        direct = f"http://127.0.0.1:{worker_port}"
        for priority in (-1, 0, 1):
            status, text = chat(direct, {}, {"priority": priority})
            checks.append({"check": f"worker takes priority {priority}", "status": status, "ok": status == 200,
                           "answer": text})
        for name in ("gold", "bulk"):
            status, text = chat(f"http://127.0.0.1:{api}", {"authorization": f"Bearer sk-probe-{name}-0123456789abcdef"}, {})
            checks.append({"check": f"{name} through the gateway", "status": status, "ok": status == 200,
                           "answer": text})
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    vllm = subprocess.run([args.python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                          text=True, env={**os.environ, **bench.WORKER_ENV}).stdout.strip()
    report = {"vllm": vllm, "worker_flags": "--scheduling-policy priority", "checks": checks, "logs": str(work)}
    out = REPO / "bench/results/flow-control/vllm-priority.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for c in checks:
        print(("ok   " if c["ok"] else "FAIL ") + c["check"] + f" ({c['status']})")
    if not all(c["ok"] for c in checks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
