"""Stored answers through the gateway, with the official `openai` SDK: vLLM keeps a `/v1/responses` answer
(with `VLLM_ENABLE_RESPONSES_API_STORE=1`) in the memory of the worker that made it, so a request continuing it
(`previous_response_id`) must reach that worker, and only its own tenant may continue it.
Real processes only: three `vllm-sim` workers storing answers as vLLM does, and `kinference-gateway`.
"""
from __future__ import annotations

import time

import openai
import pytest
import requests

from conftest import BIN_DIR, MODEL, TOKENIZER_DIR, Cluster, Gateway, free_port, wait_for
from test_tenancy import KEYS, start_gateway, write_tenants

TURNS = 8


def oai(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def holders(workers, answer_id: str) -> list[str]:
    """The workers that can continue `answer_id` (asked directly, storing nothing new)."""
    found = []
    for w in workers:
        r = requests.post(f"{w.url}/v1/responses", timeout=30, json={
            "model": MODEL, "input": "and?", "previous_response_id": answer_id, "max_output_tokens": 1,
            "store": False})
        if r.status_code == 200:
            found.append(w.url)
        else:
            assert r.status_code == 404, r.text
    return found


def continue_chain(client: openai.OpenAI, first, turns: int):
    """Continues `first` for `turns` turns, streamed every other turn; returns the last answer."""
    previous, seen_input = first, first.usage.input_tokens
    for turn in range(turns):
        question = f"Go on, part {turn}."
        if turn % 2:
            with client.responses.stream(model=MODEL, input=question, previous_response_id=previous.id,
                                         max_output_tokens=3) as stream:
                for _ in stream:
                    pass
                answer = stream.get_final_response()
        else:
            answer = client.responses.create(model=MODEL, input=question, previous_response_id=previous.id,
                                             max_output_tokens=3)
        assert answer.status == "completed", answer
        # The worker read the stored conversation: the prompt grew by the last answer and the question.
        assert answer.usage.input_tokens > seen_input, (turn, answer.usage)
        previous, seen_input = answer, answer.usage.input_tokens
    return previous


def test_a_stored_answer_is_continued_where_it_is_held_and_by_its_tenant_only(tmp_path):
    c = Cluster(tmp_path)
    try:
        workers = [c.worker("--responses-store") for _ in range(3)]
        tenants, secrets = write_tenants(tmp_path)
        gw = start_gateway(c, workers, f"tenants_dir: {tenants}\nsecrets_dir: {secrets}", "stored")
        acme = oai(gw.openai_base, KEYS["acme"])
        first = acme.responses.create(model=MODEL, input="Tell me about prefix caches.", max_output_tokens=4)
        # The answer is held by one worker alone: anywhere else a follow-up is vLLM's 404.
        assert len(holders(workers, first.id)) == 1
        last = continue_chain(acme, first, TURNS)
        assert gw.metric("kinference_routing_decisions_total", reason="previous_response") >= TURNS
        assert holders(workers, last.id) == holders(workers, first.id)

        # Another tenant naming acme's answer is refused as an unknown one, before any worker sees it.
        asked_before = gw.metric("kinference_routing_decisions_total")
        with pytest.raises(openai.NotFoundError) as e:
            oai(gw.openai_base, KEYS["strict"]).responses.create(
                model=MODEL, input="What did they say?", previous_response_id=last.id, max_output_tokens=2)
        assert e.value.body["message"] == f"Response with id '{last.id}' not found."
        assert gw.metric("kinference_routing_decisions_total") == asked_before

        # An answer the gateway never saw made is routed as any request: the worker's own 404 comes back.
        with pytest.raises(openai.NotFoundError) as e:
            acme.responses.create(model=MODEL, input="x", previous_response_id="resp_" + "0" * 32,
                                  max_output_tokens=2)
        assert "not found" in e.value.body["message"]

        # Not a string: the client's 400, in OpenAI's shape.
        r = requests.post(f"{gw.openai_base}/responses", timeout=30,
                          headers={"Authorization": f"Bearer {KEYS['acme']}"},
                          json={"model": MODEL, "input": "x", "previous_response_id": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text

        # An open gateway routing by a baseline (least outstanding) pins the same way.
        open_gw = c.gateway(workers)
        anonymous = oai(open_gw.openai_base)
        start = anonymous.responses.create(model=MODEL, input="Another conversation.", max_output_tokens=4)
        continue_chain(anonymous, start, 4)
        assert open_gw.metric("kinference_routing_decisions_total", reason="previous_response") >= 4
    finally:
        c.close()


ADMIN_KEY = "replicas-admin-key-0123456789abcdef"


def replica_pair(c: Cluster, workers) -> list[Gateway]:
    """Two open Kinference gateways over `workers`, each the other's peer (`replicas.peers`)."""
    ports = [(free_port(), free_port()) for _ in range(2)]
    gateways = []
    for i, (port, admin) in enumerate(ports):
        peer_admin = ports[1 - i][1]
        config = c.workdir / f"replica-{i}.yaml"
        lines = [f"models:\n  - name: {MODEL}\n    tokenizer_dir: {TOKENIZER_DIR}\nworkers:"]
        lines += [f"  - url: {w.url}\n    model: {MODEL}" for w in workers]
        lines.append(f"routing: kinference\nreplicas:\n  peers: [\"http://127.0.0.1:{peer_admin}\"]")
        config.write_text("\n".join(lines) + "\n")
        process = c._spawn(f"replica-{i}", [
            str(BIN_DIR / "kinference-gateway"), "--listen", f"127.0.0.1:{port}",
            "--admin-listen", f"127.0.0.1:{admin}", "--admin-key", ADMIN_KEY, "--config", str(config)])
        gateways.append(Gateway(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", process, list(workers)))
    for gw in gateways:
        wait_for(f"{gw.admin}/readyz", proc=gw.process.proc)
    return gateways


def test_a_stored_answer_made_through_one_replica_is_continued_through_the_other(tmp_path):
    c = Cluster(tmp_path)
    try:
        workers = [c.worker("--responses-store") for _ in range(3)]
        replicas = replica_pair(c, workers)
        clients = [oai(gw.openai_base) for gw in replicas]
        previous = clients[0].responses.create(model=MODEL, input="A conversation over two replicas.",
                                               max_output_tokens=3)
        held = holders(workers, previous.id)
        assert len(held) == 1
        for turn in range(6):
            # Each turn through the other replica than the last: it knows the answer only from its peer.
            client = clients[(turn + 1) % 2]
            deadline = time.monotonic() + 5
            while True:
                try:
                    answer = client.responses.create(model=MODEL, input=f"Turn {turn}.",
                                                     previous_response_id=previous.id, max_output_tokens=3)
                    break
                except openai.NotFoundError:
                    # The peer's note is a heartbeat away (200 ms by default): only then is a miss allowed.
                    assert time.monotonic() < deadline, "the peer never told this replica of the answer"
                    time.sleep(0.2)
            assert answer.status == "completed"
            previous = answer
        assert holders(workers, previous.id) == held
        assert sum(gw.metric("kinference_routing_decisions_total", reason="previous_response")
                   for gw in replicas) >= 6
    finally:
        c.close()
