# Reads `perf script` output; for samples whose stack contains ROOT, tallies the leaf (self) symbol
# and the first frame below ROOT (the inclusive child of ROOT).
import sys, re, collections
root = sys.argv[1]
leaf = collections.Counter(); child = collections.Counter(); total = 0
def short(s):
    s = re.sub(r'\+0x[0-9a-f]+$', '', s)
    return s[:140]
def flush(frames):
    global total
    syms = [short(f) for f in frames]
    idx = next((i for i, s in enumerate(syms) if root in s), None)
    if idx is None: return
    total += 1
    leaf[syms[0]] += 1
    child[syms[idx-1] if idx > 0 else '(self)'] += 1
frames = []
for line in sys.stdin:
    line = line.rstrip('\n')
    if not line.strip():
        if frames: flush(frames)
        frames = []; continue
    if line.startswith('\t') or line.startswith(' '):
        parts = line.strip().split(None, 1)
        if len(parts) == 2:
            sym = parts[1].rsplit(' (', 1)[0]
            frames.append(sym)
if frames: flush(frames)
print(f"samples under {root}: {total}")
print("-- self (leaf) symbols")
for s, n in leaf.most_common(25): print(f"{100*n/total:6.2f}%  {s}")
print("-- direct children of root (inclusive)")
for s, n in child.most_common(15): print(f"{100*n/total:6.2f}%  {s}")
