//! A proxy's-eye client of the ext_proc handler: what Envoy does with one HTTP request when its
//! `ext_proc` filter points at Kinference, replayed message by message from Envoy's ext_proc
//! protocol (`envoy.service.ext_proc.v3`): the request headers, the body (`BUFFERED`: one chunk;
//! `STREAMED`: several), the mutations of each answer applied, the request forwarded to the
//! destination the handler set (`x-gateway-destination-endpoint`) as a real HTTP call, and the
//! answer shown to the handler through the response phases (headers, body chunks as they come),
//! its mutations applied to what the client gets. A local reply ends the exchange at once.
//!
//! No Envoy binary can run here; this is its behaviour as its documentation and protos give it, for
//! the handler's side of the protocol.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as PReq;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as PResp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, CommonResponse, HeaderMutation, HttpBody, HttpHeaders, HttpTrailers,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration, StreamedBodyResponse,
};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

/// How Envoy sends the request body to the processor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMode {
    /// `BUFFERED`: the whole body in one message.
    Buffered,
    /// `STREAMED`: the body in chunks as they arrive (here: three).
    Streamed,
    /// `FULL_DUPLEX_STREAMED` both ways (the endpoint picker's setting, with request and response
    /// trailers `SEND`): chunks go out without waiting for answers, the request headers are held
    /// until answered, and only what the processor sends back in `StreamedBodyResponse`s is
    /// forwarded. Driven by [`Envoy::request`] like the others.
    FullDuplex,
}

/// `failure_mode_allow` of Envoy's ext_proc filter, i.e. the pool's `endpointPickerRef.failureMode`
/// as a Gateway translates it: what the proxy does when the processor fails (cannot be reached,
/// or its stream ends in an error) before it decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureMode {
    /// `FailClose` (`failure_mode_allow: false`): the client gets Envoy's 500.
    FailClose,
    /// `FailOpen` (`failure_mode_allow: true`): the request goes, as the client sent it, to this
    /// endpoint of the proxy's own choosing.
    FailOpen(String),
}

/// Whether Envoy shows the processor the response (`response_header_mode: SEND`,
/// `response_body_mode: STREAMED`, the endpoint picker's setting) or not (`SKIP`, `NONE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponsePhase {
    /// Headers and body chunks go to the processor.
    Streamed,
    /// The processor never sees the answer.
    Skipped,
}

/// What the client got.
#[derive(Debug, Clone)]
pub struct Answer {
    /// Status.
    pub status: u16,
    /// Headers (names lower-case).
    pub headers: http::HeaderMap,
    /// Body.
    pub body: Bytes,
    /// `Some(ip:port)` when the handler routed the request (else it answered locally).
    pub destination: Option<String>,
    /// The body the worker received, when routed.
    pub sent_body: Option<Bytes>,
    /// The endpoint that served the request (the first of the destination list that answered).
    pub served: Option<String>,
    /// Whether the processor failed and the failure mode decided.
    pub processor_failed: bool,
}

/// An Envoy with an ext_proc filter in front of the handler at `addr`.
#[derive(Clone)]
pub struct Envoy {
    client: ExternalProcessorClient<Channel>,
    http: Client<HttpConnector, Full<Bytes>>,
    /// How request bodies go to the processor.
    pub body_mode: BodyMode,
    /// Whether the processor sees the answer.
    pub response_phase: ResponsePhase,
    /// The subset hint sent with the request headers (filter metadata
    /// `envoy.lb.subset_hint { x-gateway-destination-endpoint-subset }`), when set.
    pub subset: Option<Vec<String>>,
    /// The request ends with trailers instead of `end_of_stream` on its last body chunk.
    pub trailers: bool,
    /// What to do when the processor fails ([`BodyMode::FullDuplex`] only).
    pub failure_mode: FailureMode,
}

