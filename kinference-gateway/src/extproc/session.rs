//! One ext_proc stream, i.e. one HTTP request through Envoy: the pipeline's stages as Envoy's
//! messages arrive, and the answer seen through the response phases.
//!
//! Request headers: the request's [`Exchange`] (its root span starts here), then stages
//! "authenticate" and "admit" (a refusal is the answer to the headers: Envoy sends no body). The
//! body, buffered here until `end_of_stream` or trailers (within the body limit and the room
//! admitted), then the stages up to the plan and the pick, within the proxy's subset hint. How the
//! route goes back depends on the proxy's body mode ([`super::mode`]): with the last chunk
//! (`BUFFERED`, `STREAMED`), or, in `FULL_DUPLEX_STREAMED`, as the answer to the held headers
//! followed by the body in streamed chunks, the only bytes Envoy forwards. Response phase (when Envoy is configured to send it): the
//! status, then the body through the same relay as the HTTP door ([`relay::Feed`], or
//! [`Passing`] for a pass-through endpoint): it hears the first token and the usage, and what the
//! client gets is replaced chunk by chunk where the relay changes it (the usage chunk the client did
//! not ask for is taken out). Whatever happens, the request's [`Settlement`] is settled once: at the
//! answer's end, by a refusal, as abandoned when the stream breaks, or, when Envoy never showed the
//! answer, as a success billed its reservation.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::config::core::v3::HeaderMap;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, processing_response,
};
use http_body_util::BodyExt as _;
use kinference_crds::ApiStyle;
use tracing::Instrument as _;

use super::mode::{BodyMode, Modes};
use super::picker::{self, Subset};
use super::reply::Phase;
use super::{Handler, body, reply};
use crate::api::openai::Usage;
use crate::api::openai::UsageOnly;
use crate::api::openai::passthrough::{Route, answer_id_of, usage_of};
use crate::backend::relay::{self, ClientShape, Spec};
use crate::errors::GatewayError;
use crate::pipeline::exchange::{Door, Exchange};
use crate::pipeline::forward::{self, WorkerCall};
use crate::pipeline::passthrough::Passing;
use crate::pipeline::settle::Settlement;
use crate::pipeline::{Endpoint, admit, govern, local, queue};
use crate::policy::stage::PlanTarget;
use crate::routing::Decision;
use crate::telemetry::{self, REQUEST_ID_HEADER, RequestContext, propagation};

/// The request headers the handler keeps: governance's (the API key, the policy tags, the admin
/// key and debug flag) and telemetry's (the request id, the W3C trace context).
const KEPT_HEADERS: [&str; 13] = [
    "authorization",
    "x-api-key",
    "x-kinference-tags",
    "x-kinference-debug",
    // The band and objectives a request claims (stage "queue" decides what they are worth).
    crate::pipeline::exchange::PRIORITY_HEADER,
    crate::pipeline::exchange::TTFT_OBJECTIVE_HEADER,
    crate::pipeline::exchange::TPOT_OBJECTIVE_HEADER,
    kinference_crds::standard::OBJECTIVE_HEADER,
    crate::access::ADMIN_KEY_HEADER,
    "content-length",
    REQUEST_ID_HEADER,
    propagation::TRACEPARENT,
    propagation::TRACESTATE,
];

/// The most of a whole (not streamed) answer kept to read its usage; past it, its tail.
const WHOLE_ANSWER_BYTES: usize = 4 * 1024 * 1024;
/// The tail of an answer kept past [`WHOLE_ANSWER_BYTES`] (the usage is at its end).
const USAGE_TAIL_BYTES: usize = 64 * 1024;

