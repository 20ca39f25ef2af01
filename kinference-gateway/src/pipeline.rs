//! One inference request's path through the gateway, top to bottom in [`handle`]:
//! read -> parse -> validate (and translate) -> route -> forward -> stream back -> account.
//!
//! Each stage is a small function below; errors from any of them surface as one [`GatewayError`]
//! that [`handle`] maps to the client's protocol.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use crate::api::anthropic::{self, MessagesRequest};
use crate::api::openai::{
    self, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, UpstreamErrorBody,
    UsageOnly,
};
use crate::errors::{GatewayError, Protocol};
use crate::metrics::{InFlightGuard, RequestLabels, WorkerLabels};
use crate::policy::stage::{Plan, PlanTarget, StageRequest};
use crate::providers::relay::{Accounting, ClientShape};
use crate::providers::{ProviderClient, ProviderError, ProviderRequest};
use crate::relay::{Relay, RelayMode};
use crate::routing::{Decision, Prompt, RouteError, RouteRequest};
use crate::server::{Body, Gateway, full};

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

    /// The worker's endpoint the request goes to.
    fn upstream_path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions | Endpoint::Messages => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

/// What one request carries through the stages.
struct Context {
    endpoint: Endpoint,
    protocol: Protocol,
    started: Instant,
    debug: bool,
    model: String,
    worker: String,
    in_flight: Option<InFlightGuard>,
    /// `x-kinference-tags` (policy stage).
    tags: Option<String>,
    /// The policy stage's one-line explanation (debug), also sent with refusals.
    policy_explain: Option<String>,
    /// Who is calling (the authenticate stage).
    caller: Option<crate::tenancy::Caller>,
    /// The tenant's admission (rate limits, budget); settled with the request, exactly once.
    admission: Option<crate::tenancy::Admission>,
}

/// A parsed client request.
enum ClientRequest {
    Chat(ChatCompletionRequest),
    Completion(CompletionRequest),
    Messages(MessagesRequest),
}

/// The request as the worker will get it.
struct WorkerRequest {
    /// Chat (also translated Anthropic) or completion request, kept for the router's prompt view.
    openai: OpenAiRequest,
    body: Bytes,
    stream: bool,
    /// OpenAI streams: whether the client asked for the usage chunk itself.
    client_wants_usage: bool,
}

enum OpenAiRequest {
    Chat(ChatCompletionRequest),
    Completion(CompletionRequest),
}

impl WorkerRequest {
    fn model(&self) -> &str {
        match &self.openai {
            OpenAiRequest::Chat(r) => &r.model,
            OpenAiRequest::Completion(r) => &r.model,
        }
    }

    fn prompt(&self) -> Prompt<'_> {
        match &self.openai {
            OpenAiRequest::Chat(r) => Prompt::Chat(&r.messages),
            OpenAiRequest::Completion(r) => Prompt::Text(r.prompt_text()),
        }
    }

    /// The same request for another served model (a policy chose a pool serving a different one).
    fn for_model(&self, model: &str) -> Result<WorkerRequest, GatewayError> {
        let (openai, body) = match &self.openai {
            OpenAiRequest::Chat(r) => {
                let mut r = r.clone();
                r.model = model.to_string();
                let body = serialize(&r)?;
                (OpenAiRequest::Chat(r), body)
            }
            OpenAiRequest::Completion(r) => {
                let mut r = r.clone();
                r.model = model.to_string();
                let body = serialize(&r)?;
                (OpenAiRequest::Completion(r), body)
            }
        };
        Ok(WorkerRequest {
            openai,
            body,
            stream: self.stream,
            client_wants_usage: self.client_wants_usage,
        })
    }

    fn provider_request(&self) -> ProviderRequest<'_> {
        match &self.openai {
            OpenAiRequest::Chat(r) => ProviderRequest::Chat(r),
            OpenAiRequest::Completion(r) => ProviderRequest::Completion(r),
        }
    }
}

