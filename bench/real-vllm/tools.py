"""One Anthropic tools conversation through Kinference to a real vLLM worker (CPU, tiny random Qwen2).

The worker runs with vLLM's hermes tool parser (`--enable-auto-tool-choice --tool-call-parser hermes`).
A random model does not decide to call tools, so the first turn names the tool (`tool_choice` of type
`tool`) and the tool is `strict`: vLLM 0.32 constrains a forced call's arguments to the schema only for
a strict tool (otherwise any JSON value, a string included). Its grammar for the call (a structural
tag) allows free whitespace, which a random model emits until `max_tokens`; so the worker runs with
`VLLM_ENFORCE_STRICT_TOOL_CALLING=0` (the forced call is constrained by the JSON schema alone) and
`disable_any_whitespace`. The schema's only property is an enum, so the call is short and valid. The
conversation, over plain HTTP as any client sends it:

1. `POST /v1/messages/count_tokens` with the tools;
2. `POST /v1/messages`: a `tool_use` block, `stop_reason: tool_use`, and the prompt size equal to step 1;
3. the same streamed: `content_block_start` with `tool_use`, `input_json_delta` pieces that join to the
   same input;
4. the `tool_result` turn: a text answer;
5. the OpenAI chat API with the same tool: `message.tool_calls`.

Exits non-zero on the first check that fails. Usage (normally through `run.sh tools`):
python tools.py --python VLLM_PYTHON --model-dir DIR --tokenizer-dir DIR --bin-dir DIR --work-dir DIR
"""

import argparse
import json
import signal
import sys
from pathlib import Path

import requests

from bench import MODEL, WORKER_ENV, Stack, free_ports, log, metric_sum, write_yaml

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
    },
    "strict": True,
}
ASK = {"role": "user", "content": "What is the weather like in Paris?"}
FORCED = {"type": "tool", "name": "get_weather"}


# The checks passed so far, in order (the transcript lists them).
PASSED: list[str] = []


def check(condition: bool, what: str, detail) -> None:
    if not condition:
        raise SystemExit(f"FAILED: {what}: {detail}")
    log(f"ok: {what}")
    PASSED.append(what)


