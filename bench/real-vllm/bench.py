"""Shared-prefix workload through Kinference on real vLLM workers (CPU build, tiny random Qwen2).

For every scenario (a per-worker KV-cache size) and routing mode (the gateway's `routing` setting), this
starts a fresh stack on loopback: N vLLM workers with prefix caching and KV events, one Kinference agent,
one gateway. It then sends the same sequence of streamed chat completions (a few long shared system
prompts, short distinct questions) through the gateway, and reads vLLM's own prefix-cache counters from
every worker's /metrics. Each run starts from cold caches because every process is new.

Usage (normally through run.sh): python bench.py --model-dir DIR --tokenizer-dir DIR --bin-dir DIR ...
"""

import argparse
import concurrent.futures
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
from tokenizers import Tokenizer

MODEL = "tiny-qwen2"

# The environment of every vLLM worker: CPU, offline, lean.
WORKER_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # lean mode: one process per worker, no busy-spinning
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# Words for the synthetic system prompts: ordinary English, so the tokenizer sees normal text.
WORDS = (
    "account agent answer archive balance billing cache calendar carrier change channel checkout claim "
    "client contract credit customer database delivery deposit device discount document email error "
    "estimate export feature invoice issue journal ledger license limit manager market message network "
    "notice order owner package partner payment period policy portal price product profile quota record "
    "refund region release renewal report request reseller return review schedule service session "
    "shipment status storage subscription support system tariff team ticket transfer update upgrade "
    "usage vendor version warranty window workflow always never please must should carefully politely "
    "quickly before after during within unless when if the a of to for with on by from and or"
).split()


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Workload


@dataclass(frozen=True)
class Request:
    prefix: int
    question: int
    messages: list


def system_prompt(tokenizer: Tokenizer, index: int, tokens: int) -> str:
    """A deterministic system prompt of about `tokens` tokens, distinct from its first word on."""
    rng = random.Random(1000 + index)
    text = f"You are support assistant number {index} of the Kinference benchmark company. Rules:"
    while len(tokenizer.encode(text).ids) < tokens:
        sentence = " ".join(rng.choice(WORDS) for _ in range(12))
        text += f" {sentence.capitalize()}."
    return text


def workload(tokenizer: Tokenizer, args: argparse.Namespace) -> list[Request]:
    prompts = [system_prompt(tokenizer, i, args.prefix_tokens) for i in range(args.prefixes)]
    rng = random.Random(args.seed)
    requests_ = [
        Request(
            p,
            q,
            [
                {"role": "system", "content": prompts[p]},
                {
                    "role": "user",
                    "content": f"Question {q}: how do I {rng.choice(WORDS)} my {rng.choice(WORDS)}?",
                },
            ],
        )
        for p in range(args.prefixes)
        for q in range(args.questions)
    ]
    rng.shuffle(requests_)
    return requests_


