//! The inference handler: Kinference's worker choice served over Envoy's external-processing protocol
//! (`envoy.service.ext_proc.v3.ExternalProcessor/Process`), the way the Gateway API Inference
//! Extension's endpoint picker serves it, so an Envoy-based Gateway API implementation routes with
//! Kinference without a second proxy hop.
//!
//! Per HTTP request Envoy opens one bidirectional stream and sends the request headers, then the body
//! (configure `request_body_mode: BUFFERED`; `STREAMED` chunks are accumulated until `end_of_stream`).
//! The handler parses the OpenAI / Anthropic body with the HTTP gateway's own types, calls the same
//! [`Router::pick`], and answers the last body chunk with the header `x-gateway-destination-endpoint:
//! ip:port` (route cache cleared) and the dynamic metadata `envoy.lb { x-gateway-destination-endpoint }`
//! that Envoy's original-destination cluster reads. Refusals are local replies with a JSON error body
//! in the client's protocol: 400 malformed body, 404 unknown model, 413 body too large, 503 no ready
//! worker, 429 shed (every worker of the model at the in-flight limit).
//!
//! The decision's [`InFlight`](crate::routing::InFlight) ticket lives as long as the stream. With
//! `response_header_mode: SEND` and `response_body_mode: STREAMED` (the endpoint picker's setting) the
//! handler also sees the response: the first event of an SSE stream is reported as the first token,
//! and the end of the body finishes the ticket with the `usage` it carries. Without the response phase
//! the ticket is released when Envoy closes the stream.
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

use crate::errors::{GatewayError, Protocol};
use crate::routing::{Decision, RouteRequest, Router};
use body::Parsed;
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

    /// The ext_proc local reply.
    pub fn reply(&self, protocol: Protocol) -> ProcessingResponse {
        let details = match self {
            Refusal::Gateway(e) => e.kind(),
            Refusal::Shed { .. } => "shed",
        };
        reply::immediate(
            self.status(),
            &self.body(protocol),
            &format!("kinference_{details}"),
        )
    }
}

/// A routed request: the router's decision and the `ip:port` Envoy connects to.
#[derive(Debug)]
pub struct Routed {
    /// The decision (its ticket must be kept until the request ends).
    pub decision: Decision,
    /// `host:port` of the worker.
    pub endpoint: String,
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

/// What every stream shares: the router and the settings.
#[derive(Debug, Clone)]
pub struct Handler {
    router: Arc<Router>,
    settings: Settings,
}

impl Handler {
    /// A handler over the gateway's router.
    pub fn new(router: Arc<Router>, settings: Settings) -> Self {
        Self { router, settings }
    }

    /// Admission, then the router's pick: the same decision the HTTP gateway makes for this request.
    pub async fn decide(&self, req: &Parsed, debug: bool) -> Result<Routed, Refusal> {
        self.admit(&req.model)?;
        // Policies plug in here once the HTTP pipeline applies them: evaluate the request against the
        // policy set (reject -> Refusal, route constraints -> candidate filter) before picking, with the
        // same function the pipeline calls, so both front ends keep deciding identically.
        let decision = self
            .router
            .pick(RouteRequest {
                model: &req.model,
                prompt: req.prompt.as_prompt(),
                debug,
            })
            .await
            .map_err(|e| Refusal::Gateway(e.into()))?;
        let endpoint = endpoint_of(&decision.worker).ok_or_else(|| {
            Refusal::Gateway(GatewayError::BadUpstream {
                worker: decision.worker.clone(),
                detail: "worker URL has no host".into(),
            })
        })?;
        Ok(Routed { decision, endpoint })
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
        Self {
            handler: Arc::new(Handler::new(router, settings)),
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

/// Serves the handler on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    router: Arc<Router>,
    settings: Settings,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(ExtProcService::new(router, settings).into_server())
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await
}

/// Starts the handler when `--extproc-listen` is given (what `main` calls); runs until the process ends.
pub async fn spawn(
    args: &ExtProcArgs,
    router: Arc<Router>,
) -> std::io::Result<Option<tokio::task::JoinHandle<()>>> {
    let Some(addr) = args.extproc_listen else {
        return Ok(None);
    };
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(listen = %listener.local_addr()?, "ext_proc inference handler listening");
    let settings = Settings::from(args);
    Ok(Some(tokio::spawn(async move {
        if let Err(error) = serve(listener, router, settings, std::future::pending()).await {
            tracing::error!(%error, "ext_proc inference handler stopped");
        }
    })))
}

#[cfg(test)]
mod tests;
