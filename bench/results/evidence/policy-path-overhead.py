"""Added latency of the gateway's policy path (one local pool, routing kinference) over a direct call
to the same vllm-sim, at concurrency 1, and the gateway's own routing stage timers.

    python3 policy_path.py GATEWAY_BIN VLLM_SIM_BIN TOKENIZER_DIR {worker|local} [requests]

`worker`: the model has no tokenizer in the gateway (the prompt goes to the worker's /tokenize);
`local`: the gateway tokenizes with the model's tokenizer. Prints one JSON line."""
import http.client, json, os, re, socket, subprocess, sys, tempfile, time

gw_bin, sim_bin, tok, mode = sys.argv[1:5]
n = int(sys.argv[5]) if len(sys.argv) > 5 else 300

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def wait(port, path, limit=60):
    end = time.time() + limit
    while time.time() < end:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2); c.request("GET", path)
            if c.getresponse().status == 200: return
        except OSError: pass
        time.sleep(0.1)
    raise SystemExit(f"port {port}{path} never answered")

sim_port, api, admin = free_port(), free_port(), free_port()
sim = subprocess.Popen([sim_bin, "--host", "127.0.0.1", "--port", str(sim_port), "--model", "sim",
                        "--preset", "fast", "--time-scale", "0.01", "--tokenizer-dir", tok],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
d = tempfile.mkdtemp()
os.makedirs(f"{d}/policies")
tokenizer = f'  tokenizer: {{dir: "{tok}"}}\n' if mode == "local" else ""
open(f"{d}/policies/all.yaml", "w").write(f"""apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {{name: sim}}
spec:
  servedName: sim
{tokenizer}---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {{name: local}}
spec:
  models: [sim]
  gpuClass: sim
  locality: Local
  endpoints: [{{url: "http://127.0.0.1:{sim_port}"}}]
  prices: {{cachedInputPerMillion: 0.01, uncachedInputPerMillion: 0.1, outputPerMillion: 0.4}}
""")
open(f"{d}/gateway.yaml", "w").write(f"routing: kinference\npolicy_dir: {d}/policies\ntenancy:\n  usage_journal: {d}/usage.jsonl\n")
try:
    wait(sim_port, "/health")
    gw = subprocess.Popen([gw_bin, "--listen", f"127.0.0.1:{api}", "--admin-listen", f"127.0.0.1:{admin}",
                           "--config", f"{d}/gateway.yaml"], cwd=d,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait(admin, "/healthz")
        # About 1,500 prompt tokens: a system prompt every request repeats, and a short question.
        system = " ".join(f"Rule {i}: answer briefly and cite the section you rely on." for i in range(120))
        def body(i):
            return json.dumps({"model": "sim", "max_tokens": 4, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]})
        conns = {p: http.client.HTTPConnection("127.0.0.1", p, timeout=30) for p in (sim_port, api)}
        def call(port, i):
            c = conns[port]
            t = time.perf_counter()
            c.request("POST", "/v1/chat/completions", body(i), {"content-type": "application/json"})
            r = c.getresponse(); r.read()
            assert r.status == 200, r.status
            return time.perf_counter() - t
        for i in range(30):
            call(sim_port, i); call(api, i)
        direct, routed = [], []
        for i in range(n):
            first, second = (sim_port, api) if i % 2 else (api, sim_port)
            a = call(first, 1000 + i); b = call(second, 1000 + i)
            (direct if first == sim_port else routed).append(a)
            (routed if first == sim_port else direct).append(b)
        c = http.client.HTTPConnection("127.0.0.1", admin, timeout=5); c.request("GET", "/metrics")
        metrics = c.getresponse().read().decode()
    finally:
        gw.terminate(); gw.wait()
finally:
    sim.terminate(); sim.wait()

def pct(xs, q):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] * 1000

def metric(name, **labels):
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "): continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()): total += float(line.rsplit(" ", 1)[1])
    return total

out = {"mode": mode, "requests": n,
       "direct_p50_ms": pct(direct, 50), "gw_p50_ms": pct(routed, 50),
       "direct_p99_ms": pct(direct, 99), "gw_p99_ms": pct(routed, 99)}
out["added_p50_ms"] = out["gw_p50_ms"] - out["direct_p50_ms"]
out["added_p99_ms"] = out["gw_p99_ms"] - out["direct_p99_ms"]
for stage in ("tokenize", "decide"):
    cnt = metric("kinference_routing_stage_seconds_count", stage=stage)
    s = metric("kinference_routing_stage_seconds_sum", stage=stage)
    out[f"{stage}_mean_us"] = s / cnt * 1e6 if cnt else None
    out[f"{stage}_timed"] = cnt
for source in ("local", "worker", "failed"):
    out[f"tokenize_{source}"] = metric("kinference_routing_tokenize_total", source=source)
print(json.dumps(out))
