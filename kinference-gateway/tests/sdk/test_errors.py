"""Bad input and faults come back as each SDK's own exception types, with the right statuses; a worker
killed mid-stream ends the stream with an error event and leaks no in-flight count."""

from __future__ import annotations

import socket
import threading
import time

import anthropic
import openai
import pytest
import requests

from conftest import MODEL, Gateway

MSG = [{"role": "user", "content": "Hello there"}]


def oai(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key="unused", max_retries=0, timeout=60)


def ant(gw: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# --- bad input (shared cluster) ---------------------------------------------------------------

def test_openai_bad_field_is_bad_request(gateway):
    with pytest.raises(openai.BadRequestError) as e:
        oai(gateway).chat.completions.create(model=MODEL, messages=[])
    assert e.value.body["param"] == "messages"


def test_openai_unknown_model_is_not_found(gateway):
    with pytest.raises(openai.NotFoundError) as e:
        oai(gateway).chat.completions.create(model="no-such-model", messages=MSG)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        oai(gateway).completions.create(model="no-such-model", prompt="x")


def test_openai_oversized_body_is_413(gateway):
    with pytest.raises(openai.APIStatusError) as e:
        oai(gateway).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x" * (5 * 1024 * 1024)}])
    assert e.value.status_code == 413


def test_anthropic_bad_fields_are_bad_request(gateway):
    with pytest.raises(anthropic.BadRequestError) as e:
        ant(gateway).messages.create(model=MODEL, max_tokens=0, messages=MSG)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        ant(gateway).messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "AAAA"}}]}])
    assert "document" in e.value.body["error"]["message"]


def test_anthropic_missing_max_tokens_is_bad_request(gateway):
    r = requests.post(f"{gateway.url}/v1/messages", json={"model": MODEL, "messages": MSG}, timeout=10)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "max_tokens: Field required"}}


def test_anthropic_malformed_json(gateway):
    r = requests.post(f"{gateway.url}/v1/messages", data=b"{", timeout=10)
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_anthropic_unknown_model_is_not_found(gateway):
    with pytest.raises(anthropic.NotFoundError) as e:
        ant(gateway).messages.create(model="no-such-model", max_tokens=5, messages=MSG)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_anthropic_oversized_body_is_413(gateway):
    with pytest.raises(anthropic.APIStatusError) as e:
        ant(gateway).messages.create(model=MODEL, max_tokens=5,
                                     messages=[{"role": "user", "content": "x" * (5 * 1024 * 1024)}])
    assert e.value.status_code == 413


# --- faults (private clusters) -----------------------------------------------------------------

def test_no_healthy_worker_is_503(cluster):
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    gw = cluster.gateway([], "--health-interval-ms", "100", extra_worker_urls=(dead,), wait_ready=False)
    # Worker health is reported apart from readiness: the gateway itself stays ready (it answers 503).
    assert wait_until(lambda: requests.get(f"{gw.admin}/healthz/workers", timeout=2).json()["healthy"] == 0)
    assert requests.get(f"{gw.admin}/readyz", timeout=2).status_code == 200
    with pytest.raises(openai.InternalServerError) as e:
        oai(gw).chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
    assert e.value.status_code == 503
    with pytest.raises(anthropic.InternalServerError) as e:
        ant(gw).messages.create(model=MODEL, max_tokens=3, messages=MSG)
    assert e.value.status_code == 503
    assert e.value.body["error"]["type"] == "overloaded_error"


def test_refused_connections_are_502_then_503(cluster):
    worker = cluster.worker()
    # Slow probes, so that the request (not the prober) is the first to meet the dead worker.
    gw = cluster.gateway([worker], "--health-interval-ms", "600000")
    worker.process.kill()
    # One refusal is no ejection: each of the first three (--health-unhealthy-threshold) gets 502.
    for _ in range(3):
        with pytest.raises(openai.InternalServerError) as e:
            oai(gw).chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
        assert e.value.status_code == 502
    # The third consecutive refusal ejected the worker: now nothing can serve the model.
    with pytest.raises(anthropic.InternalServerError) as e:
        ant(gw).messages.create(model=MODEL, max_tokens=3, messages=MSG)
    assert e.value.status_code == 503
    workers = requests.get(f"{gw.admin}/healthz/workers", timeout=2).json()
    assert workers["healthy"] == 0 and [w["healthy"] for w in workers["workers"]] == [False], workers
    assert [w["state"] for w in workers["workers"]] == ["ejected"], workers
    assert requests.get(f"{gw.admin}/readyz", timeout=2).status_code == 200