impl Envoy {
    /// Connects to the handler at `addr` (retrying for a minute while it starts).
    pub async fn connect(addr: std::net::SocketAddr) -> Self {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let client = loop {
            match ExternalProcessorClient::connect(format!("http://{addr}")).await {
                Ok(c) => break c,
                Err(e) => {
                    assert!(std::time::Instant::now() < deadline, "ext_proc not up: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        Envoy {
            client,
            http: Client::builder(TokioExecutor::new()).build_http(),
            body_mode: BodyMode::Buffered,
            response_phase: ResponsePhase::Streamed,
            subset: None,
            trailers: false,
            failure_mode: FailureMode::FailClose,
        }
    }

    /// An Envoy whose processor at `addr` may not be up (or ever come up): the connection is
    /// tried per request, as Envoy does.
    pub fn lazy(addr: std::net::SocketAddr) -> Self {
        let channel = Channel::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect_timeout(Duration::from_secs(2))
            .connect_lazy();
        Envoy {
            client: ExternalProcessorClient::new(channel),
            http: Client::builder(TokioExecutor::new()).build_http(),
            body_mode: BodyMode::FullDuplex,
            response_phase: ResponsePhase::Streamed,
            subset: None,
            trailers: false,
            failure_mode: FailureMode::FailClose,
        }
    }

    /// One request as a client sends it to Envoy; what the client gets back.
    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Answer {
        if self.body_mode == BodyMode::FullDuplex {
            return self.request_duplex(method, path, headers, body).await;
        }
        let (tx, rx) = mpsc::channel(16);
        let mut answers = self
            .client
            .process(ReceiverStream::new(rx))
            .await
            .expect("Process")
            .into_inner();
        let mut next = async move |msg: ProcessingRequest| -> ProcessingResponse {
            tx.send(msg).await.expect("send");
            tokio::time::timeout(Duration::from_secs(60), answers.message())
                .await
                .expect("an answer within 60 s")
                .expect("the stream holds")
                .expect("an answer")
        };

        // The request headers, as Envoy's HTTP/2 codec names them.
        let mut request_headers = http::HeaderMap::new();
        request_headers.insert("content-type", "application/json".parse().unwrap());
        if !body.is_empty() {
            request_headers.insert("content-length", body.len().to_string().parse().unwrap());
        }
        for (k, v) in headers {
            request_headers.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        let mut pseudo = vec![
            pb_header(":method", method),
            pb_header(":path", path),
            pb_header(":authority", "gateway.example"),
            pb_header(":scheme", "http"),
        ];
        pseudo.extend(
            request_headers
                .iter()
                .map(|(k, v)| pb_header(k.as_str(), v.to_str().unwrap())),
        );
        let answer = next(ProcessingRequest {
            request: Some(PReq::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap { headers: pseudo }),
                end_of_stream: body.is_empty(),
                ..Default::default()
            })),
            protocol_config: Some(self.protocol_config()),
            metadata_context: self.subset_metadata(),
            ..Default::default()
        })
        .await;
        let mut sent_body = BytesMut::from(body);
        let mut decided = match answer.response {
            Some(PResp::ImmediateResponse(_)) => return local(answer),
            Some(PResp::RequestHeaders(h)) => {
                apply_headers(&mut request_headers, h.response.as_ref());
                None
            }
            // No body: the routing answer comes with the headers' (the ext_proc door routes a
            // body-less request on its headers).
            other => panic!("unexpected answer to the request headers: {other:?}"),
        };
        if !body.is_empty() {
            let chunks: Vec<&[u8]> = match self.body_mode {
                BodyMode::Buffered => vec![body],
                BodyMode::Streamed | BodyMode::FullDuplex => {
                    let third = body.len().div_ceil(3).max(1);
                    body.chunks(third).collect()
                }
            };
            let mut out = BytesMut::new();
            for (i, chunk) in chunks.iter().enumerate() {
                let last = i + 1 == chunks.len();
                let answer = next(ProcessingRequest {
                    request: Some(PReq::RequestBody(HttpBody {
                        body: chunk.to_vec(),
                        end_of_stream: last,
                        ..Default::default()
                    })),
                    ..Default::default()
                })
                .await;
                match answer.response {
                    Some(PResp::ImmediateResponse(_)) => return local(answer),
                    Some(PResp::RequestBody(ref b)) => {
                        let common = b.response.as_ref();
                        out.extend_from_slice(&mutated(chunk, common));
                        apply_headers(&mut request_headers, common);
                        if last {
                            decided = Some(answer.clone());
                        }
                    }
                    ref other => panic!("unexpected answer to a body chunk: {other:?}"),
                }
            }
            sent_body = out;
        }
        let destination = request_headers
            .get("x-gateway-destination-endpoint")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .unwrap_or_else(|| panic!("routed without a destination: {decided:?}"));
        let sent_body = sent_body.freeze();

        // Envoy forwards the (mutated) request to the destination.
        let mut upstream = hyper::Request::builder()
            .method(method)
            .uri(format!("http://{destination}{path}"));
        for (k, v) in &request_headers {
            if k != "content-length" && !k.as_str().starts_with(':') {
                upstream = upstream.header(k, v);
            }
        }
        let response = self
            .http
            .request(upstream.body(Full::new(sent_body.clone())).unwrap())
            .await
            .expect("the worker answers");
        let status = response.status().as_u16();
        let mut response_headers = response.headers().clone();
        let mut body = response.into_body();
        let mut client_body = BytesMut::new();
        if self.response_phase == ResponsePhase::Skipped {
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame.expect("the worker's body").into_data() {
                    client_body.extend_from_slice(&data);
                }
            }
            return Answer {
                status,
                headers: response_headers,
                body: client_body.freeze(),
                destination: Some(destination.clone()),
                sent_body: Some(sent_body),
                served: Some(destination),
                processor_failed: false,
            };
        }
        let mut pb = vec![pb_header(":status", &status.to_string())];
        pb.extend(
            response_headers
                .iter()
                .map(|(k, v)| pb_header(k.as_str(), v.to_str().unwrap_or_default())),
        );
        let answer = next(ProcessingRequest {
            request: Some(PReq::ResponseHeaders(HttpHeaders {
                headers: Some(HeaderMap { headers: pb }),
                end_of_stream: false,
                ..Default::default()
            })),
            ..Default::default()
        })
        .await;
        match &answer.response {
            Some(PResp::ResponseHeaders(h)) => {
                apply_headers(&mut response_headers, h.response.as_ref())
            }
            other => panic!("unexpected answer to the response headers: {other:?}"),
        }
        // Each chunk as it comes; the end of the body as an empty last chunk.
        loop {
            let frame = body.frame().await;
            let (data, last) = match frame {
                Some(f) => match f.expect("the worker's body").into_data() {
                    Ok(data) => (data, false),
                    Err(_) => continue,
                },
                None => (Bytes::new(), true),
            };
            let answer = next(ProcessingRequest {
                request: Some(PReq::ResponseBody(HttpBody {
                    body: data.to_vec(),
                    end_of_stream: last,
                    ..Default::default()
                })),
                ..Default::default()
            })
            .await;
            match &answer.response {
                Some(PResp::ResponseBody(b)) => {
                    client_body.extend_from_slice(&mutated(&data, b.response.as_ref()))
                }
                other => panic!("unexpected answer to a response chunk: {other:?}"),
            }
            if last {
                break;
            }
        }
        Answer {
            status,
            headers: response_headers,
            body: client_body.freeze(),
            destination: Some(destination.clone()),
            sent_body: Some(sent_body),
            served: Some(destination),
            processor_failed: false,
        }
    }
}

