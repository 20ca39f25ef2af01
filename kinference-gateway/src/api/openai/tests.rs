use super::*;
use serde_json::json;

#[test]
fn chat_request_round_trips_unknown_fields() {
    let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"top_k":3,"stream":true}"#;
    let mut req: ChatCompletionRequest = parse_body(body).expect("parses");
    req.validate().expect("valid");
    assert!(!force_include_usage(&mut req.stream_options));
    let out: Value = serde_json::to_value(&req).expect("serializes");
    assert_eq!(out["top_k"], 3);
    assert_eq!(out["max_tokens"], 5);
    assert_eq!(out["stream_options"], json!({"include_usage": true}));
}

#[test]
fn client_asked_usage_is_reported() {
    let mut options = Some(StreamOptions {
        include_usage: Some(true),
        extra: Map::new(),
    });
    assert!(force_include_usage(&mut options));
}

#[test]
fn malformed_and_invalid_requests() {
    let err = parse_body::<ChatCompletionRequest>(b"{not json").unwrap_err();
    assert_eq!(err.status().as_u16(), 400);
    let err = parse_body::<ChatCompletionRequest>(br#"{"messages":[]}"#).unwrap_err();
    assert!(err.to_string().contains("model"), "{err}");
    let req: ChatCompletionRequest = parse_body(br#"{"model":"m","messages":[]}"#).expect("parses");
    assert!(matches!(
        req.validate(),
        Err(GatewayError::InvalidRequest {
            param: Some("messages"),
            ..
        })
    ));
    let req: CompletionRequest = parse_body(br#"{"model":"m","prompt":5}"#).expect("parses");
    assert!(req.validate().is_err());
}

#[test]
fn completion_prompt_text_for_routing() {
    let req: CompletionRequest =
        parse_body(br#"{"model":"m","prompt":["first","second"]}"#).expect("parses");
    assert_eq!(req.prompt_text(), "first");
    let req: CompletionRequest = parse_body(br#"{"model":"m","prompt":[1,2,3]}"#).expect("parses");
    assert_eq!(req.prompt_text(), "");
}

#[test]
fn token_id_prompts_route_on_their_ids() {
    use crate::routing::Prompt;
    let ids = |body: &[u8]| -> Vec<u64> {
        let req: CompletionRequest = parse_body(body).expect("parses");
        match req.routing_prompt() {
            Prompt::Ids(ids) => ids.iter().filter_map(serde_json::Value::as_u64).collect(),
            other => panic!("not ids: {other:?}"),
        }
    };
    assert_eq!(ids(br#"{"model":"m","prompt":[1,2,3]}"#), vec![1, 2, 3]);
    // A batch of token-id prompts routes on the first, as a list of strings does.
    assert_eq!(ids(br#"{"model":"m","prompt":[[4,5],[6]]}"#), vec![4, 5]);
    let req: CompletionRequest = parse_body(br#"{"model":"m","prompt":"text"}"#).expect("parses");
    assert!(matches!(req.routing_prompt(), Prompt::Text("text")));
}

#[test]
fn stream_chunks_chat_completion_and_usage() {
    let chat: StreamChunk = serde_json::from_str(
        r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" hi"},"finish_reason":null}]}"#,
    )
    .expect("parses");
    assert!(chat.has_text());
    let role: StreamChunk = serde_json::from_str(
        r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
    )
    .expect("parses");
    assert!(!role.has_text());
    let completion: StreamChunk = serde_json::from_str(
        r#"{"choices":[{"index":0,"text":" static","finish_reason":"length"}]}"#,
    )
    .expect("parses");
    assert!(completion.has_text());
    let usage: StreamChunk = serde_json::from_str(
        r#"{"choices":[],"usage":{"prompt_tokens":100,"total_tokens":103,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":96}}}"#,
    )
    .expect("parses");
    let u = usage.usage.expect("usage");
    assert_eq!(
        (u.prompt_tokens, u.completion_tokens, u.cached_tokens()),
        (100, 3, Some(96))
    );
}

#[test]
fn upstream_error_messages_in_both_vllm_shapes() {
    assert_eq!(
        UpstreamErrorBody::message_from(
            br#"{"error":{"message":"too long","type":"BadRequestError"}}"#
        ),
        "too long"
    );
    assert_eq!(
        UpstreamErrorBody::message_from(br#"{"object":"error","message":"old shape"}"#),
        "old shape"
    );
    assert_eq!(UpstreamErrorBody::message_from(b"plain"), "plain");
}

#[test]
fn models_list_shape() {
    let card = |id: &str, kind, root: Option<&str>| ModelCard {
        id: id.into(),
        owned_by: "kinference".into(),
        kind,
        root: root.map(str::to_string),
        members: vec!["a".into()],
    };
    let v = models_response(&[
        card("a", ModelKind::Model, Some("a")),
        card("fast", ModelKind::Alias, Some("a")),
        card("small", ModelKind::Class, None),
    ]);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "a");
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["parent"], Value::Null);
    assert_eq!(v["data"][1]["parent"], "a");
    assert_eq!(v["data"][1]["kind"], "alias");
    assert_eq!(v["data"][2]["members"], json!(["a"]));
    assert_eq!(v["data"][2]["owned_by"], "kinference");
}

#[test]
fn splicing_include_usage_keeps_the_body_valid() {
    let body = br#"  {"model":"m","stream":true,"messages":[]}"#;
    let spliced = splice_include_usage(body).expect("object");
    let v: Value = serde_json::from_slice(&spliced).expect("valid json");
    assert_eq!(v["stream_options"], json!({"include_usage": true}));
    assert_eq!(v["model"], "m");
    assert_eq!(v["stream"], true);
    let v: Value =
        serde_json::from_slice(&splice_include_usage(b"{}").expect("object")).expect("json");
    assert_eq!(v, json!({"stream_options": {"include_usage": true}}));
    assert!(splice_include_usage(b"[1]").is_none());
}

#[test]
fn unknown_members_stay_json_text_and_round_trip() {
    let body = br#"{"model":"m","prompt":"x","padding":[0,0,0],"logit_bias":{"1":-100},"n":2}"#;
    let req: CompletionRequest = parse_body(body).expect("parses");
    assert_eq!(req.extra.get("padding"), Some(json!([0, 0, 0])));
    assert_eq!(req.extra.u64("n"), Some(2));
    assert!(
        !req.extra.contains_key("model"),
        "known members are taken out"
    );
    let out: Value = serde_json::to_value(&req).expect("serializes");
    assert_eq!(
        out,
        json!({"model": "m", "prompt": "x", "padding": [0, 0, 0], "logit_bias": {"1": -100}, "n": 2})
    );
    // Read from a parsed tree too (the policy stage's), with the same result.
    let from_tree: CompletionRequest =
        serde_json::from_value(serde_json::from_slice(body).unwrap()).expect("from a Value");
    assert_eq!(from_tree.extra.get("logit_bias"), Some(json!({"1": -100})));
    // A known member of the wrong type is refused, naming it.
    let err = parse_body::<ChatCompletionRequest>(br#"{"model":"m","messages":[],"stream":"yes"}"#)
        .unwrap_err();
    assert!(err.to_string().contains("stream"), "{err}");
}
