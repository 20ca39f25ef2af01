use bytes::BytesMut;
use serde_json::{Value, json};

use super::*;
use crate::api::openai::{ChatCompletionRequest, ChatCompletionResponse, StreamChunk};
use crate::backend::sse::SseParser;
use crate::errors::GatewayError;

fn request(json: Value) -> Result<ChatCompletionRequest, GatewayError> {
    let req: MessagesRequest =
        serde_json::from_value(json).map_err(|e| GatewayError::MalformedJson(e.to_string()))?;
    req.to_chat_request()
}

#[test]
fn system_blocks_multi_turn_and_sampling_translate() {
    let chat = request(json!({
        "model": "m",
        "max_tokens": 7,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
            {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "b"}]}
        ],
        "stop_sequences": ["\n\nHuman:"],
        "temperature": 0.5,
        "top_k": 4,
        "stream": true
    }))
    .expect("translates");
    assert_eq!(
        chat.messages,
        json!([
            {"role": "system", "content": "Be brief.\nBe kind."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "a\nb"}
        ])
    );
    let body = serde_json::to_value(&chat).expect("serializes");
    assert_eq!(body["max_tokens"], 7);
    assert_eq!(body["stop"], json!(["\n\nHuman:"]));
    assert_eq!(body["temperature"], 0.5);
    assert_eq!(body["top_k"], 4);
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"], json!({"include_usage": true}));
}

#[test]
fn string_system_and_non_stream() {
    let chat = request(json!({"model": "m", "max_tokens": 1, "system": "S",
        "messages": [{"role": "user", "content": "x"}]}))
    .expect("translates");
    assert_eq!(chat.messages[0], json!({"role": "system", "content": "S"}));
    assert_eq!(chat.stream, Some(false));
    assert!(chat.stream_options.is_none());
}

#[test]
fn rejections_are_clear_400s() {
    let cases = [
        (
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
            "max_tokens",
        ),
        (
            json!({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
            "max_tokens",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": []}),
            "messages",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}),
            "document",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}),
            "file",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "t"}]}),
            "input_schema",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                   "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            "web_search_20250305",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                   "tool_choice": {"type": "any"}}),
            "tool_choice",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                   "tools": [{"name": "a", "input_schema": {"type": "object"}}],
                   "tool_choice": {"type": "tool", "name": "b"}}),
            "no tool named `b`",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                   "thinking": {"type": "enabled", "budget_tokens": 5}}),
            "budget_tokens",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
                {"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]}),
            "assistant turns",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "thinking", "thinking": "x"}]}]}]}),
            "text and images are",
        ),
    ];
    for (json, needle) in cases {
        let err = request(json.clone()).expect_err("rejected");
        assert_eq!(err.status().as_u16(), 400, "{json}");
        assert!(
            err.to_string().contains(needle),
            "{err} should mention {needle}"
        );
    }
    let err = request(
        json!({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}),
    )
    .expect_err("bad role");
    assert_eq!(err.status().as_u16(), 400);
}

#[test]
fn stop_reasons_map() {
    assert_eq!(stop_reason(Some("length"), None), ("max_tokens", None));
    assert_eq!(stop_reason(Some("stop"), None), ("end_turn", None));
    assert_eq!(
        stop_reason(Some("stop"), Some(&json!("END"))),
        ("stop_sequence", Some("END".to_string()))
    );
    // vLLM reports an EOS token id, not a string: a natural end.
    assert_eq!(
        stop_reason(Some("stop"), Some(&json!(151645))),
        ("end_turn", None)
    );
}

#[test]
fn non_stream_response_translates_with_cache_usage() {
    let chat: ChatCompletionResponse = serde_json::from_value(json!({
        "id": "chatcmpl-abc123",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "length", "stop_reason": null}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45, "prompt_tokens_details": {"cached_tokens": 32}}
    }))
    .expect("parses");
    let message = message_from_chat(&chat, "m").expect("translates");
    assert_eq!(message["id"], "msg_abc123");
    assert_eq!(message["type"], "message");
    assert_eq!(
        message["content"],
        json!([{"type": "text", "text": "Hello!"}])
    );
    assert_eq!(message["stop_reason"], "max_tokens");
    assert_eq!(
        message["usage"],
        json!({"input_tokens": 8, "output_tokens": 5, "cache_read_input_tokens": 32, "cache_creation_input_tokens": 0})
    );
}

fn chunk(v: Value) -> StreamChunk {
    serde_json::from_value(v).expect("chunk")
}

