"""The official `anthropic` SDK through the gateway: messages with a system prompt and several turns,
streaming and not; usage equals the worker's for the translated request."""

from __future__ import annotations

import anthropic
import requests

from conftest import MODEL, Gateway

SYSTEM = "You are a terse assistant."
TURNS = [
    {"role": "user", "content": "What is a KV cache?"},
    {"role": "assistant", "content": [{"type": "text", "text": "It stores attention keys and values."}]},
    {"role": "user", "content": [{"type": "text", "text": "And why does prefix caching help"},
                                 {"type": "text", "text": "for chat workloads?"}]},
]
# What the gateway sends the worker for SYSTEM + TURNS (text blocks joined by newlines, as vLLM does).
OPENAI_MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is a KV cache?"},
    {"role": "assistant", "content": "It stores attention keys and values."},
    {"role": "user", "content": "And why does prefix caching help\nfor chat workloads?"},
]


def client(gw: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)


def worker_usage(gw: Gateway, worker: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": OPENAI_MESSAGES, "max_tokens": max_tokens}
    r = requests.post(f"{worker}/v1/chat/completions", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["usage"]


def warm(gw: Gateway, max_tokens: int) -> None:
    for w in gw.workers:
        worker_usage(gw, w.url, max_tokens)


def assert_same_usage(usage, worker: dict) -> None:
    cached = (worker.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    # Anthropic's input_tokens excludes the tokens read from the cache.
    assert usage.input_tokens + usage.cache_read_input_tokens == worker["prompt_tokens"]
    assert usage.cache_read_input_tokens == cached
    assert usage.output_tokens == worker["completion_tokens"]


def test_messages_non_stream(gateway):
    warm(gateway, 9)
    raw = client(gateway).messages.with_raw_response.create(
        model=MODEL, max_tokens=9, system=SYSTEM, messages=TURNS)
    worker = raw.headers["x-kinference-worker"]
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason == "max_tokens"
    assert_same_usage(message.usage, worker_usage(gateway, worker, 9))


def test_messages_system_as_blocks(gateway):
    message = client(gateway).messages.create(
        model=MODEL, max_tokens=3, system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": "Hi"}], stop_sequences=["\n\nUser:"],
        extra_body={"temperature": 0.0, "top_k": 5})
    assert message.usage.output_tokens == 3
    assert message.stop_reason == "max_tokens"


def test_messages_stream_event_sequence_and_usage(gateway):
    warm(gateway, 8)
    with client(gateway).messages.stream(
        model=MODEL, max_tokens=8, system=SYSTEM, messages=TURNS
    ) as stream:
        worker = stream.response.headers["x-kinference-worker"]
        events = [event.type for event in stream]
        final = stream.get_final_message()
    raw_types = [t for t in events if t not in ("text",)]
    assert raw_types[:3] == ["message_start", "content_block_start", "ping"] or \
        raw_types[:2] == ["message_start", "content_block_start"]
    assert raw_types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert raw_types.count("content_block_delta") >= 1
    assert final.content[0].text
    assert final.stop_reason == "max_tokens"
    assert_same_usage(final.usage, worker_usage(gateway, worker, 8))


def test_raw_event_sequence_is_exact(gateway):
    """Without the SDK: the exact event names, in order."""
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    with requests.post(f"{gateway.url}/v1/messages", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        names = [line[len("event: "):] for line in r.iter_lines(decode_unicode=True)
                 if line and line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    deltas = names[3:-3]
    assert deltas and set(deltas) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
