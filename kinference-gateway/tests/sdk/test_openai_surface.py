"""The OpenAI surface agents and frameworks call, with the official `openai` SDK through the gateway to
`vllm-sim` workers: embeddings, `n > 1` with logprobs (streamed and not), `/tokenize` and `/detokenize`,
the Responses API where the worker serves it (and a clear 404 where it does not), workers started with
an API key, and `/v1/models` with owners."""

from __future__ import annotations

import math
import time

import openai
import pytest
import requests

from conftest import MODEL, Cluster, Gateway

PROMPT = "Kinference routes each request to the worker that answers it first."


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key="unused", max_retries=0, timeout=60)


def wait_until(check, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


@pytest.fixture(scope="module")
def surface(tmp_path_factory) -> Gateway:
    """Two plain workers behind one gateway."""
    c = Cluster(tmp_path_factory.mktemp("surface"))
    try:
        yield c.gateway([c.worker(), c.worker()])
    finally:
        c.close()


def input_tokens(gw: Gateway) -> float:
    """Prompt tokens the gateway billed, once every earlier request is settled."""
    assert wait_until(lambda: gw.metric("kinference_gateway_requests_in_flight") == 0)
    return gw.metric("kinference_gateway_input_tokens_total", model=MODEL)


def test_embeddings_go_to_a_worker_and_are_billed(surface):
    before = input_tokens(surface)
    raw = client(surface).embeddings.with_raw_response.create(model=MODEL, input=[PROMPT, "a second text"])
    assert raw.headers["x-kinference-worker"] in [w.url for w in surface.workers]
    result = raw.parse()
    assert [d.index for d in result.data] == [0, 1]
    for d in result.data:
        # The SDK asked for base64 and decoded it: unit vectors of the simulator's size.
        assert len(d.embedding) == 16
        assert math.isclose(sum(x * x for x in d.embedding), 1.0, rel_tol=1e-4)
    direct = requests.post(f"{surface.workers[0].url}/v1/embeddings",
                           json={"model": MODEL, "input": [PROMPT, "a second text"]}, timeout=30).json()
    assert result.usage.prompt_tokens == direct["usage"]["prompt_tokens"] > 0
    assert wait_until(lambda: input_tokens(surface) - before == direct["usage"]["prompt_tokens"])


def test_embedding_errors_are_openai_errors(surface):
    with pytest.raises(openai.NotFoundError) as e:
        client(surface).embeddings.create(model="no-such-model", input="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client(surface).embeddings.create(model=MODEL, input=[])
    assert e.value.status_code == 400


def test_chat_n_and_logprobs_whole(surface):
    assert wait_until(lambda: surface.metric("kinference_gateway_requests_in_flight") == 0)
    before = surface.metric("kinference_gateway_output_tokens_total", model=MODEL)
    completion = client(surface).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=5, n=3,
        logprobs=True, top_logprobs=2)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    for c in completion.choices:
        assert c.message.content
        assert len(c.logprobs.content) == 5
        assert all(len(t.top_logprobs) == 2 and t.logprob < 0 for t in c.logprobs.content)
    assert completion.usage.completion_tokens == 3 * 5
    # The gateway bills every choice.
    assert wait_until(lambda: surface.metric("kinference_gateway_output_tokens_total", model=MODEL) - before == 15)


def test_chat_n_and_logprobs_streamed(surface):
    stream = client(surface).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, n=2,
        logprobs=True, top_logprobs=1, stream=True, stream_options={"include_usage": True})
    text, logprobs, usage = {0: "", 1: ""}, {0: 0, 1: 0}, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                logprobs[c.index] += len(c.logprobs.content)
    assert text[0] and text[1]
    assert logprobs == {0: 4, 1: 4}
    assert usage is not None and usage.completion_tokens == 2 * 4


