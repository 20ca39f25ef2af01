//! One ext_proc stream, i.e. one HTTP request through Envoy: the state between its messages.
//!
//! Request phase: headers (path, debug flag, request id and trace context: the request's root span
//! starts here), then the body, buffered here until `end_of_stream`
//! (Envoy's `BUFFERED` mode sends one chunk; `STREAMED` sends several, each acknowledged), then the
//! decision. Response phase (when Envoy is configured to send it): the status, the first body chunk
//! of a server-sent-event stream (the first token: it feeds the router's learned rates), and the end
//! of the body with its `usage`, which finishes the router's in-flight ticket and settles the tenant's
//! admission (usage, cost, token limits), and ends the request's span. Whatever happens, they are
//! dropped with the session, so an aborted request never leaks an in-flight count and is recorded
//! once. The request's `x-request-id` is set on the request (headers and routed answer) and on the
//! response headers, and is in every local reply. One access line per request, as over HTTP, when
//! it is refused or its response ends (a request whose response Envoy does not send has none).

use std::time::Instant;

use bytes::BytesMut;
use envoy_types::pb::envoy::config::core::v3::HeaderMap;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, ProcessingRequest, ProcessingResponse, processing_response,
};

use super::body::Api;
use super::{Handler, Head, Refusal, reply};
use crate::api::openai::passthrough::{Route, usage_of};
use crate::api::openai::{Usage, UsageOnly};
use crate::errors::{GatewayError, Protocol};
use crate::overload::gate::Slot;
use crate::routing::InFlight;
use crate::telemetry::{self, REQUEST_ID_HEADER, RequestContext, RequestId, propagation};
use crate::tenancy::Admission;
use tracing::Instrument as _;

/// The request headers the handler reads: governance's (the API key, the policy tags) and
/// telemetry's (the request id, the W3C trace context).
const KEPT_HEADERS: [&str; 6] = [
    "authorization",
    "x-api-key",
    "x-kinference-tags",
    REQUEST_ID_HEADER,
    propagation::TRACEPARENT,
    propagation::TRACESTATE,
];

/// The most response-body bytes kept to find `usage` at the end (the tail of a stream suffices).
const USAGE_TAIL_BYTES: usize = 64 * 1024;

/// The access line of one request, written once when it ends (as over HTTP: target
/// `kinference_gateway::access_log`, in the request's span).
#[derive(Debug)]
struct AccessLine {
    method: http::Method,
    path: String,
    started: Instant,
    tenant: String,
    model: String,
    backend: String,
}

impl AccessLine {
    fn write(self, status: u16, usage: Option<&Usage>, id: &str) {
        let usage = usage.copied().unwrap_or_default();
        tracing::info!(
            target: "kinference_gateway::access_log",
            method = %self.method,
            path = %self.path,
            status,
            tenant = %self.tenant,
            model = %self.model,
            backend = %self.backend,
            input_tokens = usage.prompt_tokens,
            cached_tokens = usage.cached_tokens().unwrap_or(0),
            output_tokens = usage.completion_tokens,
            duration_ms = self.started.elapsed().as_millis() as u64,
            request_id = id,
            "request"
        );
    }
}

/// Per-stream state.
#[derive(Debug, Default)]
pub struct Session {
    head: Head,
    /// The request's id and the client's trace context (from the request headers).
    context: Option<RequestContext>,
    /// The request's root span, ended with the response (or the stream).
    span: Option<tracing::Span>,
    /// The access line, until it is written (by a local reply, or at the response's end).
    access: Option<AccessLine>,
    body: BytesMut,
    /// The decision's ledger entry, held until the response ends (or the stream does).
    ticket: Option<InFlight>,
    /// The tenant's admission, settled when the response ends (or as abandoned with the stream).
    admission: Option<Admission>,
    /// The place under the gateway's in-flight limit, given back when the response ends (or the
    /// stream does).
    slot: Option<Slot>,
    response_status: u16,
    /// A refusal was sent: Envoy ignores everything after it.
    done: bool,
    response_ok: bool,
    response_sse: bool,
    response_tail: BytesMut,
}

