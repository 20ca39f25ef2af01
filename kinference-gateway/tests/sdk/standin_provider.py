"""A stand-in cloud provider on loopback: OpenAI-compatible (`/v1/chat/completions`, `/v1/completions`)
and Anthropic-compatible (`/v1/messages`), streaming and not. It never touches the internet.

It checks the API key (OpenAI: `Authorization: Bearer KEY`; Anthropic: `x-api-key: KEY` plus
`anthropic-version`) and records every request it gets, authorised or not: `GET /_requests` returns
them (path, headers that matter, body), `POST /_reset` clears the record. `--delay-ms` delays each
answer (a remote provider is slower than loopback).

    python standin_provider.py --port 18080 --key sk-test [--delay-ms 50]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPLY_WORDS = ["Hello", " from", " the", " stand-in", " provider", "."]


class State:
    def __init__(self, key: str, delay_s: float):
        self.key = key
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.requests: list[dict] = []


def make_handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        # ---- helpers ----
        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _start_stream(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()

        def _chunk(self, text: str) -> None:
            data = text.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _end_stream(self) -> None:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        # ---- routes ----
        def do_GET(self):
            if self.path == "/health":
                return self._json(200, {"ok": True})
            if self.path == "/_requests":
                with state.lock:
                    return self._json(200, {"requests": list(state.requests)})
            self._json(404, {"error": {"message": "not found"}})

        def do_POST(self):
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            if self.path == "/_reset":
                with state.lock:
                    state.requests.clear()
                return self._json(200, {"ok": True})
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError:
                body = {"unparsable": raw.decode(errors="replace")}
            record = {
                "path": self.path,
                "authorization": self.headers.get("authorization"),
                "x_api_key": self.headers.get("x-api-key"),
                "anthropic_version": self.headers.get("anthropic-version"),
                "traceparent": self.headers.get("traceparent"),
                "x_request_id": self.headers.get("x-request-id"),
                "body": body,
                "at": time.time(),
            }
            with state.lock:
                state.requests.append(record)
            if self.path in ("/v1/chat/completions", "/v1/completions"):
                if self.headers.get("authorization") != f"Bearer {state.key}":
                    return self._json(401, {"error": {"message": "invalid api key", "type": "invalid_request_error"}})
                time.sleep(state.delay_s)
                return self._openai(body, chat=self.path.endswith("chat/completions"))
            if self.path == "/v1/messages":
                if self.headers.get("x-api-key") != state.key or not self.headers.get("anthropic-version"):
                    return self._json(401, {"type": "error", "error": {"type": "authentication_error",
                                                                       "message": "invalid x-api-key"}})
                time.sleep(state.delay_s)
                return self._anthropic(body)
            self._json(404, {"error": {"message": f"no route {self.path}"}})

        def _openai(self, body: dict, chat: bool) -> None:
            model = body.get("model", "?")
            rid = f"chatcmpl-{uuid.uuid4().hex[:12]}" if chat else f"cmpl-{uuid.uuid4().hex[:12]}"
            usage = {"prompt_tokens": 11, "completion_tokens": len(REPLY_WORDS),
                     "total_tokens": 11 + len(REPLY_WORDS), "prompt_tokens_details": {"cached_tokens": 0}}
            created = int(time.time())
            kind = "chat.completion" if chat else "text_completion"
            if not body.get("stream"):
                text = "".join(REPLY_WORDS)
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                          if chat else {"index": 0, "text": text, "finish_reason": "stop"})
                return self._json(200, {"id": rid, "object": kind, "created": created, "model": model,
                                        "choices": [choice], "usage": usage})
            self._start_stream()
            obj = "chat.completion.chunk" if chat else "text_completion"
            if chat:
                self._chunk("data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                                "finish_reason": None}]}) + "\n\n")
            for i, word in enumerate(REPLY_WORDS):
                last = i == len(REPLY_WORDS) - 1
                choice = ({"index": 0, "delta": {"content": word}, "finish_reason": "stop" if last else None}
                          if chat else {"index": 0, "text": word, "finish_reason": "stop" if last else None})
                self._chunk("data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                                   "choices": [choice]}) + "\n\n")
            if (body.get("stream_options") or {}).get("include_usage"):
                self._chunk("data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                                   "choices": [], "usage": usage}) + "\n\n")
            self._chunk("data: [DONE]\n\n")
            self._end_stream()

        def _anthropic(self, body: dict) -> None:
            model = body.get("model", "?")
            mid = f"msg_{uuid.uuid4().hex[:12]}"
            if "max_tokens" not in body:
                return self._json(400, {"type": "error", "error": {"type": "invalid_request_error",
                                                                   "message": "max_tokens: Field required"}})
            if not body.get("stream"):
                return self._json(200, {
                    "id": mid, "type": "message", "role": "assistant", "model": model,
                    "content": [{"type": "text", "text": "".join(REPLY_WORDS)}],
                    "stop_reason": "end_turn", "stop_sequence": None,
                    "usage": {"input_tokens": 9, "output_tokens": len(REPLY_WORDS),
                              "cache_read_input_tokens": 2, "cache_creation_input_tokens": 0},
                })
            self._start_stream()

            def event(name: str, data: dict) -> None:
                self._chunk(f"event: {name}\ndata: {json.dumps(data)}\n\n")

            event("message_start", {"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 9, "output_tokens": 1, "cache_read_input_tokens": 2,
                          "cache_creation_input_tokens": 0}}})
            event("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}})
            event("ping", {"type": "ping"})
            for word in REPLY_WORDS:
                event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": word}})
            event("content_block_stop", {"type": "content_block_stop", "index": 0})
            event("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                    "usage": {"output_tokens": len(REPLY_WORDS)}})
            event("message_stop", {"type": "message_stop"})
            self._end_stream()

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(State(args.key, args.delay_ms / 1000)))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