def test_completions_n_and_logprobs_streamed_and_not(surface):
    whole = client(surface).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=2, logprobs=2)
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(len(c.logprobs.token_logprobs) == 3 and len(c.logprobs.top_logprobs[0]) == 2
               for c in whole.choices)
    assert whole.usage.completion_tokens == 6
    seen = {0: 0, 1: 0}
    usage = None
    for chunk in client(surface).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=2, logprobs=1,
                                                    stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            seen[c.index] += len(c.logprobs.tokens)
    assert seen == {0: 3, 1: 3}
    assert usage.completion_tokens == 6


def test_tokenize_and_detokenize_pass_through(surface):
    r = requests.post(f"{surface.url}/tokenize", json={"model": MODEL, "prompt": PROMPT}, timeout=30)
    assert r.status_code == 200, r.text
    direct = requests.post(f"{surface.workers[0].url}/tokenize", json={"model": MODEL, "prompt": PROMPT},
                           timeout=30).json()
    assert r.json()["tokens"] == direct["tokens"]
    back = requests.post(f"{surface.url}/detokenize", json={"model": MODEL, "tokens": direct["tokens"]}, timeout=30)
    assert back.status_code == 200 and back.json()["prompt"] == PROMPT
    missing = requests.post(f"{surface.url}/tokenize", json={"model": "no-such-model", "prompt": "x"}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    bad = requests.post(f"{surface.url}/detokenize", data=b"{not json", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_responses_whole_and_streamed(surface):
    before = input_tokens(surface)
    response = client(surface).responses.create(model=MODEL, input=PROMPT, instructions="Be brief.",
                                                max_output_tokens=4)
    assert response.status == "completed" and response.output_text
    assert response.usage.output_tokens == 4
    assert wait_until(lambda: input_tokens(surface) - before == response.usage.input_tokens)
    events, final = [], None
    with client(surface).responses.stream(model=MODEL, input=[{"role": "user", "content": PROMPT}],
                                          max_output_tokens=3) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_response()
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert events.count("response.output_text.delta") == 3
    assert final.usage.output_tokens == 3 and final.output_text


def test_responses_where_no_worker_serves_them_is_a_clear_404(tmp_path):
    c = Cluster(tmp_path)
    try:
        gw = c.gateway([c.worker("--no-responses-api")])
        with pytest.raises(openai.NotFoundError) as e:
            client(gw).responses.create(model=MODEL, input="hi", max_output_tokens=2)
        assert "do not serve /v1/responses" in e.value.body["message"]
        # The chat API of the same worker still works.
        chat = client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2)
        assert chat.choices[0].message.content
    finally:
        c.close()


def keyed_gateway(c: Cluster, worker_url: str, key_yaml: str) -> tuple[Gateway | None, object]:
    """A gateway in front of `worker_url` with `key_yaml` (the `worker_api_key` entry) in its file."""
    from conftest import BIN_DIR, TOKENIZER_DIR, free_port, wait_for
    port, admin_port = free_port(), free_port()
    config = c.workdir / f"keyed-{port}.yaml"
    config.write_text(f"models:\n  - name: {MODEL}\n    tokenizer_dir: {TOKENIZER_DIR}\n"
                      f"workers:\n  - url: {worker_url}\n    model: {MODEL}\n{key_yaml}")
    process = c._spawn(f"gateway-{port}", [
        str(BIN_DIR / "kinference-gateway"), "--listen", f"127.0.0.1:{port}",
        "--admin-listen", f"127.0.0.1:{admin_port}", "--config", str(config)])
    gw = Gateway(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", process, [])
    try:
        wait_for(f"{gw.admin}/readyz", proc=process.proc)
    except RuntimeError:
        return None, process
    return gw, process


def test_workers_started_with_an_api_key(tmp_path, monkeypatch):
    c = Cluster(tmp_path)
    try:
        worker = c.worker("--api-key", "sk-worker-secret")
        # The worker really wants the key.
        assert requests.get(f"{worker.url}/v1/models", timeout=10).status_code == 401
        key_file = tmp_path / "worker-key"
        key_file.write_text("sk-worker-secret\n")
        gw, _ = keyed_gateway(c, worker.url, f"worker_api_key:\n  file: {key_file}\n")
        assert gw is not None
        chat = client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2)
        assert chat.choices[0].message.content
        assert len(client(gw).embeddings.create(model=MODEL, input="hi").data[0].embedding) == 16
        assert client(gw).responses.create(model=MODEL, input="hi", max_output_tokens=2).output_text
        stream = client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        # Without the key, the worker's refusal is the gateway's fault, not the client's.
        bare, _ = keyed_gateway(c, worker.url, "")
        with pytest.raises(openai.InternalServerError) as e:
            client(bare).embeddings.create(model=MODEL, input="hi")
        assert e.value.status_code == 502 and e.value.body["code"] == "bad_upstream"
        with pytest.raises(openai.InternalServerError) as e:
            client(bare).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2)
        assert e.value.status_code == 502 and e.value.body["code"] == "bad_upstream"
        # One command in front of the keyed worker: the key from the environment, as the chart sets it.
        from conftest import BIN_DIR, free_port, wait_for
        monkeypatch.setenv("KINFERENCE_WORKER_API_KEY", "sk-worker-secret")
        port, admin_port = free_port(), free_port()
        one = c._spawn(f"gateway-{port}", [
            str(BIN_DIR / "kinference-gateway"), "--listen", f"127.0.0.1:{port}", "--admin-listen",
            f"127.0.0.1:{admin_port}", "--config", str(tmp_path / "absent.yaml"), "--worker", worker.url])
        wait_for(f"http://127.0.0.1:{admin_port}/readyz", proc=one.proc)
        flagged = Gateway(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", one, [])
        assert MODEL in [m.id for m in client(flagged).models.list()]
        assert client(flagged).embeddings.create(model=MODEL, input="hi").data
        # The variable and a key in the file at once: which one was meant is not clear.
        both, process = keyed_gateway(c, worker.url, f"worker_api_key:\n  file: {key_file}\n")
        assert both is None and "keep one" in process.log.read_text()
        monkeypatch.delenv("KINFERENCE_WORKER_API_KEY")
        # A key that is named but cannot be read stops the start.
        broken, process = keyed_gateway(c, worker.url, "worker_api_key:\n  env: KINFERENCE_TEST_UNSET_WORKER_KEY\n")
        assert broken is None
        assert process.proc.wait(timeout=10) != 0
        assert "KINFERENCE_TEST_UNSET_WORKER_KEY" in process.log.read_text()
    finally:
        c.close()


def test_models_list_served_models_aliases_and_classes(tmp_path):
    from policy_cluster import pool_yaml, start_gateway, start_sim, write_dir
    c = Cluster(tmp_path)
    try:
        worker = start_sim(c)
        policies = tmp_path / "policies"
        write_dir(policies, {
            "model.yaml": f"""apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {{name: {MODEL}}}
spec:
  servedName: {MODEL}
  aliases: [house-model]
  classes: [general]
""",
            "pool.yaml": pool_yaml("local", [worker]),
        })
        gw = start_gateway(c, policies)
        models = {m.id: m for m in client(gw).models.list()}
        assert models[MODEL].owned_by == "kinference"
        alias = models["house-model"]
        assert alias.owned_by == "kinference" and alias.root == MODEL and alias.parent == MODEL
        general = models["general"]
        assert general.kind == "class" and general.members == [MODEL]
        # An alias works on the pass-through endpoints too: the worker is asked for the served name.
        assert client(gw).embeddings.create(model="house-model", input="hi").model == MODEL
        # The alias and the class are names a client can use.
        for name in ("house-model", "general"):
            chat = client(gw).chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=2)
            assert chat.choices[0].message.content
        # A class resolves on the pass-through endpoints as it does for chat (here its only model).
        assert client(gw).embeddings.create(model="general", input="hi").model == MODEL
        assert client(gw).responses.create(model="general", input="hi", max_output_tokens=2).output_text
        tokens = requests.post(f"{gw.url}/tokenize", json={"model": "general", "prompt": "hi"}, timeout=10)
        assert tokens.status_code == 200 and tokens.json()["tokens"], tokens.text
    finally:
        c.close()


