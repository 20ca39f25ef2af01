"""The official `anthropic` SDK through the gateway to `vllm-sim` workers with tools, images, thinking and
`count_tokens`; the `openai` SDK with tools through the chat API.

`vllm-sim` calls a tool by a fixed rule (`bench/src/sim/api/tools.rs`): with `tool_choice` auto it calls
the tool the last user message names, with arguments from its `key=value` words, and after a tool
result it answers in text. So a conversation here is: the user names `get_weather` with `city=Paris`,
the model calls it, the client sends the result, the model answers.
"""

from __future__ import annotations

import base64
import json

import anthropic
import openai
import pytest
import requests

from conftest import MODEL, Gateway

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CLOCK = {
    "name": "get_time",
    "description": "The current time in a time zone.",
    "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
}
ASK = {"role": "user", "content": "What is the weather like? Please call get_weather with city=Paris."}
# The smallest valid PNG (1x1, transparent).
PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c63000100000500010d0a2db40000000049454e44ae426082")).decode()


def client(gw: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)


def oai(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key="unused", max_retries=0, timeout=60)


def prompt_tokens(usage) -> int:
    """The worker's prompt_tokens: Anthropic's input_tokens exclude those read from the cache."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def result_turn(tool_use, text: str, **extra) -> dict:
    return {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": tool_use.id, "content": text, **extra}]}


def test_tool_conversation_non_stream(gateway):
    ant = client(gateway)
    first = ant.messages.create(model=MODEL, max_tokens=64, tools=[CLOCK, WEATHER], messages=[ASK])
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and all(b.type != "text" for b in first.content)
    call = calls[0]
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    assert call.id

    # The whole assistant message goes back as the SDK returned it, then the tool's result.
    history = [ASK, {"role": "assistant", "content": first.content}, result_turn(call, "18 C and sunny")]
    final = ant.messages.create(model=MODEL, max_tokens=6, tools=[CLOCK, WEATHER], messages=history)
    assert final.stop_reason == "max_tokens"
    assert [b.type for b in final.content] == ["text"] and final.content[0].text
    # The second prompt holds the first (and the call and its result): it is longer.
    assert prompt_tokens(final.usage) > prompt_tokens(first.usage)

    # A tool that failed, its result given as blocks: still a turn the worker answers.
    failed = [ASK, {"role": "assistant", "content": first.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                                            "content": [{"type": "text", "text": "station offline"}]}]}]
    answer = ant.messages.create(model=MODEL, max_tokens=4, tools=[CLOCK, WEATHER], messages=failed)
    assert answer.content[0].type == "text"


def test_tool_conversation_stream(gateway):
    ant = client(gateway)
    with ant.messages.stream(model=MODEL, max_tokens=64, tools=[CLOCK, WEATHER], messages=[ASK]) as stream:
        events = list(stream)
        first = stream.get_final_message()
    kinds = [e.type for e in events]
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    assert starts[0].content_block.name == "get_weather"
    pieces = [e for e in events if e.type == "input_json"]
    assert len(pieces) >= 2, "the arguments arrive in several input_json_delta pieces"
    assert "".join(e.partial_json for e in pieces) == json.dumps({"city": "Paris"}, separators=(",", ":"))
    assert pieces[-1].snapshot == {"city": "Paris"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert first.stop_reason == "tool_use"
    call = first.content[0]
    assert call.type == "tool_use" and call.input == {"city": "Paris"}

    history = [ASK, {"role": "assistant", "content": first.content}, result_turn(call, "18 C")]
    with ant.messages.stream(model=MODEL, max_tokens=5, tools=[CLOCK, WEATHER], messages=history) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 5


def test_tool_choice(gateway):
    ant = client(gateway)
    hello = [{"role": "user", "content": "Hello"}]
    # `any`: some tool (the worker takes the first); `tool`: that one; `none` and `auto`: text here.
    forced = ant.messages.create(model=MODEL, max_tokens=64, tools=[CLOCK, WEATHER], messages=hello,
                                 tool_choice={"type": "any"})
    assert forced.stop_reason == "tool_use" and forced.content[0].name == "get_time"
    named = ant.messages.create(model=MODEL, max_tokens=64, tools=[CLOCK, WEATHER], messages=hello,
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True})
    assert named.content[0].name == "get_weather" and named.content[0].input == {"city": "sim"}
    for choice in ({"type": "none"}, {"type": "auto"}):
        text = ant.messages.create(model=MODEL, max_tokens=3, tools=[CLOCK, WEATHER], messages=[ASK]
                                   if choice["type"] == "none" else hello, tool_choice=choice)
        assert text.stop_reason == "max_tokens" and text.content[0].type == "text"


def test_count_tokens_equals_the_workers_prompt(gateway):
    ant = client(gateway)
    system = [{"type": "text", "text": "You answer about weather.", "cache_control": {"type": "ephemeral"}}]
    for tools in ([], [CLOCK, WEATHER]):
        counted = ant.messages.count_tokens(model=MODEL, system=system, tools=tools, messages=[ASK])
        created = ant.messages.create(model=MODEL, max_tokens=1, system=system, tools=tools, messages=[ASK])
        assert counted.input_tokens == prompt_tokens(created.usage) > 0
    with_tools = ant.messages.count_tokens(model=MODEL, tools=[CLOCK, WEATHER], messages=[ASK]).input_tokens
    without = ant.messages.count_tokens(model=MODEL, messages=[ASK]).input_tokens
    assert with_tools > without + 50, "the tools' definitions are part of the prompt"

    with pytest.raises(anthropic.NotFoundError) as e:
        ant.messages.count_tokens(model="no-such-model", messages=[ASK])
    assert e.value.body["type"] == "error"


def test_a_strict_tool_reaches_the_worker_and_is_counted(gateway):
    """`strict` is sent to the worker as the function's `strict` (vLLM 0.32 constrains a forced call's
    arguments to the schema only then), and it is part of the prompt the template renders: the worker's
    prompt grows by it and count_tokens still equals that prompt (keys and spacing as vLLM renders
    them: transformers' `tojson`, the tool in vLLM's field order)."""
    ant = client(gateway)
    strict = {**WEATHER, "strict": True}
    loose = ant.messages.create(model=MODEL, max_tokens=1, tools=[WEATHER], messages=[ASK])
    created = ant.messages.create(model=MODEL, max_tokens=1, tools=[strict], messages=[ASK])
    assert prompt_tokens(created.usage) > prompt_tokens(loose.usage)
    counted = ant.messages.count_tokens(model=MODEL, tools=[strict], messages=[ASK])
    assert counted.input_tokens == prompt_tokens(created.usage)


def test_count_tokens_without_a_tokenizer_is_a_clear_error(cluster):
    gw = cluster.gateway([cluster.worker()], tokenizer=False)
    with pytest.raises(anthropic.BadRequestError) as e:
        client(gw).messages.count_tokens(model=MODEL, messages=[ASK])
    error = e.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert "no tokenizer" in error["message"] and "tokenizer_dir" in error["message"]
    # Generation does not need the gateway's tokenizer.
    assert client(gw).messages.create(model=MODEL, max_tokens=2, messages=[ASK]).usage.output_tokens == 2


def test_images_reach_the_worker(gateway):
    ant = client(gateway)
    question = {"type": "text", "text": "What is in these pictures?"}
    plain = ant.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [question]}])
    with_images = ant.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
        question,
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"},
         "cache_control": {"type": "ephemeral"}},
    ]}])
    assert with_images.content[0].type == "text"
    # The simulator renders each image as its vision placeholder: the prompt grew.
    assert prompt_tokens(with_images.usage) > prompt_tokens(plain.usage)

    # A screenshot a tool returned reaches the worker too (in a user message after the tool's text).
    call = {"type": "tool_use", "id": "toolu_shot", "name": "screenshot", "input": {}}
    def after_result(result_content):
        return ant.messages.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "Take a screenshot."}, {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_shot",
                                          "content": result_content}]}])
    text_only = after_result([{"type": "text", "text": "Here it is."}])
    shot = after_result([{"type": "text", "text": "Here it is."},
                         {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}])
    assert prompt_tokens(shot.usage) > prompt_tokens(text_only.usage)


def test_thinking_cache_control_metadata_and_stop_sequences(gateway):
    ant = client(gateway)
    hello = [{"role": "user", "content": [{"type": "text", "text": "Hello", "cache_control": {"type": "ephemeral"}}]}]
    default = ant.messages.create(model=MODEL, max_tokens=2, messages=hello)
    # Thinking off reaches the chat template (Qwen's adds an empty think block to the prompt).
    off = ant.messages.create(model=MODEL, max_tokens=2, messages=hello, thinking={"type": "disabled"})
    assert prompt_tokens(off.usage) > prompt_tokens(default.usage)
    on = ant.messages.create(model=MODEL, max_tokens=2048, messages=hello,
                             thinking={"type": "enabled", "budget_tokens": 1024},
                             metadata={"user_id": "user-42"}, stop_sequences=["\n\nUser:"])
    assert on.content[-1].type == "text"
    # Thinking blocks of an earlier turn are accepted (and not sent to the worker).
    again = ant.messages.create(model=MODEL, max_tokens=2, messages=[
        *hello,
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "They greet me.", "signature": "c2ln"},
                                          {"type": "text", "text": "Hi!"}]},
        {"role": "user", "content": "How are you?"}])
    assert again.content[0].type == "text"


def test_errors_stay_in_anthropics_shape(gateway):
    ant = client(gateway)
    cases = [
        dict(tools=[{"type": "web_search_20250305", "name": "web_search"}], messages=[ASK]),
        dict(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_time"}, messages=[ASK]),
        dict(messages=[ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                              "input": {"city": "Paris"}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                           {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                           "data": "report"}}]}]}]),
        dict(thinking={"type": "enabled", "budget_tokens": 64}, messages=[ASK]),
    ]
    for case in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            ant.messages.create(model=MODEL, max_tokens=32, **case)
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert e.value.body["error"]["message"]
    # Raw: a streamed request that is refused gets the JSON error, not an event stream.
    r = requests.post(f"{gateway.url}/v1/messages", timeout=10, json={
        "model": MODEL, "max_tokens": 5, "stream": True, "messages": [ASK],
        "tools": [{"name": "get_weather"}]})
    assert r.status_code == 400
    assert "input_schema" in r.json()["error"]["message"]


def test_openai_sdk_tools_through_the_chat_api(gateway):
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    messages = [{"role": "user", "content": ASK["content"]}]
    whole = oai(gateway).chat.completions.create(model=MODEL, max_tokens=64, tools=tools, messages=messages)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    stream = oai(gateway).chat.completions.create(model=MODEL, max_tokens=64, tools=tools, messages=messages,
                                                  stream=True)
    arguments, names, finish = [], [], None
    for chunk in stream:
        for c in chunk.choices:
            for piece in c.delta.tool_calls or []:
                names += [piece.function.name] if piece.function and piece.function.name else []
                arguments += [piece.function.arguments] if piece.function and piece.function.arguments else []
            finish = c.finish_reason or finish
    assert names == ["get_weather"] and len(arguments) >= 2
    assert json.loads("".join(arguments)) == {"city": "Paris"}
    assert finish == "tool_calls"

    # The tool's result goes back as a `tool` message; the worker answers in text.
    follow = oai(gateway).chat.completions.create(model=MODEL, max_tokens=3, tools=tools, messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"}])
    assert follow.choices[0].finish_reason == "length" and follow.choices[0].message.content


def test_a_worker_without_a_tool_parser_refuses_in_anthropics_shape(cluster):
    """vLLM started without --enable-auto-tool-choice refuses `auto` tool choice with 400; the client sees
    that refusal as an Anthropic error, streamed or not. A named tool still works there (vLLM constrains
    the output to the tool's schema)."""
    gw = cluster.gateway([cluster.worker("--no-auto-tool-choice")])
    ant = client(gw)
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model=MODEL, max_tokens=32, tools=[WEATHER], messages=[ASK])
    assert e.value.body["type"] == "error"
    assert "enable-auto-tool-choice" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        with ant.messages.stream(model=MODEL, max_tokens=32, tools=[WEATHER], messages=[ASK]) as stream:
            list(stream)
    named = ant.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER], messages=[ASK],
                                tool_choice={"type": "tool", "name": "get_weather"})
    assert named.stop_reason == "tool_use"
