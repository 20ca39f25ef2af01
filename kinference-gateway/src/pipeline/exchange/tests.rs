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
        assert_eq!(
            renamed.output_limit(Endpoint::Completions),
            r.output_limit(Endpoint::Completions)
        );
    }
}

#[test]
fn the_worker_is_sent_exactly_the_output_limit_reserved() {
    // Two limits that disagree: the largest is reserved, and both say it to the worker.
    let mut r = parse(
        Endpoint::ChatCompletions,
        body(
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1, "max_completion_tokens": 400}),
        ),
    )
    .unwrap();
    assert_eq!(r.output_limit(Endpoint::ChatCompletions), Some(400));
    r.limit_output(Endpoint::ChatCompletions, 400, false)
        .unwrap();
    let sent = worker_json(&r);
    assert_eq!(
        (
            sent["max_tokens"].clone(),
            sent["max_completion_tokens"].clone()
        ),
        (json!(400), json!(400))
    );
    // A renamed copy keeps it.
    let renamed = worker_json(&r.for_model("other").unwrap());
    assert_eq!(renamed["max_completion_tokens"], 400);

    // None set: added only when a bucket holds the reservation.
    let client = body(json!({"model": "m", "prompt": "hi"}));
    let mut r = parse(Endpoint::Completions, client.clone()).unwrap();
    assert_eq!(r.output_limit(Endpoint::Completions), None);
    r.limit_output(Endpoint::Completions, 16, false).unwrap();
    assert_eq!(r.body, client, "nothing reserved: the body as sent");
    r.limit_output(Endpoint::Completions, 16, true).unwrap();
    assert_eq!(worker_json(&r)["max_tokens"], 16);

    // A response's `max_output_tokens`.
    let mut r = parse(
        Endpoint::Responses,
        body(json!({"model": "m", "input": "hi", "max_output_tokens": 9})),
    )
    .unwrap();
    assert_eq!(r.output_limit(Endpoint::Responses), Some(9));
    r.limit_output(Endpoint::Responses, 9, true).unwrap();
    assert_eq!(worker_json(&r)["max_output_tokens"], 9);
    // Embeddings generate nothing: nothing to limit.
    let client = body(json!({"model": "m", "input": "hi"}));
    let mut r = parse(Endpoint::Embeddings, client.clone()).unwrap();
    r.limit_output(Endpoint::Embeddings, 5, true).unwrap();
    assert_eq!(r.body, client);
}

#[test]
fn a_session_is_named_by_the_header_then_safety_identifier_then_user() {
    let chat = |extra: Value| {
        let mut b = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        parse(Endpoint::ChatCompletions, body(b)).unwrap()
    };
    let both = chat(json!({"user": "u-1", "safety_identifier": "sid-1"}));
    assert_eq!(both.session_name(Some("conv-9")).as_deref(), Some("conv-9"));
    assert_eq!(both.session_name(None).as_deref(), Some("sid-1"));
    assert_eq!(both.session_name(Some("")).as_deref(), Some("sid-1"));
    let user = chat(json!({"user": "u-1"}));
    assert_eq!(user.session_name(None).as_deref(), Some("u-1"));
    assert_eq!(chat(json!({"user": ""})).session_name(None), None);
    assert_eq!(chat(json!({"user": 7})).session_name(None), None);

    let completion = parse(
        Endpoint::Completions,
        body(json!({"model": "m", "prompt": "hi", "user": "u-2"})),
    )
    .unwrap();
    assert_eq!(completion.session_name(None).as_deref(), Some("u-2"));

    // Anthropic's metadata.user_id arrives as the translated request's `user`.
    let messages = parse(
        Endpoint::Messages,
        body(json!({
            "model": "m",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"user_id": "anthropic-user"}
        })),
    )
    .unwrap();
    assert_eq!(
        messages.session_name(None).as_deref(),
        Some("anthropic-user")
    );

    let responses = parse(
        Endpoint::Responses,
        body(json!({"model": "m", "input": "hi", "safety_identifier": "r-1"})),
    )
    .unwrap();
    assert_eq!(responses.session_name(None).as_deref(), Some("r-1"));
}
