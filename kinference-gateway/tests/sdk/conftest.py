"""End-to-end fixtures: real `vllm-sim` workers and a real `kinference-gateway` on free loopback ports.

Binaries come from `$KINFERENCE_BIN_DIR` (default: `<repo>/target/debug`), the tokenizer from
`$KINFERENCE_TOKENIZER_DIR` (default: `<repo>/.assets/qwen2`). Nothing is built here: run
`cargo build -p kinference-bench -p kinference-gateway` first. Every process started is killed at teardown.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[3]
BIN_DIR = Path(os.environ.get("KINFERENCE_BIN_DIR", REPO / "target" / "debug"))
TOKENIZER_DIR = Path(os.environ.get("KINFERENCE_TOKENIZER_DIR", REPO / ".assets" / "qwen2"))
MODEL = "qwen2-sim"


# Ports for the processes a test starts are handed out in turn from below the kernel's ephemeral range
# (32768-60999) and above the well-known services. A port from `bind(0)` is an ephemeral one: once
# given back, it can become the local port of any outgoing connection (a readiness poll, a gateway's
# probe of its workers) before the process it was meant for binds it, which then fails with "Address
# already in use" (seen once in CI). Nothing takes a port of this range unasked. Kubernetes' NodePorts
# (30000-32767) are left out too.
_PORTS = range(20000, 30000)
_next_port = random.randrange(len(_PORTS))


def free_port() -> int:
    """A loopback port that nothing listens on now and that no earlier call of this process handed out
    (until the range wraps)."""
    global _next_port
    for _ in range(len(_PORTS)):
        port = _PORTS[_next_port % len(_PORTS)]
        _next_port += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


def wait_for(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            r = requests.get(url, timeout=1)
            if r.status_code == 200:
                return
            last = r.status_code
        except requests.RequestException as e:  # not listening yet
            last = e
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout}s (last: {last})")


@dataclass
class Process:
    name: str
    proc: subprocess.Popen
    log: Path

    def kill(self) -> None:
        """SIGKILL: the process dies without closing anything gracefully."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Worker:
    url: str
    process: Process


@dataclass
class Gateway:
    url: str
    admin: str
    process: Process
    workers: list[Worker] = field(default_factory=list)

    @property
    def openai_base(self) -> str:
        return f"{self.url}/v1"

    def metrics(self) -> str:
        return requests.get(f"{self.admin}/metrics", timeout=5).text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith("#"):
                continue
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)", line)
            if not m or m.group(1) != name:
                continue
            found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(m.group(4))
        return total


class Cluster:
    """Starts processes and guarantees they are killed (also when a test fails)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.processes: list[Process] = []

    def _spawn(self, name: str, argv: list[str]) -> Process:
        binary = Path(argv[0])
        if not binary.exists():
            pytest.fail(f"{binary} not found: build it first (cargo build -p kinference-bench -p kinference-gateway) "
                        f"or set KINFERENCE_BIN_DIR")
        log = self.workdir / f"{name}.log"
        # No endpoints to take a gateway out of here: it closes its ports at once on SIGTERM (default 5 s).
        env = {"KINFERENCE_SHUTDOWN_DELAY_SECONDS": "0", **os.environ}
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        process = Process(name, proc, log)
        self.processes.append(process)
        return process

    def worker(self, *extra: str) -> Worker:
        if not (TOKENIZER_DIR / "tokenizer.json").exists():
            pytest.fail(f"tokenizer missing in {TOKENIZER_DIR}: run `cargo xtask setup`")
        port = free_port()
        process = self._spawn(f"vllm-sim-{port}", [
            str(BIN_DIR / "vllm-sim"), "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
            "--tokenizer-dir", str(TOKENIZER_DIR), "--preset", "fast", *extra,
        ])
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(f"{url}/health", proc=process.proc)
        except Exception:
            raise RuntimeError(f"vllm-sim did not start:\n{process.log_tail()}")
        return Worker(url, process)

    def gateway(self, workers: list[Worker], *flags: str, extra_worker_urls: tuple[str, ...] = (),
                wait_ready: bool = True, tokenizer: bool = True, serves_messages: bool = False) -> Gateway:
        """A gateway in front of `workers`; `tokenizer=False` configures the model without its tokenizer,
        `serves_messages=True` says its workers serve Anthropic's `/v1/messages` themselves."""
        port, admin_port = free_port(), free_port()
        config = self.workdir / f"gateway-{port}.yaml"
        tokenizer_line = f"\n    tokenizer_dir: {TOKENIZER_DIR}" if tokenizer else ""
        if serves_messages:
            tokenizer_line += "\n    serves_messages: true"
        lines = [f"models:\n  - name: {MODEL}{tokenizer_line}\nworkers:"]
        for url in [w.url for w in workers] + list(extra_worker_urls):
            lines.append(f"  - url: {url}\n    model: {MODEL}")
        lines.append("routing: least-outstanding")
        config.write_text("\n".join(lines) + "\n")
        process = self._spawn(f"gateway-{port}", [
            str(BIN_DIR / "kinference-gateway"), "--listen", f"127.0.0.1:{port}",
            "--admin-listen", f"127.0.0.1:{admin_port}", "--config", str(config), *flags,
        ])
        gw = Gateway(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", process, list(workers))
        try:
            wait_for(f"{gw.admin}/{'readyz' if wait_ready else 'healthz'}", proc=process.proc)
        except Exception:
            raise RuntimeError(f"gateway did not start:\n{process.log_tail()}")
        return gw

    def close(self) -> None:
        for process in reversed(self.processes):
            process.stop()


@pytest.fixture(scope="session")
def session_cluster():
    with tempfile.TemporaryDirectory(prefix="kinference-sdk-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            yield cluster
        finally:
            cluster.close()


@pytest.fixture(scope="session")
def gateway(session_cluster) -> Gateway:
    """Two simulated workers behind one gateway, shared by the tests that do not break anything."""
    workers = [session_cluster.worker(), session_cluster.worker()]
    return session_cluster.gateway(workers)


@pytest.fixture
def cluster(tmp_path):
    """A private cluster for tests that kill processes."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
