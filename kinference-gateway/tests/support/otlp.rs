//! An OTLP trace receiver on loopback, over gRPC or HTTP: what a test's gateway exports its spans
//! to (the OpenTelemetry Collector is not installable here), and the spans' ids and attributes as
//! text.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt as _, Full};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use tokio::net::TcpListener;

/// The spans an OTLP receiver on loopback was sent.
#[derive(Default, Clone)]
pub struct Receiver(Arc<Mutex<Vec<Span>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.keep(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Receiver {
    /// Serves OTLP/gRPC on a free loopback port; its `http://` endpoint.
    pub async fn start(&self) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let service = TraceServiceServer::new(self.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        format!("http://127.0.0.1:{port}")
    }

    /// Serves OTLP/HTTP (protobuf bodies posted to `/v1/traces`) on a free loopback port; its
    /// `http://` endpoint (the base URL: the exporter appends the path).
    pub async fn start_http(&self) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let receiver = self.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let receiver = receiver.clone();
                let service =
                    hyper::service::service_fn(move |req| receiver.clone().export_http(req));
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
                );
            }
        });
        format!("http://127.0.0.1:{port}")
    }

    /// One OTLP/HTTP export: its spans kept when it is protobuf posted to `/v1/traces`; anything
    /// else is answered 404, 415 or 400 and kept out.
    async fn export_http(
        self,
        req: hyper::Request<hyper::body::Incoming>,
    ) -> Result<hyper::Response<Full<Bytes>>, hyper::Error> {
        let protobuf = req
            .headers()
            .get("content-type")
            .is_some_and(|v| v == "application/x-protobuf");
        let status = if req.uri().path() != "/v1/traces" {
            StatusCode::NOT_FOUND
        } else if !protobuf {
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        } else {
            let body = req.into_body().collect().await?.to_bytes();
            match ExportTraceServiceRequest::decode(body) {
                Ok(request) => {
                    self.keep(request);
                    StatusCode::OK
                }
                Err(_) => StatusCode::BAD_REQUEST,
            }
        };
        let answer = ExportTraceServiceResponse {
            partial_success: None,
        };
        let mut response = hyper::Response::new(Full::new(Bytes::from(answer.encode_to_vec())));
        *response.status_mut() = status;
        response.headers_mut().insert(
            "content-type",
            http::HeaderValue::from_static("application/x-protobuf"),
        );
        Ok(response)
    }

    /// Keeps the spans of an export.
    fn keep(&self, request: ExportTraceServiceRequest) {
        let mut spans = self.0.lock().unwrap();
        for resource in request.resource_spans {
            for scope in resource.scope_spans {
                spans.extend(scope.spans);
            }
        }
    }

    /// The spans of `trace` received so far.
    pub fn spans(&self, trace: &str) -> Vec<Span> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|s| hex(&s.trace_id) == trace)
            .cloned()
            .collect()
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A span's attributes, as text.
pub fn attributes(span: &Span) -> HashMap<String, String> {
    span.attributes
        .iter()
        .map(|kv| {
            let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Value::StringValue(s)) => s.clone(),
                Some(Value::IntValue(i)) => i.to_string(),
                Some(Value::DoubleValue(d)) => d.to_string(),
                Some(Value::BoolValue(b)) => b.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), value)
        })
        .collect()
}
