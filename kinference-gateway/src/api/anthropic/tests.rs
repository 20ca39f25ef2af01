use super::*;
use crate::backend::sse::SseParser;

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
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            "image",
        ),
        (
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{}]}),
            "tools",
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
    let message = message_from_chat(&chat, "m");
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