fn pb_header(key: &str, value: &str) -> HeaderValue {
    HeaderValue {
        key: key.to_string(),
        raw_value: value.as_bytes().to_vec(),
        ..Default::default()
    }
}

/// A local reply as the client gets it.
fn local(answer: ProcessingResponse) -> Answer {
    let Some(PResp::ImmediateResponse(ir)) = answer.response else {
        unreachable!("called on an immediate response")
    };
    let mut headers = http::HeaderMap::new();
    for h in ir.headers.map(|m| m.set_headers).unwrap_or_default() {
        set(&mut headers, &h);
    }
    Answer {
        status: ir.status.map_or(0, |s| s.code as u16),
        headers,
        body: Bytes::from(ir.body),
        destination: None,
        sent_body: None,
        served: None,
        processor_failed: false,
    }
}

fn set(headers: &mut http::HeaderMap, h: &HeaderValueOption) {
    let Some(hv) = &h.header else { return };
    let value = if hv.raw_value.is_empty() {
        hv.value.as_bytes().to_vec()
    } else {
        hv.raw_value.clone()
    };
    if let (Ok(name), Ok(value)) = (
        http::HeaderName::from_bytes(hv.key.as_bytes()),
        http::HeaderValue::from_bytes(&value),
    ) {
        headers.insert(name, value);
    }
}

/// Applies a common response's header mutation to `headers`.
fn apply_headers(headers: &mut http::HeaderMap, common: Option<&CommonResponse>) {
    let Some(HeaderMutation {
        set_headers,
        remove_headers,
    }) = common.and_then(|c| c.header_mutation.as_ref())
    else {
        return;
    };
    for name in remove_headers {
        headers.remove(name.as_str());
    }
    for h in set_headers {
        set(headers, h);
    }
}