def test_models_list_without_policies(surface):
    models = list(client(surface).models.list())
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "kinference" and models[0].root == MODEL


def test_a_class_of_two_models_on_the_pass_through_endpoints(tmp_path):
    """`/v1/responses` takes a class of two models as chat does; `/v1/embeddings` and `/tokenize`,
    whose answers mean different things per model, refuse it with an error naming the models."""
    from policy_cluster import model_yaml, pool_yaml, start_gateway, start_sim, write_dir
    c = Cluster(tmp_path)
    try:
        other = "qwen2-sim-b"
        first, second = start_sim(c), start_sim(c, model=other)
        write_dir(tmp_path / "policies", {
            "models.yaml": model_yaml() + "---\n" + model_yaml(other),
            "pools.yaml": pool_yaml("a", [first]) + "---\n" + pool_yaml("b", [second], model=other),
        })
        gw = start_gateway(c, tmp_path / "policies")
        chat = client(gw).chat.completions.create(model="general", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2)
        assert chat.model in (MODEL, other)
        assert client(gw).responses.create(model="general", input="hi", max_output_tokens=2).output_text
        with pytest.raises(openai.BadRequestError) as e:
            client(gw).embeddings.create(model="general", input="hi")
        assert "several models" in e.value.body["message"] and other in e.value.body["message"], e.value.body
        tokens = requests.post(f"{gw.url}/tokenize", json={"model": "general", "prompt": "hi"}, timeout=10)
        assert tokens.status_code == 400 and "/tokenize" in tokens.json()["error"]["message"], tokens.text
        # Each model by name still works.
        assert client(gw).embeddings.create(model=other, input="hi").data
        # The pool gauges are per InferencePool.
        assert gw.metric("kinference_gateway_pool_workers", model=MODEL, pool="a", state="healthy") == 1
        assert gw.metric("kinference_gateway_pool_workers", model=other, pool="b", state="healthy") == 1
        assert f'pool_workers{{model="{MODEL}",pool="b"' not in gw.metrics()
    finally:
        c.close()


