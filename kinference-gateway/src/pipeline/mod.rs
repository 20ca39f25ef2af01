//! One inference request's path through the gateway, top to bottom in [`handle`]:
//! authenticate -> read -> parse -> tokenize -> admit -> plan -> forward -> relay, settled once.
//! The prompt is tokenized at most once per served model ([`Exchange::tokens`]); only the
//! gateway's own tokenizer runs before the plan, so no byte of the request reaches a worker before
//! the policies have classified it.
//!
//! - [`exchange`]: the [`Exchange`] made once per request and the parsed [`exchange::Request`];
//! - [`govern`]: admit and plan, the stages the Envoy ext_proc front door runs too;
//! - [`forward`]: the request to a worker or a provider, and the answer back through the one relay;
//! - [`settle`]: the [`settle::Settlement`] that owns the request's metrics, the router's ticket and
//!   the tenant's admission, and settles them exactly once.
//!
//! Errors from any stage surface as one [`GatewayError`] that [`handle`] maps to the client's
//! protocol.
//!
//! Every request has an id ([`crate::telemetry::RequestId`], echoed in `x-request-id`) and a root
//! span carrying it, so each log line of the request names it; the stages run in their own `debug`
//! spans, which exist only when traces are exported ([`crate::telemetry`]).

pub mod exchange;
pub mod forward;
pub mod govern;
pub mod models;
pub mod passthrough;
pub mod settle;

use std::sync::Arc;

use http::{Request as HttpRequest, Response};
use hyper::body::Incoming;
use tracing::Instrument as _;

use crate::access::Peer;
use crate::body::Body;
use crate::errors::{GatewayError, Protocol};
use crate::gateway::Gateway;
use crate::telemetry::{REQUEST_ID_HEADER, RequestContext};
use exchange::Exchange;
use govern::PlanInput;

/// The inference endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// OpenAI `POST /v1/chat/completions`.
    ChatCompletions,
    /// OpenAI `POST /v1/completions`.
    Completions,
    /// Anthropic `POST /v1/messages`.
    Messages,
}

impl Endpoint {
    /// The client's protocol.
    pub fn protocol(self) -> Protocol {
        match self {
            Endpoint::ChatCompletions | Endpoint::Completions => Protocol::OpenAi,
            Endpoint::Messages => Protocol::Anthropic,
        }
    }

    /// The client's path of the endpoint.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Messages => "/v1/messages",
        }
    }

    /// The worker's endpoint the request goes to.
    pub fn upstream_path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions | Endpoint::Messages => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

/// Serves one inference request, in its span, its id echoed in `x-request-id`.
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
    let mut ex = Exchange::new(endpoint, req.headers(), admin, &gw.metrics);
    if let Some(s) = ex.settlement() {
        s.request(id.clone(), endpoint.path(), span.clone());
    }
    let served = async {
        match run(&gw, &mut ex, req).await {
            Ok(response) => response,
            Err(error) => ex.refuse(error),
        }
    };
    let mut response = context.scope(served.instrument(span)).await;
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
    // Before the body is read: an unknown caller costs the gateway nothing.
    let caller =
        tracing::debug_span!("authenticate").in_scope(|| gw.tenancy.authenticate(req.headers()))?;
    // Still before the body: past the in-flight limit a request is shed before it costs memory.
    if let Some(slot) = gw.overload.admit(caller.priority()).await?
        && let Some(s) = ex.settlement()
    {
        s.hold(slot);
    }
    let body = exchange::read_body(
        req,
        gw.settings.body_limit_bytes,
        gw.settings.body_read_timeout(),
    )
    .await?;
    // Under policies the JSON is kept for the plan stage (the body is parsed once).
    // Shared: a stream's second chance ([`forward::relay`]) outlives this function.
    let request = Arc::new(exchange::parse_as(ex.endpoint, body, gw.policy.is_some())?);
    if let Some(s) = ex.settlement() {
        s.model(request.model());
    }
    gw.router
        .tokenize_locally(request.model(), request.prompt(), &ex.tokens)
        .await;
    let admission = govern::admit(&gw.tenancy, &caller, &request, &ex.tokens, ex.protocol)
        .instrument(tracing::debug_span!("admission", tenant = caller.name()))
        .await?;
    let local_only = admission.local_only();
    if let Some(s) = ex.settlement() {
        s.admitted(admission);
    }
    ex.caller = Some(caller);
    let forwarded = match &gw.policy {
        None => forward::plain(gw, ex, &request).await?,
        Some(stage) => {
            let input = PlanInput {
                caller: ex.caller.as_ref(),
                tags: ex.tags.as_deref(),
                debug: ex.debug,
                local_only,
                tokens: &ex.tokens,
            };
            let mut explain = None;
            let planned = govern::plan(
                stage,
                &gw.router,
                Some(&gw.tenancy),
                &request,
                input,
                &mut explain,
            )
            .instrument(tracing::debug_span!("policy"))
            .await;
            ex.explain = explain;
            forward::planned(gw, ex, &request, Arc::new(planned?)).await?
        }
    };
    forward::relay(gw, ex, &request, forwarded).await
}
