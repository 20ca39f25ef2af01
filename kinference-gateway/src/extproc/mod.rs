//! The inference handler: Kinference's worker choice served over Envoy's external-processing protocol
//! (`envoy.service.ext_proc.v3.ExternalProcessor/Process`), the way the Gateway API Inference
//! Extension's endpoint picker serves it, so an Envoy-based Gateway API implementation routes with
//! Kinference without a second proxy hop.
//!
//! Per HTTP request Envoy opens one bidirectional stream and sends the request headers, then the body
//! (configure `request_body_mode: BUFFERED`; `STREAMED` chunks are accumulated until `end_of_stream`).
//! The handler runs the HTTP pipeline's own stages up to the plan ([`crate::pipeline`]): the body is
//! parsed with the gateway's types, the API key authenticated (401), the tenant's budget and token
//! limits admitted (429), the policies evaluated (a refusal, or local pools only: personal data never
//! gets a provider as target). Like an HTTP request it first takes a slot of the gateway's in-flight
//! gate (the same [`Admitter`], by the tenant's priority; past the limit a bounded queue, then 503
//! in the client's protocol with `Retry-After`), held until the response ends. It then picks a
//! worker with the same [`Router`] and answers the last body chunk with the header
//! `x-gateway-destination-endpoint: ip:port` (route cache cleared) and the dynamic metadata
//! `envoy.lb { x-gateway-destination-endpoint }` that Envoy's original-destination cluster reads.
//! Envoy forwards to workers only: a plan's providers are passed over, and so are pools serving
//! another model name than the one in the body (Envoy forwards the body unchanged). Refusals
//! are local replies with a JSON error body in the client's protocol: 400 malformed body, 401 no or a
//! wrong API key, 403 refused by a policy, 404 unknown model, 413 body too large, 429 tenant limits or
//! shed (every worker of the model at the in-flight limit), 503 overloaded (the gateway's in-flight
//! gate) or no ready worker.
//!
//! The decision's [`InFlight`](crate::routing::InFlight) ticket and the tenant's admission live as long
//! as the stream. With `response_header_mode: SEND` and `response_body_mode: STREAMED` (the endpoint
//! picker's setting) the handler also sees the response: the first event of an SSE stream is
//! reported as the first token, and the end of the body finishes the ticket and settles the tenant's
//! usage with the `usage` it carries. Without the response phase both are released when Envoy closes the stream (the request is
//! then recorded as abandoned, with the gateway's own figures).
//!
//! The pass-through endpoints go where the HTTP gateway sends them ([`crate::pipeline::passthrough`]):
//! `/v1/embeddings`, `/tokenize` and `/detokenize` to the model's least loaded worker,
//! `/v1/responses` to the worker the router picks for its input, the tenant admitted and billed for
//! embeddings and responses. A model alias or class the HTTP gateway would rewrite in the body is
//! refused (400), on these endpoints and on chat alike: Envoy forwards the body as sent, so choosing a
//! class's model (a cheaper one for a simple prompt) needs the HTTP gateway.
//!
//! Telemetry as over HTTP ([`crate::telemetry`]): the client's `x-request-id` (or a new one) is set
//! on the request to the worker, on the response headers and on local replies, and carried by the
//! usage record; the request's span continues the client's `traceparent`, its stages
//! (`authenticate`, `admission`, `policy`, `routing`) are its children, and the worker gets a
//! `traceparent` naming it (Envoy, not the gateway, makes the upstream call).
//!
//! [`session`] is one stream's state; [`body`] the request parsing; [`reply`] the messages sent back.

pub mod body;
pub mod reply;
pub mod session;

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument as _;