/// A chunk after a common response's body mutation.
fn mutated(chunk: &[u8], common: Option<&CommonResponse>) -> Bytes {
    match common.and_then(|c| c.body_mutation.as_ref()) {
        Some(BodyMutation {
            mutation: Some(Mutation::Body(b)),
        }) => Bytes::from(b.clone()),
        Some(BodyMutation {
            mutation: Some(Mutation::ClearBody(true)),
        }) => Bytes::new(),
        _ => Bytes::copy_from_slice(chunk),
    }
}

// ---------------------------------------------------------------------------------------------
// FULL_DUPLEX_STREAMED, the endpoint picker's mode

impl Envoy {
    /// The `protocol_config` Envoy puts on a stream's first message.
    fn protocol_config(&self) -> ProtocolConfiguration {
        let request = match self.body_mode {
            BodyMode::Buffered => BodySendMode::Buffered,
            BodyMode::Streamed => BodySendMode::Streamed,
            BodyMode::FullDuplex => BodySendMode::FullDuplexStreamed,
        };
        let response = match (self.response_phase, self.body_mode) {
            (ResponsePhase::Skipped, _) => BodySendMode::None,
            (ResponsePhase::Streamed, BodyMode::FullDuplex) => BodySendMode::FullDuplexStreamed,
            (ResponsePhase::Streamed, _) => BodySendMode::Streamed,
        };
        ProtocolConfiguration {
            request_body_mode: request as i32,
            response_body_mode: response as i32,
            send_body_without_waiting_for_header_response: self.body_mode == BodyMode::FullDuplex,
        }
    }