def render(messages: list) -> str:
    """The Qwen2 chat template's output for a system + user conversation (generation prompt added)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


def hit_upper_bound(tokenizer: Tokenizer, plan: list, block_size: int) -> int:
    """Prefix-cache hits (tokens) if every request found, on its worker, each full block that an earlier
    request of the same system prompt shares with it: one worker per prompt, nothing evicted."""
    seen: dict = {}
    total = 0
    for req in plan:
        ids = tokenizer.encode(render(req.messages)).ids
        best = 0
        for other in seen.get(req.prefix, []):
            common = 0
            for a, b in zip(ids, other):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        # vLLM never serves the last prompt token from the cache (it must compute one position).
        total += min(best, len(ids) - 1) // block_size * block_size
        seen.setdefault(req.prefix, []).append(ids)
    return total


@dataclass
class Outcome:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    worker: str = ""
    error: str = ""


def send(url: str, request: Request, max_tokens: int) -> Outcome:
    """One streamed chat completion; TTFT is the time to the first chunk that carries a choice."""
    body = {
        "model": MODEL,
        "messages": request.messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    usage = None
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=300) as r:
            if r.status_code != 200:
                return Outcome(False, error=f"HTTP {r.status_code}: {r.text[:200]}")
            worker = r.headers.get("x-kinference-worker", "")
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(False, error=json.dumps(chunk["error"])[:200])
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except requests.RequestException as e:
        return Outcome(False, error=str(e)[:200])
    e2e = time.perf_counter() - start
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(
        True,
        ttft_s=ttft if ttft is not None else e2e,
        e2e_s=e2e,
        prompt_tokens=usage.get("prompt_tokens", 0),
        cached_tokens=details.get("cached_tokens") or 0,
        worker=worker,
    )


# --------------------------------------------------------------------------------------------------
# Processes


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now, below the kernel's ephemeral range.

    vLLM binds its sockets up to a minute after the ports are chosen. Ports the kernel hands out for
    `bind(0)` and outgoing connections (vLLM's internal ZeroMQ sockets, other programs) come from the
    ephemeral range, so ports chosen outside it are far less likely to be taken in the meantime.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    ports: list = []
    while len(ports) < n:
        port = rng.randrange(20000, max(20001, low))
        if port in ports:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Stack:
    """A running set of workers, agent and gateway; `stop()` ends every process group it started."""

    work_dir: Path
    procs: list = field(default_factory=list)
    workers: list = field(default_factory=list)
    gateway_url: str = ""
    gateway_admin: str = ""
    agent_metrics: str = ""
    agent_url: str = ""

    def spawn(self, name: str, argv: list, env: dict | None = None) -> Proc:
        log_path = self.work_dir / f"{name}.log"
        with open(log_path, "wb") as out:
            popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def wait_ready(self, proc: Proc, url: str, timeout_s: float, check=None) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
            try:
                r = requests.get(url, timeout=2)
                if r.status_code == 200 and (check is None or check(r.text)):
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proc.name} not ready at {url} after {timeout_s} s:\n{proc.tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                try:
                    os.killpg(proc.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.popen.wait()
        self.procs.clear()


def worker_env(args: argparse.Namespace) -> dict:
    """The workers' environment: `WORKER_ENV` plus the run's own (`args.worker_env`, e.g. the dev mode
    that serves `/reset_prefix_cache`)."""
    return {**WORKER_ENV, **getattr(args, "worker_env", {})}


def pinned(args: argparse.Namespace, index: int, argv: list) -> list:
    """`argv` on a core of its own (`args.pin_workers`): worker `index` on CPU `index` modulo the CPUs,
    at a raised priority (`nice -n -5`, root only), as each engine has a GPU of its own in a real fleet.
    Without it the two engines' processes and the machine's other work share both cores, and one
    engine's step can stall the other's for hundreds of milliseconds."""
    if not getattr(args, "pin_workers", False):
        return argv
    cpu = index % (os.cpu_count() or 1)
    prefix = ["taskset", "-c", str(cpu)]
    if os.geteuid() == 0:
        prefix += ["nice", "-n", "-5"]
    return prefix + argv


def write_yaml(path: Path, value: dict) -> None:
    # JSON is YAML; the Rust side reads it with serde_yaml.
    path.write_text(json.dumps(value, indent=2) + "\n")


def spawn_gateway(
    stack: Stack, args: argparse.Namespace, name: str, ports: tuple, extra: dict, profile: str | None = None
) -> Proc:
    """A gateway over the stack's workers on `ports` (listen, admin), its configuration `<name>.yaml`:
    the model (with its engine `profile`, if any), the workers, and `extra` (e.g. `routing`, `agents`)."""
    listen, admin = ports
    config = stack.work_dir / f"{name}.yaml"
    model = {"name": MODEL, "tokenizer_dir": str(args.tokenizer_dir)}
    if profile:
        model["profile"] = profile
    write_yaml(config, {"models": [model], "workers": [{"url": u, "model": MODEL} for u in stack.workers], **extra})
    return stack.spawn(
        name,
        [
            str(args.bin_dir / "kinference-gateway"),
            "--listen", f"127.0.0.1:{listen}",
            "--admin-listen", f"127.0.0.1:{admin}",
            "--config", str(config),
        ],
        env={"RUST_LOG": os.environ.get("RUST_LOG", "warn")},
    )


def start_gateway(stack: Stack, args: argparse.Namespace, name: str, extra: dict) -> str:
    """Another gateway over the running stack's workers (`extra`: its gateway.yaml keys beyond the
    workers and the model, e.g. `routing`, `agents`; no engine profile); returns its URL once every
    worker is healthy."""
    listen, admin = free_ports(2)
    proc = spawn_gateway(stack, args, name, (listen, admin), extra)
    stack.wait_ready(
        proc,
        f"http://127.0.0.1:{admin}/metrics",
        60,
        check=lambda text: metric_sum(text, "kinference_gateway_worker_healthy") >= len(stack.workers),
    )
    return f"http://127.0.0.1:{listen}"


def reset_caches(workers: list) -> None:
    """Every worker's prefix cache emptied (vLLM's dev mode endpoint); waits for the engines to idle."""
    for url in workers:
        for _ in range(20):
            r = requests.post(f"{url}/reset_prefix_cache", timeout=30)
            # vLLM refuses while requests still hold blocks; they finish within a second or two.
            if r.status_code == 200:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{url}/reset_prefix_cache kept failing: {r.status_code} {r.text[:200]}")


def start_stack(
    args: argparse.Namespace, mode: str, cache_blocks: int, work_dir: Path, gateway_extra: dict | None = None
) -> Stack:
    """Starts agent, workers and gateway and waits until all are ready; stops them all if one fails.
    `gateway_extra`: more top-level keys of the gateway's gateway.yaml (e.g. `tenancy`)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(work_dir)
    try:
        launch(stack, args, mode, cache_blocks, gateway_extra)
    except BaseException:
        stack.stop()
        raise
    return stack