use crate::api::openai::passthrough::{PassthroughRequest, Route};
use crate::errors::{GatewayError, Protocol};
use crate::gateway::Gateway;
use crate::overload::Admitter;
use crate::overload::gate::Slot;
use crate::pipeline::exchange::{self, Request as Parsed};
use crate::pipeline::govern::{self, PlanInput};
use crate::pipeline::passthrough;
use crate::policy::model::Requested;
use crate::policy::stage::{PlanTarget, PolicyStage};
use crate::routing::tokenize::PromptTokens;
use crate::routing::{Decision, RouteRequest, Router};
use crate::telemetry::{REQUEST_ID_HEADER, RequestId};
use crate::tenancy::{Admission, Tenancy};
use session::Session;

/// Command-line flags of the inference handler (flattened into the gateway's flags).
#[derive(Debug, Clone, clap::Args)]
pub struct ExtProcArgs {
    /// Address of the ext_proc inference handler (gRPC, Envoy's external-processing protocol); off
    /// unless given.
    #[arg(long, env = "KINFERENCE_EXTPROC_LISTEN")]
    pub extproc_listen: Option<SocketAddr>,

    /// Shed (429) a request when every ready worker of its model already has this many requests in
    /// flight from this gateway; 0 never sheds.
    #[arg(long, env = "KINFERENCE_EXTPROC_SHED_IN_FLIGHT", default_value_t = 0)]
    pub extproc_shed_in_flight: usize,

    /// Largest request body the handler buffers, in bytes; larger bodies get 413.
    #[arg(long, env = "KINFERENCE_EXTPROC_BODY_LIMIT_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub extproc_body_limit_bytes: usize,

    /// mTLS on the ext_proc port: the handler's certificate (PEM). With `--extproc-tls-key` and
    /// `--extproc-tls-client-ca`, only a proxy presenting a certificate of that CA may connect.
    #[arg(long, env = "KINFERENCE_EXTPROC_TLS_CERT", requires_all = ["extproc_tls_key", "extproc_tls_client_ca"])]
    pub extproc_tls_cert: Option<std::path::PathBuf>,

    /// mTLS on the ext_proc port: the handler's private key (PEM).
    #[arg(
        long,
        env = "KINFERENCE_EXTPROC_TLS_KEY",
        requires = "extproc_tls_cert"
    )]
    pub extproc_tls_key: Option<std::path::PathBuf>,

    /// mTLS on the ext_proc port: the CA that signs the proxy's client certificate (PEM).
    #[arg(
        long,
        env = "KINFERENCE_EXTPROC_TLS_CLIENT_CA",
        requires = "extproc_tls_cert"
    )]
    pub extproc_tls_client_ca: Option<std::path::PathBuf>,
}

/// The handler's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// See [`ExtProcArgs::extproc_shed_in_flight`]; `None` never sheds.
    pub shed_in_flight: Option<usize>,
    /// See [`ExtProcArgs::extproc_body_limit_bytes`].
    pub body_limit_bytes: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            shed_in_flight: None,
            body_limit_bytes: 4 * 1024 * 1024,
        }
    }
}

impl From<&ExtProcArgs> for Settings {
    fn from(a: &ExtProcArgs) -> Self {
        Self {
            shed_in_flight: (a.extproc_shed_in_flight > 0).then_some(a.extproc_shed_in_flight),
            body_limit_bytes: a.extproc_body_limit_bytes,
        }
    }
}

/// Why a request is answered locally instead of routed.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// What the HTTP gateway would answer (400, 404, 413, 503), with its status and body.
    #[error(transparent)]
    Gateway(GatewayError),
    /// Every ready worker of the model is at the in-flight limit.
    #[error("every worker of model `{model}` is at its in-flight limit ({limit})")]
    Shed {
        /// The model.
        model: String,
        /// The limit.
        limit: usize,
    },
}

impl Refusal {
    /// The HTTP status Envoy answers with.
    pub fn status(&self) -> u16 {
        match self {
            Refusal::Gateway(e) => e.status().as_u16(),
            Refusal::Shed { .. } => 429,
        }
    }