/// Per-stream state.
pub struct Session {
    handler: Handler,
    /// The request so far (after its headers).
    ex: Option<Exchange>,
    /// The request's id and the client's trace context (from the request headers).
    context: Option<RequestContext>,
    /// The request's root span, ended with the request.
    span: Option<tracing::Span>,
    /// The request headers kept.
    headers: http::HeaderMap,
    /// The path names no endpoint (an HTTPRoute may rewrite it): the body's shape decides.
    unknown_path: bool,
    body: BytesMut,
    /// Body chunks were taken off the request (streamed body mode): the last carries the whole.
    streamed_body: bool,
    /// A refusal or a local answer was sent: Envoy ignores everything after it.
    done: bool,
    /// The routed request, until its answer is seen.
    routed: Option<Routed>,
    /// The answer being seen.
    answer: Option<Answer>,
    /// How Envoy sends bodies on this stream.
    modes: Modes,
    /// The endpoints the proxy allows (the picker protocol's subset hint), when it sent one.
    subset: Option<Subset>,
    /// `FULL_DUPLEX_STREAMED`: the request headers are not answered yet (they wait for the body).
    headers_owed: bool,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("endpoint", &self.ex.as_ref().map(|e| e.endpoint))
            .field("done", &self.done)
            .finish()
    }
}

/// A request sent to a worker through Envoy, waiting for its answer.
struct Routed {
    settlement: Settlement,
    spec: Spec,
    route: Option<Route>,
    worker: String,
    /// The chosen worker's `ip:port` (the first of the destination list).
    endpoint: String,
}

/// An answer seen through the response phases.
enum Answer {
    /// A chat, completion or Anthropic stream, through the relay.
    Relay(Box<relay::Feed<Settlement>>),
    /// A pass-through endpoint's stream.
    Passing(Box<Passing<Settlement>>, String),
    /// A whole answer, kept to read its usage at the end.
    Whole {
        settlement: Box<Settlement>,
        spec: Spec,
        route: Option<Route>,
        body: BytesMut,
        /// The answer was larger than [`WHOLE_ANSWER_BYTES`]: `body` is its tail.
        cut: bool,
    },
}

/// What the stages decided for a request.
enum Decided {
    /// The gateway answers it itself.
    Local(serde_json::Value),
    /// A worker of the plan takes it.
    Worker {
        decision: Box<Decision>,
        call: WorkerCall,
        /// The model the client asked for (an Anthropic answer names it).
        asked: String,
        /// The client asked for a stream's usage chunk itself.
        wants_usage: bool,
    },
}

/// What the stages make of a read request.
enum Verdict {
    /// The answer is the gateway's own: a local reply or a refusal.
    Answer(ProcessingResponse),
    /// A worker takes it.
    Route(Destination),
}

/// Where a routed request goes, and as what.
struct Destination {
    /// The chosen `ip:port`, then any fallbacks, comma-separated.
    endpoints: String,
    /// The chosen worker's base URL.
    worker: String,
    /// Headers for the worker (its pool's credentials, the request id, the trace context).
    headers: http::HeaderMap,
    /// The body the worker gets.
    body: Bytes,
}

impl Session {
    /// A session of `handler`'s.
    pub fn new(handler: &Handler) -> Self {
        Session {
            handler: handler.clone(),
            ex: None,
            context: None,
            span: None,
            headers: http::HeaderMap::new(),
            unknown_path: false,
            body: BytesMut::new(),
            streamed_body: false,
            done: false,
            routed: None,
            answer: None,
            modes: Modes::default(),
            subset: None,
            headers_owed: false,
        }
    }

    /// Handles one message from Envoy; returns the answers to send, in order: one per message in
    /// every mode but `FULL_DUPLEX_STREAMED`, where the request's messages are answered together
    /// once its body is read (the headers' answer first, then the body's chunks), and none in
    /// observability mode or after a local reply.
    pub async fn on_message(&mut self, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
        if let Some(config) = &msg.protocol_config {
            self.modes = Modes::from(config);
        }
        let Some(request) = msg.request else {
            return Vec::new();
        };
        let metadata = msg.metadata_context.as_ref();
        let answers = match request {
            Request::RequestHeaders(h) => {
                self.subset = Subset::from_metadata(metadata);
                self.on_request_headers(h).await
            }
            Request::RequestBody(b) => self.on_request_body(b).await,
            Request::RequestTrailers(_) => self.on_request_trailers().await,
            Request::ResponseHeaders(h) => {
                self.on_response_headers(h.headers.as_ref(), picker::served(metadata));
                if h.end_of_stream {
                    self.end_answer();
                }
                vec![reply::response_headers_continue(&self.id_header())]
            }
            Request::ResponseBody(b) => self.on_response_body(b),
            Request::ResponseTrailers(_) => self.on_response_trailers(),
        };
        if msg.observability_mode {
            return Vec::new();
        }
        if self.done {
            // After a local reply Envoy ignores everything but that reply.
            return answers
                .into_iter()
                .filter(|a| matches!(a.response, Some(ref r) if is_immediate(r)))
                .collect();
        }
        answers
    }