impl Session {
    /// Handles one message from Envoy; returns the answer to send (none in observability mode, or
    /// after a local reply).
    pub async fn on_message(
        &mut self,
        handler: &Handler,
        msg: ProcessingRequest,
    ) -> Option<ProcessingResponse> {
        let answer = match msg.request? {
            Request::RequestHeaders(h) => {
                self.on_request_headers(h.headers.as_ref());
                if h.end_of_stream {
                    // No body (GET /v1/models, health checks): nothing to route on; Envoy's route decides.
                    tracing::debug!("ext_proc request without body; not routed");
                }
                reply::request_headers_continue(&self.id_header())
            }
            Request::RequestBody(b) => self.on_request_body(handler, b).await,
            Request::RequestTrailers(_) => reply::request_trailers_continue(),
            Request::ResponseHeaders(h) => {
                self.on_response_headers(h.headers.as_ref());
                if h.end_of_stream {
                    self.finish(None);
                }
                reply::response_headers_continue(&self.id_header())
            }
            Request::ResponseBody(b) => {
                self.on_response_body(b);
                reply::response_body_continue()
            }
            Request::ResponseTrailers(_) => {
                self.finish(None);
                reply::response_trailers_continue()
            }
        };
        if self.done && !matches!(answer.response, Some(ref r) if is_immediate(r)) {
            return None;
        }
        (!msg.observability_mode).then_some(answer)
    }

