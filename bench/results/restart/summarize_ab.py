"""A/B table of interleaved builds (`fade-ab/`, `drain-ab/`, `late-sweep/`): per workload, concurrency,
policy and build, each seed and the median over seeds. Each run is a folder `<workload>-<build>-s<seed>`
holding the routing.json routing-bench wrote; the README section of each experiment says which build is
which. Usage: python3 summarize_ab.py DIR"""
import json, os, statistics, sys
root = sys.argv[1]
rows = {}
for d in sorted(os.listdir(root)):
    p = os.path.join(root, d, 'routing.json')
    if not os.path.exists(p):
        continue
    workload, build, seed = d.rsplit('-', 2)
    r = json.load(open(p))
    for w, by_pol in r['results'].items():
        for pol, by_c in by_pol.items():
            for c, res in by_c.items():
                rows.setdefault((w, int(c), pol, build), []).append((seed, res))
print('| workload | c | policy | build | median TTFT (s) | p90 TTFT (s) | goodput (req/min) | cached | failed |')
print('|---|---:|---|---|---:|---:|---:|---:|---:|')
for (w, c, pol, build), lst in sorted(rows.items()):
    def col(k, f=lambda v: f'{v:.2f}'):
        vals = [res[k] for _, res in lst]
        return f'{f(statistics.median(vals))} ({", ".join(f(v) for v in vals)})'
    print(f'| {w} | {c} | {pol} | {build} | {col("median_ttft_s")} | {col("p90_ttft_s")} | {col("goodput_rpm", lambda v: f"{v:.1f}")} | {col("cached_token_share", lambda v: f"{100*v:.0f}%")} | {col("errors", lambda v: f"{v:.0f}")} |')
