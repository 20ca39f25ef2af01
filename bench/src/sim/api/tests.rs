use serde_json::json;

use super::error::ApiError;
use super::openai::{PromptInput, parse_chat, parse_completion, usage};

#[test]
fn completion_prompts_of_every_shape() {
    let r = parse_completion(&json!({"prompt": "hi", "max_tokens": 3})).expect("text");
    assert!(matches!(r.prompt, PromptInput::Text(ref t) if t == "hi"));
    assert_eq!(r.max_tokens, Some(3));
    let r = parse_completion(&json!({"prompt": [1, 2, 3]})).expect("ids");
    assert!(matches!(r.prompt, PromptInput::Tokens(ref t) if t == &[1, 2, 3]));
    let r = parse_completion(&json!({"prompt": [[4, 5]]})).expect("nested ids");
    assert!(matches!(r.prompt, PromptInput::Tokens(ref t) if t == &[4, 5]));
}

#[test]
fn bad_requests_are_400_with_vllm_shape() {
    for body in [
        json!({}),
        json!({"prompt": 3}),
        json!({"prompt": "x", "max_tokens": -1}),
        json!({"prompt": "x", "max_tokens": 0}),
        json!({"prompt": "x", "n": 0}),
        json!({"prompt": "x", "logprobs": 21}),
        json!({"prompt": "x", "stream_options": {"include_usage": true}}),
        json!({"prompt": ["a", "b"]}),
        json!({"prompt": "x", "min_tokens": null}),
    ] {
        let e = parse_completion(&body).expect_err("must fail");
        assert_eq!(e.status(), 400, "{body}");
        let v = e.body();
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert_eq!(v["error"]["code"], 400);
    }
    assert!(parse_chat(&json!({"messages": "hi"})).is_err());
    assert!(parse_completion(&json!({"prompt": "x", "min_tokens": 0})).is_ok());
}

#[test]
fn unknown_model_is_404_not_found_error() {
    let v = ApiError::ModelNotFound("nope".into()).body();
    assert_eq!(v["error"]["type"], "NotFoundError");
    assert_eq!(v["error"]["code"], 404);
    assert_eq!(v["error"]["message"], "The model `nope` does not exist.");
}

#[test]
fn usage_details_follow_the_flag() {
    assert_eq!(
        usage(100, 3, 96, true)["prompt_tokens_details"]["cached_tokens"],
        96
    );
    assert!(usage(100, 3, 96, false)["prompt_tokens_details"].is_null());
    assert_eq!(usage(100, 3, 96, true)["total_tokens"], 103);
}

fn weather_request(last_user: &str, tool_choice: serde_json::Value) -> serde_json::Value {
    json!({
        "messages": [{"role": "user", "content": last_user}],
        "tools": [
            {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string"}},
                "required": ["city", "days"]}}}
        ],
        "tool_choice": tool_choice,
    })
}

