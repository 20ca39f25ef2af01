//! The inference handler: Kinference's worker choice served over Envoy's external-processing protocol
//! (`envoy.service.ext_proc.v3.ExternalProcessor/Process`), the way the Gateway API Inference
//! Extension's endpoint picker serves it, so an Envoy-based Gateway API implementation routes with
//! Kinference without a second proxy hop.
//!
//! One front door of the one pipeline ([`crate::pipeline`]): every endpoint of the route table runs
//! the same stages as over HTTP, in the same order, with the same errors. Per HTTP request Envoy
//! opens one bidirectional stream and sends the request headers (authenticate and admit run there:
//! a caller without a key, or past the in-flight limit or the body budget, is answered before Envoy
//! sends a byte of the body), then the body (`request_body_mode: BUFFERED`, or `STREAMED` chunks,
//! each taken off the request until the last, which carries the whole body as the worker is to get
//! it; or `FULL_DUPLEX_STREAMED`, the endpoint picker's mode, where the headers wait unanswered for
//! the body and the body goes back as streamed chunks, [`mode`]), then the gateway parses, limits,
//! classifies and plans, and picks a worker of the plan's pools (within the proxy's subset hint,
//! [`picker`]) with the same [`crate::routing::Router`]. The last body chunk (in full duplex: the
//! headers) is answered with `x-gateway-destination-endpoint: ip:port[,fallback...]` (route cache
//! cleared), the same value in the dynamic metadata
//! `envoy.lb { x-gateway-destination-endpoint }` that Envoy's original-destination cluster reads,
//! the worker's own credentials in place of the client's, and the body rewritten where the gateway
//! must: the model a policy, alias or class resolved to, the output limit it reserved, and, for a
//! stream, `stream_options.include_usage` so the answer can be billed. Envoy forwards to workers
//! only: a plan's providers are passed over. What the gateway answers itself (token counts, the
//! model list) and every refusal are local replies in the client's protocol: 400 malformed body, 401
//! no or a wrong API key, 403 refused by a policy or outside the tenant's models, 404 unknown model,
//! 413 body too large, 429 tenant limits or shed, 503 overloaded or no ready worker.
//!
//! With `response_header_mode: SEND` and `response_body_mode: STREAMED` (the endpoint picker's
//! setting) the handler sees the answer through the same relay as the HTTP door: the first text is
//! the first token, the usage chunk it asked for settles the tenant's usage (and is taken out of
//! the answer when the client did not ask for it), an answer without usage is counted by the
//! gateway. Without the response phase a routed request is settled when Envoy closes the stream,
//! billed its prompt and its output reservation, marked estimated: never zero.
//!
//! Telemetry as over HTTP ([`crate::telemetry`]): the client's `x-request-id` (or a new one) is set
//! on the request to the worker, on the response headers and on local replies, and carried by the
//! usage record; the request's span continues the client's `traceparent`, its stages are its
//! children, and the worker gets a `traceparent` naming it (Envoy, not the gateway, makes the
//! upstream call). One access line per request, written by its settlement as over HTTP.
//!
//! [`session`] is one stream's state; [`mode`] how the proxy sends bodies; [`picker`] the endpoint
//! picker protocol's subset hint, fallback list and served endpoint; [`body`] the request's API when
//! its path does not say; [`reply`] the messages sent back. `deploy/picker.md` has the protocol
//! matrix and the `failureMode` behaviour.

pub mod body;
mod limit;
pub mod mode;
pub mod picker;
pub mod reply;
pub mod session;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