def test_refused_connection_retries_on_another_worker(cluster):
    a, b = cluster.worker(), cluster.worker()
    gw = cluster.gateway([a, b], "--health-interval-ms", "600000")
    a.process.kill()
    # Two idle workers tie, and a tie is broken at random: send until one pick has landed on the dead
    # worker (a run of 20 picks of the live one has odds of 1 in a million). Every answer comes from b.
    for _ in range(20):
        raw = oai(gw).chat.completions.with_raw_response.create(model=MODEL, messages=MSG, max_tokens=2)
        assert raw.headers["x-kinference-worker"] == b.url
        if gw.metric("kinference_gateway_upstream_retries_total") >= 1:
            break
    assert gw.metric("kinference_gateway_upstream_retries_total") >= 1
    # A single refusal counts toward the ejection threshold; it does not eject by itself.
    if gw.metric("kinference_gateway_upstream_retries_total") < 3:
        assert gw.metric("kinference_gateway_worker_healthy", worker=a.url) == 1
        workers = requests.get(f"{gw.admin}/healthz/workers", timeout=2).json()["workers"]
        assert {w["url"]: w["state"] for w in workers} == {a.url: "healthy", b.url: "healthy"}, workers


class ClosingWorker:
    """A worker that is going away: it passes health probes, but closes every connection that carries a
    request without answering (what a worker shutting down does to a gateway's pooled connections)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.broken = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                head = conn.recv(65536)
                if head.startswith(b"GET "):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                else:
                    self.broken += 1

    def close(self) -> None:
        self.server.close()


def test_connection_broken_before_answering_retries_on_another_worker(cluster):
    good, closing = cluster.worker(), ClosingWorker()
    try:
        gw = cluster.gateway([good], extra_worker_urls=(closing.url,))
        # Two idle workers tie and a tie is broken at random: send until a pick has landed on the closing
        # worker. Every request succeeds, answered by the good worker.
        for _ in range(20):
            raw = oai(gw).chat.completions.with_raw_response.create(model=MODEL, messages=MSG, max_tokens=2)
            assert raw.headers["x-kinference-worker"] == good.url
            if closing.broken >= 1:
                break
        assert closing.broken >= 1
        assert gw.metric("kinference_gateway_upstream_retries_total") == closing.broken
        assert gw.metric("kinference_gateway_requests_total", status="502") == 0
    finally:
        closing.close()


def test_upstream_timeout_is_504(cluster):
    worker = cluster.worker()
    gw = cluster.gateway([worker], "--first-byte-timeout-ms", "1")
    with pytest.raises(openai.InternalServerError) as e:
        oai(gw).chat.completions.create(model=MODEL, messages=MSG, max_tokens=2000)
    assert e.value.status_code == 504
    with pytest.raises(anthropic.APIStatusError) as e:
        ant(gw).messages.create(model=MODEL, max_tokens=2000, messages=MSG)
    assert e.value.status_code == 504


LONG = 4000  # tokens: a generation that is still running when the worker is killed


def test_worker_killed_mid_stream_openai(cluster):
    worker = cluster.worker()
    gw = cluster.gateway([worker])
    stream = oai(gw).chat.completions.create(model=MODEL, messages=MSG, max_tokens=LONG, stream=True)
    received = 0
    with pytest.raises(openai.APIError) as e:
        for chunk in stream:
            received += 1
            if received == 3:
                assert gw.metric("kinference_gateway_requests_in_flight") == 1
                worker.process.kill()
    assert received < LONG
    assert "worker" in str(e.value.message)
    assert wait_until(lambda: gw.metric("kinference_gateway_requests_in_flight") == 0)
    assert gw.metric("kinference_gateway_requests_total", status="502", protocol="openai") == 1


def test_worker_killed_mid_stream_anthropic(cluster):
    worker = cluster.worker()
    gw = cluster.gateway([worker])
    received = 0
    with pytest.raises(anthropic.APIStatusError) as e:
        with ant(gw).messages.stream(model=MODEL, max_tokens=LONG, messages=MSG) as stream:
            for _ in stream.text_stream:
                received += 1
                if received == 3:
                    worker.process.kill()
    assert received < LONG
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "api_error"
    assert wait_until(lambda: gw.metric("kinference_gateway_requests_in_flight") == 0)


def test_client_abandoning_a_stream_leaks_nothing(gateway):
    stream = oai(gateway).chat.completions.create(model=MODEL, messages=MSG, max_tokens=LONG, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    assert wait_until(lambda: gateway.metric("kinference_gateway_requests_in_flight") == 0)
    assert wait_until(lambda: gateway.metric("kinference_gateway_requests_total", status="499") >= 1)