/// Serves one inference request.
pub async fn handle(
    gw: Arc<Gateway>,
    endpoint: Endpoint,
    req: Request<Incoming>,
) -> Response<Body> {
    let mut ctx = Context {
        endpoint,
        protocol: endpoint.protocol(),
        started: Instant::now(),
        debug: req
            .headers()
            .get("x-kinference-debug")
            .is_some_and(|v| v.as_bytes() == b"1"),
        model: String::new(),
        worker: String::new(),
        in_flight: Some(gw.metrics.in_flight()),
        tags: req
            .headers()
            .get(crate::policy::classify::tags::TAGS_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        policy_explain: None,
        caller: None,
        admission: None,
    };
    match run(&gw, &mut ctx, req).await {
        Ok(response) => {
            // Answered without the worker relay (a provider): settled now, without worker usage.
            if let Some(admission) = ctx.admission.take() {
                admission.settle(response.status().as_u16(), None);
            }
            response
        }
        Err(error) => {
            account_error(&gw, &ctx, &error);
            if let Some(admission) = ctx.admission.take() {
                admission.settle(error.status().as_u16(), None);
            }
            if let (GatewayError::PolicyRejected { code, .. }, Some(caller)) = (&error, &ctx.caller)
            {
                gw.tenancy.policy_decision(caller, code, "reject");
            }
            let mut response = error.into_response(ctx.protocol);
            if let Some(v) = ctx
                .policy_explain
                .as_deref()
                .and_then(|e| HeaderValue::from_str(e).ok())
            {
                response.headers_mut().insert("x-kinference-decision", v);
            }
            response
        }
    }
}

async fn run(
    gw: &Gateway,
    ctx: &mut Context,
    req: Request<Incoming>,
) -> Result<Response<Body>, GatewayError> {
    authenticate(gw, ctx, req.headers())?;
    let body = read_body(req, gw.settings.body_limit_bytes).await?;
    let request = parse(ctx.endpoint, &body)?;
    let worker_request = validate_and_translate(request, body.clone())?;
    ctx.model = worker_request.model().to_string();
    admit(gw, ctx, &worker_request).await?;
    let (decision, response) = match apply_policies(gw, ctx, &body, &worker_request).await? {
        None => route_and_forward(gw, ctx, &worker_request, None).await?,
        Some(plan) => match forward_planned(gw, ctx, &worker_request, &plan).await? {
            Planned::Worker(decision, response) => (*decision, response),
            Planned::Provider(response) => return Ok(response),
        },
    };
    ctx.worker = decision.worker.clone();
    if let Some(admission) = &mut ctx.admission {
        admission.routed(&decision.worker, decision.reason, decision.prompt_tokens);
    }
    if worker_request.stream {
        Ok(stream_back(gw, ctx, &worker_request, decision, response))
    } else {
        reply_whole(gw, ctx, decision, response).await
    }
}

/// Stage 0 (tenancy): the API key -> the tenant; without a valid one, 401 in the client's protocol.
fn authenticate(
    gw: &Gateway,
    ctx: &mut Context,
    headers: &http::HeaderMap,
) -> Result<(), GatewayError> {
    ctx.caller = Some(gw.tenancy.authenticate(headers)?);
    Ok(())
}

/// Stage 3a (tenancy): the tenant's monthly budget and token rate limits, before anything is routed
/// (429 in the client's protocol, with `Retry-After` and the rate-limit headers).
async fn admit(
    gw: &Gateway,
    ctx: &mut Context,
    request: &WorkerRequest,
) -> Result<(), GatewayError> {
    let Some(caller) = &ctx.caller else {
        return Ok(());
    };
    let (fields, completion) = match &request.openai {
        OpenAiRequest::Chat(r) => (&r.extra, false),
        OpenAiRequest::Completion(r) => (&r.extra, true),
    };
    let (input, output) = gw.tenancy.demand(request.prompt(), fields, completion);
    let admission = gw
        .tenancy
        .admit(caller, &ctx.model, input, output, ctx.protocol)
        .await?;
    ctx.admission = Some(admission);
    Ok(())
}

/// The tenant's rate-limit headers for a served response.
fn tenancy_headers(ctx: &Context) -> http::HeaderMap {
    ctx.admission
        .as_ref()
        .map(|a| a.headers())
        .unwrap_or_default()
}

/// Stage 1: the body, bounded by the configured limit (413 beyond it).
async fn read_body(req: Request<Incoming>, limit: usize) -> Result<Bytes, GatewayError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(GatewayError::BodyTooLarge { limit });
    }
    match Limited::new(req.into_body(), limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(GatewayError::BodyTooLarge { limit })
        }
        Err(e) => Err(GatewayError::MalformedJson(format!(
            "reading the request body: {e}"
        ))),
    }
}