    /// The request's `x-request-id`, as a header to set (none before the request headers).
    fn id_header(&self) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        if let Some(context) = &self.context {
            headers.insert(REQUEST_ID_HEADER, context.id.header_value());
        }
        headers
    }

    async fn on_request_headers(&mut self, h: HttpHeaders) -> Vec<ProcessingResponse> {
        let headers = h.headers.as_ref();
        let raw_path = header(headers, ":path").unwrap_or_default();
        let path = raw_path.split('?').next().unwrap_or_default().to_string();
        for name in KEPT_HEADERS {
            if let Some(v) =
                header(headers, name).and_then(|v| http::HeaderValue::from_str(&v).ok())
            {
                self.headers.insert(http::HeaderName::from_static(name), v);
            }
        }
        let method = header(headers, ":method")
            .and_then(|m| http::Method::from_bytes(m.as_bytes()).ok())
            .unwrap_or(http::Method::POST);
        let endpoint = Endpoint::of_path(&path);
        // As over HTTP: the client's id when it is safe, else a new one; its trace continued.
        let context = RequestContext::for_request(&path, &self.headers);
        let span = context.span(&method, &path);
        self.span = Some(span.clone());
        self.context = Some(context.clone());
        let Some(endpoint) = endpoint.or_else(|| {
            // A body of a path no endpoint names is read by its shape (chat or completion).
            (!h.end_of_stream).then_some(Endpoint::ChatCompletions)
        }) else {
            // No body, no endpoint (a health check): nothing to route on; Envoy's route decides.
            tracing::debug!(%path, "ext_proc request for no endpoint; not routed");
            return vec![reply::request_headers_continue(&self.id_header())];
        };
        self.unknown_path = Endpoint::of_path(&path).is_none();
        let gw = &self.handler.gw;
        // Envoy is every client's peer: only the admin key makes an admin here.
        let admin = gw.access.serving_port_admin(&self.headers, None);
        let mut ex = Exchange::new(endpoint, Door::ExtProc, &self.headers, admin, &gw.metrics);
        if let Some(s) = ex.settlement() {
            s.request(context.id.clone(), endpoint.path(), span.clone());
        }
        let declared = self
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<usize>().ok());
        let admitted = context
            .scope(
                async {
                    admit::authenticate(gw, &mut ex, &self.headers)?;
                    admit::admit(gw, &mut ex, declared).await
                }
                .instrument(span.clone()),
            )
            .await;
        self.ex = Some(ex);
        if let Err(error) = admitted {
            return vec![self.refuse(error).await];
        }
        if h.end_of_stream {
            // No body (`GET /v1/models`): the stages run now, answered on the headers.
            return self.finish_request(Bytes::new(), true).await;
        }
        match self.modes.request {
            BodyMode::None => {
                // The body never comes: nothing to parse, limit, bill or route on.
                let error = GatewayError::ProxyModeUnsupported(
                    "the proxy sends no request body (request_body_mode NONE): set \
                     FULL_DUPLEX_STREAMED (or BUFFERED) for the inference handler"
                        .into(),
                );
                vec![self.refuse(error).await]
            }
            BodyMode::FullDuplex => {
                // Answered with the route once the body is read; Envoy holds the headers till then.
                self.headers_owed = true;
                Vec::new()
            }
            // The body may be rewritten for the worker: its length is Envoy's to set again.
            _ => vec![reply::request_headers_continue_without_length(
                &self.id_header(),
            )],
        }
    }

    async fn on_request_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        let duplex = self.modes.request == BodyMode::FullDuplex;
        if self.done || self.ex.is_none() {
            // Nothing to decide (already answered): in full duplex Envoy forwards only what is
            // sent back, so the chunk goes on as it came.
            return if duplex {
                reply::streamed_request_body(&b.body, b.end_of_stream)
            } else {
                vec![reply::request_body_continue()]
            };
        }
        let limit = self
            .handler
            .settings
            .body_limit_bytes
            .min(self.handler.gw.settings.body_limit_bytes);
        if self.body.len() + b.body.len() > limit {
            return vec![self.refuse(GatewayError::BodyTooLarge { limit }).await];
        }
        self.body.extend_from_slice(&b.body);
        // `BUFFERED` sends the whole body in one message, even when trailers follow it.
        let whole = b.end_of_stream || self.modes.request == BodyMode::Buffered;
        if !whole {
            if duplex {
                // Kept; the answers come with the last chunk.
                return Vec::new();
            }
            // The whole body goes with the last chunk's answer, as the worker is to get it.
            self.streamed_body = true;
            return vec![reply::request_body_taken()];
        }
        let body = std::mem::take(&mut self.body).freeze();
        self.finish_request(body, b.end_of_stream).await
    }

    /// Request trailers: the end of the request. A body still being read ends here (a client that
    /// sends trailers never sets `end_of_stream` on its last chunk).
    async fn on_request_trailers(&mut self) -> Vec<ProcessingResponse> {
        if self.done || self.ex.is_none() {
            return vec![reply::request_trailers_continue()];
        }
        if self.modes.request != BodyMode::FullDuplex {
            // The chunks are answered already: no answer left can carry the route and the body.
            let error = GatewayError::ProxyModeUnsupported(
                "request trailers after a streamed body cannot be routed: set \
                 FULL_DUPLEX_STREAMED (or BUFFERED) for the inference handler"
                    .into(),
            );
            return vec![self.refuse(error).await];
        }
        let body = std::mem::take(&mut self.body).freeze();
        let mut answers = self.finish_request(body, false).await;
        if !self.done {
            answers.push(reply::request_trailers_continue());
        }
        answers
    }

    /// The request is read (its body is `body`; `end_of_stream`: nothing follows it): the stages
    /// decide, and the answers say so in the proxy's mode. A routed request's answer is the
    /// headers' (no body, or full duplex, then the body in streamed chunks) or the last chunk's
    /// (with the body when the worker gets another than the client sent, or chunks were taken).
    async fn finish_request(
        &mut self,
        body: Bytes,
        end_of_stream: bool,
    ) -> Vec<ProcessingResponse> {
        let bodyless = body.is_empty() && end_of_stream && !self.streamed_body;
        let client_body = body.clone();
        let route = match self.decide(body).await {
            Verdict::Answer(answer) => return vec![answer],
            Verdict::Route(route) => route,
        };
        let duplex = self.modes.request == BodyMode::FullDuplex && self.headers_owed;
        self.headers_owed = false;
        if duplex {
            let mut answers = vec![reply::routed(
                &route.endpoints,
                &route.worker,
                &route.headers,
                Some(&route.body),
                Phase::Headers,
            )];
            answers.extend(reply::streamed_request_body(&route.body, end_of_stream));
            return answers;
        }
        if bodyless {
            return vec![reply::routed(
                &route.endpoints,
                &route.worker,
                &route.headers,
                None,
                Phase::Headers,
            )];
        }
        // Chunks taken off the request leave the last to carry the whole body.
        let new_body = (self.streamed_body || route.body != client_body).then_some(&route.body);
        vec![reply::routed(
            &route.endpoints,
            &route.worker,
            &route.headers,
            new_body,
            Phase::Body,
        )]
    }

    /// The stages from the body on, in the request's span and context: a local reply, or the
    /// route with the worker's body.
    async fn decide(&mut self, body: Bytes) -> Verdict {
        let Some(mut ex) = self.ex.take() else {
            return Verdict::Answer(reply::request_body_continue());
        };
        if self.unknown_path {
            match body::detect(None, &body) {
                Ok(api) => {
                    ex.endpoint = api;
                    ex.protocol = api.protocol();
                }
                Err(error) => {
                    self.ex = Some(ex);
                    return Verdict::Answer(self.refuse(error).await);
                }
            }
        }
        let span = self.span.clone().unwrap_or_else(tracing::Span::none);
        let context = self
            .context
            .clone()
            .unwrap_or_else(|| RequestContext::from_headers(&http::HeaderMap::new()));
        let handler = self.handler.clone();
        let subset = self.subset.clone();
        let (decided, telemetry) = context
            .scope(
                async {
                    let decided = stages(&handler, &mut ex, body, subset.as_ref()).await;
                    (decided, telemetry::current_headers())
                }
                .instrument(span.clone()),
            )
            .await;
        let _in_span = span.enter();
        match decided {
            Ok(Decided::Local(json)) => {
                self.done = true;
                self.span = None;
                let id = self.context.as_ref().map(|c| c.id.as_str().to_string());
                let headers: Vec<(&str, &str)> = id
                    .as_deref()
                    .map(|id| (REQUEST_ID_HEADER, id))
                    .into_iter()
                    .collect();
                Verdict::Answer(reply::immediate(
                    200,
                    &json,
                    "kinference_local_answer",
                    &headers,
                ))
            }
            Ok(Decided::Worker {
                decision,
                call,
                asked,
                wants_usage,
            }) => {
                let endpoint = ex.endpoint;
                let Some(endpoint_addr) = super::endpoint_of(&decision.worker) else {
                    self.ex = Some(ex);
                    let error = GatewayError::BadUpstream {
                        worker: decision.worker.clone(),
                        detail: "worker URL has no host".into(),
                    };
                    return Verdict::Answer(self.refuse(error).await);
                };
                tracing::debug!(worker = %decision.worker, endpoint = %endpoint_addr,
                    reason = decision.reason, "ext_proc routed");
                let worker = decision.worker.clone();
                let mut headers = self.handler.gw.upstream.headers_for(&worker);
                headers.extend(telemetry);
                // A rank of a data-parallel worker: the proxy's request carries the rank as the
                // gateway's own doors send it.
                if let Some(rank) = decision.dp_rank {
                    headers.insert(
                        crate::backend::worker::DP_RANK_HEADER,
                        http::HeaderValue::from(rank),
                    );
                }
                let mut settlement = ex
                    .settlement
                    .take()
                    .unwrap_or_else(|| Settlement::new(&self.handler.gw.metrics, ex.protocol));
                settlement.worker(
                    &decision.worker,
                    decision.reason,
                    decision.prompt_tokens,
                    decision.ticket,
                );
                settlement.relaying();
                settlement.answer_unseen(true);
                // The chosen endpoint first, then those the proxy may retry (same value in the
                // header and the metadata, as the protocol requires).
                let mut endpoints = vec![endpoint_addr.clone()];
                let fallbacks = self.handler.settings.fallback_endpoints;
                if fallbacks > 0 {
                    endpoints.extend(picker::fallbacks(
                        &self.handler.gw.router.workers(),
                        &call.model,
                        &worker,
                        call.pool.as_deref(),
                        fallbacks,
                    ));
                }
                self.routed = Some(Routed {
                    spec: spec_of(&self.handler, endpoint, &call, &asked, wants_usage, &ex),
                    route: endpoint.passthrough(),
                    settlement,
                    worker: worker.clone(),
                    endpoint: endpoint_addr,
                });
                let body = call.body_for(&self.handler.gw.router, &worker);
                Verdict::Route(Destination {
                    endpoints: endpoints.join(","),
                    worker,
                    headers,
                    body,
                })
            }
            Err(error) => {
                drop(_in_span);
                self.ex = Some(ex);
                Verdict::Answer(self.refuse(error).await)
            }
        }
    }

    /// Answers the request locally with `error` in the client's protocol (Envoy sends nothing more
    /// of it): the same answer, headers and settlement as the HTTP door's.
    async fn refuse(&mut self, error: GatewayError) -> ProcessingResponse {
        self.done = true;
        let Some(mut ex) = self.ex.take() else {
            let status = error.status().as_u16();
            return reply::immediate(status, &error.body(error_protocol(None)), error.kind(), &[]);
        };
        let kind = error.kind();
        let span = self.span.clone().unwrap_or_else(tracing::Span::none);
        let response = span.in_scope(|| ex.refuse(error));
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let mut headers: Vec<(String, String)> = parts
            .headers
            .iter()
            .filter(|(name, _)| *name != http::header::CONTENT_TYPE)
            .filter_map(|(name, v)| Some((name.to_string(), v.to_str().ok()?.to_string())))
            .collect();
        if let Some(context) = &self.context {
            headers.push((
                REQUEST_ID_HEADER.to_string(),
                context.id.as_str().to_string(),
            ));
        }
        let pairs: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        self.span = None;
        reply::immediate(
            parts.status.as_u16(),
            &json,
            &format!("kinference_{kind}"),
            &pairs,
        )
    }

    /// The answer's status and type (`served`: the endpoint that answered, when the proxy says).
    fn on_response_headers(&mut self, headers: Option<&HeaderMap>, served: Option<String>) {
        let Some(routed) = self.routed.take() else {
            return;
        };
        let status = header(headers, ":status")
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(200);
        let sse =
            header(headers, "content-type").is_some_and(|c| c.starts_with("text/event-stream"));
        let Routed {
            mut settlement,
            spec,
            route,
            worker,
            endpoint,
        } = routed;
        settlement.answer_unseen(false);
        let gw = &self.handler.gw;
        // A fallback answered when the chosen endpoint failed: the health seen is the fallback's
        // (the chosen one's failure is Envoy's to report through its own outlier detection).
        let answered = match served.filter(|s| *s != endpoint) {
            Some(served) => {
                tracing::debug!(chosen = %endpoint, %served, "ext_proc: a fallback endpoint served");
                picker::worker_at(&gw.router.workers(), &served).unwrap_or(worker.clone())
            }
            None => worker.clone(),
        };
        gw.health.observe(&answered, status < 500);
        if !(200..300).contains(&status) {
            // The worker refused or failed: its error reaches the client as it is.
            settlement.finish(status, None);
            self.span = None;
            return;
        }
        let span = self.span.clone().unwrap_or_else(tracing::Span::none);
        self.answer = Some(match (sse, route) {
            (true, Some(route)) => {
                Answer::Passing(Box::new(Passing::new(route, settlement)), worker)
            }
            (true, None) => Answer::Relay(Box::new(relay::Feed::new(spec, settlement, span))),
            (false, route) => Answer::Whole {
                settlement: Box::new(settlement),
                spec,
                route,
                body: BytesMut::new(),
                cut: false,
            },
        });
    }

    fn on_response_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        let duplex = self.modes.response == BodyMode::FullDuplex;
        let Some(answer) = self.answer.as_mut() else {
            // Not an answer the gateway reads (a worker's error, an unrouted request): as it came.
            return if duplex {
                reply::streamed_response_body(&b.body, b.end_of_stream)
            } else {
                vec![reply::response_body_continue()]
            };
        };
        let out = match answer {
            Answer::Relay(feed) => {
                feed.feed(&b.body);
                if b.end_of_stream {
                    feed.end();
                }
                Some(feed.output())
            }
            Answer::Passing(passing, worker) => {
                let mut out = BytesMut::from(&passing.feed(&b.body)[..]);
                if b.end_of_stream {
                    out.extend_from_slice(&passing.end(worker));
                }
                Some(out.freeze())
            }
            Answer::Whole { body, cut, .. } => {
                body.extend_from_slice(&b.body);
                if body.len() > WHOLE_ANSWER_BYTES {
                    let drop = body.len() - USAGE_TAIL_BYTES;
                    let _ = body.split_to(drop);
                    *cut = true;
                }
                None
            }
        };
        if b.end_of_stream {
            self.end_answer();
        }
        if duplex {
            // Envoy passes on only what is sent back.
            let out = out.unwrap_or_else(|| Bytes::from(b.body));
            return reply::streamed_response_body(&out, b.end_of_stream);
        }
        vec![match out {
            Some(out) if out != b.body => reply::response_body_replaced(out),
            _ => reply::response_body_continue(),
        }]
    }

    /// Response trailers end the answer; in full duplex what the relay still held (nothing
    /// ended the body) goes out before the trailers' answer.
    fn on_response_trailers(&mut self) -> Vec<ProcessingResponse> {
        let tail = self.end_answer();
        let mut answers = Vec::new();
        if self.modes.response == BodyMode::FullDuplex && !tail.is_empty() {
            answers.extend(reply::streamed_response_body(&tail, false));
        }
        answers.push(reply::response_trailers_continue());
        answers
    }

    /// The answer ended (its last body chunk, trailers, or headers without a body): settled with
    /// what it said; the request's span ends with it. Returns what the relay still held for the
    /// client (only an answer ended by trailers has any).
    fn end_answer(&mut self) -> Bytes {
        let tail = self.settle_answer();
        self.span = None;
        tail
    }

    fn settle_answer(&mut self) -> Bytes {
        if let Some(routed) = self.routed.take() {
            // Response headers that ended the response: an answer without a body.
            let mut settlement = routed.settlement;
            settlement.answer_unseen(false);
            settlement.finish(200, None);
            return Bytes::new();
        }
        match self.answer.take() {
            Some(Answer::Relay(mut feed)) => {
                feed.end();
                return feed.output();
            }
            Some(Answer::Passing(mut passing, worker)) => {
                return passing.end(&worker);
            }
            Some(Answer::Whole {
                mut settlement,
                spec,
                route,
                body,
                cut,
            }) => {
                let body = body.freeze();
                // A whole answer's id is at its head (gone when it was cut); an event stream's
                // last `response` event carries it too.
                let id =
                    route.and_then(|r| last_json_with(&body, "\"id\"", |j| answer_id_of(r, j)));
                if let Some(id) = id {
                    settlement.answer_id(id);
                }
                let usage = whole_usage(&body, cut, &spec, route);
                settlement.finish(200, usage.as_ref());
            }
            None => {}
        }
        Bytes::new()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Routed, and Envoy closed the stream without showing the answer (no response phase
        // configured): a success billed its reservation, marked estimated. An answer seen in part
        // and never ended is dropped with its settlement: abandoned (499).
        if let Some(mut routed) = self.routed.take() {
            routed.settlement.finish(200, None);
        }
    }
}