def post(url: str, body: dict) -> dict:
    r = requests.post(url, json=body, timeout=300)
    if r.status_code != 200:
        raise SystemExit(f"FAILED: POST {url}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def stream_events(url: str, body: dict) -> list:
    """The (event, data) pairs of an Anthropic SSE stream."""
    events, name = [], None
    with requests.post(url, json={**body, "stream": True}, stream=True, timeout=300) as r:
        if r.status_code != 200:
            raise SystemExit(f"FAILED: streamed POST {url}: HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    return events


def start(args: argparse.Namespace, stack: Stack) -> None:
    worker_port, gw_port, admin_port = free_ports(3)
    worker = f"http://127.0.0.1:{worker_port}"
    proc = stack.spawn("worker", [
        args.python, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(worker_port),
        "--model", str(args.model_dir), "--served-model-name", MODEL,
        "--dtype", "bfloat16", "--max-model-len", "4096",
        "--enable-prompt-tokens-details",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
    ], env={**WORKER_ENV, "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"})
    config = args.work_dir / "gateway.yaml"
    write_yaml(config, {
        "models": [{"name": MODEL, "tokenizer_dir": str(args.tokenizer_dir)}],
        "workers": [{"url": worker, "model": MODEL}],
        "routing": "least-outstanding",
    })
    gateway = stack.spawn("gateway", [
        str(args.bin_dir / "kinference-gateway"),
        "--listen", f"127.0.0.1:{gw_port}", "--admin-listen", f"127.0.0.1:{admin_port}",
        "--config", str(config),
    ])
    stack.workers = [worker]
    stack.gateway_url = f"http://127.0.0.1:{gw_port}"
    stack.gateway_admin = f"http://127.0.0.1:{admin_port}"
    stack.wait_ready(proc, f"{worker}/health", args.ready_timeout)
    # Ready means the worker healthy in the gateway's eyes: the gateway starts before the worker
    # answers, and until its next health check it has no worker to send a request to (503).
    stack.wait_ready(gateway, f"{stack.gateway_admin}/metrics", 60,
                     check=lambda text: metric_sum(text, "kinference_gateway_worker_healthy") >= 1)


def conversation(gw: str) -> dict:
    messages_url = f"{gw}/v1/messages"
    first_turn = {"model": MODEL, "max_tokens": 64, "tools": [WEATHER], "tool_choice": FORCED, "messages": [ASK]}

    counted = post(f"{messages_url}/count_tokens", {"model": MODEL, "tools": [WEATHER], "messages": [ASK]})
    log(f"count_tokens: {counted}")

    first = post(messages_url, first_turn)
    calls = [b for b in first["content"] if b["type"] == "tool_use"]
    check(first["stop_reason"] == "tool_use", "stop_reason tool_use", first)
    check(len(calls) == 1 and calls[0]["name"] == "get_weather", "one get_weather call", first["content"])
    check(calls[0]["input"].get("city") in ("Paris", "Oslo"), "input follows the schema", calls[0]["input"])
    usage = first["usage"]
    prompt = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    check(counted["input_tokens"] == prompt, "count_tokens equals vLLM's prompt_tokens",
          f"{counted['input_tokens']} counted, {prompt} by vLLM")

    events = stream_events(messages_url, first_turn)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    pieces = [d["delta"]["partial_json"] for n, d in events
              if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    delta = next(d for n, d in events if n == "message_delta")
    check(any(b["type"] == "tool_use" for b in starts), "streamed tool_use block", starts)
    check(pieces and json.loads("".join(pieces)).get("city") in ("Paris", "Oslo"),
          "input_json_delta pieces join to the input", pieces)
    check(delta["delta"]["stop_reason"] == "tool_use", "streamed stop_reason tool_use", delta)

    history = [ASK, {"role": "assistant", "content": first["content"]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0]["id"],
                                             "content": "18 C and sunny"}]}]
    answer = post(messages_url, {"model": MODEL, "max_tokens": 8, "tools": [WEATHER],
                                 "tool_choice": {"type": "none"}, "messages": history})
    check(answer["content"] and answer["content"][0]["type"] == "text", "text answer after the result",
          answer["content"])
    counted_answer = post(f"{messages_url}/count_tokens", {"model": MODEL, "tools": [WEATHER],
                                                           "tool_choice": {"type": "none"}, "messages": history})
    answer_prompt = answer["usage"]["input_tokens"] + answer["usage"].get("cache_read_input_tokens", 0)
    check(counted_answer["input_tokens"] == answer_prompt, "count_tokens of the tool_result turn equals vLLM's",
          f"{counted_answer['input_tokens']} counted, {answer_prompt} by vLLM")

    chat = post(f"{gw}/v1/chat/completions", {
        "model": MODEL, "max_tokens": 64, "messages": [ASK],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"],
                                                     "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    })
    tool_calls = chat["choices"][0]["message"].get("tool_calls") or []
    check(len(tool_calls) == 1 and tool_calls[0]["function"]["name"] == "get_weather",
          "OpenAI chat: message.tool_calls", chat["choices"][0])
    return {"checks": PASSED, "count_tokens": counted["input_tokens"], "prompt_tokens": prompt,
            "tool_result_turn": {"count_tokens": counted_answer["input_tokens"], "prompt_tokens": answer_prompt},
            "first": first, "answer": answer, "streamed_events": [n for n, _ in events],
            "input_json_delta_pieces": pieces, "openai_tool_calls": tool_calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="python of the vLLM venv")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--bin-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True, help="logs and config files")
    parser.add_argument("--ready-timeout", type=float, default=600)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(args.work_dir.resolve())
    args.model_dir, args.tokenizer_dir, args.bin_dir = (
        args.model_dir.resolve(), args.tokenizer_dir.resolve(), args.bin_dir.resolve())
    try:
        start(args, stack)
        version = requests.get(f"{stack.workers[0]}/version", timeout=10).json().get("version")
        result = {"vllm_version": version, **conversation(stack.gateway_url)}
    finally:
        stack.stop()
    (args.work_dir / "tools.json").write_text(json.dumps(result, indent=2) + "\n")
    log(f"tools conversation passed; transcript in {args.work_dir / 'tools.json'}")


if __name__ == "__main__":
    main()
