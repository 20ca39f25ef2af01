"""Overload through the official SDKs: a request past the gateway's in-flight limit surfaces as each
SDK's own 503 error (OpenAI `overloaded`, Anthropic `overloaded_error`) with `Retry-After`, and is
served again as soon as the slot is free."""

from __future__ import annotations

import socket
import time

import anthropic
import openai
import pytest

from conftest import MODEL, Gateway

MSG = [{"role": "user", "content": "Hello there"}]


def oai(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key="unused", max_retries=0, timeout=30)


def ant(gw: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=30)


def hold_the_slot(gw: Gateway) -> socket.socket:
    """A request that sends its head and half its body: it holds the one in-flight slot."""
    host, port = gw.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    body = b'{"model":"%s","max_tokens":1,"messages":[]}' % MODEL.encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body))
    s.sendall(head + body[: len(body) // 2])
    return s


def test_past_the_in_flight_limit_each_sdk_gets_its_overload_error(cluster):
    worker = cluster.worker()
    gw = cluster.gateway([worker], "--max-in-flight", "1", "--overload-queue-timeout-ms", "0",
                         "--body-read-timeout-ms", "1500", "--overload-retry-after-seconds", "2")
    held = hold_the_slot(gw)
    deadline = time.monotonic() + 5
    while gw.metric("kinference_gateway_overload_in_flight") < 1:
        assert time.monotonic() < deadline, "the slow body never took the slot"
        time.sleep(0.05)

    with pytest.raises(openai.InternalServerError) as e:
        oai(gw).chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    assert e.value.status_code == 503
    assert e.value.body["code"] == "overloaded"
    assert e.value.response.headers["retry-after"] == "2"
    with pytest.raises(anthropic.InternalServerError) as e:
        ant(gw).messages.create(model=MODEL, max_tokens=2, messages=MSG)
    assert e.value.status_code == 503
    assert e.value.body["error"]["type"] == "overloaded_error"
    assert e.value.response.headers["retry-after"] == "2"
    assert gw.metric("kinference_gateway_shed_total", reason="queue_full", priority="medium") == 2

    # The slow body times out (408) and frees the slot: both SDKs are served again.
    answer = held.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    held.close()
    assert oai(gw).chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).choices
    assert ant(gw).messages.create(model=MODEL, max_tokens=2, messages=MSG).content is not None
