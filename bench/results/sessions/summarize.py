import json, statistics, sys
rows = []
for arm in ["on", "off"]:
    for seed in [42, 43, 44]:
        try:
            d = json.load(open(f"sessions-{arm}-seed{seed}.json"))
        except Exception as e:
            continue
        for pol, by_c in d["results"]["multi-turn"].items():
            r = by_c.get("32")
            if not r:
                continue
            name = pol if pol == "oracle" else ("kinference+sessions" if arm == "on" else "kinference, no session key")
            rows.append((name, seed, r["median_ttft_s"], r["p90_ttft_s"], r["goodput_rpm"], r["cached_token_share"], r["errors"]))
print("| policy | seed | median TTFT (s) | p90 TTFT (s) | goodput (rpm) | cached | errors |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.2f} | {r[4]:.1f} | {r[5]:.0%} | {r[6]} |")
print()
print("| policy | median of medians | median p90 | median goodput | median cached |")
print("|---|---|---|---|---|")
med = {}
for name in ["kinference+sessions", "kinference, no session key", "oracle"]:
    rs = [r for r in rows if r[0] == name]
    if not rs: continue
    m = [statistics.median([r[i] for r in rs]) for i in (2, 3, 4, 5)]
    med[name] = m
    print(f"| {name} ({len(rs)} seeds) | {m[0]:.2f} | {m[1]:.2f} | {m[2]:.1f} | {m[3]:.0%} |")
if "oracle" in med:
    o = med["oracle"]
    for name in ["kinference+sessions", "kinference, no session key"]:
        if name in med:
            k = med[name]
            print(f"\n{name}: p90 {k[1]/o[1]:.2f}x the oracle's, goodput {k[2]/o[2]:.2f}x")
# paired per seed
print()
for seed in [42, 43, 44]:
    k = [r for r in rows if r[1] == seed and r[0] == "kinference+sessions"]
    o = [r for r in rows if r[1] == seed and r[0] == "oracle"]
    if k and o:
        print(f"seed {seed}: p90 ratio {k[0][3]/o[0][3]:.2f}, goodput ratio {k[0][4]/o[0][4]:.2f}")
