# Medians of added p50/p99 per build, mode and concurrency from an added-latency-ab.sh log.
import collections, re, statistics, sys
runs = collections.defaultdict(list)
build = None
for line in open(sys.argv[1]):
    if line.startswith("== "):
        build = line.split()[1]
        continue
    m = re.match(r"(non-stream|stream-ttfb)\s+(\d+) \|.*\|\s+([+-][\d.]+) ms\s+([+-][\d.]+) ms", line)
    if m:
        runs[(build, m[1], int(m[2]))].append((float(m[3]), float(m[4])))
print("| build | mode | conc | added p50 (runs) | median | added p99 (runs) | median |")
print("|---|---|---|---|---|---|---|")
for (build, mode, conc), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
    p50 = [r[0] for r in rs]; p99 = [r[1] for r in rs]
    fmt = lambda xs: ", ".join(f"{x:+.2f}" for x in xs)
    print(f"| {build} | {mode} | {conc} | {fmt(p50)} | {statistics.median(p50):+.2f} ms | {fmt(p99)} | {statistics.median(p99):+.2f} ms |")
