use http::{HeaderMap, HeaderValue};

use super::propagation::{ClientTrace, valid_traceparent};
use super::request_id::MAX_LEN;
use super::{RequestContext, RequestId, current_headers};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in pairs {
        h.insert(*name, HeaderValue::from_str(value).unwrap());
    }
    h
}

#[test]
fn a_safe_client_request_id_is_kept() {
    for id in ["abc-123", "req_1.2:3@edge", &"a".repeat(MAX_LEN)] {
        let got = RequestId::from_headers(&headers(&[("x-request-id", id)]));
        assert_eq!(got.as_str(), id);
    }
}

#[test]
fn an_unsafe_or_oversized_request_id_is_replaced_by_a_new_one() {
    let long = "a".repeat(MAX_LEN + 1);
    for id in [
        "",
        "has space",
        "quote\"",
        "new\\line",
        "ü-not-ascii",
        long.as_str(),
    ] {
        let Ok(value) = HeaderValue::from_str(id) else {
            continue;
        };
        let mut h = HeaderMap::new();
        h.insert("x-request-id", value);
        let got = RequestId::from_headers(&h);
        assert_ne!(got.as_str(), id);
        assert_eq!(got.as_str().len(), 32, "{got}");
        assert!(RequestId::acceptable(got.as_str()));
    }
}

#[test]
fn generated_ids_differ() {
    assert_ne!(RequestId::generate(), RequestId::generate());
    assert_ne!(
        RequestId::from_headers(&HeaderMap::new()),
        RequestId::from_headers(&HeaderMap::new())
    );
}

#[test]
fn only_valid_traceparents_are_continued() {
    assert!(valid_traceparent(TRACEPARENT));
    for bad in [
        "",
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
    ] {
        assert!(!valid_traceparent(bad), "{bad}");
        assert!(ClientTrace::from_headers(&headers(&[("traceparent", bad)])).is_none());
    }
    let trace = ClientTrace::from_headers(&headers(&[("traceparent", TRACEPARENT)])).unwrap();
    assert_eq!(trace.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
}

#[tokio::test]
async fn without_exported_traces_the_backend_gets_the_request_id_and_the_clients_trace_unchanged() {
    assert!(current_headers().is_empty(), "outside a request: nothing");
    let client = headers(&[
        ("x-request-id", "client-7"),
        ("traceparent", TRACEPARENT),
        ("tracestate", "vendor=1"),
    ]);
    let sent = RequestContext::from_headers(&client)
        .scope(async { current_headers() })
        .await;
    assert_eq!(sent["x-request-id"], "client-7");
    assert_eq!(sent["traceparent"], TRACEPARENT);
    assert_eq!(sent["tracestate"], "vendor=1");

    let sent = RequestContext::from_headers(&headers(&[("traceparent", "junk")]))
        .scope(async { current_headers() })
        .await;
    assert_eq!(sent.len(), 1, "a made-up id and no trace: {sent:?}");
}

/// Keeps the spans it is given.
#[derive(Debug, Clone, Default)]
struct Kept(std::sync::Arc<std::sync::Mutex<Vec<opentelemetry_sdk::trace::SpanData>>>);

impl opentelemetry_sdk::trace::SpanExporter for Kept {
    async fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.lock().unwrap().extend(batch);
        Ok(())
    }
}

#[test]
fn the_gateways_spans_become_children_of_the_clients_span_and_log_events_do_not() {
    let kept = Kept::default();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_simple_exporter(kept.clone())
        .build();
    let subscriber = super::subscriber(super::LogFormat::Text, Some(&provider));
    let client = headers(&[("traceparent", TRACEPARENT)]);
    let context = RequestContext::from_headers(&client);
    tracing::subscriber::with_default(subscriber, || {
        let root = context.span_exported(&http::Method::POST, "/v1/chat/completions", true);
        root.in_scope(|| {
            tracing::debug_span!("authenticate").in_scope(|| tracing::info!("an event"));
        });
        drop(root);
    });
    let spans = kept.0.lock().unwrap().clone();
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_ref()).collect();
    assert_eq!(names, ["authenticate", "POST /v1/chat/completions"]);
    let root = &spans[1];
    assert_eq!(
        root.span_context.trace_id().to_string(),
        "4bf92f3577b34da6a3ce929d0e0e4736"
    );
    assert_eq!(root.parent_span_id.to_string(), "00f067aa0ba902b7");
    assert_eq!(spans[0].parent_span_id, root.span_context.span_id());
    assert!(spans[0].events.is_empty(), "log events stay log lines");
}

#[test]
fn otlp_http_posts_to_the_endpoints_traces_path() {
    use super::http_export::traces_url;
    assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
    assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
    assert_eq!(
        traces_url("https://c/otlp/v1/traces"),
        "https://c/otlp/v1/traces"
    );
}

#[test]
fn the_otlp_protocol_flag_takes_the_specifications_names() {
    use super::{OtlpProtocol, TelemetryArgs};
    use clap::Parser as _;
    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        telemetry: TelemetryArgs,
    }
    let protocol = |args: &[&str]| {
        Flags::try_parse_from(std::iter::once("gw").chain(args.iter().copied()))
            .map(|f| f.telemetry.otlp_protocol)
    };
    assert_eq!(protocol(&[]).unwrap(), OtlpProtocol::Grpc);
    assert_eq!(
        protocol(&["--otlp-protocol", "http"]).unwrap(),
        OtlpProtocol::Http
    );
    assert_eq!(
        protocol(&["--otlp-protocol", "http/protobuf"]).unwrap(),
        OtlpProtocol::Http
    );
    assert!(protocol(&["--otlp-protocol", "http/json"]).is_err());
}
