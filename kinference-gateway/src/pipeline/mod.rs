//! One request's path through the gateway, the same for every endpoint of the route table
//! ([`routes::ROUTES`]) and both front doors (this HTTP port and the Envoy ext_proc handler,
//! [`crate::extproc`]), in the order of [`STAGES`]:
//!
//! authenticate -> admit -> read -> parse -> limit -> classify -> policy -> queue -> forward -> settle
//!
//! - [`admit`]: the caller, its in-flight slot and room for its body, before the body is read;
//! - [`exchange`]: the [`Exchange`] made once per request, the body read, and the parsed
//!   [`exchange::Request`] of any endpoint;
//! - [`govern`]: parse, limit (the tenant's models, budget and token limits, the output reserved and
//!   sent), classify and policy (the plan: pools and providers in order);
//! - [`queue`]: flow control, while the plan's pool is saturated (priority bands, fairness between
//!   tenants, shed past a deadline; [`crate::overload::flow`]);
//! - [`forward`]: the request to a worker or a provider, and the answer back through the one relay;
//!   [`passthrough`]: a pass-through endpoint's answer byte for byte; [`local`]: what the gateway
//!   answers itself (token counts, the model list);
//! - [`settle`]: the [`settle::Settlement`] that owns the request's metrics, the router's ticket,
//!   the tenant's admission, its slot and body room, and settles them exactly once.
//!
//! The prompt is tokenized at most once per served model ([`Exchange::tokens`]); only the gateway's
//! own tokenizer runs before the plan, so no byte of the request reaches a worker before the
//! policies have classified it. Errors from any stage surface as one [`GatewayError`] mapped to the
//! client's protocol. Every request has an id ([`crate::telemetry::RequestId`], echoed in
//! `x-request-id`) and a root span carrying it; the stages run in their own `debug` spans, named as
//! in [`STAGES`], which exist only when traces are exported ([`crate::telemetry`]).

pub mod admit;
pub mod exchange;
pub mod forward;
pub mod govern;
pub mod local;
pub mod models;
pub mod passthrough;
pub mod queue;
pub mod routes;
pub mod settle;

use std::sync::Arc;

use http::{HeaderValue, Request as HttpRequest, Response, StatusCode, header};
use hyper::body::Incoming;

use crate::access::Peer;
use crate::body::{Body, full};
use crate::errors::GatewayError;
use crate::gateway::Gateway;
use crate::telemetry::{REQUEST_ID_HEADER, RequestContext};
use exchange::{Door, Exchange};
pub use routes::{Endpoint, ROUTES};

/// The stages every request passes, in order. Each runs in a span of its name, except "read"
/// (the HTTP door's alone: Envoy reads the body for the other), "queue" (with flow control on),
/// "classify" and "policy" (with a
/// policy directory), "forward" (the router's `routing` span, then the backend's `upstream` and the
/// relay's `stream`; through Envoy, `routing` only) and "settle" (the request's access line and the
/// end of its root span).
pub const STAGES: [&str; 10] = [
    "authenticate",
    "admit",
    "read",
    "parse",
    "limit",
    "classify",
    "policy",
    "queue",
    "forward",
    "settle",
];

/// Serves one request to `endpoint` through the HTTP door, in its span, its id echoed in
/// `x-request-id`.
pub async fn handle(
    gw: Arc<Gateway>,
    endpoint: Endpoint,
    req: HttpRequest<Incoming>,
) -> Response<Body> {
    let admin = gw
        .access
        .serving_port_admin(req.headers(), req.extensions().get::<Peer>());
    // The server's context when it made one for the request (the same id), else the headers'.
    let context =
        RequestContext::current().unwrap_or_else(|| RequestContext::from_headers(req.headers()));
    let id = context.id.clone();
    let span = context.span(req.method(), endpoint.path());
    let mut ex = Exchange::new(endpoint, Door::Http, req.headers(), admin, &gw.metrics);
    if let Some(s) = ex.settlement() {
        s.request(id.clone(), endpoint.path(), span.clone());
    }
    let served = async {
        match run(&gw, &mut ex, req).await {
            Ok(response) => response,
            Err(error) => ex.refuse(error),
        }
    };
    let mut response = context
        .scope(tracing::Instrument::instrument(served, span))
        .await;
    response
        .headers_mut()
        .insert(REQUEST_ID_HEADER, id.header_value());
    response
}

/// The stages in order; the first error ends the request.
async fn run(
    gw: &Arc<Gateway>,
    ex: &mut Exchange,
    req: HttpRequest<Incoming>,
) -> Result<Response<Body>, GatewayError> {
    let (head, body) = req.into_parts();
    // Before the body is read: an unknown caller, or one past the limits, costs nothing.
    admit::authenticate(gw, ex, &head.headers)?;
    let declared = exchange::declared_length(&head.headers);
    admit::admit(gw, ex, declared).await?;
    let body = if ex.endpoint.has_body() {
        let read = exchange::read_body(
            body,
            declared,
            gw.settings.body_limit_bytes,
            gw.settings.body_read_timeout(),
        );
        let body = tracing::Instrument::instrument(read, tracing::debug_span!("read")).await?;
        admit::body_read(gw, ex, &body).await?;
        body
    } else {
        bytes::Bytes::new()
    };
    let prepared = govern::prepare(gw, ex, body).await?;
    if local::answers(ex.endpoint) {
        let answer = local::answer(gw, ex, &prepared.request).await?;
        return Ok(json_response(StatusCode::OK, answer.to_string()));
    }
    let plan = queue::queue(gw, ex, &prepared.request, Arc::clone(&prepared.plan)).await?;
    let forwarded = forward::planned(gw, ex, &prepared.request, plan).await?;
    forward::relay(gw, ex, &prepared.request, forwarded).await
}

/// A JSON answer with `status`.
pub fn json_response(status: StatusCode, json: String) -> Response<Body> {
    let mut response = Response::new(full(json));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}
