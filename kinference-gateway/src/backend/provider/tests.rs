use serde_json::json;

use super::translate::{AnthropicStream, anthropic_request, chat_from_anthropic, finish_reason};
use crate::api::openai::{ChatCompletionRequest, ChatCompletionResponse, StreamChunk};

fn chat(body: serde_json::Value) -> ChatCompletionRequest {
    serde_json::from_value(body).unwrap()
}

#[test]
fn openai_chat_becomes_an_anthropic_request() {
    let r = chat(json!({
        "model": "qwen",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": "Bye"},
        ],
        "max_tokens": 12,
        "temperature": 0.5,
        "stop": "END",
        "stream": true,
    }));
    let out = anthropic_request(&r, "claude-x", true).unwrap();
    assert_eq!(out["model"], "claude-x");
    assert_eq!(out["max_tokens"], 12);
    assert_eq!(out["system"], "Be brief.");
    assert_eq!(out["messages"].as_array().unwrap().len(), 3);
    assert_eq!(out["messages"][0]["content"], "Hello\nthere");
    assert_eq!(out["stop_sequences"], json!(["END"]));
    assert_eq!(out["temperature"], 0.5);
    assert_eq!(out["stream"], true);
}

#[test]
fn unsupported_parts_and_roles_are_refused_before_sending() {
    let image = chat(json!({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}));
    assert!(anthropic_request(&image, "c", false).is_err());
    let legacy = chat(json!({"model": "m", "messages": [{"role": "function", "content": "x"}]}));
    assert!(anthropic_request(&legacy, "c", false).is_err());
    let bad_arguments = chat(
        json!({"model": "m", "messages": [{"role": "assistant", "content": null,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}),
    );
    assert!(anthropic_request(&bad_arguments, "c", false).is_err());
    let plain = chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}));
    let out = anthropic_request(&plain, "c", false).unwrap();
    assert_eq!(out["max_tokens"], super::translate::DEFAULT_MAX_TOKENS);
    assert!(out.get("stream").is_none());
}

#[test]
fn anthropic_message_becomes_an_openai_chat_completion() {
    let message = json!({
        "id": "msg_abc", "type": "message", "role": "assistant", "model": "claude-x",
        "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}],
        "stop_reason": "max_tokens", "stop_sequence": null,
        "usage": {"input_tokens": 7, "output_tokens": 5, "cache_read_input_tokens": 3},
    });
    let chat = chat_from_anthropic(&message);
    let parsed: ChatCompletionResponse = serde_json::from_value(chat.clone()).unwrap();
    assert_eq!(
        parsed.choices[0].message.content.as_deref(),
        Some("Hello world")
    );
    assert_eq!(parsed.choices[0].finish_reason.as_deref(), Some("length"));
    let usage = parsed.usage.unwrap();
    assert_eq!(usage.prompt_tokens, 10);
    assert_eq!(usage.completion_tokens, 5);
    assert_eq!(usage.cached_tokens(), Some(3));
    assert_eq!(chat["id"], "chatcmpl-abc");
}

#[test]
fn anthropic_stream_becomes_openai_chunks_with_usage_last() {
    let events = [
        json!({"type": "message_start", "message": {"id": "msg_1", "model": "claude-x",
            "usage": {"input_tokens": 4, "output_tokens": 1}}}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "ping"}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
            "usage": {"output_tokens": 2}}),
        json!({"type": "message_stop"}),
    ];
    let mut conv = AnthropicStream::new();
    let mut chunks = Vec::new();
    let mut done = false;
    for e in events {
        let step = conv.event(e.to_string().as_bytes());
        assert!(step.error.is_none());
        chunks.extend(step.chunks);
        done |= step.done;
    }
    assert!(done);
    let parsed: Vec<StreamChunk> = chunks
        .iter()
        .map(|c| serde_json::from_value(c.clone()).unwrap())
        .collect();
    let text: String = parsed
        .iter()
        .flat_map(|c| c.choices.iter().filter_map(|ch| ch.text()))
        .collect();
    assert_eq!(text, "Hi!");
    assert!(parsed.iter().any(|c| {
        c.choices
            .iter()
            .any(|ch| ch.finish_reason.as_deref() == Some("stop"))
    }));
    let last = parsed.last().unwrap();
    assert!(last.choices.is_empty());
    let usage = last.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (4, 2));
    assert_eq!(chunks[0]["id"], "chatcmpl-1");
}