/// Stage 2: JSON into the endpoint's typed request (400 on bad JSON or shape).
fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ClientRequest, GatewayError> {
    Ok(match endpoint {
        Endpoint::ChatCompletions => ClientRequest::Chat(openai::parse_body(body)?),
        Endpoint::Completions => ClientRequest::Completion(openai::parse_body(body)?),
        Endpoint::Messages => ClientRequest::Messages(openai::parse_body(body)?),
    })
}

/// Stage 3: field checks, then the worker's OpenAI request (Anthropic is translated here). Streams always
/// ask the worker for the final usage chunk so every request can be accounted. OpenAI bodies that need
/// no change are forwarded byte for byte (no re-serialization on the hot path).
fn validate_and_translate(
    request: ClientRequest,
    original: Bytes,
) -> Result<WorkerRequest, GatewayError> {
    match request {
        ClientRequest::Chat(mut r) => {
            r.validate()?;
            let stream = r.stream == Some(true);
            let (body, client_wants_usage) =
                match passthrough_body(&mut r.stream_options, stream, original) {
                    (Some(body), wants) => (body, wants),
                    (None, wants) => (serialize(&r)?, wants),
                };
            Ok(WorkerRequest {
                openai: OpenAiRequest::Chat(r),
                body,
                stream,
                client_wants_usage,
            })
        }
        ClientRequest::Completion(mut r) => {
            r.validate()?;
            let stream = r.stream == Some(true);
            let (body, client_wants_usage) =
                match passthrough_body(&mut r.stream_options, stream, original) {
                    (Some(body), wants) => (body, wants),
                    (None, wants) => (serialize(&r)?, wants),
                };
            Ok(WorkerRequest {
                openai: OpenAiRequest::Completion(r),
                body,
                stream,
                client_wants_usage,
            })
        }
        ClientRequest::Messages(r) => {
            let chat = r.to_chat_request()?;
            Ok(WorkerRequest {
                stream: chat.stream == Some(true),
                body: serialize(&chat)?,
                openai: OpenAiRequest::Chat(chat),
                client_wants_usage: false,
            })
        }
    }
}

/// The body for the worker of an OpenAI request when the client's bytes can be used (`None`: the
/// request must be re-serialized), and whether the client asked for the usage chunk. Streams without
/// `stream_options` get `"stream_options":{"include_usage":true}` spliced in front of the client's fields.
fn passthrough_body(
    options: &mut Option<openai::StreamOptions>,
    stream: bool,
    original: Bytes,
) -> (Option<Bytes>, bool) {
    if !stream {
        return (Some(original), false);
    }
    let had_options = options.is_some();
    let client_wants_usage = openai::force_include_usage(options);
    if client_wants_usage {
        return (Some(original), true);
    }
    if had_options {
        return (None, false);
    }
    (openai::splice_include_usage(&original), false)
}

fn serialize<T: serde::Serialize>(request: &T) -> Result<Bytes, GatewayError> {
    serde_json::to_vec(request)
        .map(Bytes::from)
        .map_err(|e| GatewayError::MalformedJson(e.to_string()))
}

/// Stage 3b (with a policy directory): classify the request, evaluate the policies against the pools'
/// state, and get the ordered targets (pools, providers); a refusal ends the request here. `None`: no
/// policies, any worker serving the model.
async fn apply_policies(
    gw: &Gateway,
    ctx: &mut Context,
    body: &Bytes,
    request: &WorkerRequest,
) -> Result<Option<Plan>, GatewayError> {
    let Some(stage) = &gw.policy else {
        return Ok(None);
    };
    let json: serde_json::Value = openai::parse_body(body)?;
    let req = StageRequest {
        body: &json,
        model: &ctx.model,
        prompt: request.prompt(),
        tenant: ctx
            .caller
            .as_ref()
            .and_then(|c| c.tenant())
            .map(|t| t.name.as_str()),
        tags_header: ctx.tags.as_deref(),
        debug: ctx.debug,
    };
    let plan = stage
        .decide(&gw.router, req, &mut ctx.policy_explain)
        .await?;
    Ok(Some(plan))
}