#[test]
fn stream_event_sequence() {
    let mut t = StreamTranslator::new("m", "msg_1".into());
    let mut out = BytesMut::new();
    t.start(&mut out, 12);
    t.chunk(
        &mut out,
        &chunk(json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})),
    );
    t.chunk(
        &mut out,
        &chunk(json!({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})),
    );
    t.chunk(&mut out, &chunk(json!({"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop", "stop_reason": "END"}]})));
    t.chunk(&mut out, &chunk(json!({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 0}}})));
    assert!(t.finished());
    t.finish(&mut out);

    let mut parser = SseParser::new();
    parser.feed(&out);
    let events: Vec<(String, Value)> = std::iter::from_fn(|| parser.next_event())
        .map(|e| {
            let data: Value = serde_json::from_slice(&e.data).expect("json data");
            let name = e.event.expect("named");
            assert_eq!(data["type"], name.as_str());
            (name, data)
        })
        .collect();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        vec![
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert_eq!(events[0].1["message"]["usage"]["input_tokens"], 12);
    assert_eq!(
        events[3].1["delta"],
        json!({"type": "text_delta", "text": "Hel"})
    );
    assert_eq!(
        events[6].1["delta"],
        json!({"stop_reason": "stop_sequence", "stop_sequence": "END"})
    );
    assert_eq!(events[6].1["usage"]["output_tokens"], 2);
    assert_eq!(events[6].1["usage"]["input_tokens"], 12);
}

const WEATHER_SCHEMA: &str =
    r#"{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}"#;

fn weather_tool() -> Value {
    json!({"name": "get_weather", "description": "Weather in a city",
           "input_schema": serde_json::from_str::<Value>(WEATHER_SCHEMA).expect("schema"),
           "cache_control": {"type": "ephemeral"}})
}

#[test]
fn tools_and_a_tool_round_trip_translate() {
    let chat = request(json!({
        "model": "m",
        "max_tokens": 50,
        "tools": [weather_tool()],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
        "metadata": {"user_id": "u-42"},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Lyon"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
                 "content": [{"type": "text", "text": "station offline"}]},
                {"type": "text", "text": "Summarize.", "cache_control": {"type": "ephemeral"}}
            ]}
        ]
    }))
    .expect("translates");
    assert_eq!(
        chat.messages,
        json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Lyon\"}"}}
            ]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: station offline"},
            {"role": "user", "content": "Summarize."}
        ])
    );
    let body = serde_json::to_value(&chat).expect("serializes");
    assert_eq!(
        body["tools"],
        json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                "parameters": serde_json::from_str::<Value>(WEATHER_SCHEMA).expect("schema")}}])
    );
    assert_eq!(body["tool_choice"], "required");
    assert_eq!(body["parallel_tool_calls"], false);
    assert_eq!(body["user"], "u-42");
}

/// `strict` reaches the worker: vLLM 0.32 constrains a forced call's arguments to the schema only for a
/// strict function (otherwise any JSON, a string included, which no `tool_use` input can carry).
#[test]
fn a_strict_tool_stays_strict() {
    let strict = |tool: Value| {
        let chat = request(json!({"model": "m", "max_tokens": 5, "tools": [tool],
                                  "messages": [{"role": "user", "content": "Hi"}]}))
        .expect("translates");
        serde_json::to_value(&chat).expect("serializes")["tools"][0]["function"]["strict"].clone()
    };
    let mut tool = weather_tool();
    assert_eq!(strict(tool.clone()), Value::Null);
    tool["strict"] = json!(true);
    assert_eq!(strict(tool), json!(true));
}

#[test]
fn tool_choice_forms_translate() {
    let choice = |c: Value| {
        let chat = request(
            json!({"model": "m", "max_tokens": 5, "tools": [weather_tool()],
            "tool_choice": c, "messages": [{"role": "user", "content": "x"}]}),
        )
        .expect("translates");
        let body = serde_json::to_value(&chat).expect("serializes");
        (
            body["tool_choice"].clone(),
            body.get("parallel_tool_calls").cloned(),
        )
    };
    assert_eq!(choice(json!({"type": "auto"})), (json!("auto"), None));
    assert_eq!(choice(json!({"type": "none"})), (json!("none"), None));
    assert_eq!(
        choice(json!({"type": "tool", "name": "get_weather"})),
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            None
        )
    );
    // No tools, no tool_choice: the worker's request carries neither.
    let body = serde_json::to_value(
        request(
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
        )
        .expect("translates"),
    )
    .expect("serializes");
    assert!(body.get("tools").is_none() && body.get("tool_choice").is_none());
}

