"""Providers and PII fail-closed, end to end with the official SDKs.

The only local pool points at a port where nothing listens (no local pool is available), and a burst
policy sends everything to the stand-in provider while the local pools are saturated (a pool with no
healthy worker counts as saturated). Then:
- requests without personal data go to the provider, in the client's protocol whatever the provider
  speaks (OpenAI client -> Anthropic provider and back, Anthropic client -> OpenAI provider), streamed
  or not;
- requests with personal data are refused with `local_processing_required` in the client's protocol
  (OpenAI chat and completions, Anthropic; streaming and not), and the stand-in, which records every
  request it receives, received none of them.
"""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

import anthropic
import openai
import pytest
import requests

from conftest import MODEL, Cluster, free_port
from policy_cluster import (KEY, model_yaml, pool_yaml, provider_yaml, start_gateway, start_standin,
                            write_dir)
from standin_provider import REPLY_WORDS

REPLY = "".join(REPLY_WORDS)
PII_PROMPTS = [
    "Please email jane.doe@example.com the contract draft.",
    "Transfer the refund to IBAN DE89 3704 0044 0532 0130 00 today.",
    "My card 4111 1111 1111 1111 was charged twice, can you check?",
    "Call me back on +44 20 7946 0958 after lunch.",
]

POLICIES = textwrap.dedent("""\
    apiVersion: kinference.ai/v1alpha1
    kind: InferencePolicy
    metadata: {name: data-protection}
    spec:
      priority: 0
      rules:
        - name: pii-stays-local
          match: {tags: [pii]}
          action:
            requireLocal: {message: personal data must not leave our infrastructure}
    ---
    apiVersion: kinference.ai/v1alpha1
    kind: InferencePolicy
    metadata: {name: cloud-burst}
    spec:
      priority: 20
      rules:
        - name: via-anthropic
          match: {tags: [via-anthropic]}
          action:
            burst:
              providers: [standin-anthropic]
              when: {queueDepthAbove: 0}
        - name: saturated
          action:
            burst:
              providers: [standin-openai, standin-anthropic]
              when: {queueDepthAbove: 0}
    """)


@pytest.fixture(scope="module")
def env():
    with tempfile.TemporaryDirectory(prefix="kinference-policy-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            standin = start_standin(cluster)
            dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the local pool is unavailable
            policy_dir = Path(tmp) / "policies"
            write_dir(policy_dir, {
                "models.yaml": model_yaml(),
                "pools.yaml": pool_yaml("local", [dead]),
                "providers.yaml": provider_yaml("standin-openai", standin, "OpenAI") + "---\n"
                + provider_yaml("standin-anthropic", standin, "Anthropic"),
                "policies.yaml": POLICIES,
            })
            gw = start_gateway(cluster, policy_dir, wait_ready=False)
            yield gw, standin
        finally:
            cluster.close()


def oai(gw, **headers) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base, api_key="unused", max_retries=0, timeout=30,
                         default_headers=headers or None)


def ant(gw, **headers) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=30,
                               default_headers=headers or None)


VIA_ANTHROPIC = {"x-kinference-tags": "via-anthropic"}


def last_request(standin) -> dict:
    got = standin.requests()
    assert got, "the stand-in received nothing"
    return got[-1]


# ---- the client's protocol is preserved, whatever the provider speaks ----

@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_bursting_to_an_anthropic_provider(env, stream):
    gw, standin = env
    standin.reset()
    client = oai(gw, **VIA_ANTHROPIC)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    if stream:
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, stream=True,
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == REPLY
        assert chunks[-1].usage.completion_tokens == len(REPLY_WORDS)
        assert any(c.choices and c.choices[0].finish_reason == "stop" for c in chunks)
    else:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=9)
        assert raw.headers["x-kinference-provider"] == "standin-anthropic"
        completion = raw.parse()
        assert completion.object == "chat.completion"
        assert completion.choices[0].message.content == REPLY
        assert completion.usage.prompt_tokens == 11  # 9 uncached + 2 cached
        assert completion.usage.prompt_tokens_details.cached_tokens == 2
    sent = last_request(standin)
    assert sent["path"] == "/v1/messages"
    assert sent["x_api_key"] == KEY and sent["anthropic_version"]
    assert sent["body"]["model"] == "standin-anthropic-model"
    assert sent["body"]["system"] == "Be brief."
    assert sent["body"]["max_tokens"] == 9
    assert sent["body"].get("stream", False) == stream


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_client_bursting_to_an_openai_provider(env, stream):
    gw, standin = env
    standin.reset()
    client = ant(gw)
    kwargs = dict(model=MODEL, max_tokens=9, messages=[{"role": "user", "content": "Say hello."}])
    if stream:
        events = list(client.messages.create(stream=True, **kwargs))
        kinds = [e.type for e in events]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        assert text == REPLY
        delta = next(e for e in events if e.type == "message_delta")
        assert delta.delta.stop_reason == "end_turn"
        assert delta.usage.output_tokens == len(REPLY_WORDS)
    else:
        message = client.messages.create(**kwargs)
        assert message.type == "message" and message.model == MODEL
        assert message.content[0].text == REPLY
        assert message.stop_reason == "end_turn"
        assert message.usage.output_tokens == len(REPLY_WORDS)
    sent = last_request(standin)
    assert sent["path"] == "/v1/chat/completions"
    assert sent["authorization"] == f"Bearer {KEY}"
    assert sent["body"]["model"] == "standin-openai-model"


