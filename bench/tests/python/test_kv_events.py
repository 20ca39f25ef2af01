"""An independent decoder for the simulator's KV events: pyzmq + msgspec with vLLM's own event schema.

The msgspec Struct definitions below follow vLLM 0.32's `vllm/distributed/kv_events.py` (map format,
vLLM >= 0.24) and vLLM 0.23's (array_like=True, the positional format). Events received by a SUB socket
and replayed through a DEALER are decoded strictly with them and checked against the simulator's cache
(`GET /sim/state`).

Run: .venv/bin/python -m pytest bench/tests/python. Needs `target/debug/vllm-sim` (or
$KINFERENCE_BIN_DIR/vllm-sim) and the tokenizer ($KINFERENCE_TOKENIZER_DIR, default .assets/qwen2);
builds nothing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Union

import msgspec
import pytest
import requests
import zmq

REPO = Path(__file__).resolve().parents[3]
BIN_DIR = Path(os.environ.get("KINFERENCE_BIN_DIR", REPO / "target" / "debug"))
TOKENIZER_DIR = Path(os.environ.get("KINFERENCE_TOKENIZER_DIR", REPO / ".assets" / "qwen2"))
TOPIC = "kv@w1@qwen2-sim"
END_SEQ = (-1).to_bytes(8, "big", signed=True)

ExternalBlockHash = Union[bytes, int]


# ---- vLLM 0.32 (map format): vllm/distributed/kv_events.py -------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


# ---- vLLM 0.23 (array format): the same structs with array_like=True ---------------------------------
class KVCacheEventV023(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the positional (<= 0.23) events."""


class BlockStoredV023(KVCacheEventV023, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemovedV023(KVCacheEventV023, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksClearedV023(KVCacheEventV023, tag="AllBlocksCleared"):
    pass


class KVEventBatchV023(EventBatch):
    events: list[Union[BlockStoredV023, BlockRemovedV023, AllBlocksClearedV023]]


# ---- helpers -------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sim:
    """A running vllm-sim, killed at the end of the test."""

    def __init__(self, args: list[str]):
        binary = BIN_DIR / "vllm-sim"
        if not binary.exists():
            pytest.fail(f"{binary} missing: build it first (cargo build -p kinference-bench --bin vllm-sim)")
        if not (TOKENIZER_DIR / "tokenizer.json").exists():
            pytest.fail(f"no tokenizer in {TOKENIZER_DIR}: run `cargo xtask setup`")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(binary), "--host", "127.0.0.1", "--port", str(self.port), "--model", "qwen2-sim",
             "--tokenizer-dir", str(TOKENIZER_DIR), "--preset", "fast", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 90
        while time.time() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm-sim exited with {self.proc.returncode}")
            try:
                if requests.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        pytest.fail("vllm-sim did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def apply(batch: Any, live: set[int]) -> tuple[int, int]:
    stored = removed = 0
    for e in batch.events:
        name = type(e).__name__.replace("V023", "")
        if name == "BlockStored":
            stored += 1
            assert e.block_size == 16
            assert len(e.token_ids) == 16 * len(e.block_hashes)
            assert e.medium == "GPU"
            live.update(e.block_hashes)
        elif name == "BlockRemoved":
            removed += 1
            live.difference_update(e.block_hashes)
        else:
            live.clear()
    return stored, removed


@pytest.mark.parametrize(
    "fmt,replay_fmt",
    [("map", "v0.26"), ("array", "v0.25")],
)
def test_events_decode_with_vllm_schema_and_match_cache(fmt: str, replay_fmt: str) -> None:
    decoder = msgspec.msgpack.Decoder(KVEventBatch if fmt == "map" else KVEventBatchV023)
    other = msgspec.msgpack.Decoder(KVEventBatchV023 if fmt == "map" else KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    pub_port, replay_port = free_port(), free_port()
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    # Bind mode ('*' in the endpoint). Connect mode towards a libzmq SUB that binds does not deliver
    # yet (the Rust `zeromq` SUB of the agent does receive it; see bench/tests/sim_http.rs).
    sim = Sim([
        "--block-size", "16", "--num-blocks", "8",
        "--kv-events-endpoint", f"tcp://*:{pub_port}",
        "--kv-replay-endpoint", f"tcp://*:{replay_port}",
        "--kv-topic", TOPIC, "--kv-event-format", fmt, "--replay-format", replay_fmt,
    ])
    try:
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        time.sleep(0.5)  # the subscription must reach the publisher first
        for i in range(6):
            prompt = list(range(i * 1000 + 100, i * 1000 + 140))
            r = requests.post(f"{sim.url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=30)
            assert r.status_code == 200, r.text
        requests.post(f"{sim.url}/reset_prefix_cache", timeout=5)  # goes out with the next step
        r = requests.post(f"{sim.url}/v1/completions", json={"prompt": list(range(7000, 7040)), "max_tokens": 2},
                          timeout=30)
        assert r.status_code == 200

        live: set[int] = set()
        seqs, stored, removed, cleared = [], 0, 0, False
        while sub.poll(1500):
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC.encode()
            seqs.append(int.from_bytes(seq, "big"))
            batch = decoder.decode(payload)
            assert batch.data_parallel_rank == 0
            assert isinstance(batch.ts, float)
            cleared |= any(type(e).__name__.startswith("AllBlocksCleared") for e in batch.events)
            s, rm = apply(batch, live)
            stored, removed = stored + s, removed + rm
            with pytest.raises(msgspec.ValidationError):
                other.decode(payload)  # the two formats are really different on the wire
        assert seqs == list(range(len(seqs))), seqs
        assert stored >= 6 and removed >= 1 and cleared, (stored, removed, cleared)

        state = requests.get(f"{sim.url}/sim/state", timeout=5).json()
        assert live == set(state["block_hashes"])

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "replay timed out"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            body = frames[1:]
            if replay_fmt == "v0.26":
                assert len(body) == 3
                if body[1] == END_SEQ:
                    assert body == [b"", END_SEQ, b""]
                    break
                assert body[0] == TOPIC.encode()
                seq, payload = body[1], body[2]
            else:
                assert len(body) == 2
                if body[0] == END_SEQ:
                    assert body[1] == b""
                    break
                seq, payload = body
            replayed.append(int.from_bytes(seq, "big"))
            decoder.decode(payload)
        assert replayed == seqs[1:]
        dealer.close(0)
    finally:
        sim.stop()
        sub.close(0)
        ctx.term()