/// Where a planned request went.
enum Planned {
    /// A pool's worker: relayed like any worker answer.
    Worker(Box<Decision>, Response<Incoming>),
    /// A provider: the response, already in the client's protocol.
    Provider(Response<Body>),
}

/// Stages 4 and 5 under a policy plan: the targets in order. A pool without a healthy worker (or whose
/// workers refuse) and a provider that cannot take or fails the request pass it to the next target;
/// nothing has reached the client yet. A local-only plan holds no provider (the stage checks it).
async fn forward_planned(
    gw: &Gateway,
    ctx: &mut Context,
    request: &WorkerRequest,
    plan: &Plan,
) -> Result<Planned, GatewayError> {
    let mut last: Option<GatewayError> = None;
    for target in &plan.targets {
        match target {
            PlanTarget::Pool { model, workers, .. } => {
                let retargeted;
                let req = if model == request.model() {
                    request
                } else {
                    retargeted = request.for_model(model)?;
                    &retargeted
                };
                match route_and_forward(gw, ctx, req, workers.as_deref()).await {
                    Ok((mut decision, response)) => {
                        if let Some(stage) = &gw.policy {
                            stage.count_sent(target, plan.burst);
                        }
                        if ctx.debug {
                            decision.explain = Some(format!(
                                "{}; router: {}",
                                ctx.policy_explain.as_deref().unwrap_or(""),
                                decision.explain.as_deref().unwrap_or("")
                            ));
                        }
                        return Ok(Planned::Worker(Box::new(decision), response));
                    }
                    Err(
                        error @ (GatewayError::NoHealthyWorker(_)
                        | GatewayError::UnknownModel(_)
                        | GatewayError::WorkerUnreachable { .. }),
                    ) => {
                        tracing::warn!(backend = %target.label(), model = %ctx.model, %error, "policy target unavailable; trying the next");
                        last = Some(error);
                    }
                    Err(error) => return Err(error),
                }
            }
            PlanTarget::Provider { client, model } => {
                if plan.local_only {
                    continue;
                }
                match client
                    .send(request.provider_request(), model, request.stream)
                    .await
                {
                    Ok(response) => {
                        if let Some(stage) = &gw.policy {
                            stage.count_sent(target, plan.burst);
                        }
                        let response = provider_reply(gw, ctx, request, client, response).await?;
                        return Ok(Planned::Provider(response));
                    }
                    Err(ProviderError::Unusable { provider, reason }) => {
                        tracing::debug!(%provider, %reason, "provider skipped");
                    }
                    Err(ProviderError::Failed(error)) => {
                        tracing::warn!(backend = %target.label(), model = %ctx.model, %error, "provider failed; trying the next target");
                        last = Some(error);
                    }
                }
            }
        }
    }
    Err(last.unwrap_or_else(|| GatewayError::PolicyRejected {
        status: StatusCode::SERVICE_UNAVAILABLE,
        code: "no_backend_available",
        message: format!(
            "no backend chosen by the policies ({}) could take the request",
            plan.rule
        ),
    }))
}

