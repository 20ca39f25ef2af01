use super::*;

fn all_errors() -> Vec<GatewayError> {
    vec![
        GatewayError::MalformedJson("expected value".into()),
        GatewayError::invalid("max_tokens", "max_tokens: Field required"),
        GatewayError::UnknownModel("nope".into()),
        GatewayError::BodyTooLarge { limit: 10 },
        GatewayError::NotFound {
            method: "GET".into(),
            path: "/x".into(),
        },
        GatewayError::NoHealthyWorker("m".into()),
        GatewayError::WorkerUnreachable {
            worker: "http://w".into(),
            detail: "refused".into(),
        },
        GatewayError::BadUpstream {
            worker: "http://w".into(),
            detail: "eof".into(),
        },
        GatewayError::UpstreamTimeout {
            worker: "http://w".into(),
            what: "idle",
        },
        GatewayError::UpstreamRejected {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            message: "too long".into(),
        },
    ]
}

#[test]
fn statuses_follow_the_contract() {
    let statuses: Vec<u16> = all_errors().iter().map(|e| e.status().as_u16()).collect();
    assert_eq!(
        statuses,
        vec![400, 400, 404, 413, 404, 503, 502, 502, 504, 422]
    );
}

#[test]
fn openai_shape_has_message_type_param_code() {
    for error in all_errors() {
        let body = error.body(Protocol::OpenAi);
        let inner = &body["error"];
        assert!(inner["message"].is_string(), "{body}");
        assert!(inner["type"].is_string(), "{body}");
        assert!(inner.get("param").is_some(), "{body}");
        assert!(inner.get("code").is_some(), "{body}");
    }
    let body = GatewayError::UnknownModel("nope".into()).body(Protocol::OpenAi);
    assert_eq!(body["error"]["param"], "model");
    assert_eq!(body["error"]["code"], "model_not_found");
    assert_eq!(body["error"]["type"], "not_found_error");
}

#[test]
fn anthropic_shape_and_types() {
    let types: Vec<String> = all_errors()
        .iter()
        .map(|e| {
            let body = e.body(Protocol::Anthropic);
            assert_eq!(body["type"], "error");
            assert!(body["error"]["message"].is_string());
            body["error"]["type"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(
        types,
        vec![
            "invalid_request_error",
            "invalid_request_error",
            "not_found_error",
            "request_too_large",
            "not_found_error",
            "overloaded_error",
            "api_error",
            "api_error",
            "timeout_error",
            "invalid_request_error",
        ]
    );
}

#[test]
fn stream_events_in_each_protocol() {
    let error = GatewayError::BadUpstream {
        worker: "http://w".into(),
        detail: "eof".into(),
    };
    let openai = error.stream_event(Protocol::OpenAi);
    assert!(openai.starts_with(b"data: {\"error\":"));
    assert!(openai.ends_with(b"\n\n"));
    let anthropic = error.stream_event(Protocol::Anthropic);
    assert!(anthropic.starts_with(b"event: error\ndata: {"));
    let json: serde_json::Value =
        serde_json::from_slice(&anthropic[b"event: error\ndata: ".len()..]).expect("json");
    assert_eq!(json["error"]["type"], "api_error");
}

#[test]
fn response_carries_status_and_json() {
    let response = GatewayError::BodyTooLarge { limit: 1 }.into_response(Protocol::OpenAi);
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        HeaderValue::from_static("application/json")
    );
}

#[test]
fn a_shed_request_is_a_503_in_the_clients_protocol_with_retry_after() {
    let shed = GatewayError::Overloaded {
        reason: "queue_timeout",
        retry_after_s: 2,
    };
    for protocol in [Protocol::OpenAi, Protocol::Anthropic] {
        let response = shed.into_response(protocol);
        assert_eq!(response.status(), 503);
        assert_eq!(response.headers()["retry-after"], "2");
    }
    let openai = shed.body(Protocol::OpenAi);
    assert_eq!(openai["error"]["code"], "overloaded");
    assert_eq!(openai["error"]["type"], "service_unavailable_error");
    let anthropic = shed.body(Protocol::Anthropic);
    assert_eq!(anthropic["error"]["type"], "overloaded_error");

    let slow = GatewayError::BodyTimeout { timeout_ms: 500 };
    assert_eq!(slow.status(), 408);
    assert_eq!(
        slow.body(Protocol::OpenAi)["error"]["type"],
        "timeout_error"
    );
    assert_eq!(
        slow.body(Protocol::Anthropic)["error"]["type"],
        "timeout_error"
    );
}

#[test]
fn worker_addresses_stay_out_of_client_errors() {
    let worker = "http://10.1.2.3:8000".to_string();
    for error in [
        GatewayError::WorkerUnreachable {
            worker: worker.clone(),
            detail: "connection refused".into(),
        },
        GatewayError::BadUpstream {
            worker: worker.clone(),
            detail: "status 500: boom".into(),
        },
        GatewayError::UpstreamTimeout {
            worker: worker.clone(),
            what: "first byte",
        },
    ] {
        // The log line keeps the address; the client's body and stream event do not.
        assert!(error.to_string().contains("10.1.2.3"));
        for protocol in [Protocol::OpenAi, Protocol::Anthropic] {
            let body = error.body(protocol).to_string();
            assert!(!body.contains("10.1.2.3"), "{body}");
            let event = String::from_utf8_lossy(&error.stream_event(protocol)).into_owned();
            assert!(!event.contains("10.1.2.3"), "{event}");
        }
    }
}
