use serde_json::json;

use super::*;

fn worker_to_anthropic_client() -> Spec {
    Spec {
        style: ApiStyle::OpenAI,
        label: "http://10.0.0.7:8000".into(),
        shape: ClientShape::Anthropic {
            model: "m".into(),
            input_tokens: 0,
        },
        protocol: Protocol::Anthropic,
        idle_timeout: Duration::from_secs(30),
        pass_through: false,
        limits: UpstreamLimits::default(),
    }
}

#[test]
fn a_workers_in_stream_refusal_reaches_the_client_with_its_status_and_message() {
    // What vLLM 0.32 streams for an image sent to a text-only model: status 200, then this chunk.
    let refusal = json!({
        "message": "qwen2 is not a multimodal model",
        "type": "BadRequestError",
        "param": null,
        "code": 400
    });
    let error = worker_to_anthropic_client().stream_error(&refusal);
    assert_eq!(error.status(), StatusCode::BAD_REQUEST);
    assert_eq!(error.client_message(), "qwen2 is not a multimodal model");
    let event = String::from_utf8(error.stream_event(Protocol::Anthropic).to_vec()).unwrap();
    assert!(event.contains("invalid_request_error"), "{event}");
    assert!(event.contains("not a multimodal model"), "{event}");
    // A code written as a string counts the same.
    let as_text = json!({"message": "too long", "code": "400"});
    let error = worker_to_anthropic_client().stream_error(&as_text);
    assert_eq!(error.status(), StatusCode::BAD_REQUEST);
}

#[test]
fn a_workers_own_failure_in_the_stream_stays_a_bad_upstream() {
    for failure in [
        json!({"message": "engine dead", "code": 500}),
        json!({"message": "no code at all"}),
        json!({"message": "odd code", "code": "oops"}),
        json!({"message": "out of range", "code": 70000}),
    ] {
        let error = worker_to_anthropic_client().stream_error(&failure);
        assert_eq!(error.status(), StatusCode::BAD_GATEWAY, "{failure}");
        // The worker's address stays out of what the client reads.
        assert!(!error.client_message().contains("10.0.0.7"), "{failure}");
    }
}