/// Stages "read" (its cost), "parse" to "policy", "queue", and the pick: what the HTTP door runs before it
/// forwards, with the worker's body as Envoy is to send it.
async fn stages(
    handler: &Handler,
    ex: &mut Exchange,
    body: Bytes,
    subset: Option<&Subset>,
) -> Result<Decided, GatewayError> {
    let gw = &handler.gw;
    admit::body_read(gw, ex, &body).await?;
    let prepared = govern::prepare(gw, ex, body).await?;
    if local::answers(ex.endpoint) {
        return local::answer(gw, ex, &prepared.request)
            .await
            .map(Decided::Local);
    }
    let request = &prepared.request;
    handler.shed(request.model())?;
    let plan = &queue::queue(gw, ex, request, Arc::clone(&prepared.plan)).await?;
    let mut last = None;
    for target in &plan.targets {
        // Envoy forwards to workers only.
        let PlanTarget::Pool { model, workers, .. } = target else {
            continue;
        };
        let renamed = request.renamed_for(model)?;
        let req = renamed.as_ref().unwrap_or(request);
        let mut call =
            forward::worker_call(gw, ex.endpoint, req, workers.as_deref(), Door::ExtProc)?;
        call.priority = forward::priority_of(ex);
        if let Some(subset) = subset {
            // The proxy's subset hint: only its endpoints; none of them eligible is a 503.
            let allowed = subset.restrict(&gw.router.workers(), call.pool.as_deref());
            if allowed.is_empty() {
                last = Some(GatewayError::NoHealthyWorker(req.model().to_string()));
                continue;
            }
            call.pool = Some(allowed);
        }
        match forward::pick(gw, &call, req, ex.debug, &ex.tokens, &[]).await {
            Ok(decision) => {
                if let Some(stage) = &gw.policy {
                    stage.count_sent(target, plan.burst);
                }
                if let Some(s) = ex.settlement() {
                    s.served(req.model());
                }
                return Ok(Decided::Worker {
                    decision: Box::new(decision),
                    call,
                    asked: request.model().to_string(),
                    wants_usage: request.client_wants_usage,
                });
            }
            Err(error) => {
                let error = GatewayError::from(error);
                if !forward::passes_to_next_target(&error) {
                    return Err(error);
                }
                last = Some(error);
            }
        }
    }
    Err(govern::no_backend(plan, last))
}

