"""Calibrates the TTFT model on real vLLM (CPU) and measures the gateway's estimate error there.

Part 1, the engine (one vLLM worker, nothing in front): streamed `/v1/completions` with prompts given as
token ids, so every length is exact and a prefix is cached exactly when it is meant to be:
- uncached prefill: TTFT at several prompt lengths (each prompt new);
- cached fractions: a 2,048-token prompt sent once, then prompts sharing its first 25-94% (the rest new);
- decode: b concurrent requests (b = 1, 2, 4, 8) of 64 output tokens each, the time per output token;
- two prefills at once: two new 1,024-token prompts sent together, against one alone.
Then a least-squares fit of the simulator's step model (`bench/src/sim/engine/latency.rs`):

    TTFT(uncached u, context n) = step_base_s + u * prefill_s_per_token + pairs(u, n) * prefill_s_per_attention_pair
    TPOT(batch b, context c)    = step_base_s + b * decode_s_per_seq + b * c * decode_s_per_ctx_token

(pairs: the (query, key) pairs of the causal attention of the u new tokens after n cached ones), written
as a named profile with every measured point and its residual.

Part 2, the estimate (`--estimate`): two workers, the agent and the gateway (`bench.py`'s stack), a
shared-prefix workload sent with `x-kinference-debug: 1`; per request, the gateway's estimated TTFT for
the worker it chose (`est_s` of the starred candidate in `x-kinference-decision`) against the TTFT the
client measured: median absolute percentage error (MdAPE), Spearman's rank correlation between estimate
and measurement over the requests, and where the error is worst.

Usage (normally through run.sh calibrate):
  python calibrate.py --model-dir DIR --tokenizer-dir DIR --bin-dir DIR --work-dir DIR --out PATH
"""

import argparse
import concurrent.futures
import json
import random
import re
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the stack, the worker environment, process handling)

# Token ids drawn for synthetic prompts: ordinary vocabulary, far from the special tokens.
TOKEN_RANGE = (1_000, 100_000)


def log(message: str) -> None:
    print(f"[calibrate {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def complete(url: str, prompt: list[int], max_tokens: int, headers: dict | None = None) -> dict:
    """One streamed completion: TTFT (first chunk with text), per-output-token time, usage, headers."""
    body = {
        "model": bench.MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    usage = {}
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600, headers=headers or {}) as r:
        r.raise_for_status()
        response_headers = dict(r.headers)
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter() - start
    ttft = ttft if ttft is not None else end
    out = usage.get("completion_tokens", max_tokens)
    return {
        "ttft_s": ttft,
        "tpot_s": (end - ttft) / (out - 1) if out > 1 else None,
        "prompt_tokens": usage.get("prompt_tokens", len(prompt)),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        "headers": response_headers,
    }


def pairs(uncached: int, cached: int) -> float:
    """(query, key) pairs of the causal attention of `uncached` new tokens after `cached` ones."""
    return uncached * cached + uncached * (uncached + 1) / 2


# --------------------------------------------------------------------------------------------------
# Part 1: the engine


def measure_engine(url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    points: dict[str, list] = {"prefill": [], "cached": [], "decode": [], "concurrent": []}
    # Warm-up: the first requests of a fresh engine pay one-off costs (allocation, kernels).
    for _ in range(3):
        complete(url, tokens(rng, 256), 2)

    for length in args.lengths:
        for rep in range(args.repeats):
            m = complete(url, tokens(rng, length), 1)
            points["prefill"].append({"uncached": length - m["cached_tokens"], "cached": m["cached_tokens"],
                                      "ttft_s": m["ttft_s"]})
        log(f"prefill {length}: median TTFT {statistics.median(p['ttft_s'] for p in points['prefill'][-args.repeats:]):.3f} s")

    base_len = max(args.lengths)
    for fraction in args.cached_fractions:
        for rep in range(args.repeats):
            base = tokens(rng, base_len)
            complete(url, base, 1)
            keep = int(base_len * fraction)
            m = complete(url, base[:keep] + tokens(rng, base_len - keep), 1)
            points["cached"].append({"fraction": fraction, "uncached": m["prompt_tokens"] - m["cached_tokens"],
                                     "cached": m["cached_tokens"], "ttft_s": m["ttft_s"]})
        got = points["cached"][-args.repeats:]
        log(f"cached {fraction:.2f}: {statistics.median(p['cached'] for p in got)} cached, "
            f"median TTFT {statistics.median(p['ttft_s'] for p in got):.3f} s")

    for prompt_len in args.decode_prompts:
        for batch in args.batches:
            for rep in range(args.repeats):
                prompts = [tokens(rng, prompt_len) for _ in range(batch)]
                with concurrent.futures.ThreadPoolExecutor(batch) as pool:
                    results = list(pool.map(lambda p: complete(url, p, args.decode_tokens), prompts))
                tpots = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
                points["decode"].append({"batch": batch, "context": prompt_len + args.decode_tokens // 2,
                                         "tpot_s": statistics.median(tpots)})
            got = points["decode"][-args.repeats:]
            log(f"decode batch {batch}, {prompt_len}-token prompts: median TPOT "
                f"{statistics.median(p['tpot_s'] for p in got) * 1e3:.1f} ms")

    half = base_len // 2
    for rep in range(args.repeats):
        alone = complete(url, tokens(rng, half), 1)["ttft_s"]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda p: complete(url, p, 1)["ttft_s"], [tokens(rng, half), tokens(rng, half)]))
        points["concurrent"].append({"tokens": half, "alone_s": alone, "together_s": sorted(both)})
    c = points["concurrent"]
    log(f"two {half}-token prefills at once: {statistics.median(p['together_s'][1] for p in c):.3f} s for the "
        f"later, {statistics.median(p['alone_s'] for p in c):.3f} s alone")
    return points


def nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a negative one is dropped and the rest refitted."""
    keep = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (coef >= 0).all():
            out = np.zeros(a.shape[1])
            out[keep] = coef
            return out
        keep = [k for k, c in zip(keep, coef) if c >= 0] if (coef >= 0).any() else []
        if not keep:
            return np.zeros(a.shape[1])


def medians(points: list, key, value: str) -> list:
    """One point per distinct `key` (a tuple of the point's inputs): the median of `value`."""
    groups: dict = {}
    for p in points:
        groups.setdefault(key(p), []).append(p[value])
    return [(k, statistics.median(v)) for k, v in sorted(groups.items())]


def fit(points: dict) -> dict:
    """The step model from the medians of each measured setting, coefficients kept >= 0:
    - decode, one step per output token: TPOT = step_base + b * decode_s_per_seq + b * c * decode_s_per_ctx_token;
    - prefill, one step when the prompt fits the token budget, plus what a request costs outside the
      engine's steps (HTTP, tokenizing, scheduling: `request_overhead_s`, which the simulator's step model
      has no term for): TTFT - step_base = overhead + u * prefill_s_per_token + pairs * per_pair."""
    decode = medians(points["decode"], lambda p: (p["batch"], p["context"]), "tpot_s")
    a = np.array([[1.0, b, b * c] for (b, c), _ in decode])
    base, per_seq, per_ctx = nonnegative_lstsq(a, np.array([t for _, t in decode]))
    ttft = medians(points["prefill"] + points["cached"], lambda p: (p["uncached"], p["cached"]), "ttft_s")
    a2 = np.array([[1.0, u, pairs(u, n)] for (u, n), _ in ttft])
    overhead, per_token, per_pair = nonnegative_lstsq(a2, np.array([t - base for _, t in ttft]))
    model = {
        "step_base_s": float(base),
        "prefill_s_per_token": float(per_token),
        "prefill_s_per_attention_pair": float(per_pair),
        "decode_s_per_seq": float(per_seq),
        "decode_s_per_ctx_token": float(per_ctx),
    }

    def predicted_ttft(u, n):
        return overhead + base + u * per_token + pairs(u, n) * per_pair

    def predicted_tpot(b, c):
        return base + b * per_seq + b * c * per_ctx

    for p in points["prefill"] + points["cached"]:
        p["fit_s"] = predicted_ttft(p["uncached"], p["cached"])
    for p in points["decode"]:
        p["fit_s"] = predicted_tpot(p["batch"], p["context"])
    errors = [abs(predicted_ttft(u, n) - t) / t for (u, n), t in ttft] + [
        abs(predicted_tpot(b, c) - t) / t for (b, c), t in decode]
    return {"model": model, "request_overhead_s": float(overhead), "fit_mdape": statistics.median(errors),
            "fit_max_ape": max(errors)}


# --------------------------------------------------------------------------------------------------
# Part 2: the gateway's estimate on the real engine

CANDIDATE = re.compile(r"(\*?)(http://\S+) cached=(\d+) .*?est_s=([0-9.]+)")


def spearman(x: list, y: list) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r
    rx, ry = ranks(x), ranks(y)
    return float(np.corrcoef(rx, ry)[0, 1])


def estimate_plan(args: argparse.Namespace) -> list:
    """A mixed workload, so the estimate has something to rank: a few shared prefixes of different
    lengths with questions of different lengths, and fresh prompts of different lengths (misses)."""
    rng = random.Random(args.seed + 1)
    prefixes = [tokens(rng, n) for n in args.estimate_prefix_lens]
    plan = []
    for _ in range(args.estimate_requests):
        if rng.random() < args.estimate_fresh:
            plan.append(("fresh", tokens(rng, rng.randrange(128, 1537))))
        else:
            i = rng.randrange(len(prefixes))
            plan.append((f"p{i}", prefixes[i] + tokens(rng, rng.randrange(32, 257))))
    return plan


def run_estimate_pass(url: str, plan: list, args: argparse.Namespace) -> list:
    def one(item):
        label, prompt = item
        m = complete(url, prompt, args.estimate_output, headers={"x-kinference-debug": "1"})
        decision = m["headers"].get("x-kinference-decision", "")
        chosen = [c for c in CANDIDATE.findall(decision) if c[0] == "*"]
        fields = {}
        for c in decision.split("; "):
            if c.startswith("*"):
                fields = dict(kv.split("=", 1) for kv in c.split() if "=" in kv)
        return {"prompt": label, "ttft_s": m["ttft_s"], "cached_tokens": m["cached_tokens"],
                "prompt_tokens": m["prompt_tokens"],
                "worker": chosen[0][1] if chosen else None,
                "est_s": float(chosen[0][3]) if chosen else None,
                "est_cached": int(chosen[0][2]) if chosen else None,
                "est_queue_tokens": float(fields.get("queue_tokens", "nan")),
                "est_running": int(fields.get("running", "0")),
                "est_prefill": float(fields.get("prefill", "nan"))}
    rows = []
    with concurrent.futures.ThreadPoolExecutor(args.estimate_concurrency) as pool:
        for i, row in enumerate(pool.map(one, plan)):
            row["warmup"] = i < args.estimate_warmup
            rows.append(row)
    return rows


def score(rows: list) -> dict:
    scored = [r for r in rows if not r["warmup"] and r["est_s"] is not None and r["ttft_s"] > 0]
    ape = [abs(r["est_s"] - r["ttft_s"]) / r["ttft_s"] for r in scored]

    def mdape(rs):
        return statistics.median(abs(r["est_s"] - r["ttft_s"]) / r["ttft_s"] for r in rs) if rs else None
    hits = [r for r in scored if r["cached_tokens"] > 0]
    misses = [r for r in scored if r["cached_tokens"] == 0]
    queued = [r for r in scored if r["est_running"] > 0]
    return {
        "requests": len(rows),
        "scored": len(scored),
        "mdape": statistics.median(ape) if ape else None,
        "mdape_hits": mdape(hits),
        "mdape_misses": mdape(misses),
        "mdape_alone": mdape([r for r in scored if r["est_running"] == 0]),
        "mdape_behind_others": mdape(queued),
        "spearman": spearman([r["est_s"] for r in scored], [r["ttft_s"] for r in scored]) if len(scored) > 2 else None,
        "median_bias": statistics.median(r["est_s"] - r["ttft_s"] for r in scored) if scored else None,
    }


def measure_estimate(args: argparse.Namespace) -> dict:
    """The gateway's estimate on the real engine, with the calibrated profile and without (the default
    priors, no attention term): one stack, two gateways over the same workers and agent, the same plan
    through each in the order A B B A, every worker's prefix cache reset before each pass."""
    plan = estimate_plan(args)
    work_dir = args.work_dir / "estimate"
    stack_args = argparse.Namespace(
        python=args.python, model_dir=args.model_dir, tokenizer_dir=args.tokenizer_dir, bin_dir=args.bin_dir,
        workers=2, block_size=args.block_size, max_model_len=args.max_model_len, ready_timeout=args.ready_timeout,
        dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens, pin_workers=True,
        worker_env={"VLLM_SERVER_DEV_MODE": "1"}, model_profile=args.profile,
    )
    stack = bench.start_stack(stack_args, "kinference", 0, work_dir)
    arms = {}
    try:
        urls = {
            args.profile: stack.gateway_url,
            "none": bench.start_gateway(stack, stack_args, "gateway-no-profile",
                                        {"agents": [stack.agent_url], "routing": "kinference"}),
        }
        order = [args.profile, "none", "none", args.profile]
        for n, arm in enumerate(order, 1):
            bench.reset_caches(stack.workers)
            log(f"estimate pass {n}/{len(order)}: profile {arm}")
            rows = run_estimate_pass(urls[arm], plan, args)
            arms.setdefault(arm, []).append({"pass": n, "rows": rows, **score(rows)})
    finally:
        stack.stop()
    summary = {}
    for arm, passes in arms.items():
        rows = [r for p in passes for r in p["rows"]]
        summary[arm] = score(rows)
    return {"plan": {"prefix_lens": args.estimate_prefix_lens, "fresh": args.estimate_fresh,
                     "requests": args.estimate_requests, "warmup": args.estimate_warmup,
                     "concurrency": args.estimate_concurrency, "output": args.estimate_output},
            "arms": arms, "summary": summary}


# --------------------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    lines = [f"# Real vLLM calibration: `{report['profile']}`", "", "```sh", report["command"], "```", "",
             f"{report['date']}; vLLM {report['vllm_version']} (CPU), {report['model']}, {report['dtype']}; block size "
             f"{report['block_size']}, `--max-num-batched-tokens` {report['max_num_batched_tokens']}. "
             f"Machine: {report['machine']}.", ""]
    if "engine" in report:
        e = report["engine"]
        lines += ["## Engine measurements (medians) and the fit", "",
                  "| measurement | input | measured | fit |", "|---|---|---|---|"]
        by = {}
        for p in e["points"]["prefill"]:
            by.setdefault(("uncached prefill TTFT", f"{p['uncached']} tokens"), []).append(p)
        for p in e["points"]["cached"]:
            by.setdefault(("TTFT with a cached prefix", f"{p['cached']} of {p['cached'] + p['uncached']} cached"), []).append(p)
        for (what, inp), ps in by.items():
            lines.append(f"| {what} | {inp} | {statistics.median(p['ttft_s'] for p in ps) * 1e3:.0f} ms | "
                         f"{statistics.median(p['fit_s'] for p in ps) * 1e3:.0f} ms |")
        dec = {}
        for p in e["points"]["decode"]:
            dec.setdefault((p["batch"], p["context"]), []).append(p)
        for (b, c), ps in dec.items():
            lines.append(f"| time per output token | batch {b}, context {c} | "
                         f"{statistics.median(p['tpot_s'] for p in ps) * 1e3:.1f} ms | "
                         f"{statistics.median(p['fit_s'] for p in ps) * 1e3:.1f} ms |")
        c = e["points"]["concurrent"]
        lines.append(f"| two prefills at once | {c[0]['tokens']} tokens each | "
                     f"{statistics.median(p['together_s'][0] for p in c) * 1e3:.0f} / "
                     f"{statistics.median(p['together_s'][1] for p in c) * 1e3:.0f} ms (alone "
                     f"{statistics.median(p['alone_s'] for p in c) * 1e3:.0f} ms) | - |")
        m = e["fit"]["model"]
        lines += ["", "Fitted step model (seconds), and the per-request cost outside the engine's steps "
                  f"(`request_overhead_s` {e['fit']['request_overhead_s'] * 1e3:.1f} ms):", "", "```json",
                  json.dumps(m, indent=2), "```", "",
                  f"Fit error over the points: MdAPE {e['fit']['fit_mdape'] * 100:.1f}%, worst "
                  f"{e['fit']['fit_max_ape'] * 100:.1f}%.", ""]
    if "estimate" in report:
        s = report["estimate"]

        def pct(v):
            return "-" if v is None else f"{v * 100:.1f}%"
        p = s["plan"]
        lines += ["## The gateway's estimate against the engine", "",
                  f"Plan: {p['requests']} requests, {p['concurrency']} at a time, {p['output']} tokens out; prefixes of "
                  f"{', '.join(map(str, p['prefix_lens']))} tokens with 32-256-token questions, and "
                  f"{p['fresh'] * 100:.0f}% fresh prompts of 128-1,536 tokens; the first {p['warmup']} of each pass not "
                  "scored. Two gateways over the same workers and agent, with the profile and without; "
                  "passes in the order A B B A, prefix caches reset before each.", "",
                  "| profile | scored | MdAPE | hits | misses | alone on the worker | behind others | Spearman | median bias |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for arm, m in s["summary"].items():
            lines.append(f"| {arm} | {m['scored']} | {pct(m['mdape'])} | {pct(m['mdape_hits'])} | "
                         f"{pct(m['mdape_misses'])} | {pct(m['mdape_alone'])} | {pct(m['mdape_behind_others'])} | "
                         f"{m['spearman']:.2f} | {m['median_bias'] * 1e3:+.0f} ms |")
        lines += ["", "Per pass:", "", "| pass | profile | MdAPE | Spearman |", "|---|---|---|---|"]
        for arm, passes in s["arms"].items():
            for ps in passes:
                lines.append(f"| {ps['pass']} | {arm} | {pct(ps['mdape'])} | {ps['spearman']:.2f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="python of the vLLM venv")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--model-label", default="random Qwen2, make_model.py --size small (4 layers, hidden 256)")
    parser.add_argument("--profile", default="cpu-qwen2-small")
    # float32: these CPUs have AVX2 and no AVX-512, so vLLM's bf16 kernels run emulated, ~3x slower.
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--bin-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="results path without extension")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512, 1024, 2048])
    parser.add_argument("--cached-fractions", type=lambda s: [float(x) for x in s.split(",")],
                        default=[0.25, 0.5, 0.75, 0.94])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--decode-prompts", type=lambda s: [int(x) for x in s.split(",")], default=[128, 1024])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--estimate", action="store_true", help="also part 2: the gateway's estimate error")
    parser.add_argument("--estimate-prefix-lens", type=lambda s: [int(x) for x in s.split(",")],
                        default=[384, 1024, 1792])
    parser.add_argument("--estimate-fresh", type=float, default=0.2, help="share of fresh prompts")
    parser.add_argument("--estimate-requests", type=int, default=72)
    parser.add_argument("--estimate-warmup", type=int, default=8)
    parser.add_argument("--estimate-concurrency", type=int, default=2)
    parser.add_argument("--estimate-output", type=int, default=8)
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--vllm-version", default="0.32.0")
    parser.add_argument("--machine", default="2 shared CPU cores")
    parser.add_argument("--command", default=" ".join(sys.argv))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for name in ("model_dir", "tokenizer_dir", "bin_dir", "work_dir"):
        setattr(args, name, getattr(args, name).resolve())

    report = {
        "profile": args.profile,
        "command": args.command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "vllm_version": args.vllm_version,
        "model": args.model_label,
        "block_size": args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "dtype": args.dtype,
        "machine": args.machine,
    }
    if not args.skip_engine:
        stack = bench.Stack(args.work_dir / "engine")
        stack.work_dir.mkdir(parents=True, exist_ok=True)
        [port] = bench.free_ports(1)
        url = f"http://127.0.0.1:{port}"
        try:
            started = time.monotonic()
            worker = stack.spawn("worker", [
                args.python, "-m", "vllm.entrypoints.openai.api_server",
                "--host", "127.0.0.1", "--port", str(port),
                "--model", str(args.model_dir), "--served-model-name", bench.MODEL,
                "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                "--block-size", str(args.block_size), "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
                "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--seed", "0",
            ], env=bench.WORKER_ENV)
            stack.wait_ready(worker, f"{url}/health", args.ready_timeout)
            report["worker_start_s"] = time.monotonic() - started
            log(f"worker ready after {report['worker_start_s']:.0f} s")
            points = measure_engine(url, args)
            report["engine"] = {"points": points, "fit": fit(points)}
            log(f"fit: {json.dumps(report['engine']['fit'])}")
        finally:
            stack.stop()
    if args.estimate:
        report["estimate"] = measure_estimate(args)
        for arm, m in report["estimate"]["summary"].items():
            log(f"estimate, profile {arm}: MdAPE {m['mdape']}, Spearman {m['spearman']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