    /// The JSON error body in the client's protocol.
    pub fn body(&self, protocol: Protocol) -> serde_json::Value {
        match self {
            Refusal::Gateway(e) => e.body(protocol),
            Refusal::Shed { .. } => match protocol {
                Protocol::OpenAi => serde_json::json!({"error": {
                    "message": self.to_string(),
                    "type": "rate_limit_error",
                    "param": null,
                    "code": "overloaded",
                }}),
                Protocol::Anthropic => serde_json::json!({
                    "type": "error",
                    "error": {"type": "overloaded_error", "message": self.to_string()},
                }),
            },
        }
    }

    /// The ext_proc local reply, with the request's `x-request-id` (and `Retry-After` when the
    /// gateway is overloaded).
    pub fn reply(&self, protocol: Protocol, request_id: &RequestId) -> ProcessingResponse {
        let details = match self {
            Refusal::Gateway(e) => e.kind(),
            Refusal::Shed { .. } => "shed",
        };
        let retry_after = match self {
            Refusal::Gateway(GatewayError::Overloaded { retry_after_s, .. }) => {
                Some(retry_after_s.to_string())
            }
            _ => None,
        };
        let mut headers = vec![(REQUEST_ID_HEADER, request_id.as_str())];
        headers.extend(retry_after.as_deref().map(|s| ("retry-after", s)));
        reply::immediate(
            self.status(),
            &self.body(protocol),
            &format!("kinference_{details}"),
            &headers,
        )
    }
}

/// A routed request: the router's decision and the `ip:port` Envoy connects to.
#[derive(Debug)]
pub struct Routed {
    /// The decision (its ticket must be kept until the request ends).
    pub decision: Decision,
    /// The model asked for.
    pub model: String,
    /// `host:port` of the worker.
    pub endpoint: String,
    /// The tenant's admission (settled when the response ends).
    pub admission: Option<Admission>,
    /// The request's place under the gateway's in-flight limit (given back when dropped).
    pub slot: Option<Slot>,
}

impl Routed {
    /// The decision's endpoint, with the tenant's admission told where the request went.
    fn new(
        decision: Decision,
        model: &str,
        mut admission: Option<Admission>,
        slot: Option<Slot>,
    ) -> Result<Routed, Refusal> {
        let endpoint = endpoint_of(&decision.worker).ok_or_else(|| {
            Refusal::Gateway(GatewayError::BadUpstream {
                worker: decision.worker.clone(),
                detail: "worker URL has no host".into(),
            })
        })?;
        if let Some(a) = &mut admission {
            a.routed(&decision.worker, decision.reason, decision.prompt_tokens);
        }
        Ok(Routed {
            decision,
            model: model.to_string(),
            endpoint,
            admission,
            slot,
        })
    }
}

/// What a request through ext_proc tells about itself besides its body.
#[derive(Debug, Default, Clone)]
pub struct Head {
    /// The API, from `:path`.
    pub api: Option<body::Api>,
    /// The pass-through endpoint, from `:path`.
    pub passthrough: Option<Route>,
    /// `x-kinference-debug: 1`.
    pub debug: bool,
    /// The headers governance reads: the API key (`authorization`, `x-api-key`) and
    /// `x-kinference-tags`.
    pub headers: http::HeaderMap,
}

/// The `host:port` of a worker base URL (`http://10.0.0.7:8000` -> `10.0.0.7:8000`).
pub fn endpoint_of(worker_url: &str) -> Option<String> {
    let uri: http::Uri = worker_url.parse().ok()?;
    let host = uri.host()?;
    let port = uri.port_u16().unwrap_or(match uri.scheme_str() {
        Some("https") => 443,
        _ => 80,
    });
    Some(format!("{host}:{port}"))
}

/// What every stream shares: the router, the governance (tenancy, policies) and the settings.
#[derive(Debug, Clone)]
pub struct Handler {
    router: Arc<Router>,
    tenancy: Option<Arc<Tenancy>>,
    policy: Option<Arc<PolicyStage>>,
    /// The gateway's in-flight gate (none: no limit).
    overload: Option<Admitter>,
    settings: Settings,
}

impl Handler {
    /// A handler over the gateway's router alone: open (no API keys, no limits), no policies.
    pub fn new(router: Arc<Router>, settings: Settings) -> Self {
        Self {
            router,
            tenancy: None,
            policy: None,
            overload: None,
            settings,
        }
    }

