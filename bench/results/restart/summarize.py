"""Tables for routing-bench runs against the peers, one folder per seed: per workload, concurrency
and policy, every seed's figure and the median over seeds, and Kinference's ratio to the best peer.

Usage: python3 summarize.py DIR... (each DIR holds a routing.json written by routing-bench)."""
import json, statistics, sys

FIGURES = [  # (key, label, lower is better)
    ('median_ttft_s', 'median TTFT (s)', True),
    ('p90_ttft_s', 'p90 TTFT (s)', True),
    ('goodput_rpm', 'goodput (req/min)', False),
    ('cached_token_share', 'cached', False),
    ('errors', 'failed requests', True),
]

runs = [json.load(open(f'{d}/routing.json')) for d in sys.argv[1:]]
seeds = [r['experiment']['seed'] for r in runs]
cells = {}  # (workload, concurrency) -> policy -> [result per seed]
for r in runs:
    for workload, by_policy in r['results'].items():
        for policy, by_c in by_policy.items():
            for c, result in by_c.items():
                if result.get('unavailable'):
                    continue
                cells.setdefault((workload, int(c)), {}).setdefault(policy, []).append(result)

def fmt(key, v):
    if key == 'cached_token_share':
        return f'{100 * v:.0f}%'
    if key == 'errors':
        return f'{v:.0f}'
    return f'{v:.2f}' if v < 10 else f'{v:.1f}'

for (workload, c), by_policy in sorted(cells.items()):
    print(f'\n### {workload}, concurrency {c} (seeds {", ".join(map(str, seeds))}; median over seeds)\n')
    print('| policy | ' + ' | '.join(label for _, label, _ in FIGURES) + ' |')
    print('|---|' + '---:|' * len(FIGURES))
    for policy, results in by_policy.items():
        row = []
        for key, _, _ in FIGURES:
            values = [r[key] for r in results]
            row.append(f'{fmt(key, statistics.median(values))} ({", ".join(fmt(key, v) for v in values)})')
        print(f'| {policy} | ' + ' | '.join(row) + ' |')
    peers = [p for p in by_policy if p not in ('kinference', 'oracle', 'random', 'round-robin',
                                                'least-outstanding', 'prefix-hash')]
    if 'kinference' not in by_policy or not peers:
        continue
    print()
    for key, label, lower in FIGURES[:3]:
        ratios = []
        for i in range(len(by_policy['kinference'])):
            ours = by_policy['kinference'][i][key]
            theirs = [by_policy[p][i][key] for p in peers if i < len(by_policy[p])]
            best = min(theirs) if lower else max(theirs)
            ratios.append(ours / best if lower else best / ours)
        what = 'Kinference / best peer' if lower else 'best peer / Kinference'
        print(f'- {label}, {what} per seed: ' + ', '.join(f'{x:.2f}x' for x in ratios)
              + f' (under 1: Kinference ahead)')