    /// The subset hint as Envoy forwards filter metadata: a list of strings.
    fn subset_metadata(&self) -> Option<Metadata> {
        let subset = self.subset.as_ref()?;
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: subset
                    .iter()
                    .map(|e| Value {
                        kind: Some(Kind::StringValue(e.clone())),
                    })
                    .collect(),
            })),
        };
        Some(Metadata {
            filter_metadata: HashMap::from([(
                "envoy.lb.subset_hint".to_string(),
                Struct {
                    fields: HashMap::from([(
                        "x-gateway-destination-endpoint-subset".to_string(),
                        list,
                    )]),
                },
            )]),
            ..Default::default()
        })
    }

    /// What the client gets when the processor failed, by the failure mode.
    async fn failed(
        &self,
        method: &str,
        path: &str,
        headers: &http::HeaderMap,
        body: &[u8],
    ) -> Answer {
        match &self.failure_mode {
            // Envoy's local reply for a failed ext_proc call (`status_on_error` defaults to 500).
            FailureMode::FailClose => Answer {
                status: 500,
                headers: http::HeaderMap::new(),
                body: Bytes::new(),
                destination: None,
                sent_body: None,
                served: None,
                processor_failed: true,
            },
            FailureMode::FailOpen(endpoint) => {
                let (status, response_headers, client_body) = self
                    .forward(
                        endpoint,
                        method,
                        path,
                        headers,
                        Bytes::copy_from_slice(body),
                    )
                    .await
                    .expect("the proxy's own endpoint answers");
                Answer {
                    status,
                    headers: response_headers,
                    body: client_body,
                    destination: None,
                    sent_body: Some(Bytes::copy_from_slice(body)),
                    served: Some(endpoint.clone()),
                    processor_failed: true,
                }
            }
        }
    }

    /// The request sent upstream to `endpoint` and read whole; `None` when nothing answers there.
    async fn forward(
        &self,
        endpoint: &str,
        method: &str,
        path: &str,
        headers: &http::HeaderMap,
        body: Bytes,
    ) -> Option<(u16, http::HeaderMap, Bytes)> {
        let mut upstream = hyper::Request::builder()
            .method(method)
            .uri(format!("http://{endpoint}{path}"));
        for (k, v) in headers {
            if k != "content-length" && !k.as_str().starts_with(':') {
                upstream = upstream.header(k, v);
            }
        }
        let response = self
            .http
            .request(upstream.body(Full::new(body)).unwrap())
            .await
            .ok()?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await.ok()?.to_bytes();
        Some((status, headers, body))
    }

    /// One request in `FULL_DUPLEX_STREAMED`: the headers, then the body in three chunks sent
    /// without waiting (ended by `end_of_stream`, or by trailers); the answers read as they come:
    /// the headers' (the route, or a local reply), then the body's streamed chunks, which are the
    /// body forwarded. The destination list is tried in order (a refused connection moves to the
    /// next, as Envoy's retries do). The response goes back the same way: headers, then each
    /// chunk as the worker sends it, the streamed answers being what the client gets.
    async fn request_duplex(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Answer {
        let mut request_headers = http::HeaderMap::new();
        request_headers.insert("content-type", "application/json".parse().unwrap());
        if !body.is_empty() {
            request_headers.insert("content-length", body.len().to_string().parse().unwrap());
        }
        for (k, v) in headers {
            request_headers.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        let (tx, rx) = mpsc::channel(64);
        let opened = self.client.process(ReceiverStream::new(rx)).await;
        let mut answers = match opened {
            Ok(answers) => answers.into_inner(),
            Err(_) => return self.failed(method, path, &request_headers, body).await,
        };
        let mut pseudo = vec![
            pb_header(":method", method),
            pb_header(":path", path),
            pb_header(":authority", "gateway.example"),
            pb_header(":scheme", "http"),
        ];
        pseudo.extend(
            request_headers
                .iter()
                .map(|(k, v)| pb_header(k.as_str(), v.to_str().unwrap())),
        );
        // Everything of the request goes out at once: full duplex does not wait for answers.
        let mut outgoing = vec![ProcessingRequest {
            request: Some(PReq::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap { headers: pseudo }),
                end_of_stream: body.is_empty(),
                ..Default::default()
            })),
            protocol_config: Some(self.protocol_config()),
            metadata_context: self.subset_metadata(),
            ..Default::default()
        }];
        if !body.is_empty() {
            let third = body.len().div_ceil(3).max(1);
            let chunks: Vec<&[u8]> = body.chunks(third).collect();
            for (i, chunk) in chunks.iter().enumerate() {
                outgoing.push(ProcessingRequest {
                    request: Some(PReq::RequestBody(HttpBody {
                        body: chunk.to_vec(),
                        end_of_stream: i + 1 == chunks.len() && !self.trailers,
                        ..Default::default()
                    })),
                    ..Default::default()
                });
            }
            if self.trailers {
                outgoing.push(ProcessingRequest {
                    request: Some(PReq::RequestTrailers(HttpTrailers::default())),
                    ..Default::default()
                });
            }
        }
        for msg in outgoing {
            tx.send(msg).await.expect("send");
        }

        // The headers' answer: the route, or a local reply (or the processor failed).
        let mut next = async || -> Option<ProcessingResponse> {
            tokio::time::timeout(Duration::from_secs(30), answers.message())
                .await
                .expect("an answer within 30 s")
                .ok()
                .flatten()
        };
        let Some(first) = next().await else {
            return self.failed(method, path, &request_headers, body).await;
        };
        let decided = match first.response {
            Some(PResp::ImmediateResponse(_)) => return local(first),
            Some(PResp::RequestHeaders(ref h)) => {
                apply_headers(&mut request_headers, h.response.as_ref());
                first.clone()
            }
            ref other => panic!("full duplex: the headers are answered first, got {other:?}"),
        };
        // The body: streamed chunks until one ends it (or, with trailers, the trailers' answer).
        let mut sent_body = BytesMut::new();
        let mut ended = body.is_empty();
        while !ended {
            let Some(answer) = next().await else {
                return self.failed(method, path, &request_headers, body).await;
            };
            match answer.response {
                Some(PResp::ImmediateResponse(_)) => return local(answer),
                Some(PResp::RequestBody(b)) => {
                    let streamed = streamed_of(b.response.as_ref());
                    sent_body.extend_from_slice(&streamed.body);
                    ended = streamed.end_of_stream && !self.trailers;
                }
                Some(PResp::RequestTrailers(_)) if self.trailers => ended = true,
                other => panic!("full duplex: a body chunk or trailers expected, got {other:?}"),
            }
        }
        let destination = request_headers
            .get("x-gateway-destination-endpoint")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .unwrap_or_else(|| panic!("routed without a destination: {decided:?}"));
        // The protocol: the header and the metadata name the same endpoints.
        let in_metadata = decided
            .dynamic_metadata
            .as_ref()
            .and_then(|m| m.fields.get("envoy.lb"))
            .and_then(|v| match &v.kind {
                Some(Kind::StructValue(s)) => s.fields.get("x-gateway-destination-endpoint"),
                _ => None,
            })
            .and_then(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.clone()),
                _ => None,
            });
        assert_eq!(
            in_metadata.as_deref(),
            Some(destination.as_str()),
            "the envoy.lb metadata names what the header names"
        );
        let sent_body = sent_body.freeze();

        // The destination list, in order: the first endpoint that takes the connection serves.
        let mut served = None;
        let mut response = None;
        for endpoint in destination.split(',') {
            let mut upstream = hyper::Request::builder()
                .method(method)
                .uri(format!("http://{endpoint}{path}"));
            for (k, v) in &request_headers {
                if k != "content-length" && !k.as_str().starts_with(':') {
                    upstream = upstream.header(k, v);
                }
            }
            if let Ok(r) = self
                .http
                .request(upstream.body(Full::new(sent_body.clone())).unwrap())
                .await
            {
                served = Some(endpoint.to_string());
                response = Some(r);
                break;
            }
        }
        let response = response.expect("an endpoint of the destination list answers");
        let served = served.expect("served");
        let status = response.status().as_u16();
        let mut response_headers = response.headers().clone();
        let mut upstream_body = response.into_body();
        let mut client_body = BytesMut::new();
        if self.response_phase == ResponsePhase::Skipped {
            while let Some(frame) = upstream_body.frame().await {
                if let Ok(data) = frame.expect("the worker's body").into_data() {
                    client_body.extend_from_slice(&data);
                }
            }
        } else {
            let mut pb = vec![pb_header(":status", &status.to_string())];
            pb.extend(
                response_headers
                    .iter()
                    .map(|(k, v)| pb_header(k.as_str(), v.to_str().unwrap_or_default())),
            );
            // The endpoint that served, as the protocol has the proxy report it.
            let served_metadata = Metadata {
                filter_metadata: HashMap::from([(
                    "envoy.lb".to_string(),
                    Struct {
                        fields: HashMap::from([(
                            "x-gateway-destination-endpoint-served".to_string(),
                            Value {
                                kind: Some(Kind::StringValue(served.clone())),
                            },
                        )]),
                    },
                )]),
                ..Default::default()
            };
            tx.send(ProcessingRequest {
                request: Some(PReq::ResponseHeaders(HttpHeaders {
                    headers: Some(HeaderMap { headers: pb }),
                    end_of_stream: false,
                    ..Default::default()
                })),
                metadata_context: Some(served_metadata),
                ..Default::default()
            })
            .await
            .expect("send");
            match next().await.map(|a| a.response) {
                Some(Some(PResp::ResponseHeaders(h))) => {
                    apply_headers(&mut response_headers, h.response.as_ref())
                }
                other => panic!("unexpected answer to the response headers: {other:?}"),
            }
            // Each chunk as it comes, without waiting; the end as an empty last chunk.
            loop {
                let (data, last) = match upstream_body.frame().await {
                    Some(f) => match f.expect("the worker's body").into_data() {
                        Ok(data) => (data, false),
                        Err(_) => continue,
                    },
                    None => (Bytes::new(), true),
                };
                tx.send(ProcessingRequest {
                    request: Some(PReq::ResponseBody(HttpBody {
                        body: data.to_vec(),
                        end_of_stream: last,
                        ..Default::default()
                    })),
                    ..Default::default()
                })
                .await
                .expect("send");
                if last {
                    break;
                }
            }
            loop {
                match next().await.map(|a| a.response) {
                    Some(Some(PResp::ResponseBody(b))) => {
                        let streamed = streamed_of(b.response.as_ref());
                        client_body.extend_from_slice(&streamed.body);
                        if streamed.end_of_stream {
                            break;
                        }
                    }
                    other => panic!("full duplex: response chunks expected, got {other:?}"),
                }
            }
        }
        Answer {
            status,
            headers: response_headers,
            body: client_body.freeze(),
            destination: Some(destination),
            sent_body: Some(sent_body),
            served: Some(served),
            processor_failed: false,
        }
    }
}

/// A full-duplex body answer's streamed chunk (a continue without one forwards nothing).
fn streamed_of(common: Option<&CommonResponse>) -> StreamedBodyResponse {
    match common.and_then(|c| c.body_mutation.as_ref()) {
        Some(BodyMutation {
            mutation: Some(Mutation::StreamedResponse(s)),
        }) => s.clone(),
        other => {
            panic!("full duplex: a body answer must carry a StreamedBodyResponse, got {other:?}")
        }
    }
}