    /// A handler with the gateway's governance: its tenants (API keys, limits, usage) and policies.
    pub fn governed(gw: &Gateway, settings: Settings) -> Self {
        Self {
            router: Arc::clone(&gw.router),
            tenancy: Some(Arc::clone(&gw.tenancy)),
            policy: gw.policy.clone(),
            overload: Some(gw.overload.admitter()),
            settings,
        }
    }

    /// With `tenancy` and `policy` (tests build them without a whole gateway).
    pub fn with_governance(
        mut self,
        tenancy: Option<Arc<Tenancy>>,
        policy: Option<Arc<PolicyStage>>,
    ) -> Self {
        self.tenancy = tenancy;
        self.policy = policy;
        self
    }

    /// Admitting through `overload` (the gateway's in-flight gate, shared with the HTTP path).
    pub fn with_overload(mut self, overload: Admitter) -> Self {
        self.overload = Some(overload);
        self
    }

    /// The HTTP pipeline's stages up to the plan (parse, authenticate, admit, plan), then the
    /// router's pick: the same decision the HTTP gateway makes for this request.
    pub async fn decide(&self, head: &Head, body: bytes::Bytes) -> Result<Routed, Refusal> {
        // As over HTTP: the caller before the body, so an unknown one learns nothing about it.
        let caller = match &self.tenancy {
            Some(t) => Some(
                tracing::debug_span!("authenticate")
                    .in_scope(|| t.authenticate(&head.headers))
                    .map_err(Refusal::Gateway)?,
            ),
            None => None,
        };
        // Then the in-flight gate, as over HTTP: past the limit, shed before any work is spent.
        let slot = match &self.overload {
            Some(gate) => {
                let priority = caller.as_ref().map(|c| c.priority()).unwrap_or_default();
                gate.admit(priority)
                    .await
                    .map_err(|refused| Refusal::Gateway(refused.into()))?
            }
            None => None,
        };
        if let Some(route) = head.passthrough {
            return self
                .decide_passthrough(route, head, &body, caller.as_ref(), slot)
                .await;
        }
        let api = body::detect(head.api, &body).map_err(Refusal::Gateway)?;
        let protocol = api.protocol();
        let request = exchange::parse_as(api.endpoint(), body, self.policy.is_some())
            .map_err(Refusal::Gateway)?;
        self.refuse_renamed(request.model())?;
        self.admit(request.model())?;
        let tokens = PromptTokens::default();
        self.router
            .tokenize_locally(request.model(), request.prompt(), &tokens)
            .await;
        let admission = match (&self.tenancy, &caller) {
            (Some(t), Some(c)) => Some(
                govern::admit(t, c, &request, &tokens, protocol)
                    .instrument(tracing::debug_span!("admission", tenant = c.name()))
                    .await
                    .map_err(Refusal::Gateway)?,
            ),
            _ => None,
        };
        let decision = self
            .pick(head, &request, &tokens, caller.as_ref(), admission.as_ref())
            .await
            .map_err(Refusal::Gateway)?;
        Routed::new(decision, request.model(), admission, slot)
    }

    /// A pass-through endpoint, as the HTTP gateway routes it ([`crate::pipeline::passthrough`]):
    /// `/v1/responses` to the worker the router picks for the input's text, the others to the
    /// model's least loaded worker; the tenant admitted for what generates or embeds. No policy
    /// runs (these requests only go to the model's own workers). An alias the HTTP gateway would
    /// rename is refused: Envoy forwards the body unchanged.
    async fn decide_passthrough(
        &self,
        route: Route,
        head: &Head,
        body: &[u8],
        caller: Option<&crate::tenancy::Caller>,
        slot: Option<Slot>,
    ) -> Result<Routed, Refusal> {
        let request = PassthroughRequest::parse(route, body).map_err(Refusal::Gateway)?;
        self.refuse_renamed(&request.model)?;
        self.admit(&request.model)?;
        let text = request.text();
        let admission = match (&self.tenancy, caller) {
            (Some(t), Some(c)) if route.billed() => {
                let (input, output) = passthrough::token_demand(t, route, &request, &text);
                Some(
                    t.admit(c, &request.model, input, output, Protocol::OpenAi)
                        .instrument(tracing::debug_span!("admission", tenant = c.name()))
                        .await
                        .map_err(Refusal::Gateway)?,
                )
            }
            _ => None,
        };
        let decision = passthrough::pick(&self.router, route, &request, &text, head.debug)
            .await
            .map_err(|e| Refusal::Gateway(e.into()))?;
        Routed::new(decision, &request.model, admission, slot)
    }