def launch(
    stack: Stack, args: argparse.Namespace, mode: str, cache_blocks: int, gateway_extra: dict | None = None
) -> None:
    work_dir = stack.work_dir
    n = args.workers
    ports = free_ports(3 * n + 4)
    worker_ports = [ports[3 * i : 3 * i + 3] for i in range(n)]
    agent_grpc, agent_metrics, gw_listen, gw_admin = ports[3 * n :]
    stack.workers = [f"http://127.0.0.1:{p[0]}" for p in worker_ports]
    stack.agent_metrics = f"http://127.0.0.1:{agent_metrics}/metrics"
    stack.gateway_url = f"http://127.0.0.1:{gw_listen}"
    stack.gateway_admin = f"http://127.0.0.1:{gw_admin}"

    # The agent binds the SUB sockets; each vLLM connects to its own (an endpoint without `*` makes
    # vLLM's PUB connect), and binds its replay ROUTER. As a vLLM pod does towards a node-local agent.
    agent_yaml = work_dir / "agent-workers.yaml"
    write_yaml(
        agent_yaml,
        {
            "workers": [
                {
                    "url": url,
                    "model": MODEL,
                    "kv_events_endpoint": f"tcp://127.0.0.1:{p[1]}",
                    "kv_events_bind": True,
                    "kv_replay_endpoint": f"tcp://127.0.0.1:{p[2]}",
                    "kv_topic": f"kv@w{i + 1}@{MODEL}",
                }
                for i, (url, p) in enumerate(zip(stack.workers, worker_ports))
            ]
        },
    )
    agent = stack.spawn(
        "agent",
        [
            str(args.bin_dir / "kinference-agent"),
            "--grpc-listen", f"127.0.0.1:{agent_grpc}",
            "--metrics-listen", f"127.0.0.1:{agent_metrics}",
            "--workers", str(agent_yaml),
            "--node", "real-vllm-node",
        ],
        env={"RUST_LOG": os.environ.get("RUST_LOG", "warn")},
    )
    stack.wait_ready(agent, stack.agent_metrics, 30)

    worker_procs = []
    for i, p in enumerate(worker_ports):
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{p[1]}",
            "replay_endpoint": f"tcp://127.0.0.1:{p[2]}",
            "topic": f"kv@w{i + 1}@{MODEL}",
        }
        argv = [
            args.python, "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1",
            "--port", str(p[0]),
            "--model", str(args.model_dir),
            "--served-model-name", MODEL,
            "--dtype", getattr(args, "dtype", "bfloat16"),
            "--max-model-len", str(args.max_model_len),
            "--block-size", str(args.block_size),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv_events),
            "--seed", str(i),
        ]
        if cache_blocks > 0:
            argv += ["--num-gpu-blocks-override", str(cache_blocks)]
        if getattr(args, "max_num_batched_tokens", None):
            argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        worker_procs.append(stack.spawn(f"worker-{i + 1}", pinned(args, i, argv), env=worker_env(args)))

    stack.agent_url = f"http://127.0.0.1:{agent_grpc}"
    gateway = spawn_gateway(
        stack,
        args,
        "gateway",
        (gw_listen, gw_admin),
        {"agents": [stack.agent_url], "routing": mode, **(gateway_extra or {})},
        profile=getattr(args, "model_profile", None),
    )

    for proc, url in zip(worker_procs, stack.workers):
        stack.wait_ready(proc, f"{url}/health", args.ready_timeout)
    # Ready means: every worker healthy in the gateway's eyes and the agent's stream connected.
    stack.wait_ready(
        gateway,
        f"{stack.gateway_admin}/metrics",
        60,
        check=lambda text: metric_sum(text, "kinference_gateway_worker_healthy") >= n
        and metric_sum(text, "kinference_routing_agent_connected") >= 1,
    )


