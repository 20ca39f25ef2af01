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
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as PReq;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as PResp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, CommonResponse, HeaderMutation, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse,
};
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
                BodyMode::Streamed => {
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
                destination: Some(destination),
                sent_body: Some(sent_body),
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
            destination: Some(destination),
            sent_body: Some(sent_body),
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