#[test]
fn tool_only_assistant_turn_has_null_content() {
    let chat = request(json!({"model": "m", "max_tokens": 5, "tools": [weather_tool()], "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1"}]}
    ]}))
    .expect("translates");
    assert_eq!(chat.messages[1]["content"], Value::Null);
    assert_eq!(
        chat.messages[1]["tool_calls"][0]["function"]["arguments"],
        "{}"
    );
    // A user turn of tool results only adds no empty user message.
    assert_eq!(
        chat.messages[2],
        json!({"role": "tool", "tool_call_id": "c1", "content": ""})
    );
    assert_eq!(chat.messages.as_array().map(Vec::len), Some(3));
}

#[test]
fn images_become_image_url_parts() {
    let chat = request(json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}, "cache_control": {"type": "ephemeral"}}
    ]}]}))
    .expect("translates");
    assert_eq!(
        chat.messages[0]["content"],
        json!([
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}
        ])
    );
}

#[test]
fn thinking_switches_the_template_and_sends_its_budget() {
    let chat = |thinking: Value| {
        let chat = request(
            json!({"model": "m", "max_tokens": 2000, "thinking": thinking,
            "messages": [{"role": "user", "content": "x"}]}),
        )
        .expect("translates");
        serde_json::to_value(&chat).expect("serializes")
    };
    let enabled = chat(json!({"type": "enabled", "budget_tokens": 1024}));
    assert_eq!(
        enabled["chat_template_kwargs"],
        json!({"enable_thinking": true, "thinking_budget": 1024})
    );
    assert_eq!(enabled["thinking_token_budget"], json!(1024));
    let disabled = chat(json!({"type": "disabled"}));
    assert_eq!(
        disabled["chat_template_kwargs"],
        json!({"enable_thinking": false})
    );
    assert!(disabled.get("thinking_token_budget").is_none());
}

#[test]
fn count_tokens_prompt_needs_no_max_tokens() {
    let req: MessagesRequest =
        serde_json::from_value(json!({"model": "m", "tools": [weather_tool()],
        "system": "S", "messages": [{"role": "user", "content": "x"}]}))
        .expect("parses");
    let prompt = req.chat_prompt().expect("translates");
    assert_eq!(prompt.messages.len(), 2);
    assert_eq!(prompt.tools.as_ref().map(Vec::len), Some(1));
    assert!(req.to_chat_request().is_err());
}

#[test]
fn non_stream_tool_calls_and_reasoning_become_blocks() {
    let chat: ChatCompletionResponse = serde_json::from_value(json!({
        "id": "chatcmpl-9",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null,
            "reasoning_content": "Need the weather.",
            "tool_calls": [{"id": "chatcmpl-tool-1", "type": "function",
                            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            "finish_reason": "tool_calls", "stop_reason": null}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}
    }))
    .expect("parses");
    let message = message_from_chat(&chat, "m").expect("translates");
    assert_eq!(
        message["content"],
        json!([
            {"type": "thinking", "thinking": "Need the weather.", "signature": ""},
            {"type": "tool_use", "id": "chatcmpl-tool-1", "name": "get_weather", "input": {"city": "Paris"}}
        ])
    );
    assert_eq!(message["stop_reason"], "tool_use");

    // vLLM answers a call forced by a named tool_choice with finish_reason `stop`.
    let mut forced = chat.clone();
    forced.choices[0].finish_reason = Some("stop".into());
    assert_eq!(
        message_from_chat(&forced, "m").expect("translates")["stop_reason"],
        "tool_use"
    );

    let bad: ChatCompletionResponse = serde_json::from_value(json!({"id": "x", "choices": [{"index": 0,
        "message": {"content": null, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]},
        "finish_reason": "tool_calls"}]}))
    .expect("parses");
    let err = message_from_chat(&bad, "m").expect_err("not an object");
    assert!(err.to_string().contains("`f`"), "{err}");
}

fn events_of(out: &BytesMut) -> Vec<(String, Value)> {
    let mut parser = SseParser::new();
    parser.feed(out);
    std::iter::from_fn(|| parser.next_event())
        .map(|e| {
            let data: Value = serde_json::from_slice(&e.data).expect("json data");
            let name = e.event.expect("named");
            assert_eq!(data["type"], name.as_str());
            (name, data)
        })
        .collect()
}

