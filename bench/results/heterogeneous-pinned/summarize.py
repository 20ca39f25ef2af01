"""Tables for the heterogeneous comparison of gateway builds: per seed and build, Kinference and the
oracle of the same run.

Usage: python3 summarize.py DIR VERSION... (DIR holds het-VERSION-SEED/ with routing.json and
requests.jsonl or requests.jsonl.gz; the versions in the order to print them, e.g. before pin late)."""
import gzip, json, os, re, statistics, sys

root = sys.argv[1]
versions = sys.argv[2:] or ['before', 'pin']
seeds = sorted({n.rsplit('-', 1)[1] for n in os.listdir(root) if n.startswith('het-')})

def requests(d):
    p = os.path.join(d, 'requests.jsonl')
    f = open(p) if os.path.exists(p) else gzip.open(p + '.gz', 'rt')
    return [json.loads(l) for l in f]

def misses(rows, c):
    """Kinference's requests at concurrency c by what its index predicted and what the worker reported."""
    out = {'discounted_but_hit': 0, 'sent_cold_from_discounted_holder': 0}
    for r in rows:
        if r['policy'] != 'kinference' or r['concurrency'] != c:
            continue
        q = r['request']; ex = q['decision'] or ''; pt = q['prompt_tokens']
        chosen = re.search(r'\*http://\S+ cached=(\d+)', ex)
        runs = [(int(a), int(b)) for a, b in re.findall(r'run:(\d+)->(\d+)', ex)]
        discounted = any(a * 16 > pt * 0.5 and b * 16 <= pt * 0.5 for a, b in runs)
        if not chosen or not discounted:
            continue
        if int(chosen.group(1)) <= pt * 0.5:
            if q['cached_tokens'] > pt * 0.5:
                out['discounted_but_hit'] += 1
            else:
                out['sent_cold_from_discounted_holder'] += 1
    return out

rows = []
for seed in seeds:
    for v in versions:
        d = os.path.join(root, f'het-{v}-{seed}')
        if not os.path.isdir(d):
            continue
        res = json.load(open(os.path.join(d, 'routing.json')))['results']['heterogeneous']
        reqs = requests(d)
        for c in ('8', '32'):
            k, o = res['kinference'][c], res['oracle'][c]
            rows.append(dict(seed=seed, version=v, c=int(c), median=k['median_ttft_s'], p90=k['p90_ttft_s'],
                             goodput=k['goodput_rpm'], cached=k['cached_token_share'],
                             oracle_median=o['median_ttft_s'], oracle_goodput=o['goodput_rpm'],
                             oracle_cached=o['cached_token_share'], **misses(reqs, int(c))))
print('| c | seed | version | median TTFT (s) | p90 (s) | goodput (rpm) | cached | oracle median / goodput / cached | holder discounted, went cold and missed |')
print('|---|---|---|---|---|---|---|---|---|')
for r in sorted(rows, key=lambda r: (r['c'], r['seed'], versions.index(r['version']))):
    print(f"| {r['c']} | {r['seed']} | {r['version']} | {r['median']:.2f} | {r['p90']:.2f} | {r['goodput']:.1f} | {r['cached']:.0%} | "
          f"{r['oracle_median']:.2f} / {r['oracle_goodput']:.1f} / {r['oracle_cached']:.0%} | {r['sent_cold_from_discounted_holder']} |")
print()
print('Medians over the seeds (kinference / oracle in the same run):')
for c in (8, 32):
    for v in versions:
        sel = [r for r in rows if r['c'] == c and r['version'] == v]
        if not sel:
            continue
        m = lambda key: statistics.median(r[key] for r in sel)
        ratio = statistics.median(r['median'] / r['oracle_median'] for r in sel)
        gratio = statistics.median(r['goodput'] / r['oracle_goodput'] for r in sel)
        print(f"- c={c} {v}: median TTFT {m('median'):.2f} s, p90 {m('p90'):.2f} s, goodput {m('goodput'):.1f} rpm, cached {m('cached'):.0%}; "
              f"vs oracle: median {ratio:.2f}x, goodput {gratio:.2f}x")
