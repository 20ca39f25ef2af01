use bytes::Bytes;
use serde_json::{Value, json};

use super::*;

fn body(v: Value) -> Bytes {
    Bytes::from(v.to_string())
}

fn worker_json(r: &Request) -> Value {
    serde_json::from_slice(&r.body).unwrap()
}

#[test]
fn chat_and_completion_bodies_pass_through_unless_a_stream_needs_its_usage() {
    for (endpoint, request) in [
        (
            Endpoint::ChatCompletions,
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (Endpoint::Completions, json!({"model": "m", "prompt": "hi"})),
    ] {
        let client = body(request.clone());
        let r = parse(endpoint, client.clone()).unwrap();
        assert_eq!(r.model(), "m");
        assert!(!r.stream);
        assert_eq!(r.body, client, "{endpoint:?}: forwarded byte for byte");

        let mut streamed = request.clone();
        streamed["stream"] = json!(true);
        let r = parse(endpoint, body(streamed)).unwrap();
        assert!(r.stream && !r.client_wants_usage);
        assert_eq!(
            worker_json(&r)["stream_options"],
            json!({"include_usage": true})
        );

        let mut asked = request.clone();
        asked["stream"] = json!(true);
        asked["stream_options"] = json!({"include_usage": true});
        let r = parse_as(endpoint, body(asked), true).unwrap();
        assert!(r.client_wants_usage && r.json.is_some());
    }
}

#[test]
fn both_kinds_are_checked_and_renamed_for_another_served_model() {
    assert!(
        parse(
            Endpoint::ChatCompletions,
            body(json!({"model": "m", "messages": []}))
        )
        .is_err()
    );
    assert!(
        parse(
            Endpoint::Completions,
            body(json!({"model": "m", "prompt": []}))
        )
        .is_err()
    );

    let chat = parse(
        Endpoint::ChatCompletions,
        body(json!({"model": "alias", "messages": [{"role": "user", "content": "hi"}]})),
    )
    .unwrap();
    let completion = parse(
        Endpoint::Completions,
        body(json!({"model": "alias", "prompt": "hi", "max_tokens": 3})),
    )
    .unwrap();
    for r in [chat, completion] {
        let renamed = r.for_model("served").unwrap();
        assert_eq!(renamed.model(), "served");
        let sent = worker_json(&renamed);
        assert_eq!(sent["model"], "served");
        assert_eq!(renamed.client_body, r.client_body);
        assert_eq!(renamed.fields().1, r.fields().1);
    }
}
