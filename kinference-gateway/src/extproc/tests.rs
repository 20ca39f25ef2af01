use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::google::protobuf::value::Kind;
use serde_json::json;

use super::body::{Api, OwnedPrompt, parse, passthrough_of};
use super::session::usage_in;
use super::*;

#[test]
fn paths_name_the_api() {
    assert_eq!(Api::from_path("/v1/chat/completions"), Some(Api::Chat));
    assert_eq!(
        Api::from_path("/v1/completions?x=1"),
        Some(Api::Completions)
    );
    assert_eq!(Api::from_path("/v1/messages/"), Some(Api::Messages));
    assert_eq!(Api::from_path("/v1/models"), None);
    assert_eq!(passthrough_of("/v1/embeddings"), Some(Route::Embeddings));
    assert_eq!(passthrough_of("/v1/responses?x=1"), Some(Route::Responses));
    assert_eq!(passthrough_of("/tokenize"), Some(Route::Tokenize));
    assert_eq!(passthrough_of("/detokenize/"), Some(Route::Detokenize));
    assert_eq!(passthrough_of("/v1/chat/completions"), None);
}

#[test]
fn bodies_parse_like_the_http_gateway() {
    let chat = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let p = parse(Some(Api::Chat), chat).expect("chat");
    assert_eq!(p.model, "m");
    assert_eq!(
        p.prompt,
        OwnedPrompt::Chat(json!([{"role":"user","content":"hi"}]))
    );
    // An unknown path: the shape decides.
    assert_eq!(parse(None, chat).expect("chat by shape").api, Api::Chat);
    let completion = br#"{"model":"m","prompt":["abc","def"]}"#;
    let p = parse(None, completion).expect("completion");
    assert_eq!(p.prompt, OwnedPrompt::Text("abc".into()));
    // Anthropic: translated to OpenAI messages (the system prompt becomes the first message).
    let anthropic = br#"{"model":"m","max_tokens":8,"system":"be brief","messages":[{"role":"user","content":"hi"}]}"#;
    let p = parse(Some(Api::Messages), anthropic).expect("anthropic");
    let OwnedPrompt::Chat(messages) = p.prompt else {
        panic!("chat prompt expected")
    };
    assert_eq!(messages[0]["role"], "system");
    assert_eq!(messages.as_array().map(Vec::len), Some(2));
}

