#!/usr/bin/env python3
"""Summarizes the heterogeneous and bursty routing-bench runs: the median over seeds of each router's
figures, Kinference's ratios to the best peer, random and the oracle in each run, and (from the
requests logs) where each router sent the heterogeneous fleet's requests before and after the
mid-run slowdown.

Usage: summarize.py OUT.json RUN_DIR... (each RUN_DIR holds routing.json, and optionally
requests.jsonl[.gz] and workers.yaml: the agent's worker list of that run, in start order).
"""

import gzip
import json
import re
import statistics
import sys
from pathlib import Path

FIGURES = ("median_ttft_s", "p90_ttft_s", "goodput_rpm", "cached_token_share")
PEERS = ("smg-cache-aware", "smg-prefix-hash", "vllm-router-kv-aware")


def request_rows(run_dir):
    """The run's requests log (requests.jsonl, or requests.jsonl.gz as committed)."""
    for name, opener in (("requests.jsonl", open), ("requests.jsonl.gz", gzip.open)):
        if (run_dir / name).is_file():
            with opener(run_dir / name, "rt") as f:
                return [json.loads(line) for line in f]
    return []


def worker_order(run_dir):
    """Worker URLs in start order (w1 first), from the agent's workers file."""
    path = run_dir / "workers.yaml"
    if not path.is_file():
        return []
    return re.findall(r"url: (http://\S+)", path.read_text())


def placement(run_dir, warmup, workers):
    """Per (workload, concurrency, policy): requests per worker before and after the halfway event."""
    rows = [r for r in request_rows(run_dir) if r["workload"] == "heterogeneous"]
    if not rows or not workers:
        return {}
    out = {}
    for key in {(r["workload"], r["concurrency"], r["policy"]) for r in rows}:
        mine = [r["request"] for r in rows if (r["workload"], r["concurrency"], r["policy"]) == key]
        sessions = sorted({r["session"] for r in mine})
        half = warmup + len(sessions) // 2
        phases = {"before": [0] * len(workers), "after": [0] * len(workers)}
        for r in mine:
            if r.get("worker") in workers:
                phase = "before" if r["session"] < half else "after"
                phases[phase][workers.index(r["worker"])] += 1
        key = "|".join(map(str, key))
        if sum(phases["before"]) + sum(phases["after"]) > 0:  # peers name no worker
            out[key] = phases
    return out


def learned_rates(run_dir, warmup, workers):
    """Kinference's view of each worker's speed: the median of queue_s / queue_tokens over the
    candidates of its decisions (seconds per 1,000 queued prompt tokens), before and after the
    halfway event."""
    rows = [r for r in request_rows(run_dir) if r["workload"] == "heterogeneous"]
    if not rows or not workers:
        return {}
    out = {}
    for c in sorted({r["concurrency"] for r in rows}):
        mine = [r["request"] for r in rows if r["policy"] == "kinference" and r["concurrency"] == c]
        if not mine:
            continue
        half = warmup + len({r["session"] for r in mine}) // 2
        samples = {"before": [[] for _ in workers], "after": [[] for _ in workers]}
        for r in mine:
            phase = "before" if r["session"] < half else "after"
            for cand in (r.get("decision") or "").split("; "):
                m = re.match(r"\*?(\S+) .*?queue_tokens=(\d+) .*?queue_s=([\d.]+)", cand)
                if m and m.group(1) in workers and int(m.group(2)) >= 1000:
                    rate = 1000 * float(m.group(3)) / int(m.group(2))
                    samples[phase][workers.index(m.group(1))].append(rate)
        out[str(c)] = {
            phase: [round(statistics.median(v), 3) if v else None for v in per_worker]
            for phase, per_worker in samples.items()
        }
    return out


