# Samples of a `perf script` dump whose stack holds FUNCTION, counted by the function it called
# (child) and by the innermost frame (leaf): perf_children.py FUNCTION PERF_SCRIPT_FILE
import sys,re,collections
target=sys.argv[1]
def short(s): return re.sub(r'\+0x[0-9a-f]+$','',s)[:140]
child=collections.Counter(); leaf=collections.Counter(); n=0; frames=[]
def flush():
    global n
    idx=[i for i,f in enumerate(frames) if target in f]
    if not idx: return
    n+=1
    i=idx[-1]  # outermost occurrence (frames listed leaf first)
    i=idx[0]
    # frames[0] is leaf; caller chain follows
    # find the child: frame just before the first (leafmost) occurrence of target
    if i>0: child[short(frames[i-1])]+=1
    else: child['(self)']+=1
    leaf[short(frames[0])]+=1
for line in open(sys.argv[2]):
    line=line.rstrip('\n')
    if not line.strip():
        if frames: flush()
        frames=[]; continue
    if line[0] in '\t ':
        p=line.strip().split(None,1)
        if len(p)==2: frames.append(p[1].rsplit(' (',1)[0])
print(target,"samples",n)
for s,c in child.most_common(15): print(f"  child {c:5d} {s}")
for s,c in leaf.most_common(15): print(f"  leaf  {c:5d} {s}")