/// How the relay reads the answer of `call` for the client of `ex`.
fn spec_of(
    handler: &Handler,
    endpoint: Endpoint,
    call: &WorkerCall,
    asked: &str,
    wants_usage: bool,
    ex: &Exchange,
) -> Spec {
    Spec {
        style: call.style,
        label: call.model.clone(),
        shape: match endpoint {
            Endpoint::Messages => ClientShape::Anthropic {
                model: asked.to_string(),
                input_tokens: 0,
            },
            _ => ClientShape::OpenAi {
                pass_usage_chunk: wants_usage,
            },
        },
        protocol: ex.protocol,
        idle_timeout: handler.gw.upstream.idle_timeout(),
        // What a worker may send back, as on the HTTP door: the session parses what Envoy shows it.
        limits: handler.gw.upstream.limits(),
        // Envoy relays the worker's answer: an Anthropic answer goes to the client as it is.
        pass_through: call.style == ApiStyle::Anthropic,
    }
}

/// The usage of a whole answer (or of its tail, when it was cut).
fn whole_usage(body: &Bytes, cut: bool, spec: &Spec, route: Option<Route>) -> Option<Usage> {
    let whole = match route {
        _ if cut => None,
        Some(route) => usage_of(route, body),
        None => relay::shape_whole(body.clone(), spec)
            .ok()
            .and_then(|(_, u)| u),
    };
    // Cut, or not what its content type said (an event stream labelled JSON): its last usage.
    whole.or_else(|| usage_at_end(route, body))
}