def main():
    out_path, dirs = Path(sys.argv[1]), [Path(d) for d in sys.argv[2:]]
    runs = []
    for d in dirs:
        data = json.loads((d / "routing.json").read_text())
        warmup = 2 * data["experiment"]["shape"]["shared_prefixes"]
        runs.append(
            {
                "dir": d.name,
                "seed": data["setup"]["seed"],
                "commit": data["setup"].get("git_commit"),
                "results": data["results"],
                "placement": placement(d, warmup, worker_order(d)),
                "learned_s_per_1k_tokens": learned_rates(d, warmup, worker_order(d)),
            }
        )
    table = {}
    for run in runs:
        for workload, policies in run["results"].items():
            for policy, levels in policies.items():
                for c, s in levels.items():
                    if s.get("unavailable") or not s.get("n"):
                        continue
                    cell = table.setdefault(workload, {}).setdefault(int(c), {}).setdefault(policy, [])
                    cell.append({f: s[f] for f in FIGURES} | {"seed": run["seed"], "errors": s["errors"]})
    summary = {"runs": [{k: r[k] for k in ("dir", "seed", "commit", "placement", "learned_s_per_1k_tokens")} for r in runs], "cells": {}}
    for workload, levels in sorted(table.items()):
        print(f"\n### {workload}\n")
        seeds = sorted({s["seed"] for p in levels.values() for v in p.values() for s in v})
        print(f"Each cell: the runs of seeds {' / '.join(map(str, seeds))}, in that order.\n")
        print("| c | router | median TTFT (s) | p90 TTFT (s) | goodput (rpm) | cached |")
        print("|---|---|---|---|---|---|")
        for c, policies in sorted(levels.items()):
            for policy, samples in sorted(policies.items(), key=lambda p: p[0] != "kinference"):
                med = {f: statistics.median(s[f] for s in samples) for f in FIGURES}
                summary["cells"].setdefault(workload, {}).setdefault(str(c), {})[policy] = {
                    "median_over_seeds": med,
                    "per_seed": samples,
                }
                by_seed = sorted(samples, key=lambda s: s["seed"])

                def cells(fig, fmt):
                    return " / ".join(fmt(s[fig]) for s in by_seed)

                print(
                    f"| {c} | {policy} | {cells('median_ttft_s', '{:.2f}'.format)} | "
                    f"{cells('p90_ttft_s', '{:.2f}'.format)} | {cells('goodput_rpm', '{:.1f}'.format)} | "
                    f"{cells('cached_token_share', lambda v: f'{100 * v:.0f}%')} |"
                )
        print(f"\nKinference / other router in the same run (median TTFT, p90 TTFT), per seed:\n")
        print("| c | seed | vs best peer (median) | vs best peer (p90) | vs random (median) | vs oracle (median) |")
        print("|---|---|---|---|---|---|")
        for c, policies in sorted(levels.items()):
            seeds = sorted({s["seed"] for s in policies.get("kinference", [])})
            for seed in seeds:
                at = {p: next((s for s in v if s["seed"] == seed), None) for p, v in policies.items()}
                k = at["kinference"]
                peers = [(p, at[p]) for p in PEERS if at.get(p)]

                def best(fig):
                    p, s = min(peers, key=lambda ps: ps[1][fig])
                    return f"{k[fig] / s[fig]:.2f}x ({p} {s[fig]:.2f})"

                def vs(p):
                    return f"{k['median_ttft_s'] / at[p]['median_ttft_s']:.2f}x" if at.get(p) else "-"

                print(
                    f"| {c} | {seed} | {best('median_ttft_s') if peers else '-'} | "
                    f"{best('p90_ttft_s') if peers else '-'} | {vs('random')} | {vs('oracle')} |"
                )
    for run in runs:
        if not run["placement"]:
            continue
        print(f"\nRequests per worker (w1..w4) before / after the halfway event, seed {run['seed']}:\n")
        print("| workload, c | router | before | after |")
        print("|---|---|---|---|")
        for key, phases in sorted(run["placement"].items()):
            workload, c, policy = key.split("|")
            print(f"| {workload}, {c} | {policy} | {phases['before']} | {phases['after']} |")
    for run in runs:
        if not run["learned_s_per_1k_tokens"]:
            continue
        print(f"\nKinference's learned queue seconds per 1,000 prompt tokens (w1..w4), seed {run['seed']}:\n")
        print("| c | before the event | after |")
        print("|---|---|---|")
        for c, phases in run["learned_s_per_1k_tokens"].items():
            print(f"| {c} | {phases['before']} | {phases['after']} |")
    out_path.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
