"""`vllm-sim`'s own `POST /v1/messages` (recent vLLM serves Anthropic's Messages API beside the OpenAI
one), with the official `anthropic` SDK straight at the worker: the peer a gateway passing Messages
requests through would talk to. Text turns and a system prompt, whole and streamed; usage as Anthropic
counts it, with the worker's prefix-cache hits in `cache_read_input_tokens`."""

from __future__ import annotations

import anthropic
import requests

from conftest import MODEL

SYSTEM = "You are a terse assistant."
TURNS = [
    {"role": "user", "content": "What is a KV cache? Explain it with an example, please."},
    {"role": "assistant", "content": [{"type": "text", "text": "It stores attention keys and values."}]},
    {"role": "user", "content": [{"type": "text", "text": "And why does prefix caching help"},
                                 {"type": "text", "text": "for chat workloads?"}]},
]
OPENAI_MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is a KV cache? Explain it with an example, please."},
    {"role": "assistant", "content": "It stores attention keys and values."},
    {"role": "user", "content": "And why does prefix caching help\nfor chat workloads?"},
]


def test_messages_whole_and_streamed(cluster):
    worker = cluster.worker()
    client = anthropic.Anthropic(base_url=worker.url, api_key="unused", max_retries=0, timeout=60)

    message = client.messages.create(model=MODEL, system=SYSTEM, messages=TURNS, max_tokens=6)
    assert message.role == "assistant" and message.model == MODEL
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 6
    # The same prompt as the chat route renders it, counted the same way.
    chat = requests.post(f"{worker.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": OPENAI_MESSAGES, "max_tokens": 6}).json()["usage"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat["prompt_tokens"]

    # Asked again, the prompt's full blocks come from the worker's prefix cache.
    with client.messages.stream(model=MODEL, system=SYSTEM, messages=TURNS, max_tokens=6) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text and text
    assert final.usage.output_tokens == 6
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == chat["prompt_tokens"]


def test_messages_errors_name_the_field(cluster):
    worker = cluster.worker()
    client = anthropic.Anthropic(base_url=worker.url, api_key="unused", max_retries=0, timeout=60)
    try:
        client.messages.create(model="no-such-model", messages=TURNS, max_tokens=6)
        raise AssertionError("an unknown model was served")
    except anthropic.NotFoundError:
        pass
    r = requests.post(f"{worker.url}/v1/messages", timeout=10,
                      json={"model": MODEL, "messages": TURNS})
    assert r.status_code == 400 and "max_tokens" in r.text


def test_gateway_passes_messages_through_to_workers_that_serve_them(cluster):
    """With `serves_messages: true` the gateway sends Anthropic requests to the worker's own
    `/v1/messages` as the client wrote them and relays the worker's answer as it is, whole and streamed,
    billing the usage the worker reports; without it, the same request is translated to the chat API."""
    serving, bare = cluster.worker(), cluster.worker("--no-messages-api")

    def client(gw):
        return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)

    through = cluster.gateway([serving], serves_messages=True)
    message = client(through).messages.create(model=MODEL, system=SYSTEM, messages=TURNS, max_tokens=6)
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    with client(through).messages.stream(model=MODEL, system=SYSTEM, messages=TURNS, max_tokens=6) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and text == final.content[0].text
    assert final.usage.output_tokens == 6 and final.usage.cache_read_input_tokens > 0
    # Both answers were billed from the worker's own usage.
    assert through.metric("kinference_gateway_output_tokens_total") == 12
    assert through.metric("kinference_gateway_input_tokens_total") == (
        message.usage.input_tokens + message.usage.cache_read_input_tokens
        + final.usage.input_tokens + final.usage.cache_read_input_tokens)

    # A worker without the route shows which way the request went: passed through, it meets the
    # worker's 404 (in Anthropic's shape); translated, the same request is served.
    wrongly = cluster.gateway([bare], serves_messages=True)
    try:
        client(wrongly).messages.create(model=MODEL, messages=TURNS, max_tokens=6)
        raise AssertionError("a worker without /v1/messages answered a passed-through request")
    except anthropic.NotFoundError:
        pass
    translated = cluster.gateway([bare])
    assert client(translated).messages.create(model=MODEL, messages=TURNS, max_tokens=6).content[0].text