use crate::errors::GatewayError;
use crate::gateway::Gateway;
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

    /// Most open connections on the ext_proc port; past it a new connection is closed at once.
    #[arg(
        long,
        env = "KINFERENCE_EXTPROC_MAX_CONNECTIONS",
        default_value_t = 1024
    )]
    pub extproc_max_connections: usize,

    /// Most streams (requests) open at once on one ext_proc connection (HTTP/2
    /// `max_concurrent_streams`).
    #[arg(long, env = "KINFERENCE_EXTPROC_MAX_STREAMS", default_value_t = 1024)]
    pub extproc_max_streams: u32,

    /// Longest silence on an open stream, in seconds, before the handler closes it (and a routed
    /// request is settled as abandoned): a proxy that stopped sending holds no slot.
    #[arg(
        long,
        env = "KINFERENCE_EXTPROC_IDLE_TIMEOUT_SECONDS",
        default_value_t = 300
    )]
    pub extproc_idle_timeout_seconds: u64,

    /// Longest a stream may stay open, in seconds, whatever it does: past it the handler closes it
    /// and the request's slot, ticket and body room are given back (settled as abandoned).
    #[arg(
        long,
        env = "KINFERENCE_EXTPROC_STREAM_DEADLINE_SECONDS",
        default_value_t = 1800
    )]
    pub extproc_stream_deadline_seconds: u64,

    /// Endpoints to name after the chosen one in the destination (`ip:port,ip:port`, the endpoint
    /// picker protocol's fallback list): other healthy workers of the model, least loaded first,
    /// which a proxy with retries tries in order. 0 names the chosen endpoint only.
    #[arg(
        long,
        env = "KINFERENCE_EXTPROC_FALLBACK_ENDPOINTS",
        default_value_t = 0
    )]
    pub extproc_fallback_endpoints: usize,

    /// mTLS on the ext_proc port: the handler's certificate (PEM). With `--extproc-tls-key` and
    /// `--extproc-tls-client-ca`, only a proxy presenting a certificate of that CA may connect. The
    /// files are read again every 5 s: renewed certificates apply without a restart.
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

    /// mTLS on the ext_proc port: the roles admitted, as DNS names the proxy's certificate must carry
    /// one of in its subject alternative names (comma-separated). The default admits the proxy only:
    /// an agent's or a gateway's certificate of the same CA is refused.
    #[arg(
        long,
        env = "KINFERENCE_EXTPROC_TLS_CLIENT_NAMES",
        value_delimiter = ',',
        default_value = "kinference-envoy"
    )]
    pub extproc_tls_client_names: Vec<String>,
}

/// The handler's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// See [`ExtProcArgs::extproc_shed_in_flight`]; `None` never sheds.
    pub shed_in_flight: Option<usize>,
    /// See [`ExtProcArgs::extproc_body_limit_bytes`].
    pub body_limit_bytes: usize,
    /// See [`ExtProcArgs::extproc_max_connections`].
    pub max_connections: usize,
    /// See [`ExtProcArgs::extproc_max_streams`].
    pub max_streams: u32,
    /// See [`ExtProcArgs::extproc_idle_timeout_seconds`].
    pub idle_timeout: Duration,
    /// See [`ExtProcArgs::extproc_stream_deadline_seconds`].
    pub stream_deadline: Duration,
    /// See [`ExtProcArgs::extproc_fallback_endpoints`].
    pub fallback_endpoints: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Self::from(&ExtProcArgs::default())
    }
}

impl Default for ExtProcArgs {
    fn default() -> Self {
        // The clap defaults: parse an empty command line.
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            extproc: ExtProcArgs,
        }
        <Only as clap::Parser>::parse_from(["kinference-gateway"]).extproc
    }
}

impl From<&ExtProcArgs> for Settings {
    fn from(a: &ExtProcArgs) -> Self {
        Self {
            shed_in_flight: (a.extproc_shed_in_flight > 0).then_some(a.extproc_shed_in_flight),
            body_limit_bytes: a.extproc_body_limit_bytes,
            max_connections: a.extproc_max_connections.max(1),
            max_streams: a.extproc_max_streams.max(1),
            idle_timeout: Duration::from_secs(a.extproc_idle_timeout_seconds.max(1)),
            stream_deadline: Duration::from_secs(a.extproc_stream_deadline_seconds.max(1)),
            fallback_endpoints: a.extproc_fallback_endpoints,
        }
    }
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

/// What every stream shares: the gateway (its router, governance and limits) and the settings.
#[derive(Debug, Clone)]
pub struct Handler {
    gw: Arc<Gateway>,
    settings: Settings,
}

impl Handler {
    /// A handler of `gw`'s requests.
    pub fn new(gw: Arc<Gateway>, settings: Settings) -> Self {
        Self { gw, settings }
    }

    /// The gateway it serves.
    pub fn gateway(&self) -> &Arc<Gateway> {
        &self.gw
    }