@pytest.mark.parametrize("stream", [False, True])
def test_same_protocol_both_ways(env, stream):
    gw, standin = env
    standin.reset()
    # OpenAI completions -> OpenAI provider.
    if stream:
        text = "".join(c.choices[0].text for c in oai(gw).completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True) if c.choices)
    else:
        text = oai(gw).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6).choices[0].text
    assert text == REPLY
    assert last_request(standin)["path"] == "/v1/completions"
    # Anthropic -> Anthropic provider.
    kwargs = dict(model=MODEL, max_tokens=9, messages=[{"role": "user", "content": "Say hello."}])
    if stream:
        events = list(ant(gw, **VIA_ANTHROPIC).messages.create(stream=True, **kwargs))
        text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    else:
        text = ant(gw, **VIA_ANTHROPIC).messages.create(**kwargs).content[0].text
    assert text == REPLY
    assert last_request(standin)["path"] == "/v1/messages"


def test_the_provider_gets_the_request_id_and_the_clients_traceparent(env):
    """Traces are not exported here: the client's W3C traceparent reaches the provider unchanged, and the
    client's x-request-id is echoed to it and sent on."""
    gw, standin = env
    standin.reset()
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    client = ant(gw, **VIA_ANTHROPIC, **{"traceparent": traceparent, "x-request-id": "sdk-trace-1"})
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=9, messages=[{"role": "user", "content": "Say hello."}])
    assert raw.headers["x-request-id"] == "sdk-trace-1"
    assert raw.parse().content[0].text == REPLY
    sent = last_request(standin)
    assert sent["traceparent"] == traceparent
    assert sent["x_request_id"] == "sdk-trace-1"


def test_burst_decision_is_explained_and_counted(env):
    gw, _ = env
    r = requests.post(f"{gw.openai_base}/chat/completions", timeout=30,
                      headers={"x-kinference-debug": "1"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    decision = r.headers["x-kinference-decision"]
    assert "policy=cloud-burst/saturated outcome=burst" in decision
    assert "local(unavailable)" in decision
    assert r.headers["x-kinference-worker"].endswith("/v1")
    assert gw.metric("kinference_gateway_policy_decisions_total", policy="cloud-burst", rule="saturated",
                     outcome="burst") >= 1
    assert gw.metric("kinference_gateway_policy_backend_requests_total", backend="provider/standin-openai",
                     burst="true") >= 1


# ---- personal data never reaches a provider ----

def expect_refusal_openai(call) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        call()
    assert err.value.status_code == 503
    body = err.value.response.json()["error"]
    assert body["code"] == "local_processing_required"
    assert body["type"] == "service_unavailable_error"
    assert "personal data" in body["message"] and "local" in body["message"]


def expect_refusal_anthropic(call) -> None:
    with pytest.raises(anthropic.APIStatusError) as err:
        call()
    assert err.value.status_code == 503
    body = err.value.response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error"
    assert "personal data" in body["error"]["message"]


def test_pii_is_refused_in_every_protocol_and_never_reaches_the_provider(env):
    gw, standin = env
    standin.reset()
    refused = 0
    for prompt in PII_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        for headers in ({}, VIA_ANTHROPIC):
            client = oai(gw, **headers)
            expect_refusal_openai(lambda: client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8))
            expect_refusal_openai(lambda: list(client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, stream=True)))
            expect_refusal_openai(lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=8))
            expect_refusal_openai(lambda: list(client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, stream=True)))
            aclient = ant(gw, **headers)
            expect_refusal_anthropic(lambda: aclient.messages.create(
                model=MODEL, max_tokens=8, messages=messages))
            expect_refusal_anthropic(lambda: list(aclient.messages.create(
                model=MODEL, max_tokens=8, messages=messages, stream=True)))
            # PII hidden in an earlier turn or in the system prompt counts too.
            expect_refusal_anthropic(lambda: aclient.messages.create(
                model=MODEL, max_tokens=8, system=prompt,
                messages=[{"role": "user", "content": "Summarize the above."}]))
            refused += 7
    assert standin.requests() == [], "a request with personal data reached the provider"
    assert gw.metric("kinference_gateway_policy_rejects_total",
                     code="local_processing_required") >= refused
    # The refusal is explained too.
    r = requests.post(f"{gw.openai_base}/chat/completions", timeout=30, headers={"x-kinference-debug": "1"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": PII_PROMPTS[0]}]})
    assert r.status_code == 503
    assert "outcome=reject" in r.headers["x-kinference-decision"]
    assert "local_only=" in r.headers["x-kinference-decision"]
    assert standin.requests() == []
