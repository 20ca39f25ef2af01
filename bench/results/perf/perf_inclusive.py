# Inclusive share of each symbol (counted once per sample when anywhere on the stack), from `perf script`.
import sys, re, collections
pat = re.compile(sys.argv[1]) if len(sys.argv) > 1 else None
incl = collections.Counter(); total = 0; frames = []
def short(s): return re.sub(r'\+0x[0-9a-f]+$', '', s)[:150]
def flush():
    global total
    total += 1
    for s in set(short(f) for f in frames): incl[s] += 1
for line in sys.stdin:
    line = line.rstrip('\n')
    if not line.strip():
        if frames: flush()
        frames = []; continue
    if line[0] in '\t ':
        parts = line.strip().split(None, 1)
        if len(parts) == 2: frames.append(parts[1].rsplit(' (', 1)[0])
if frames: flush()
print("samples", total)
n = 0
for s, c in incl.most_common():
    if pat and not pat.search(s): continue
    print(f"{100*c/total:6.2f}%  {s}"); n += 1
    if n >= int(sys.argv[2] if len(sys.argv) > 2 else 60): break