#[test]
fn stream_tool_calls_become_tool_use_blocks_with_json_deltas() {
    let mut t = StreamTranslator::new("m", "msg_2".into());
    let mut out = BytesMut::new();
    t.start(&mut out, 3);
    for c in [
        json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        json!({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]}),
        json!({"choices": [{"index": 0, "delta": {"content": "Checking."}}]}),
        json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather"}}]}}]}),
        json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": "}}]}}]}),
        json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}}]}),
        json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}}]}),
        json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
    ] {
        t.chunk(&mut out, &chunk(c));
    }
    t.finish(&mut out);
    let events = events_of(&out);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        vec![
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert_eq!(events[1].1["content_block"]["type"], "thinking");
    assert_eq!(
        events[5].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    assert_eq!(
        events[8].1,
        json!({"type": "content_block_start", "index": 2, "content_block":
               {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {}}})
    );
    let json: String = events[9..11]
        .iter()
        .map(|(_, e)| {
            assert_eq!(e["delta"]["type"], "input_json_delta");
            assert_eq!(e["index"], 2);
            e["delta"]["partial_json"]
                .as_str()
                .expect("piece")
                .to_string()
        })
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&json).expect("whole JSON"),
        json!({"city": "Paris"})
    );
    assert_eq!(events[12].1["content_block"]["name"], "get_time");
    assert_eq!(events[12].1["index"], 3);
    assert_eq!(events[15].1["delta"]["stop_reason"], "tool_use");
}

#[test]
fn stream_repeating_ids_stay_one_block_and_empty_stream_has_a_text_block() {
    let mut t = StreamTranslator::new("m", "msg_3".into());
    let mut out = BytesMut::new();
    for piece in ["{\"a\"", ": 1}"] {
        t.chunk(
            &mut out,
            &chunk(json!({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "same", "function": {"name": "f", "arguments": piece}}]}}]})),
        );
    }
    t.finish(&mut out);
    let starts = events_of(&out)
        .iter()
        .filter(|(n, _)| n == "content_block_start")
        .count();
    assert_eq!(starts, 1);

    let mut t = StreamTranslator::new("m", "msg_4".into());
    let mut out = BytesMut::new();
    t.finish(&mut out);
    let names: Vec<String> = events_of(&out).into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        vec![
            "message_start",
            "content_block_start",
            "ping",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
}

fn qwen2() -> kinference_api::tokenize::ModelTokenizer {
    let dir = std::env::var_os("KINFERENCE_TOKENIZER_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.assets/qwen2"))
        });
    kinference_api::tokenize::ModelTokenizer::from_dir(&dir).unwrap_or_else(|e| {
        panic!(
            "no tokenizer at {}: run `cargo xtask setup` ({e})",
            dir.display()
        )
    })
}

#[test]
fn count_tokens_renders_tools_and_needs_a_tokenizer() {
    let tok = qwen2();
    let parse = |v: Value| serde_json::from_value::<MessagesRequest>(v).expect("parses");
    let plain =
        parse(json!({"model": "m", "messages": [{"role": "user", "content": "Hello there"}]}));
    let with_tools = parse(json!({"model": "m", "tools": [weather_tool()],
        "messages": [{"role": "user", "content": "Hello there"}]}));
    let n = count_tokens::count(Some(&tok), &plain).expect("counts");
    // The chat template's own tokens plus the text's: exactly the worker's prompt_tokens.
    let expected = tok
        .encode_chat(&json!([{"role": "user", "content": "Hello there"}]))
        .expect("encodes")
        .len();
    assert_eq!(n, expected);
    assert!(count_tokens::count(Some(&tok), &with_tools).expect("counts") > n + 20);
    let err = count_tokens::count(None, &plain).expect_err("no tokenizer");
    assert_eq!(err.status().as_u16(), 400);
    assert!(err.to_string().contains("tokenizer_dir"), "{err}");
    // An image is left out of the count rather than refused.
    let image = parse(
        json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello there"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]}),
    );
    assert_eq!(count_tokens::count(Some(&tok), &image).expect("counts"), n);
}

#[test]
fn images_a_tool_returned_follow_its_result_in_a_user_message() {
    let chat = request(json!({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "s1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "s1", "content": [
                {"type": "text", "text": "Here it is."},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]},
            {"type": "text", "text": "What do you see?"}]}
    ]}))
    .expect("translates");
    assert_eq!(
        chat.messages[2],
        json!({"role": "tool", "tool_call_id": "s1", "content": "Here it is."})
    );
    assert_eq!(
        chat.messages[3],
        json!({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "What do you see?"}]})
    );
}