/// Stages 6 and 7 for a provider's answer: in the client's protocol, whole or streamed, accounted
/// under `worker="provider/<name>"`.
async fn provider_reply(
    gw: &Gateway,
    ctx: &mut Context,
    request: &WorkerRequest,
    client: &ProviderClient,
    response: Response<Incoming>,
) -> Result<Response<Body>, GatewayError> {
    ctx.worker = client.label();
    let shape = match ctx.endpoint {
        Endpoint::Messages => ClientShape::Anthropic {
            model: ctx.model.clone(),
        },
        _ => ClientShape::OpenAi {
            pass_usage_chunk: request.client_wants_usage,
        },
    };
    let acct = Accounting {
        metrics: gw.metrics.clone(),
        labels: WorkerLabels {
            model: ctx.model.clone(),
            worker: ctx.worker.clone(),
        },
        protocol: ctx.protocol,
        started: ctx.started,
        idle_timeout: gw.upstream.idle_timeout(),
        in_flight: ctx.in_flight.take(),
    };
    let label = client.label();
    let mut response = if request.stream {
        crate::providers::relay::stream(client.api_style(), &label, response, shape, acct)
    } else {
        crate::providers::relay::whole(client.api_style(), &label, response, &shape, acct).await?
    };
    let h = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(client.base_url()) {
        h.insert("x-kinference-worker", v);
    }
    if let Ok(v) = HeaderValue::from_str(client.name()) {
        h.insert("x-kinference-provider", v);
    }
    if ctx.debug
        && let Some(v) = ctx
            .policy_explain
            .as_deref()
            .and_then(|e| HeaderValue::from_str(e).ok())
    {
        h.insert("x-kinference-decision", v);
    }
    Ok(response)
}

/// Stages 4 and 5: pick a worker (among `pool` when a policy chose one) and send the request. A worker
/// that refuses the connection is marked unhealthy and the request goes once more to another worker
/// (nothing has been streamed yet).
async fn route_and_forward(
    gw: &Gateway,
    ctx: &Context,
    request: &WorkerRequest,
    pool: Option<&[String]>,
) -> Result<(Decision, Response<Incoming>), GatewayError> {
    let mut refused: Option<GatewayError> = None;
    loop {
        let route = RouteRequest {
            model: request.model(),
            prompt: request.prompt(),
            debug: ctx.debug,
        };
        let picked = match pool {
            Some(workers) => gw.router.pick_among(route, workers).await,
            None => gw.router.pick(route).await,
        };
        let decision = match picked {
            Ok(decision) => decision,
            // The retry found no other worker: the refusal is the more useful answer.
            Err(RouteError::NoHealthyWorker(_)) if refused.is_some() => {
                return Err(refused.unwrap_or(GatewayError::NoHealthyWorker(ctx.model.clone())));
            }
            Err(e) => return Err(e.into()),
        };
        let path = ctx.endpoint.upstream_path();
        match gw
            .upstream
            .post_json(&decision.worker, path, request.body.clone())
            .await
        {
            Ok(response) if response.status().is_success() => return Ok((decision, response)),
            Ok(response) => return Err(upstream_rejection(gw, &decision.worker, response).await),
            Err(error @ GatewayError::WorkerUnreachable { .. }) => {
                tracing::warn!(worker = %decision.worker, model = %ctx.model, %error, "worker unreachable; marking it unhealthy");
                gw.set_health(&decision.worker, false);
                if refused.is_some() {
                    return Err(error);
                }
                gw.metrics.retry();
                refused = Some(error);
            }
            Err(error) => return Err(error),
        }
    }
}

/// A worker's non-2xx answer: its own 4xx passes on with its message; anything else is a bad upstream.
async fn upstream_rejection(
    gw: &Gateway,
    worker: &str,
    response: Response<Incoming>,
) -> GatewayError {
    let status = response.status();
    let body = gw
        .upstream
        .read_body(worker, response.into_body())
        .await
        .unwrap_or_default();
    let message = UpstreamErrorBody::message_from(&body);
    if status.is_client_error() {
        GatewayError::UpstreamRejected { status, message }
    } else {
        GatewayError::BadUpstream {
            worker: worker.to_string(),
            detail: format!("status {status}: {message}"),
        }
    }
}