#[test]
fn malformed_bodies_are_400() {
    for (api, body) in [
        (Some(Api::Chat), &b"{not json"[..]),
        (Some(Api::Chat), br#"{"model":"m","messages":[]}"#),
        (Some(Api::Completions), br#"{"model":"","prompt":"x"}"#),
        (None, br#"{"model":"m"}"#),
    ] {
        let e = parse(api, body).expect_err("must be refused");
        assert_eq!(e.status().as_u16(), 400, "{e}");
    }
}

#[test]
fn endpoints_are_host_and_port() {
    assert_eq!(
        endpoint_of("http://10.0.0.7:8000").as_deref(),
        Some("10.0.0.7:8000")
    );
    assert_eq!(
        endpoint_of("http://10.0.0.7/").as_deref(),
        Some("10.0.0.7:80")
    );
    assert_eq!(
        endpoint_of("http://[fd00::1]:8000").as_deref(),
        Some("[fd00::1]:8000")
    );
    assert_eq!(endpoint_of("not a url"), None);
}

#[test]
fn routed_reply_sets_header_and_lb_metadata() {
    let mut telemetry = http::HeaderMap::new();
    telemetry.insert("x-request-id", http::HeaderValue::from_static("req-7"));
    let r = reply::routed("10.0.0.7:8000", "http://10.0.0.7:8000", &telemetry);
    let Some(Response::RequestBody(body)) = r.response else {
        panic!("request body response expected")
    };
    let common = body.response.expect("common response");
    assert!(common.clear_route_cache);
    let mutation = common.header_mutation.expect("mutation");
    assert_eq!(mutation.remove_headers, ["x-kinference-admin-key"]);
    let set = mutation.set_headers;
    let dest = set
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == reply::DESTINATION_HEADER)
        .expect("destination header");
    assert_eq!(dest.raw_value, b"10.0.0.7:8000");
    let id = set
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == "x-request-id")
        .expect("the request id for the worker");
    assert_eq!(id.raw_value, b"req-7");
    let md = r.dynamic_metadata.expect("metadata");
    let Some(Kind::StructValue(lb)) = md.fields["envoy.lb"].kind.clone() else {
        panic!("envoy.lb struct expected")
    };
    assert_eq!(
        lb.fields[reply::DESTINATION_HEADER].kind,
        Some(Kind::StringValue("10.0.0.7:8000".into()))
    );
}

#[test]
fn refusals_map_to_status_and_protocol_body() {
    let shed = Refusal::Shed {
        model: "m".into(),
        limit: 2,
    };
    assert_eq!(shed.status(), 429);
    assert_eq!(
        shed.body(Protocol::OpenAi)["error"]["type"],
        "rate_limit_error"
    );
    assert_eq!(
        shed.body(Protocol::Anthropic)["error"]["type"],
        "overloaded_error"
    );
    let none = Refusal::Gateway(GatewayError::NoHealthyWorker("m".into()));
    assert_eq!(none.status(), 503);
    let id = crate::telemetry::RequestId::generate();
    let Some(Response::ImmediateResponse(ir)) = none.reply(Protocol::OpenAi, &id).response else {
        panic!("immediate response expected")
    };
    assert_eq!(ir.status.map(|s| s.code), Some(503));
    let echoed = ir
        .headers
        .expect("headers")
        .set_headers
        .into_iter()
        .filter_map(|h| h.header)
        .find(|h| h.key == "x-request-id")
        .expect("x-request-id");
    assert_eq!(echoed.raw_value, id.as_str().as_bytes());
    let body: serde_json::Value = serde_json::from_slice(&ir.body).expect("json body");
    assert_eq!(body["error"]["code"], "no_healthy_worker");
}

#[test]
fn usage_is_found_in_json_and_sse_tails() {
    let whole =
        br#"{"id":"x","usage":{"prompt_tokens":10,"completion_tokens":4,"total_tokens":14}}"#;
    assert_eq!(usage_in(whole).map(|u| u.completion_tokens), Some(4));
    let sse = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":7,\"total_tokens\":17,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\ndata: [DONE]\n\n";
    let u = usage_in(sse).expect("usage");
    assert_eq!((u.completion_tokens, u.cached_tokens()), (7, Some(8)));
    assert_eq!(usage_in(b"data: [DONE]\n\n"), None);
}

#[test]
fn pass_through_usage_is_read_the_way_the_http_gateway_reads_it() {
    let embeddings = br#"{"data":[],"usage":{"prompt_tokens":5,"total_tokens":5}}"#;
    let u = super::session::usage_at_end(Some(Route::Embeddings), embeddings).expect("usage");
    assert_eq!((u.prompt_tokens, u.completion_tokens), (5, 0));
    let streamed = b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\"}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":12,\"output_tokens\":3}}}\n\n";
    let u = super::session::usage_at_end(Some(Route::Responses), streamed).expect("usage");
    assert_eq!((u.prompt_tokens, u.completion_tokens), (12, 3));
}

#[tokio::test]
async fn ext_proc_requests_take_the_same_in_flight_gate_as_http() {
    use crate::overload::{Overload, OverloadSettings};
    use crate::routing::{RoutingConfig, RoutingMode, WorkerConfig};
    use kinference_crds::TenantPriority;

    let settings = OverloadSettings {
        max_in_flight: 1,
        overload_queue: 4,
        overload_queue_timeout_ms: 50,
        ..OverloadSettings::default()
    };
    let overload = Overload::new(
        settings,
        &mut prometheus_client::registry::Registry::default(),
    );
    let router = Router::new(RoutingConfig {
        workers: vec![WorkerConfig {
            url: "http://127.0.0.1:9".into(),
            model: "m".into(),
        }],
        models: vec![],
        agents: vec![],
        mode: RoutingMode::LeastOutstanding,
    })
    .expect("router");
    let handler =
        Handler::new(Arc::new(router), Settings::default()).with_overload(overload.admitter());
    let head = Head {
        api: Some(Api::Messages),
        ..Head::default()
    };
    let body = bytes::Bytes::from_static(
        br#"{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}"#,
    );

    // An HTTP request holds the only slot: the ext_proc request waits its queue time, then is shed
    // with the overload error of its protocol and Retry-After.
    let http = overload.admit(TenantPriority::High).await.expect("slot");
    let refusal = handler
        .decide(&head, body.clone())
        .await
        .expect_err("past the in-flight limit");
    assert_eq!(refusal.status(), 503, "{refusal}");
    assert_eq!(
        refusal.body(Protocol::Anthropic)["error"]["type"],
        "overloaded_error"
    );
    let id = crate::telemetry::RequestId::generate();
    let Some(Response::ImmediateResponse(ir)) = refusal.reply(Protocol::Anthropic, &id).response
    else {
        panic!("immediate response expected")
    };
    let headers = ir.headers.expect("headers").set_headers;
    let retry_after = headers
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == "retry-after")
        .expect("Retry-After");
    assert_eq!(retry_after.raw_value, b"1");

    // The slot given back: the ext_proc request is routed and holds the slot itself, so now an
    // HTTP request is the one shed, until the routed request ends.
    drop(http);
    let routed = handler.decide(&head, body).await.expect("routed");
    assert_eq!(overload.in_flight(), 1);
    assert!(overload.admit(TenantPriority::Medium).await.is_err());
    drop(routed);
    assert_eq!(overload.in_flight(), 0);
    assert!(overload.admit(TenantPriority::Medium).await.is_ok());
}