    /// The request's `x-request-id`, as a header to set (none before the request headers).
    fn id_header(&self) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        if let Some(context) = &self.context {
            headers.insert(REQUEST_ID_HEADER, context.id.header_value());
        }
        headers
    }

    /// The request's context (with a new id if the request headers never came).
    fn context(&mut self) -> RequestContext {
        self.context
            .get_or_insert_with(|| RequestContext::from_headers(&http::HeaderMap::new()))
            .clone()
    }

    fn on_request_headers(&mut self, headers: Option<&HeaderMap>) {
        let path = header(headers, ":path").unwrap_or_default();
        self.head.api = Api::from_path(&path);
        self.head.passthrough = super::body::passthrough_of(&path);
        self.head.debug = header(headers, "x-kinference-debug").as_deref() == Some("1");
        for name in KEPT_HEADERS {
            if let Some(v) =
                header(headers, name).and_then(|v| http::HeaderValue::from_str(&v).ok())
            {
                self.head
                    .headers
                    .insert(http::HeaderName::from_static(name), v);
            }
        }
        // As over HTTP: the client's id when it is safe, else a new one; its trace continued.
        let path = path.split('?').next().unwrap_or_default();
        let context = RequestContext::for_request(path, &self.head.headers);
        let method = header(headers, ":method")
            .and_then(|m| http::Method::from_bytes(m.as_bytes()).ok())
            .unwrap_or(http::Method::POST);
        self.span = Some(context.span(&method, path));
        self.context = Some(context);
        self.access = Some(AccessLine {
            method,
            path: path.to_string(),
            started: Instant::now(),
            tenant: String::new(),
            model: String::new(),
            backend: String::new(),
        });
    }

    async fn on_request_body(&mut self, handler: &Handler, b: HttpBody) -> ProcessingResponse {
        if self.done {
            return reply::request_body_continue();
        }
        let protocol = self.head.api.map_or(Protocol::OpenAi, Api::protocol);
        let context = self.context();
        let id = context.id.clone();
        if self.body.len() + b.body.len() > handler.settings.body_limit_bytes {
            let limit = handler.settings.body_limit_bytes;
            let refusal = Refusal::Gateway(GatewayError::BodyTooLarge { limit });
            return self.refuse(&refusal, protocol, &id);
        }
        self.body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            return reply::request_body_continue();
        }
        let body = std::mem::take(&mut self.body).freeze();
        // A body whose API only its shape tells answers errors in OpenAI's protocol, as before;
        // the pass-through endpoints are OpenAI's.
        let protocol = if self.head.passthrough.is_some() {
            Protocol::OpenAi
        } else {
            super::body::detect(self.head.api, &body).map_or(protocol, Api::protocol)
        };
        let span = self.span.clone().unwrap_or_else(tracing::Span::none);
        // In the request's span and context: the stages' spans are its children, and the worker's
        // `traceparent` names it (or is the client's own when traces are not exported).
        let (decided, telemetry) = context
            .scope(
                async {
                    let decided = handler.decide(&self.head, body).await;
                    (decided, telemetry::current_headers())
                }
                .instrument(span.clone()),
            )
            .await;
        let _in_span = span.enter();
        match decided {
            Ok(routed) => {
                let answer = reply::routed(&routed.endpoint, &routed.decision.worker, &telemetry);
                tracing::debug!(worker = %routed.decision.worker,
                    endpoint = %routed.endpoint, reason = routed.decision.reason, "ext_proc routed");
                if let Some(line) = &mut self.access {
                    line.model = routed.model;
                    line.backend = routed.decision.worker;
                    line.tenant = routed
                        .admission
                        .as_ref()
                        .map_or_else(String::new, |a| a.tenant().to_string());
                }
                self.ticket = Some(routed.decision.ticket);
                self.admission = routed.admission;
                if let Some(admission) = &mut self.admission {
                    admission.request_id(id.as_str());
                }
                self.slot = routed.slot;
                answer
            }
            Err(refusal) => {
                tracing::debug!(error = %refusal, "ext_proc refused");
                self.refuse(&refusal, protocol, &id)
            }
        }
    }

    /// Answers the request locally with `refusal` (Envoy sends nothing more of it) and writes its
    /// access line.
    fn refuse(
        &mut self,
        refusal: &Refusal,
        protocol: Protocol,
        id: &RequestId,
    ) -> ProcessingResponse {
        self.done = true;
        if let Some(line) = self.access.take() {
            let span = self.span.clone().unwrap_or_else(tracing::Span::none);
            span.in_scope(|| line.write(refusal.status(), None, id.as_str()));
        }
        refusal.reply(protocol, id)
    }

    fn on_response_headers(&mut self, headers: Option<&HeaderMap>) {
        self.response_status = header(headers, ":status")
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        self.response_ok = (200..300).contains(&self.response_status);
        self.response_sse =
            header(headers, "content-type").is_some_and(|c| c.starts_with("text/event-stream"));
    }

    fn on_response_body(&mut self, b: HttpBody) {
        if let Some(ticket) = self.ticket.as_mut()
            && self.response_sse
            && !b.body.is_empty()
        {
            // The first event of a stream is the first token (a whole JSON answer is not).
            ticket.first_token();
        }
        self.response_tail.extend_from_slice(&b.body);
        if self.response_tail.len() > USAGE_TAIL_BYTES {
            let cut = self.response_tail.len() - USAGE_TAIL_BYTES;
            let _ = self.response_tail.split_to(cut);
        }
        if b.end_of_stream {
            let usage = usage_at_end(self.head.passthrough, &self.response_tail);
            self.finish(usage);
        }
    }

    /// The response ended: release the ledger entry and settle the tenant with what the worker
    /// reported.
    fn finish(&mut self, usage: Option<Usage>) {
        self.slot = None;
        let status = if self.response_status == 0 {
            200
        } else {
            self.response_status
        };
        if let Some(admission) = self.admission.take() {
            admission.settle(status, usage.as_ref());
        }
        if self.ticket.is_some()
            && let (Some(line), Some(span)) = (self.access.take(), &self.span)
        {
            let id = self.context.as_ref().map_or("", |c| c.id.as_str());
            span.in_scope(|| line.write(status, usage.as_ref(), id));
        }
        if let Some(ticket) = self.ticket.take() {
            let usage = usage.unwrap_or_default();
            ticket.finish(
                self.response_ok,
                usize::try_from(usage.completion_tokens).unwrap_or(usize::MAX),
                usage.cached_tokens().and_then(|c| usize::try_from(c).ok()),
            );
        }
        // The request span ends once the request is settled, as over HTTP.
        self.span = None;
    }
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
fn last_json(tail: &[u8], read: impl Fn(&[u8]) -> Option<Usage>) -> Option<Usage> {
    if let Some(usage) = read(tail) {
        return Some(usage);
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
        .filter(|d| d.contains("\"usage\""))
        .find_map(|d| read(d.as_bytes()))
}