    /// Sheds when every ready worker of `model` is at the in-flight limit (the router would still
    /// pick one; piling onto it only lengthens everyone's queue, and Envoy can retry elsewhere).
    fn shed(&self, model: &str) -> Result<(), GatewayError> {
        let Some(limit) = self.settings.shed_in_flight else {
            return Ok(());
        };
        let workers = self.gw.router.workers();
        let mut ready = workers.iter().filter(|w| w.model == model && w.healthy);
        let mut any = false;
        let all_full = ready.all(|w| {
            any = true;
            w.in_flight >= limit
        });
        if any && all_full {
            return Err(GatewayError::RateLimited {
                message: format!(
                    "every worker of model `{model}` is at its in-flight limit ({limit}); retry shortly"
                ),
                headers: vec![("retry-after", "1".to_string())],
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
    /// A service over `handler`.
    pub fn with_handler(handler: Handler) -> Self {
        Self {
            handler: Arc::new(handler),
        }
    }

    /// The gRPC server for this service: messages up to a whole body (Envoy's `BUFFERED` mode
    /// sends it in one) and some room for the headers around it.
    pub fn into_server(self) -> ExternalProcessorServer<Self> {
        let largest = self.handler.settings.body_limit_bytes + 64 * 1024;
        ExternalProcessorServer::new(self).max_decoding_message_size(largest)
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
            // stream, broke it, stopped reading, went silent past the idle timeout, or kept it
            // open past the stream deadline.
            let settings = &handler.settings;
            let deadline = tokio::time::Instant::now() + settings.stream_deadline;
            let mut session = Session::new(&handler);
            'stream: loop {
                let next = tokio::time::timeout_at(
                    deadline.min(tokio::time::Instant::now() + settings.idle_timeout),
                    inbound.message(),
                );
                let msg = match next.await {
                    Ok(Ok(Some(msg))) => msg,
                    Ok(Ok(None)) => break,
                    Ok(Err(status)) => {
                        tracing::debug!(%status, "ext_proc stream broke");
                        break;
                    }
                    Err(_) => {
                        tracing::warn!(
                            idle_timeout_s = settings.idle_timeout.as_secs(),
                            deadline_s = settings.stream_deadline.as_secs(),
                            "ext_proc stream closed: silent past the idle timeout, or open past its deadline"
                        );
                        let _ = tx
                            .send(Err(Status::deadline_exceeded(
                                "the stream was silent or open too long",
                            )))
                            .await;
                        break;
                    }
                };
                for answer in session.on_message(msg).await {
                    if tx.send(Ok(answer)).await.is_err() {
                        break 'stream;
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
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
/// and role are refused during the handshake).
pub async fn serve_handler_tls(
    listener: TcpListener,
    handler: Handler,
    tls: Option<kinference_api::tls::ServerTls>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let settings = handler.settings.clone();
    let incoming = limit::Limited::new(TcpListenerStream::new(listener), settings.max_connections);
    let server = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .max_concurrent_streams(settings.max_streams)
        // A proxy that vanished without closing its connections is found within 40 s.
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_service(ExtProcService::with_handler(handler).into_server());
    match tls {
        Some(tls) => {
            server
                .serve_with_incoming_shutdown(tls.accept(incoming), shutdown)
                .await
        }
        None => {
            server
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
    }
}

/// Starts the handler when `--extproc-listen` is given (what `main` calls), with the gateway's
/// governance; runs until `shutdown` resolves, then closes its socket and lets open streams finish.
pub async fn spawn(
    args: &ExtProcArgs,
    gw: &Arc<Gateway>,
    tls_metrics: &kinference_api::tls::TlsMetrics,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<Option<tokio::task::JoinHandle<()>>> {
    let Some(addr) = args.extproc_listen else {
        return Ok(None);
    };
    let tls = kinference_api::tls::ServerTlsFiles::from_flags(
        args.extproc_tls_cert.as_ref(),
        args.extproc_tls_key.as_ref(),
        args.extproc_tls_client_ca.as_ref(),
        &args.extproc_tls_client_names,
    )
    .map(|files| kinference_api::tls::ServerTls::load("extproc", &files, tls_metrics))
    .transpose()
    // A certificate or key that does not load stops the start, not only the handler later.
    .map_err(|e| std::io::Error::other(format!("ext_proc mTLS: {e}")))?;
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(listen = %listener.local_addr()?, "ext_proc inference handler listening");
    let handler = Handler::new(Arc::clone(gw), Settings::from(args));
    Ok(Some(tokio::spawn(async move {
        if let Err(error) = serve_handler_tls(listener, handler, tls, shutdown).await {
            tracing::error!(%error, "ext_proc inference handler stopped");
        }
    })))
}

#[cfg(test)]
mod tests;
