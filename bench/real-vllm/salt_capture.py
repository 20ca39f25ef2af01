#!/usr/bin/env python3
"""Captures what a real vLLM worker does with `cache_salt` (opt-in; needs the venv of install.sh).

Starts one vLLM 0.32 CPU worker (the tiny random Qwen2 of make_model.py, block size 32, prefix caching,
`--enable-prompt-tokens-details`, KV events bound on an ipc:// socket), subscribes to its events, and
sends the same 100-token prompt (token ids 3000..3099, as a completion) five times:

  1. salted "kinference-salt-a"   -> cold: cached_tokens 0, BlockStored with the salt as block 0's extra key
  2. salted "kinference-salt-a"   -> a hit: cached_tokens 96
  3. salted "kinference-salt-b"   -> another tenant's salt: cached_tokens 0, new blocks stored
  4. no salt                      -> cached_tokens 0 (an unsalted prompt never hits a salted prefix)
  5. no salt again                -> cached_tokens 96

Writes `bench/fixtures/vllm-0.32/salted-events.jsonl` (one line per ZeroMQ message, the format of the other
captures there) and `salted-requests.json` (each request's salt and its usage). The Rust tests replay them:
`bench/tests/sim_hashes.rs` (the simulator's salted sha256/pickle digests equal vLLM's event hashes) and
`kinference-gateway/tests/cache_salt_vllm.rs` (the gateway's salted block keys equal the agent's keys for
these events). Run:

    ~/.cache/kinference-bench/real-vllm/venv/bin/python bench/real-vllm/salt_capture.py
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request

import msgspec
import zmq

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = "tiny"
PROMPT = list(range(3000, 3100))
STEPS = [
    ("kinference-salt-a", 0),
    ("kinference-salt-a", 96),
    ("kinference-salt-b", 0),
    (None, 0),
    (None, 96),
]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def jsonable(v):
    if isinstance(v, (bytes, bytearray)):
        return {"__bytes__": bytes(v).hex()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    return v


def main() -> int:
    cache = pathlib.Path(os.environ.get("REAL_VLLM_CACHE", pathlib.Path.home() / ".cache/kinference-bench/real-vllm"))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=str(cache / "venv/bin/python"))
    p.add_argument("--model-dir", default=str(cache / "model/tiny-qwen2"))
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--out", default=str(REPO / "bench/fixtures/vllm-0.32"))
    p.add_argument("--ready-timeout", type=float, default=300)
    args = p.parse_args()

    work = pathlib.Path(tempfile.mkdtemp(prefix="salt-capture-"))
    events_ep = f"ipc://{work}/kv.sock"
    kv = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events_ep,
        "topic": f"kv@salt@{MODEL}",
    }
    env = dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("PYTHONHASHSEED", None)
    argv = [
        args.python, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(args.port),
        "--model", args.model_dir, "--served-model-name", MODEL,
        "--dtype", "bfloat16", "--max-model-len", "512", "--block-size", "32",
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(kv),
    ]
    log = open(work / "worker.log", "w")
    t0 = time.time()
    worker = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{args.port}"
        while True:
            if worker.poll() is not None:
                print(f"worker exited {worker.returncode}; log {work}/worker.log", file=sys.stderr)
                return 1
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                if time.time() - t0 > args.ready_timeout:
                    print("worker not ready in time", file=sys.stderr)
                    return 1
                time.sleep(1)
        print(f"worker ready in {time.time() - t0:.0f} s", file=sys.stderr)
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(events_ep)
        time.sleep(1.0)  # the slow-joiner: let the subscription reach the publisher
        lines, requests = [], []
        for salt, expected in STEPS:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
            if salt is not None:
                body["cache_salt"] = salt
            usage = post(f"{base}/v1/completions", body)["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            requests.append({"cache_salt": salt, "prompt_token_ids": PROMPT, "usage": usage, "expected_cached": expected})
            print(f"salt={salt!r}: cached_tokens={cached} (expected {expected})", file=sys.stderr)
            deadline = time.time() + 3
            while time.time() < deadline:
                if not sub.poll(300):
                    continue
                frames = sub.recv_multipart()
                topic, seq, payload = frames[0], frames[1], frames[-1]
                batch = msgspec.msgpack.decode(payload)
                lines.append({
                    "nframes": len(frames),
                    "topic": topic.decode(),
                    "seq": int.from_bytes(seq, "big"),
                    "payload_len": len(payload),
                    "payload_head_hex": payload[:16].hex(),
                    "batch": jsonable(batch),
                })
        out = pathlib.Path(args.out)
        (out / "salted-events.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        (out / "salted-requests.json").write_text(json.dumps(requests, indent=1) + "\n")
        bad = [r for r in requests if (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) != r["expected_cached"]]
        print(f"{len(lines)} event messages; {len(bad)} requests off the expected cached_tokens", file=sys.stderr)
        return 1 if bad else 0
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()


if __name__ == "__main__":
    sys.exit(main())