    /// Refuses a model name the HTTP gateway would rewrite in the body for the worker under
    /// policies (an `InferenceModel`'s alias, or a model class): Envoy forwards the body as sent.
    fn refuse_renamed(&self, model: &str) -> Result<(), Refusal> {
        let Some(stage) = &self.policy else {
            return Ok(());
        };
        let set = stage.current();
        let detail = match set.resolve(model) {
            Requested::Model(name) => match set.models.get(&name) {
                Some(m) if m.spec.served_name != model => {
                    let served = &m.spec.served_name;
                    format!("`{model}` is served as `{served}`: ask for `{served}`")
                }
                _ => return Ok(()),
            },
            Requested::Class(_) => format!("`{model}` is a model class: name one of its models"),
            Requested::Unknown(_) => return Ok(()),
        };
        Err(Refusal::Gateway(GatewayError::invalid(
            "model",
            format!("{detail} (a request through Envoy reaches the worker unchanged)"),
        )))
    }

    /// The plan (with policies: its pools in order, providers passed over) and the router's pick.
    async fn pick(
        &self,
        head: &Head,
        request: &Parsed,
        tokens: &PromptTokens,
        caller: Option<&crate::tenancy::Caller>,
        admission: Option<&Admission>,
    ) -> Result<Decision, GatewayError> {
        let route = |model| RouteRequest {
            model,
            prompt: request.prompt(),
            debug: head.debug,
            tokens: Some(tokens),
        };
        let Some(stage) = &self.policy else {
            return Ok(self.router.pick(route(request.model())).await?);
        };
        let input = PlanInput {
            caller,
            tags: head
                .headers
                .get(crate::policy::classify::tags::TAGS_HEADER)
                .and_then(|v| v.to_str().ok()),
            debug: head.debug,
            local_only: admission.is_some_and(Admission::local_only),
            tokens,
        };
        let mut explain = None;
        let plan = govern::plan(
            stage,
            &self.router,
            self.tenancy.as_deref(),
            request,
            input,
            &mut explain,
        )
        .instrument(tracing::debug_span!("policy"))
        .await?;
        let mut last = None;
        for target in &plan.targets {
            let PlanTarget::Pool { model, workers, .. } = target else {
                continue; // Envoy forwards to workers only.
            };
            if model != request.model() {
                tracing::debug!(backend = %target.label(), %model, "ext_proc cannot rename the model; pool passed over");
                continue;
            }
            match self
                .router
                .pick_except(route(model), workers.as_deref(), &[])
                .await
            {
                Ok(decision) => {
                    stage.count_sent(target, plan.burst);
                    return Ok(decision);
                }
                Err(error) => last = Some(GatewayError::from(error)),
            }
        }
        Err(last.unwrap_or_else(|| GatewayError::PolicyRejected {
            status: http::StatusCode::SERVICE_UNAVAILABLE,
            code: "no_backend_available",
            message: format!(
                "no worker chosen by the policies ({}) can be reached through Envoy",
                plan.rule
            ),
        }))
    }