#[test]
fn anthropic_stream_errors_surface() {
    let mut conv = AnthropicStream::new();
    let step = conv.event(
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(step.error.as_deref(), Some("busy"));
}

#[test]
fn stop_reasons_map_to_finish_reasons() {
    assert_eq!(finish_reason(Some("end_turn")), "stop");
    assert_eq!(finish_reason(Some("stop_sequence")), "stop");
    assert_eq!(finish_reason(Some("max_tokens")), "length");
    assert_eq!(finish_reason(Some("tool_use")), "tool_calls");
    assert_eq!(finish_reason(None), "stop");
}

#[test]
fn provider_clients_never_print_their_key_and_follow_spec_changes() {
    use kinference_crds::{ApiStyle, CredentialRef, InferenceProviderSpec, ProviderModel};
    // Never set: the provider has no key.
    let var = "KINFERENCE_TEST_PROVIDER_KEY_UNIT";
    let spec = |url: &str| InferenceProviderSpec {
        base_url: url.into(),
        api_style: ApiStyle::OpenAI,
        credentials: CredentialRef {
            secret_ref: None,
            env: Some(var.into()),
        },
        models: vec![ProviderModel {
            name: "gpt".into(),
            substitutes: vec![],
            classes: vec![],
            prices: None,
        }],
        prices: None,
        timeout_seconds: None,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let providers = super::Providers::new(std::time::Duration::from_secs(1));
        let a = providers.client("p", &spec("http://127.0.0.1:1/v1/"));
        let b = providers.client("p", &spec("http://127.0.0.1:1/v1/"));
        assert!(std::sync::Arc::ptr_eq(&a, &b));
        assert_eq!(a.base_url(), "http://127.0.0.1:1/v1");
        let c = providers.client("p", &spec("http://127.0.0.1:2/v1"));
        assert!(!std::sync::Arc::ptr_eq(&a, &c));
        assert!(!format!("{c:?}").contains("secret"));
        // No key in the environment: skipped without sending anything.
        let r: ChatCompletionRequest =
            chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}));
        let err = c
            .send(super::ProviderRequest::Chat(&r), "gpt", false)
            .await
            .unwrap_err();
        assert!(
            matches!(err, super::ProviderError::Unusable { .. }),
            "{err}"
        );
    });
}

#[test]
fn tools_calls_and_results_become_anthropic_blocks() {
    let r = chat(json!({
        "model": "m",
        "messages": [
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "5 C"}]},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "tool_choice": "required",
        "parallel_tool_calls": false,
        "user": "u-1",
    }));
    let out = anthropic_request(&r, "claude", false).unwrap();
    assert_eq!(
        out["messages"],
        json!([
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "c2", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": "18 C"},
                {"type": "tool_result", "tool_use_id": "c2", "content": "5 C"}]},
        ])
    );
    assert_eq!(
        out["tools"],
        json!([{"name": "get_weather", "description": "Weather",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}])
    );
    assert_eq!(
        out["tool_choice"],
        json!({"type": "any", "disable_parallel_tool_use": true})
    );
    assert_eq!(out["metadata"], json!({"user_id": "u-1"}));
    let named = chat(
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    );
    assert_eq!(
        anthropic_request(&named, "c", false).unwrap()["tool_choice"],
        json!({"type": "tool", "name": "f"})
    );
}

#[test]
fn anthropic_tool_use_becomes_openai_tool_calls_whole_and_streamed() {
    let message = json!({"id": "msg_1", "model": "claude", "stop_reason": "tool_use",
        "content": [{"type": "thinking", "thinking": "Need data."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        "usage": {"input_tokens": 5, "output_tokens": 3}});
    let chat = chat_from_anthropic(&message);
    let parsed: ChatCompletionResponse = serde_json::from_value(chat.clone()).unwrap();
    let reply = &parsed.choices[0].message;
    assert_eq!(reply.content, None);
    assert_eq!(reply.reasoning(), Some("Need data."));
    let call = &reply.tool_calls.as_ref().unwrap()[0];
    assert_eq!(call.id.as_deref(), Some("toolu_1"));
    let function = call.function.as_ref().unwrap();
    assert_eq!(function.name.as_deref(), Some("get_weather"));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(function.arguments.as_deref().unwrap()).unwrap(),
        json!({"city": "Paris"})
    );
    assert_eq!(chat["choices"][0]["finish_reason"], "tool_calls");

    let mut stream = AnthropicStream::new();
    let mut calls = Vec::new();
    for event in [
        json!({"type": "message_start", "message": {"id": "msg_2", "model": "c", "usage": {"input_tokens": 4}}}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Checking."}}),
        json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {}}}),
        json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"city\": "}}),
        json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "\"Oslo\"}"}}),
        json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}}),
    ] {
        for chunk in stream.event(event.to_string().as_bytes()).chunks {
            let chunk: StreamChunk = serde_json::from_value(chunk).unwrap();
            for choice in chunk.choices {
                if let Some(tool_calls) = choice.delta.and_then(|d| d.tool_calls) {
                    calls.extend(tool_calls);
                }
                if let Some(reason) = choice.finish_reason {
                    assert_eq!(reason, "tool_calls");
                }
            }
        }
    }
    assert_eq!(calls.len(), 3);
    assert_eq!(calls[0].id.as_deref(), Some("toolu_9"));
    assert!(calls.iter().all(|c| c.index == Some(0)));
    let arguments: String = calls
        .iter()
        .filter_map(|c| c.function.as_ref()?.arguments.clone())
        .collect();
    assert_eq!(arguments, "{\"city\": \"Oslo\"}");
}
