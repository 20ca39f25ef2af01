"""One command in front of running servers: `kinference-gateway --worker URL --worker ...` with no
configuration file learns the served model from each worker's `/v1/models` and serves the official
OpenAI and Anthropic SDKs across all three workers."""

from __future__ import annotations

import anthropic
import openai
import pytest

from conftest import BIN_DIR, MODEL, Cluster, Gateway, free_port, wait_for


@pytest.fixture(scope="module")
def flag_gateway(tmp_path_factory) -> Gateway:
    cluster = Cluster(tmp_path_factory.mktemp("worker-flag"))
    try:
        workers = [cluster.worker() for _ in range(3)]
        port, admin_port = free_port(), free_port()
        # No --config file exists under this name: the flags are the whole configuration.
        missing = cluster.workdir / "absent.yaml"
        argv = [str(BIN_DIR / "kinference-gateway"), "--listen", f"127.0.0.1:{port}",
                "--admin-listen", f"127.0.0.1:{admin_port}", "--config", str(missing)]
        for w in workers:
            argv += ["--worker", w.url]
        process = cluster._spawn(f"gateway-{port}", argv)
        gw = Gateway(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", process, workers)
        try:
            wait_for(f"{gw.admin}/readyz", proc=process.proc)
        except Exception:
            raise RuntimeError(f"gateway did not start:\n{process.log_tail()}")
        yield gw
    finally:
        cluster.close()


def test_models_are_learned_from_the_workers(flag_gateway):
    client = openai.OpenAI(base_url=flag_gateway.openai_base, api_key="unused", max_retries=0, timeout=60)
    assert MODEL in [m.id for m in client.models.list()]
    log = flag_gateway.process.log.read_text(errors="replace")
    for w in flag_gateway.workers:
        assert w.url in log and "routing signals" in log, log[-2000:]


def test_openai_sdk_is_routed_over_all_three_workers(flag_gateway):
    client = openai.OpenAI(base_url=flag_gateway.openai_base, api_key="unused", max_retries=0, timeout=60)
    urls = {w.url for w in flag_gateway.workers}
    for i in range(6):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=4,
            extra_headers={"x-kinference-debug": "1"})
        assert raw.headers["x-kinference-worker"] in urls
        # The router weighed all three learned workers (which one wins depends on its estimates).
        decision = raw.headers["x-kinference-decision"]
        assert all(url in decision for url in urls), decision
        assert raw.parse().choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream please"}], max_tokens=6, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_anthropic_sdk(flag_gateway):
    client = anthropic.Anthropic(base_url=flag_gateway.url, api_key="unused", max_retries=0, timeout=60)
    message = client.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello there"}])
    assert message.content[0].text and message.usage.input_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=8,
                                messages=[{"role": "user", "content": "Stream to me"}]) as stream:
        assert "".join(stream.text_stream)


def test_an_unreachable_worker_is_a_start_up_error(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        dead = f"http://127.0.0.1:{free_port()}"
        process = cluster._spawn("gateway-dead", [
            str(BIN_DIR / "kinference-gateway"), "--listen", f"127.0.0.1:{free_port()}",
            "--admin-listen", f"127.0.0.1:{free_port()}", "--config", str(tmp_path / "absent.yaml"),
            "--worker", dead])
        assert process.proc.wait(timeout=30) != 0
        assert f"--worker {dead}: GET /v1/models failed" in process.log.read_text(errors="replace")
    finally:
        cluster.close()