def test_each_pool_sends_its_own_worker_key(tmp_path, monkeypatch):
    """Two pools whose workers want different keys (`--api-key`), each key named by its
    InferencePool's `workerCredentials`; a pool whose key is wrong answers 502 bad_upstream."""
    from policy_cluster import model_yaml, pool_yaml, start_gateway, start_sim, write_dir
    c = Cluster(tmp_path)
    try:
        models = {"a": MODEL, "b": "qwen2-sim-b", "c": "qwen2-sim-c"}
        files = {}
        for pool, model in models.items():
            url = start_sim(c, "fast", "--api-key", f"sk-{pool}", model=model)
            assert requests.get(f"{url}/v1/models", timeout=10).status_code == 401
            monkeypatch.setenv(f"KINFERENCE_TEST_POOL_KEY_{pool.upper()}", "sk-wrong" if pool == "c" else f"sk-{pool}")
            files[f"model-{pool}.yaml"] = model_yaml(model, classes=(f"class-{pool}",))
            files[f"pool-{pool}.yaml"] = pool_yaml(pool, [url], model=model) + \
                f"  workerCredentials: {{env: KINFERENCE_TEST_POOL_KEY_{pool.upper()}}}\n" + \
                "  workerHeaders: {x-pool-tag: " + pool + "}\n"
        write_dir(tmp_path / "policies", files)
        gw = start_gateway(c, tmp_path / "policies")
        for model in (models["a"], models["b"]):
            chat = client(gw).chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=2)
            assert chat.choices[0].message.content
            assert client(gw).embeddings.create(model=model, input="hi").data
        with pytest.raises(openai.InternalServerError) as e:
            client(gw).chat.completions.create(model=models["c"], messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
        assert e.value.status_code == 502 and e.value.body["code"] == "bad_upstream", e.value.body
        with pytest.raises(openai.InternalServerError) as e:
            client(gw).embeddings.create(model=models["c"], input="hi")
        assert e.value.status_code == 502 and e.value.body["code"] == "bad_upstream", e.value.body
    finally:
        c.close()