# --------------------------------------------------------------------------------------------------
# Metrics


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of `name` (all label sets) in a Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        rest = line[len(name) :]
        if rest.startswith("{"):
            rest = rest[rest.index("}") + 1 :]
        elif not rest.startswith(" "):
            continue  # a longer name, e.g. foo_total_created
        try:
            total += float(rest.split()[0])
        except (ValueError, IndexError):
            pass
    return total


def scrape(url: str) -> str:
    return requests.get(url, timeout=10).text


def cache_counters(workers: list) -> dict:
    hits = queries = 0.0
    for url in workers:
        text = scrape(f"{url}/metrics")
        hits += metric_sum(text, "vllm:prefix_cache_hits_total")
        queries += metric_sum(text, "vllm:prefix_cache_queries_total")
    return {"hits": hits, "queries": queries}


def percentile(values: list, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --------------------------------------------------------------------------------------------------
# One run


def run_mode(args, mode: str, cache_blocks: int, plan: list, work_dir: Path) -> dict:
    started = time.monotonic()
    log(f"{mode}: starting {args.workers} vLLM workers + agent + gateway (cache {cache_label(cache_blocks)})")
    for attempt in range(1, 4):
        try:
            stack = start_stack(args, mode, cache_blocks, work_dir / f"attempt-{attempt}")
            break
        except RuntimeError as e:
            # Typically a port taken between choosing and binding it: retry with fresh ports.
            log(f"{mode}: start-up attempt {attempt} failed: {str(e).splitlines()[0]}")
            if attempt == 3:
                raise
    try:
        startup_s = time.monotonic() - started
        log(f"{mode}: stack ready in {startup_s:.0f} s; warming up each worker directly")
        for url in stack.workers:
            # Shorter than one block, so nothing is cached; compiles the first-request paths.
            requests.post(
                f"{url}/v1/completions",
                json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                timeout=120,
            ).raise_for_status()
        before = cache_counters(stack.workers)
        log(f"{mode}: sending {len(plan)} requests, concurrency {args.concurrency}")
        outcomes: list = [None] * len(plan)
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            futures = {
                pool.submit(send, stack.gateway_url, req, args.max_tokens): i
                for i, req in enumerate(plan)
            }
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                outcomes[futures[future]] = future.result()
                if done % max(1, len(plan) // 8) == 0 or done == len(plan):
                    log(f"{mode}: {done}/{len(plan)} done")
        duration_s = time.monotonic() - t0
        time.sleep(1)  # the last scheduler steps' metrics
        after = cache_counters(stack.workers)
        gateway_metrics = scrape(f"{stack.gateway_admin}/metrics")
        agent_metrics = scrape(stack.agent_metrics)
    finally:
        stack.stop()

    ok = [o for o in outcomes if o.ok]
    errors = [o.error for o in outcomes if not o.ok]
    hits = after["hits"] - before["hits"]
    queries = after["queries"] - before["queries"]
    per_worker: dict = {}
    for o in ok:
        per_worker[o.worker] = per_worker.get(o.worker, 0) + 1
    # Which workers served each prefix: Kinference should keep a prefix on one worker.
    prefix_workers: dict = {}
    for req, o in zip(plan, outcomes):
        if o.ok:
            prefix_workers.setdefault(req.prefix, set()).add(o.worker)
    result = {
        "mode": mode,
        "requests": len(plan),
        "errors": len(errors),
        "first_errors": errors[:3],
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "hit_share": hits / queries if queries else 0.0,
        "client_prompt_tokens": sum(o.prompt_tokens for o in ok),
        "client_cached_tokens": sum(o.cached_tokens for o in ok),
        "ttfts_s": [round(o.ttft_s, 4) for o in ok],
        "median_ttft_s": statistics.median(o.ttft_s for o in ok) if ok else None,
        "p90_ttft_s": percentile([o.ttft_s for o in ok], 0.9),
        "median_e2e_s": statistics.median(o.e2e_s for o in ok) if ok else None,
        "duration_s": duration_s,
        "startup_s": startup_s,
        "requests_per_worker": dict(sorted(per_worker.items())),
        "workers_per_prefix": {str(k): len(v) for k, v in sorted(prefix_workers.items())},
        "prefixes_per_worker": {
            w: sum(1 for ws in prefix_workers.values() if w in ws) for w in sorted(per_worker)
        },
        "agent_block_events": metric_sum(agent_metrics, "kinference_agent_kv_block_events_total"),
        "agent_decode_errors": metric_sum(agent_metrics, "kinference_agent_kv_decode_errors_total"),
        "gateway_predicted_cached_tokens": metric_sum(
            gateway_metrics, "kinference_routing_predicted_cached_tokens_total"
        ),
    }
    log(
        f"{mode}: hits {hits:.0f} / queries {queries:.0f} tokens ({result['hit_share']:.1%}), "
        f"cached_tokens seen by clients {result['client_cached_tokens']}, "
        f"median TTFT {fmt_ms(result['median_ttft_s'])}, errors {len(errors)}"
    )
    return result


def cache_label(blocks: int) -> str:
    return f"{blocks} blocks per worker" if blocks > 0 else "default size (1 GiB per worker)"


def fmt_ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


# --------------------------------------------------------------------------------------------------
# Report


def provenance(bin_dir: Path) -> dict:
    """Which agent and gateway builds ran: their modification times and the checkout's commit."""
    out = {}
    for name in ("kinference-agent", "kinference-gateway"):
        path = bin_dir / name
        out[name] = time.strftime("built %Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        out["checkout"] = head
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


def summarise(blocks: int, runs: list, modes: list) -> dict:
    """Per mode over the repeats: mean hits, their range, TTFT over every request; and the ratios."""
    summary = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        hits = [r["prefix_cache_hits"] for r in mine]
        ttfts = [t for r in mine for t in r["ttfts_s"]]
        summary[mode] = {
            "runs": len(mine),
            "mean_hits": statistics.mean(hits),
            "min_hits": min(hits),
            "max_hits": max(hits),
            "mean_queries": statistics.mean(r["prefix_cache_queries"] for r in mine),
            "mean_client_cached_tokens": statistics.mean(r["client_cached_tokens"] for r in mine),
            "median_ttft_s": statistics.median(ttfts) if ttfts else None,
            "p90_ttft_s": percentile(ttfts, 0.9),
            "errors": sum(r["errors"] for r in mine),
        }
    scenario = {"cache_blocks": blocks, "cache": cache_label(blocks), "summary": summary, "runs": runs}
    kin, rnd = summary.get("kinference"), summary.get("random")
    if kin and rnd and rnd["mean_hits"] > 0:
        scenario["hits_ratio"] = kin["mean_hits"] / rnd["mean_hits"]
        by_repeat = {}
        for r in runs:
            by_repeat.setdefault(r["repeat"], {})[r["mode"]] = r["prefix_cache_hits"]
        scenario["hits_ratio_per_run"] = [
            v["kinference"] / v["random"]
            for _, v in sorted(by_repeat.items())
            if v.get("random") and "kinference" in v
        ]
        if kin["median_ttft_s"] and rnd["median_ttft_s"]:
            scenario["ttft_ratio"] = rnd["median_ttft_s"] / kin["median_ttft_s"]
    return scenario


def markdown(report: dict) -> str:
    w = report["workload"]
    lines = [
        "# Real vLLM: Kinference vs random routing",
        "",
        "```",
        report["command"],
        "```",
        "",
        f"{report['date']}. vLLM: `vllm-cpu` {report['vllm_version']} (lean mode, CPU), "
        f"{report['workers']} workers, model: tiny random Qwen2 built locally with the Qwen2 tokenizer, "
        f"block size {report['block_size']}. Agent {report['binaries'].get('kinference-agent', '')}, gateway "
        f"{report['binaries'].get('kinference-gateway', '')}, checkout "
        f"{report['binaries'].get('checkout', '?')}. Workload: {w['prefixes']} shared system prompts of about "
        f"{w['prefix_tokens']} tokens x {w['questions']} short questions = {w['requests']} streamed chat "
        f"completions (max_tokens {w['max_tokens']}), shuffled (seed {w['seed']}), concurrency "
        f"{w['concurrency']}, through the gateway. Every run starts a fresh stack (cold caches).",
        "",
        "`hits / queries`: vLLM's own `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` "
        "(tokens), summed over the workers. `cached tokens`: `usage.prompt_tokens_details.cached_tokens` "
        "summed over the responses the clients got. TTFT: client-side, through the gateway.",
        "",
        f"Upper bound of the hits (each system prompt on one worker, nothing evicted): "
        f"{report['hit_upper_bound']} tokens. {report['repeats']} runs per mode and KV-cache size, "
        "the modes' order alternating.",
        "",
        "## Summary",
        "",
        "| KV cache | routing | mean hits (tokens) | min - max | of the upper bound | mean hit share "
        "| median TTFT | p90 TTFT | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    bound = report["hit_upper_bound"]
    for s in report["scenarios"]:
        for mode, m in s["summary"].items():
            lines.append(
                f"| {s['cache']} | {mode} | {m['mean_hits']:.0f} | {m['min_hits']:.0f} - "
                f"{m['max_hits']:.0f} | {m['mean_hits'] / bound:.0%} | "
                f"{m['mean_hits'] / m['mean_queries']:.1%} | {fmt_ms(m['median_ttft_s'])} | "
                f"{fmt_ms(m['p90_ttft_s'])} | {m['errors']} |"
            )
    lines.append("")
    for s in report["scenarios"]:
        if s.get("hits_ratio") is None:
            continue
        per_run = ", ".join(f"{r:.2f}x" for r in s["hits_ratio_per_run"])
        ttft = f"; median TTFT random / Kinference {s['ttft_ratio']:.2f}x" if s.get("ttft_ratio") else ""
        lines.append(
            f"- {s['cache']}: Kinference / random prefix-cache hits **{s['hits_ratio']:.2f}x** "
            f"(per run: {per_run}){ttft}."
        )
    lines += [
        "",
        "## Every run",
        "",
        "| KV cache | run | routing | hits / queries (tokens) | hit share | cached tokens seen by clients "
        "| median TTFT | p90 TTFT | requests per worker | system prompts per worker | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in report["scenarios"]:
        for m in s["runs"]:
            spread = " / ".join(str(v) for v in m["requests_per_worker"].values())
            prompts = " / ".join(str(v) for v in m["prefixes_per_worker"].values())
            lines.append(
                f"| {s['cache']} | {m['repeat']} | {m['mode']} | {m['prefix_cache_hits']:.0f} / "
                f"{m['prefix_cache_queries']:.0f} | {m['hit_share']:.1%} | "
                f"{m['client_cached_tokens']} / {m['client_prompt_tokens']} | "
                f"{fmt_ms(m['median_ttft_s'])} | {fmt_ms(m['p90_ttft_s'])} | {spread} | {prompts} | "
                f"{m['errors']} |"
            )
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="python of the vLLM venv")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--bin-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True, help="logs and config files")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--cache-blocks",
        default="160,0",
        help="comma-separated per-worker KV-cache sizes in blocks, one scenario each (0: vLLM's default)",
    )
    parser.add_argument("--modes", default="kinference,random")
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--questions", type=int, default=12, help="questions per prefix")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode and cache size")
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--vllm-version", default="0.32.0")
    parser.add_argument("--command", default=" ".join(sys.argv), help="shown at the top of the report")
    parser.add_argument("--out", type=Path, required=True, help="results path without extension")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so every started process group is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.model_dir = args.model_dir.resolve()
    args.tokenizer_dir = args.tokenizer_dir.resolve()
    args.bin_dir = args.bin_dir.resolve()

    tokenizer = Tokenizer.from_file(str(args.tokenizer_dir / "tokenizer.json"))
    plan = workload(tokenizer, args)
    modes = args.modes.split(",")
    scenarios = []
    for blocks in (int(b) for b in args.cache_blocks.split(",")):
        runs = []
        for repeat in range(1, args.repeats + 1):
            # Alternate the order, so neither mode always runs first (the machine's load drifts).
            for mode in modes if repeat % 2 else modes[::-1]:
                work_dir = args.work_dir / f"cache-{blocks}-run{repeat}-{mode}"
                log(f"cache {cache_label(blocks)}, run {repeat}/{args.repeats}, {mode}")
                result = run_mode(args, mode, blocks, plan, work_dir)
                result["repeat"] = repeat
                runs.append(result)
        scenarios.append(summarise(blocks, runs, modes))
    report = {
        "command": args.command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "vllm": "vllm-cpu",
        "vllm_version": args.vllm_version,
        "workers": args.workers,
        "block_size": args.block_size,
        "model": "tiny random Qwen2 (2 layers, hidden 128, 2 heads x 64, vocab 151936, bf16)",
        "workload": {
            "prefixes": args.prefixes,
            "prefix_tokens": args.prefix_tokens,
            "questions": args.questions,
            "requests": len(plan),
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
        },
        "binaries": provenance(args.bin_dir),
        "hit_upper_bound": hit_upper_bound(tokenizer, plan, args.block_size),
        "repeats": args.repeats,
        "scenarios": scenarios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