/// The protocol of a refusal before the request's endpoint is known.
fn error_protocol(endpoint: Option<Endpoint>) -> crate::errors::Protocol {
    endpoint.map_or(crate::errors::Protocol::OpenAi, Endpoint::protocol)
}

fn is_immediate(r: &processing_response::Response) -> bool {
    matches!(r, processing_response::Response::ImmediateResponse(_))
}

/// A header's value (Envoy fills `raw_value`; older versions `value`). Names are lower-case in HTTP/2.
fn header(headers: Option<&HeaderMap>, name: &str) -> Option<String> {
    headers?
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| {
            if h.raw_value.is_empty() {
                h.value.clone()
            } else {
                String::from_utf8_lossy(&h.raw_value).into_owned()
            }
        })
}

/// `usage` from the end of a response body: a pass-through endpoint's in that endpoint's terms
/// (a Responses stream's in its `response.completed` event), else [`usage_in`].
pub fn usage_at_end(passthrough: Option<Route>, tail: &[u8]) -> Option<Usage> {
    match passthrough {
        Some(route) => last_json(tail, |json| usage_of(route, json)),
        None => usage_in(tail),
    }
}

/// `usage` from the end of a chat or completion response body: a whole JSON answer, or the last
/// SSE event carrying it.
pub fn usage_in(tail: &[u8]) -> Option<Usage> {
    last_json(tail, |json| {
        serde_json::from_slice::<UsageOnly>(json).ok()?.usage
    })
}

/// `read` of the end of a response body: of the whole body when it is one JSON answer, else of the
/// last SSE event mentioning `usage` that `read` finds it in.
fn last_json<T>(tail: &[u8], read: impl Fn(&[u8]) -> Option<T>) -> Option<T> {
    last_json_with(tail, "\"usage\"", read)
}

/// What `read` finds in a whole JSON `tail`, else in its last SSE event whose data holds `hint`.
fn last_json_with<T>(tail: &[u8], hint: &str, read: impl Fn(&[u8]) -> Option<T>) -> Option<T> {
    if let Some(found) = read(tail) {
        return Some(found);
    }
    let text = std::str::from_utf8(tail).ok().or_else(|| {
        // The tail may start mid-character; skip to the first line start.
        let start = tail.iter().position(|b| *b == b'\n')? + 1;
        std::str::from_utf8(&tail[start..]).ok()
    })?;
    text.lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim)
        .filter(|d| d.contains(hint))
        .find_map(|d| read(d.as_bytes()))
}