    /// Sheds when every ready worker of `model` is at the in-flight limit (the router would still
    /// pick one; piling onto it only lengthens everyone's queue, and Envoy can retry elsewhere).
    fn admit(&self, model: &str) -> Result<(), Refusal> {
        let Some(limit) = self.settings.shed_in_flight else {
            return Ok(());
        };
        let workers = self.router.workers();
        let mut ready = workers.iter().filter(|w| w.model == model && w.healthy);
        let mut any = false;
        let all_full = ready.all(|w| {
            any = true;
            w.in_flight >= limit
        });
        if any && all_full {
            return Err(Refusal::Shed {
                model: model.to_string(),
                limit,
            });
        }
        Ok(())
    }
}

/// The tonic service.
#[derive(Debug, Clone)]
pub struct ExtProcService {
    handler: Arc<Handler>,
}

impl ExtProcService {
    /// A service over the gateway's router.
    pub fn new(router: Arc<Router>, settings: Settings) -> Self {
        Self::with_handler(Handler::new(router, settings))
    }

    /// A service over `handler`.
    pub fn with_handler(handler: Handler) -> Self {
        Self {
            handler: Arc::new(handler),
        }
    }

    /// The gRPC server for this service.
    pub fn into_server(self) -> ExternalProcessorServer<Self> {
        ExternalProcessorServer::new(self)
    }
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let handler = Arc::clone(&self.handler);
        tokio::spawn(async move {
            // The session (and the ticket in it) is dropped when this task ends: Envoy closed the
            // stream, broke it, or stopped reading.
            let mut session = Session::default();
            loop {
                let msg = match inbound.message().await {
                    Ok(Some(msg)) => msg,
                    Ok(None) => break,
                    Err(status) => {
                        tracing::debug!(%status, "ext_proc stream broke");
                        break;
                    }
                };
                if let Some(answer) = session.on_message(&handler, msg).await
                    && tx.send(Ok(answer)).await.is_err()
                {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Serves an open handler over `router` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    router: Arc<Router>,
    settings: Settings,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    serve_handler(listener, Handler::new(router, settings), shutdown).await
}

/// Serves `handler` on `listener` until `shutdown` resolves.
pub async fn serve_handler(
    listener: TcpListener,
    handler: Handler,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    serve_handler_tls(listener, handler, None, shutdown).await
}

/// [`serve_handler`], with mutual TLS when `tls` is given (clients without a certificate of its CA
/// are refused during the handshake).
pub async fn serve_handler_tls(
    listener: TcpListener,
    handler: Handler,
    tls: Option<tonic::transport::ServerTlsConfig>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        server = server.tls_config(tls)?;
    }
    server
        .tcp_nodelay(true)
        .add_service(ExtProcService::with_handler(handler).into_server())
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await
}

/// Starts the handler when `--extproc-listen` is given (what `main` calls), with the gateway's
/// governance; runs until `shutdown` resolves, then closes its socket and lets open streams finish.
pub async fn spawn(
    args: &ExtProcArgs,
    gw: &Gateway,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<Option<tokio::task::JoinHandle<()>>> {
    let Some(addr) = args.extproc_listen else {
        return Ok(None);
    };
    let tls = kinference_api::tls::ServerTlsFiles::from_flags(
        args.extproc_tls_cert.as_ref(),
        args.extproc_tls_key.as_ref(),
        args.extproc_tls_client_ca.as_ref(),
    )
    .map(|files| files.config())
    .transpose()
    .map_err(|e| std::io::Error::other(format!("ext_proc mTLS: {e}")))?;
    // A certificate or key that does not parse stops the start, not only the handler later.
    if let Some(tls) = &tls {
        tonic::transport::Server::builder()
            .tls_config(tls.clone())
            .map_err(|e| std::io::Error::other(format!("ext_proc mTLS: {e}")))?;
    }
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(listen = %listener.local_addr()?, "ext_proc inference handler listening");
    let handler = Handler::governed(gw, Settings::from(args));
    Ok(Some(tokio::spawn(async move {
        if let Err(error) = serve_handler_tls(listener, handler, tls, shutdown).await {
            tracing::error!(%error, "ext_proc inference handler stopped");
        }
    })))
}

#[cfg(test)]
mod tests;
