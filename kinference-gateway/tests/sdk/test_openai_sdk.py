"""The official `openai` SDK through the gateway: chat and completions, streaming and not, with usage
figures equal to what the worker itself reports for the same request."""

from __future__ import annotations

import openai
import pytest
import requests

from conftest import MODEL, Gateway

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Explain prefix caching in one paragraph, please, with an example."},
]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key="unused", max_retries=0, timeout=60)


def direct(url: str, path: str, body: dict) -> dict:
    r = requests.post(f"{url}{path}", json=body, timeout=60)
    r.raise_for_status()
    return r.json()


def warm(gw: Gateway, path: str, body: dict) -> None:
    """Sends the request to every worker directly, so that whichever worker the gateway picks has the
    same cache state as the direct call that follows it."""
    for w in gw.workers:
        direct(w.url, path, body)


def cached(usage) -> int | None:
    details = getattr(usage, "prompt_tokens_details", None)
    return getattr(details, "cached_tokens", None) if details is not None else None


def assert_same_usage(gateway_usage, worker_usage: dict) -> None:
    assert gateway_usage.prompt_tokens == worker_usage["prompt_tokens"]
    assert gateway_usage.completion_tokens == worker_usage["completion_tokens"]
    assert gateway_usage.total_tokens == worker_usage["total_tokens"]
    assert cached(gateway_usage) == (worker_usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def test_models_list(gateway):
    ids = [m.id for m in client(gateway).models.list()]
    assert MODEL in ids


def test_chat_non_stream(gateway):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12}
    warm(gateway, "/v1/chat/completions", body)
    raw = client(gateway).chat.completions.with_raw_response.create(**body)
    worker = raw.headers["x-kinference-worker"]
    assert worker in [w.url for w in gateway.workers]
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 12
    assert_same_usage(completion.usage, direct(worker, "/v1/chat/completions", body)["usage"])


def test_chat_stream_with_usage(gateway):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10}
    warm(gateway, "/v1/chat/completions", body)
    with client(gateway).chat.completions.with_streaming_response.create(
        **body, stream=True, stream_options={"include_usage": True}
    ) as response:
        worker = response.headers["x-kinference-worker"]
        chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.completion_tokens == 10
    assert_same_usage(usage, direct(worker, "/v1/chat/completions", body)["usage"])


def test_chat_stream_without_usage_hides_the_usage_chunk(gateway):
    stream = client(gateway).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, stream=True
    )
    chunks = list(stream)
    assert chunks and all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_non_stream(gateway):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}
    warm(gateway, "/v1/completions", body)
    raw = client(gateway).completions.with_raw_response.create(**body)
    worker = raw.headers["x-kinference-worker"]
    completion = raw.parse()
    assert completion.choices[0].text
    assert completion.usage.completion_tokens == 8
    assert_same_usage(completion.usage, direct(worker, "/v1/completions", body)["usage"])


def test_completions_stream(gateway):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 7}
    warm(gateway, "/v1/completions", body)
    with client(gateway).completions.with_streaming_response.create(
        **body, stream=True, stream_options={"include_usage": True}
    ) as response:
        worker = response.headers["x-kinference-worker"]
        chunks = list(response.parse())
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 7
    assert_same_usage(usage, direct(worker, "/v1/completions", body)["usage"])


def test_gateway_metrics_count_tokens(gateway):
    before = gateway.metric("kinference_gateway_output_tokens_total", model=MODEL)
    client(gateway).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    after = gateway.metric("kinference_gateway_output_tokens_total", model=MODEL)
    assert after - before == 4
    assert gateway.metric("kinference_gateway_requests_total", model=MODEL, status="200", protocol="openai") >= 1
    assert gateway.metric("kinference_gateway_time_to_first_token_seconds_count", model=MODEL) >= 1
    assert gateway.metric("kinference_gateway_requests_in_flight") == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_json_is_an_openai_400(gateway, path):
    r = requests.post(f"{gateway.url}{path}", data=b'{"model": "x",', timeout=10,
                      headers={"content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
