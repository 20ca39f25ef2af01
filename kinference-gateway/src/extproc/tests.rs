use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::google::protobuf::value::Kind;

use super::body::detect;
use super::session::usage_in;
use super::*;
use crate::api::openai::passthrough::Route;
use crate::pipeline::Endpoint;

#[test]
fn a_body_of_an_unknown_path_is_read_by_its_shape() {
    let chat = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(detect(None, chat).expect("chat"), Endpoint::ChatCompletions);
    let completion = br#"{"model":"m","prompt":["abc","def"]}"#;
    assert_eq!(
        detect(None, completion).expect("completion"),
        Endpoint::Completions
    );
    assert_eq!(
        detect(Some(Endpoint::Messages), b"{}").expect("the path decides"),
        Endpoint::Messages
    );
    for bad in [&b"{not json"[..], br#"{"model":"m"}"#] {
        let e = detect(None, bad).expect_err("must be refused");
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
fn routed_reply_sets_header_and_lb_metadata_and_takes_the_clients_credentials_off() {
    let mut headers = http::HeaderMap::new();
    headers.insert("x-request-id", http::HeaderValue::from_static("req-7"));
    headers.insert(
        "authorization",
        http::HeaderValue::from_static("Bearer pool-key"),
    );
    let body = bytes::Bytes::from_static(b"{\"model\":\"served\"}");
    let r = reply::routed(
        "10.0.0.7:8000",
        "http://10.0.0.7:8000",
        &headers,
        Some(&body),
        reply::Phase::Body,
    );
    let Some(Response::RequestBody(reply_body)) = r.response else {
        panic!("request body response expected")
    };
    let common = reply_body.response.expect("common response");
    assert!(common.clear_route_cache);
    let mutation = common.header_mutation.expect("mutation");
    // The pool's key replaces the client's; the rest of what only the client may send is removed.
    assert_eq!(
        mutation.remove_headers,
        [
            "x-api-key",
            "x-kinference-admin-key",
            "x-gateway-destination-endpoint"
        ]
    );
    let set = mutation.set_headers;
    let get = |key: &str| {
        set.iter()
            .filter_map(|h| h.header.as_ref())
            .find(|h| h.key == key)
            .map(|h| h.raw_value.clone())
    };
    assert_eq!(
        get(reply::DESTINATION_HEADER).as_deref(),
        Some(&b"10.0.0.7:8000"[..])
    );
    assert_eq!(get("x-request-id").as_deref(), Some(&b"req-7"[..]));
    assert_eq!(
        get("authorization").as_deref(),
        Some(&b"Bearer pool-key"[..])
    );
    assert_eq!(get("content-length").as_deref(), Some(&b"18"[..]));
    assert!(matches!(
        common.body_mutation.and_then(|m| m.mutation),
        Some(envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation::Body(b)) if b == body
    ));
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

/// One request's messages through a session: its headers, then (unless the headers were
/// answered) its body in one chunk; the last answer.
async fn through(session: &mut session::Session, path: &str, body: &[u8]) -> ProcessingResponse {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as PReq;
    use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders};
    let headers = HeaderMap {
        headers: [(":path", path), (":method", "POST")]
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.to_string(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    };
    let first = session
        .on_message(ProcessingRequest {
            request: Some(PReq::RequestHeaders(HttpHeaders {
                headers: Some(headers),
                ..Default::default()
            })),
            ..Default::default()
        })
        .await
        .pop()
        .expect("an answer to the headers");
    if matches!(first.response, Some(Response::ImmediateResponse(_))) {
        return first;
    }
    session
        .on_message(ProcessingRequest {
            request: Some(PReq::RequestBody(HttpBody {
                body: body.to_vec(),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        })
        .await
        .pop()
        .expect("an answer to the body")
}

#[tokio::test]
async fn ext_proc_requests_take_the_same_in_flight_gate_as_http() {
    use crate::gateway::{Gateway, Parts};
    use crate::overload::OverloadSettings;
    use crate::routing::{Router, RoutingConfig, RoutingMode, WorkerConfig};
    use kinference_crds::TenantPriority;

    let settings = OverloadSettings {
        max_in_flight: 1,
        overload_queue: 4,
        overload_queue_timeout_ms: 50,
        ..OverloadSettings::default()
    };
    let router = Router::new(RoutingConfig {
        workers: vec![WorkerConfig {
            url: "http://127.0.0.1:9".into(),
            model: "m".into(),
            role: Default::default(),
        }],
        models: vec![],
        agents: vec![],
        mode: RoutingMode::LeastOutstanding,
    })
    .expect("router");
    let gw = Gateway::assemble(
        Arc::new(router),
        Parts {
            overload: Some(settings),
            ..Parts::default()
        },
    )
    .expect("gateway");
    let handler = Handler::new(Arc::clone(&gw), Settings::default());
    let body = br#"{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}"#;

    // An HTTP request holds the only slot: the ext_proc request waits its queue time, then is shed
    // at its headers with the overload error of its protocol and Retry-After.
    let http = gw.overload.admit(TenantPriority::High).await.expect("slot");
    let mut refused = session::Session::new(&handler);
    let answer = through(&mut refused, "/v1/messages", body).await;
    let Some(Response::ImmediateResponse(ir)) = answer.response else {
        panic!("immediate response expected: {answer:?}")
    };
    assert_eq!(ir.status.map(|s| s.code), Some(503));
    let json: serde_json::Value = serde_json::from_slice(&ir.body).expect("json body");
    assert_eq!(json["error"]["type"], "overloaded_error", "{json}");
    let headers = ir.headers.expect("headers").set_headers;
    let retry_after = headers
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == "retry-after")
        .expect("Retry-After");
    assert_eq!(retry_after.raw_value, b"1");
    assert!(
        headers
            .iter()
            .filter_map(|h| h.header.as_ref())
            .any(|h| h.key == "x-request-id"),
        "the request id is echoed"
    );

    // The slot given back: the ext_proc request is routed and holds the slot itself, so now an
    // HTTP request is the one shed, until the routed request ends.
    drop(http);
    let mut routed = session::Session::new(&handler);
    let answer = through(&mut routed, "/v1/messages", body).await;
    assert!(
        matches!(answer.response, Some(Response::RequestBody(_))),
        "routed: {answer:?}"
    );
    assert_eq!(gw.overload.in_flight(), 1);
    assert!(gw.overload.admit(TenantPriority::Medium).await.is_err());
    drop(routed);
    assert_eq!(gw.overload.in_flight(), 0);
    assert!(gw.overload.admit(TenantPriority::Medium).await.is_ok());
}

fn subset_metadata(
    value: envoy_types::pb::google::protobuf::Value,
) -> envoy_types::pb::envoy::config::core::v3::Metadata {
    use envoy_types::pb::google::protobuf::Struct;
    envoy_types::pb::envoy::config::core::v3::Metadata {
        filter_metadata: std::collections::HashMap::from([(
            picker::SUBSET_NAMESPACE.to_string(),
            Struct {
                fields: std::collections::HashMap::from([(picker::SUBSET_KEY.to_string(), value)]),
            },
        )]),
        ..Default::default()
    }
}

fn text(s: &str) -> envoy_types::pb::google::protobuf::Value {
    envoy_types::pb::google::protobuf::Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

fn view(url: &str, in_flight: usize, healthy: bool) -> crate::routing::WorkerView {
    crate::routing::WorkerView {
        url: url.to_string(),
        model: "m".to_string(),
        healthy,
        in_flight,
        agent_live: false,
        cached_blocks: 0,
    }
}

#[test]
fn the_subset_hint_is_read_as_a_list_or_a_comma_separated_string() {
    use envoy_types::pb::google::protobuf::ListValue;
    assert_eq!(picker::Subset::from_metadata(None), None);
    let list = subset_metadata(envoy_types::pb::google::protobuf::Value {
        kind: Some(Kind::ListValue(ListValue {
            values: vec![text("10.0.0.1:8000"), text("10.0.0.2:8000, 10.0.0.3")],
        })),
    });
    let subset = picker::Subset::from_metadata(Some(&list)).expect("a subset");
    assert!(subset.admits("10.0.0.1:8000"));
    assert!(
        !subset.admits("10.0.0.1:8001"),
        "a port names that port only"
    );
    assert!(subset.admits("10.0.0.2:8000"));
    assert!(
        subset.admits("10.0.0.3:9999"),
        "a bare address admits every port"
    );
    assert!(!subset.admits("10.0.0.4:8000"));
    let string = subset_metadata(text("[fd00::1]:8000,10.0.0.9:80"));
    let subset = picker::Subset::from_metadata(Some(&string)).expect("a subset");
    assert!(subset.admits("[fd00::1]:8000") && subset.admits("10.0.0.9:80"));
    // Present but empty: nothing is eligible (the 503 case), unlike no hint at all.
    let empty = picker::Subset::from_metadata(Some(&subset_metadata(text("")))).expect("a subset");
    assert!(
        empty
            .restrict(&[view("http://10.0.0.1:8000", 0, true)], None)
            .is_empty()
    );
}

#[test]
fn the_subset_restricts_the_pool_and_fallbacks_are_the_least_loaded_others() {
    let workers = [
        view("http://10.0.0.1:8000", 3, true),
        view("http://10.0.0.2:8000", 1, true),
        view("http://10.0.0.3:8000", 0, false),
        view("http://10.0.0.4:8000", 2, true),
    ];
    let subset = picker::Subset::of(&["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.4"]);
    assert_eq!(
        subset.restrict(&workers, None),
        [
            "http://10.0.0.1:8000",
            "http://10.0.0.2:8000",
            "http://10.0.0.4:8000"
        ]
    );
    let pool = vec!["http://10.0.0.1:8000".to_string()];
    assert_eq!(subset.restrict(&workers, Some(&pool)), pool);
    // Healthy others of the model, least loaded first; none asked, none given.
    assert_eq!(
        picker::fallbacks(&workers, "m", "http://10.0.0.1:8000", None, 2),
        ["10.0.0.2:8000", "10.0.0.4:8000"]
    );
    assert!(picker::fallbacks(&workers, "m", "http://10.0.0.1:8000", None, 0).is_empty());
    assert!(picker::fallbacks(&workers, "other", "http://10.0.0.1:8000", None, 2).is_empty());
}

#[test]
fn full_duplex_bodies_go_back_in_bounded_chunks_the_last_ending_the_stream() {
    use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
    let body = vec![b'x'; reply::STREAMED_CHUNK_BYTES * 2 + 10];
    let answers = reply::streamed_request_body(&body, true);
    let chunks: Vec<(usize, bool)> = answers
        .iter()
        .map(|a| match &a.response {
            Some(Response::RequestBody(b)) => match b
                .response
                .as_ref()
                .and_then(|c| c.body_mutation.as_ref())
                .and_then(|m| m.mutation.as_ref())
            {
                Some(Mutation::StreamedResponse(s)) => (s.body.len(), s.end_of_stream),
                other => panic!("a streamed response expected: {other:?}"),
            },
            other => panic!("a request body answer expected: {other:?}"),
        })
        .collect();
    let n = reply::STREAMED_CHUNK_BYTES;
    assert_eq!(chunks, [(n, false), (n, false), (10, true)]);
    // Ended by trailers: no chunk ends the stream; an empty body is still one (empty) answer.
    assert!(
        reply::streamed_request_body(&body, false)
            .iter()
            .all(|a| !format!("{a:?}").contains("end_of_stream: true"))
    );
    assert_eq!(reply::streamed_response_body(b"", true).len(), 1);
}