/// Stage 6 (streams): relay the worker's SSE stream chunk by chunk; accounting happens when it ends.
fn stream_back(
    gw: &Gateway,
    ctx: &mut Context,
    request: &WorkerRequest,
    decision: Decision,
    response: Response<Incoming>,
) -> Response<Body> {
    let mode = match ctx.endpoint {
        Endpoint::Messages => RelayMode::Anthropic(anthropic::StreamTranslator::new(
            &ctx.model,
            anthropic::message_id(&format!("{:x}", rand::random::<u64>())),
        )),
        _ => RelayMode::OpenAi {
            pass_usage_chunk: request.client_wants_usage,
        },
    };
    let mut headers = routed_headers(&decision, ctx.debug);
    headers.extend(tenancy_headers(ctx));
    let relay = Relay::new(
        response.into_body(),
        mode,
        decision,
        gw.metrics.clone(),
        gw.upstream.idle_timeout(),
        ctx.started,
        WorkerLabels {
            model: ctx.model.clone(),
            worker: ctx.worker.clone(),
        },
        ctx.protocol,
        ctx.in_flight.take(),
    )
    .with_admission(ctx.admission.take());
    let mut response = Response::new(relay.into_body());
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.extend(headers);
    response
}

/// Stages 6 and 7 (non-streaming): read the worker's answer, translate it for Anthropic clients, account.
async fn reply_whole(
    gw: &Gateway,
    ctx: &mut Context,
    decision: Decision,
    response: Response<Incoming>,
) -> Result<Response<Body>, GatewayError> {
    let body = gw
        .upstream
        .read_body(&decision.worker, response.into_body())
        .await?;
    let (body, usage) = match ctx.endpoint {
        Endpoint::Messages => {
            let chat: ChatCompletionResponse =
                serde_json::from_slice(&body).map_err(|e| GatewayError::BadUpstream {
                    worker: decision.worker.clone(),
                    detail: format!("unreadable chat completion: {e}"),
                })?;
            let message = anthropic::message_from_chat(&chat, &ctx.model);
            (Bytes::from(message.to_string()), chat.usage)
        }
        // OpenAI clients get the worker's bytes untouched; only usage is read, for accounting.
        _ => {
            let usage = serde_json::from_slice::<UsageOnly>(&body)
                .ok()
                .and_then(|u| u.usage);
            (body, usage)
        }
    };
    let mut headers = routed_headers(&decision, ctx.debug);
    headers.extend(tenancy_headers(ctx));
    if let Some(admission) = ctx.admission.take() {
        admission.settle(StatusCode::OK.as_u16(), usage.as_ref());
    }
    account(gw, ctx, decision, StatusCode::OK, usage);
    let mut response = Response::new(full(body));
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.extend(headers);
    Ok(response)
}

/// `x-kinference-worker` (always) and `x-kinference-decision` (when debugging).
fn routed_headers(decision: &Decision, debug: bool) -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(&decision.worker) {
        headers.insert("x-kinference-worker", v);
    }
    if debug
        && let Some(v) = decision
            .explain
            .as_deref()
            .and_then(|e| HeaderValue::from_str(e).ok())
    {
        headers.insert("x-kinference-decision", v);
    }
    headers
}

/// Stage 7 (non-streaming): metrics and the router's ledger.
fn account(
    gw: &Gateway,
    ctx: &Context,
    decision: Decision,
    status: StatusCode,
    usage: Option<openai::Usage>,
) {
    let labels = WorkerLabels {
        model: ctx.model.clone(),
        worker: ctx.worker.clone(),
    };
    let usage = usage.unwrap_or_default();
    let cached = usage.cached_tokens();
    gw.metrics.e2e(&labels, ctx.started.elapsed().as_secs_f64());
    gw.metrics.tokens(
        &labels,
        usage.prompt_tokens,
        usage.completion_tokens,
        cached.unwrap_or(0),
    );
    gw.metrics.request(RequestLabels {
        model: labels.model,
        worker: labels.worker,
        status: status.as_u16(),
        protocol: ctx.protocol.as_str(),
    });
    decision.ticket.finish(
        status.is_success(),
        usize::try_from(usage.completion_tokens).unwrap_or(usize::MAX),
        cached.and_then(|c| usize::try_from(c).ok()),
    );
}

/// Accounting for a request that ended in an error response.
fn account_error(gw: &Gateway, ctx: &Context, error: &GatewayError) {
    tracing::debug!(model = %ctx.model, worker = %ctx.worker, kind = error.kind(), %error, "request failed");
    gw.metrics.request(RequestLabels {
        model: ctx.model.clone(),
        worker: ctx.worker.clone(),
        status: error.status().as_u16(),
        protocol: ctx.protocol.as_str(),
    });
}