#[test]
fn tool_calls_follow_the_documented_rule() {
    use super::tools::plan;
    // auto: the tool the last user message names, arguments from `key=value`, required keys only.
    let call = plan(&weather_request(
        "Please call get_weather for city=Paris days=3.",
        json!("auto"),
    ))
    .expect("a call");
    assert_eq!(call.name, "get_weather");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&call.arguments).expect("json"),
        json!({"city": "Paris", "days": 3})
    );
    assert!(call.id.starts_with("chatcmpl-tool-"));
    // No tool named: text. `none`: text. `required`: the first tool. A named function: that one.
    assert!(plan(&weather_request("Hello", json!("auto"))).is_none());
    assert!(plan(&weather_request("call get_weather", json!("none"))).is_none());
    assert_eq!(
        plan(&weather_request("Hello", json!("required"))).map(|c| c.name),
        Some("get_time".into())
    );
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let call = plan(&weather_request("Hello", named)).expect("named");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&call.arguments).expect("json"),
        json!({"city": "sim", "days": 1})
    );
    // After a tool result the model answers in text.
    let mut after = weather_request("call get_weather", json!("auto"));
    after["messages"] = json!([
        {"role": "user", "content": "call get_weather"},
        {"role": "assistant", "content": null, "tool_calls": [call.whole()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"}
    ]);
    assert!(plan(&after).is_none());
    // Without tools nothing is planned, and parse_chat carries the plan.
    assert!(plan(&json!({"messages": [{"role": "user", "content": "get_weather"}]})).is_none());
    let r = parse_chat(&weather_request("get_weather city=Oslo", json!("auto"))).expect("chat");
    assert_eq!(r.tool_call.map(|c| c.name), Some("get_weather".into()));
}

#[test]
fn a_streamed_call_opens_then_carries_every_argument_piece() {
    let call = super::tools::PlannedCall {
        id: "chatcmpl-tool-1".into(),
        name: "f".into(),
        arguments: r#"{"city": "Paris", "days": 3}"#.into(),
    };
    let tokens = 12;
    let mut stream = super::CallStream::new(call.clone(), tokens);
    let deltas: Vec<_> = (0..tokens)
        .filter_map(|i| stream.delta(i, i == tokens - 1))
        .collect();
    assert_eq!(deltas[0], call.opening_delta());
    let arguments: String = deltas[1..]
        .iter()
        .filter_map(|d| d["tool_calls"][0]["function"]["arguments"].as_str())
        .collect();
    assert_eq!(arguments, call.arguments);
    assert!(deltas.len() > 3, "the arguments come in several pieces");
}

#[test]
fn auto_tool_choice_is_what_a_worker_without_a_parser_refuses() {
    use super::tools::wants_auto;
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    assert!(wants_auto(&json!({"tools": tools})));
    assert!(wants_auto(&json!({"tools": tools, "tool_choice": "auto"})));
    assert!(!wants_auto(
        &json!({"tools": tools, "tool_choice": "required"})
    ));
    assert!(!wants_auto(
        &json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    ));
    assert!(!wants_auto(&json!({"tools": [], "tool_choice": "auto"})));
    assert!(!wants_auto(&json!({"messages": []})));
}

#[test]
fn n_and_logprobs_are_read_for_chat_and_completions() {
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "n": 3, "logprobs": true, "top_logprobs": 2});
    let r = parse_chat(&chat).expect("chat");
    assert_eq!((r.n, r.logprobs), (3, Some(2)));
    let r = parse_completion(&json!({"prompt": "hi", "logprobs": 1})).expect("completion");
    assert_eq!((r.n, r.logprobs), (1, Some(1)));
    let r = parse_chat(&json!({"messages": [], "logprobs": false})).expect("no logprobs");
    assert_eq!(r.logprobs, None);
}

#[test]
fn the_api_key_guards_v1_routes_only() {
    use super::surface::authorized;
    let mut headers = http::HeaderMap::new();
    assert!(authorized(None, "/v1/models", &headers));
    assert!(!authorized(Some("k"), "/v1/models", &headers));
    assert!(authorized(Some("k"), "/health", &headers));
    headers.insert(
        http::header::AUTHORIZATION,
        "Bearer k".parse().expect("header"),
    );
    assert!(authorized(Some("k"), "/v1/chat/completions", &headers));
    headers.insert(
        http::header::AUTHORIZATION,
        "Bearer other".parse().expect("header"),
    );
    assert!(!authorized(Some("k"), "/v1/embeddings", &headers));
}

#[test]
fn embeddings_are_unit_vectors_fixed_by_the_tokens() {
    let a = super::surface::embedding_of(&[1, 2, 3]);
    assert_eq!(a.len(), super::surface::EMBEDDING_DIMENSIONS);
    assert!((a.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-5);
    assert_eq!(a, super::surface::embedding_of(&[1, 2, 3]));
    assert_ne!(a, super::surface::embedding_of(&[3, 2, 1]));
}

#[test]
fn cache_salt_is_read_and_checked_as_vllm_does() {
    let r = parse_completion(&json!({"prompt": "x", "cache_salt": "s1"})).expect("salted");
    assert_eq!(r.cache_salt.as_deref(), Some("s1"));
    assert!(
        parse_completion(&json!({"prompt": "x"}))
            .expect("plain")
            .cache_salt
            .is_none()
    );
    for bad in [
        json!(""),
        json!(3),
        json!("a/b"),
        json!("a@b"),
        json!("x".repeat(129)),
    ] {
        let e = parse_completion(&json!({"prompt": "x", "cache_salt": bad})).expect_err("refused");
        assert_eq!(e.status(), 400, "{bad}");
    }
}
