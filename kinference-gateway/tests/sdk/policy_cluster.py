"""Helpers for the policy tests: the stand-in provider process, a policy directory, and a gateway
started with `policy_dir` (its pools' endpoints are the workers; no `workers:` list).

Everything runs on loopback; processes are started through `conftest.Cluster` so they are killed at
teardown.
"""

from __future__ import annotations

import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import requests

from conftest import BIN_DIR, MODEL, TOKENIZER_DIR, Cluster, Gateway, free_port, wait_for

HERE = Path(__file__).resolve().parent
KEY_ENV = "KINFERENCE_STANDIN_KEY"
KEY = "sk-standin-test-key"


@dataclass
class StandIn:
    """The stand-in provider: OpenAI and Anthropic APIs under `{url}/v1`."""

    url: str

    @property
    def base(self) -> str:
        return f"{self.url}/v1"

    def requests(self) -> list[dict]:
        return requests.get(f"{self.url}/_requests", timeout=5).json()["requests"]

    def reset(self) -> None:
        requests.post(f"{self.url}/_reset", timeout=5).raise_for_status()


def start_standin(cluster: Cluster, delay_ms: float = 0.0) -> StandIn:
    port = free_port()
    process = cluster._spawn(f"standin-{port}", [
        sys.executable, str(HERE / "standin_provider.py"), "--port", str(port), "--key", KEY,
        "--delay-ms", str(delay_ms),
    ])
    url = f"http://127.0.0.1:{port}"
    wait_for(f"{url}/health", proc=process.proc)
    return StandIn(url)


def model_yaml(name: str = MODEL, classes: tuple[str, ...] = ("general",), served: str | None = None) -> str:
    return textwrap.dedent(f"""\
        apiVersion: kinference.ai/v1alpha1
        kind: InferenceModel
        metadata: {{name: {name}}}
        spec:
          servedName: {served or name}
          classes: [{", ".join(classes)}]
          tokenizer: {{dir: "{TOKENIZER_DIR}"}}
        """)


def pool_yaml(name: str, urls: list[str], model: str = MODEL, uncached: float = 0.1, cached: float = 0.01) -> str:
    endpoints = ", ".join(f'{{url: "{u}"}}' for u in urls)
    return textwrap.dedent(f"""\
        apiVersion: kinference.ai/v1alpha1
        kind: InferencePool
        metadata: {{name: {name}}}
        spec:
          models: [{model}]
          gpuClass: sim
          locality: Local
          endpoints: [{endpoints}]
          prices: {{cachedInputPerMillion: {cached}, uncachedInputPerMillion: {uncached}, outputPerMillion: 0.4}}
        """)


def provider_yaml(name: str, standin: StandIn, style: str, substitutes: str = MODEL) -> str:
    return textwrap.dedent(f"""\
        apiVersion: kinference.ai/v1alpha1
        kind: InferenceProvider
        metadata: {{name: {name}}}
        spec:
          baseUrl: {standin.base}
          apiStyle: {style}
          credentials: {{env: {KEY_ENV}}}
          timeoutSeconds: 30
          models:
            - name: {name}-model
              substitutes: [{substitutes}]
          prices: {{cachedInputPerMillion: 0.1, uncachedInputPerMillion: 1.0, outputPerMillion: 4.0}}
        """)


def write_dir(directory: Path, files: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def start_gateway(cluster: Cluster, policy_dir: Path, *, routing: str = "kinference",
                  load_interval_ms: int = 200, reload_interval_ms: int = 100,
                  wait_ready: bool = True, extra_yaml: str = "") -> Gateway:
    """A gateway whose workers are the pools' endpoints (no `workers:` list in its YAML); `extra_yaml`
    is appended to its configuration (e.g. a `tenancy:` block)."""
    os.environ[KEY_ENV] = KEY  # the gateway inherits it: the providers' credentials (local mode)
    port, admin_port = free_port(), free_port()
    config = cluster.workdir / f"gateway-{port}.yaml"
    config.write_text(textwrap.dedent(f"""\
        models:
          - name: {MODEL}
            tokenizer_dir: {TOKENIZER_DIR}
        routing: {routing}
        policy_dir: {policy_dir}
        policy_reload_interval_ms: {reload_interval_ms}
        policy_load_interval_ms: {load_interval_ms}
        """) + extra_yaml)
    process = cluster._spawn(f"gateway-{port}", [
        str(BIN_DIR / "kinference-gateway"), "--listen", f"127.0.0.1:{port}",
        "--admin-listen", f"127.0.0.1:{admin_port}", "--config", str(config),
    ])
    gw = Gateway(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", process, [])
    try:
        wait_for(f"{gw.admin}/{'readyz' if wait_ready else 'healthz'}", proc=process.proc)
    except Exception:
        raise RuntimeError(f"gateway did not start:\n{process.log_tail()}")
    return gw


def start_sim(cluster: Cluster, preset: str = "fast", *extra: str, model: str = MODEL) -> str:
    """A `vllm-sim` worker with the given preset (conftest's `Cluster.worker` fixes `fast`); its URL."""
    port = free_port()
    process = cluster._spawn(f"vllm-sim-{port}", [
        str(BIN_DIR / "vllm-sim"), "--host", "127.0.0.1", "--port", str(port), "--model", model,
        "--tokenizer-dir", str(TOKENIZER_DIR), "--preset", preset, *extra,
    ])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(f"{url}/health", proc=process.proc)
    except Exception:
        raise RuntimeError(f"vllm-sim did not start:\n{process.log_tail()}")
    return url


def sim_waiting(url: str) -> float:
    """`vllm:num_requests_waiting` of a worker."""
    for line in requests.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:num_requests_waiting{") or line.startswith("vllm:num_requests_waiting "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
