"""Medians over seeds of the replicas-*.json runs in this directory, and ratios to one replica
paired by seed (median of the per-seed ratios). Usage: python3 summarize.py > summary.md"""
import glob, json, os, statistics as st

rows = []
for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__) or ".", "replicas-*.json"))):
    rows += json.load(open(path))["records"]

def key(r):
    return (r["workload"], r["concurrency"])

def fig(r):
    s = r["summary"]
    return {"hit": r["cache_hit_share"] or float("nan"), "p50": s["median_ttft_s"],
            "p90": s["p90_ttft_s"], "goodput": s["goodput_rpm"]}

print("| workload | c | N | dispatches shared | seeds | hit | TTFT p50 (s) | TTFT p90 (s) | goodput (/min) | hit x1 | p90 x1 | goodput x1 | p90 after/before | goodput after/before |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for wc in sorted({key(r) for r in rows}):
    for n, shared in [(1, False), (2, False), (2, True), (4, False), (4, True)]:
        runs = [r for r in rows if key(r) == wc and r["replicas"] == n and r["share_dispatches"] == shared]
        if not runs:
            continue
        one = {r["seed"]: fig(r) for r in rows if key(r) == wc and r["replicas"] == 1}
        med = {k: st.median(fig(r)[k] for r in runs) for k in ("hit", "p50", "p90", "goodput")}
        def ratio(k):
            v = [fig(r)[k] / one[r["seed"]][k] for r in runs if r["seed"] in one and one[r["seed"]][k] > 0]
            return f"{st.median(v):.2f}" if v else "-"
        before = {r["seed"]: fig(r) for r in rows if key(r) == wc and r["replicas"] == n and not r["share_dispatches"]}
        def paired(k):
            v = [fig(r)[k] / before[r["seed"]][k] for r in runs if shared and r["seed"] in before and before[r["seed"]][k] > 0]
            return f"{st.median(v):.2f}" if v else "-"
        print(f"| {wc[0]} | {wc[1]} | {n} | {'yes' if shared else 'no'} | {len(runs)} | {100*med['hit']:.1f}% | "
              f"{med['p50']:.2f} | {med['p90']:.2f} | {med['goodput']:.0f} | {ratio('hit')} | {ratio('p90')} | {ratio('goodput')} | {paired('p90')} | {paired('goodput')} |")
