//! Wires the agent together: discovery -> per-worker subscriber, scraper and kernel watch -> registry ->
//! broadcaster -> gRPC; the node signals (eBPF, NVML) -> registry; plus the metrics port (`/metrics`,
//! `/healthz`, `/readyz`). `main` only parses flags and calls [`run`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use kinference_api::summary::node_agent_server::NodeAgentServer;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::config::{Args, WorkersFile};
use crate::discovery::{self, WorkerChange};
use crate::grpc::{Broadcaster, NodeAgentService};
use crate::metrics::AgentMetrics;
use crate::node::ebpf::EbpfOptions;
use crate::registry::Registry;
use crate::signals::{self, NodeSignals};
use crate::{scrape, subscriber};

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("gRPC mTLS: {0}")]
    Tls(#[from] kinference_api::tls::TlsError),
    #[error(transparent)]
    Guard(#[from] crate::zmq_guard::GuardError),
    #[error("starting the node signals (eBPF, NVML): {0}")]
    Signals(#[from] tokio::task::JoinError),
}

/// Runs the agent until `shutdown` is cancelled.
pub async fn run(args: Args, shutdown: CancellationToken) -> Result<(), StartError> {
    // mTLS on the gRPC port when its three files are given: a missing or bad file stops the start.
    let tls_metrics = kinference_api::tls::TlsMetrics::default();
    let grpc_tls = kinference_api::tls::ServerTlsFiles::from_flags(
        args.grpc_tls_cert.as_ref(),
        args.grpc_tls_key.as_ref(),
        args.grpc_tls_client_ca.as_ref(),
        &args.grpc_tls_client_names,
    )
    .map(|files| kinference_api::tls::ServerTls::load("grpc", &files, &tls_metrics))
    .transpose()?;
    // Fail fast on a bad file or contradictory limits at start; later edits of the file that do not
    // parse are only logged.
    WorkersFile::load(&args.workers)?;
    args.zmq_guard().validate()?;

    // eBPF and NVML load meanwhile (parsing the kernel's BTF takes a moment): both log once what works and
    // why the rest does not, and never fail the agent.
    let mut ebpf_options = EbpfOptions::from_env();
    ebpf_options.poll_interval = args.kernel_poll();
    ebpf_options.idle_gap = args.kernel_idle_gap();
    let starting = tokio::task::spawn_blocking(move || {
        let signals = NodeSignals::start(ebpf_options);
        // A first GPU sample, so the first snapshot already carries the node state (or why it is missing).
        let state = signals.gpu.sample(&[]).to_proto();
        (signals, state)
    });

    let grpc_listener = TcpListener::bind(args.grpc_listen)
        .await
        .map_err(|source| StartError::Listen {
            addr: args.grpc_listen,
            source,
        })?;
    let metrics_listener = TcpListener::bind(args.metrics_listen)
        .await
        .map_err(|source| StartError::Listen {
            addr: args.metrics_listen,
            source,
        })?;

    let (signals, node_state) = starting.await?;
    let signals = Arc::new(signals);

    let metrics = AgentMetrics::default();
    let mut prom = prometheus_client::registry::Registry::default();
    metrics.register(&mut prom);
    tls_metrics.register(&mut prom);
    signals.register_metrics(&mut prom);
    let prom = Arc::new(prom);

    let registry = Arc::new(Registry::default());
    registry.set_node_state(node_state);
    let node = args.node_name();
    let broadcaster = Broadcaster::new(
        registry.clone(),
        metrics.clone(),
        node.clone(),
        args.watcher_queue,
    );

    tracing::info!(grpc = %args.grpc_listen, metrics = %args.metrics_listen, node, "kinference-agent listening");

    let ready = Arc::new(AtomicBool::new(false));
    let health = Health {
        ready: Arc::clone(&ready),
        registry: Arc::clone(&registry),
        signals: Arc::clone(&signals),
    };
    tokio::spawn(serve_metrics(
        metrics_listener,
        prom,
        health,
        (args.metrics_max_connections, metrics.clone()),
        shutdown.clone(),
    ));
    tokio::spawn(broadcaster.clone().run(args.coalesce(), shutdown.clone()));
    tokio::spawn(signals::run_kernel(
        Arc::clone(&signals.kernel),
        Arc::clone(&registry),
        args.kernel_poll(),
        shutdown.clone(),
    ));
    tokio::spawn(signals::run_gpu(
        Arc::clone(&signals.gpu),
        Arc::clone(&registry),
        args.gpu_interval(),
        shutdown.clone(),
    ));

    let changes = discovery::watch_file(
        args.workers.clone(),
        std::time::Duration::from_millis(args.workers_poll_ms.max(50)),
        shutdown.clone(),
    );
    let changes = discovery::kube::with_kube_source(changes, &node, shutdown.clone()).await;
    tokio::spawn(supervise(
        changes,
        registry.clone(),
        metrics.clone(),
        Arc::clone(&signals),
        args.clone(),
        shutdown.clone(),
    ));

    let service = NodeAgentServer::new(NodeAgentService::new(broadcaster))
        .max_decoding_message_size(GRPC_MAX_REQUEST_BYTES)
        .max_encoding_message_size(args.grpc_max_message_bytes);
    let incoming = limited_incoming(
        grpc_listener,
        "grpc",
        args.grpc_max_connections,
        metrics.clone(),
    );
    // Listening, signals started, discovery running: gateways may connect.
    ready.store(true, Ordering::Release);
    let server = tonic::transport::Server::builder()
        .http2_max_header_list_size(HTTP_MAX_HEADER_BYTES as u32)
        .max_concurrent_streams(GRPC_MAX_STREAMS_PER_CONNECTION)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_service(service);
    let stopped = shutdown.cancelled_owned();
    match grpc_tls {
        Some(tls) => {
            server
                .serve_with_incoming_shutdown(tls.accept(Box::pin(incoming)), stopped)
                .await?
        }
        None => {
            server
                .serve_with_incoming_shutdown(incoming, stopped)
                .await?
        }
    }
    Ok(())
}

/// Largest gRPC request: a `WatchRequest` is a gateway id.
const GRPC_MAX_REQUEST_BYTES: usize = 64 << 10;
/// A gateway needs one Watch stream per connection.
const GRPC_MAX_STREAMS_PER_CONNECTION: u32 = 16;
/// Largest request head (HTTP/1 buffer, HTTP/2 header list) on the agent's servers.
const HTTP_MAX_HEADER_BYTES: usize = 16 << 10;
/// Time a client has to send a request's headers on the metrics port.
const HTTP_HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// An accepted connection holding one of its listener's slots until it closes.
struct Limited {
    io: TcpStream,
    _slot: Slot,
}

/// One connection slot of a listener; freed (and the open-connections gauge lowered) on drop.
struct Slot {
    _permit: OwnedSemaphorePermit,
    gauge: prometheus_client::metrics::gauge::Gauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// Takes a slot for a new connection, or counts and logs the refusal when all are taken.
fn take_slot(
    slots: &Arc<Semaphore>,
    listener: &'static str,
    metrics: &AgentMetrics,
) -> Option<Slot> {
    match slots.clone().try_acquire_owned() {
        Ok(permit) => {
            let gauge = metrics.connections(listener);
            gauge.inc();
            Some(Slot {
                _permit: permit,
                gauge,
            })
        }
        Err(_) => {
            metrics.reject(
                listener,
                "too_many_connections",
                &"every connection slot is taken",
            );
            None
        }
    }
}

/// The gRPC listener's connections, at most `max` open at once (the others are closed on accept).
fn limited_incoming(
    listener: TcpListener,
    name: &'static str,
    max: usize,
    metrics: AgentMetrics,
) -> impl futures::Stream<Item = std::io::Result<Limited>> {
    let slots = Arc::new(Semaphore::new(max.max(1)));
    futures::stream::unfold(
        (listener, slots, metrics),
        move |(listener, slots, metrics)| async move {
            loop {
                match listener.accept().await {
                    Ok((io, _)) => {
                        let Some(slot) = take_slot(&slots, name, &metrics) else {
                            continue;
                        };
                        let _ = io.set_nodelay(true);
                        return Some((Ok(Limited { io, _slot: slot }), (listener, slots, metrics)));
                    }
                    Err(error) => {
                        // Out of descriptors, most likely: back off instead of spinning.
                        metrics.reject(name, "accept_error", &error);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        },
    )
}

impl tonic::transport::server::Connected for Limited {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl tokio::io::AsyncRead for Limited {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Limited {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Starts and stops each worker's subscriber and scraper as discovery reports changes.
async fn supervise(
    mut changes: tokio::sync::mpsc::Receiver<WorkerChange>,
    registry: Arc<Registry>,
    metrics: AgentMetrics,
    signals: Arc<NodeSignals>,
    args: Args,
    shutdown: CancellationToken,
) {
    let mut tasks: HashMap<String, CancellationToken> = HashMap::new();
    let client = scrape::client();
    while let Some(change) = changes.recv().await {
        match change {
            WorkerChange::Upsert(spec) => {
                if let Some(old) = tasks.remove(&spec.url) {
                    old.cancel();
                }
                let cancel = shutdown.child_token();
                let slot = registry.upsert(spec.clone(), args.max_blocks_per_worker);
                tokio::spawn(subscriber::run(
                    slot.clone(),
                    registry.clone(),
                    metrics.clone(),
                    args.zmq_guard(),
                    cancel.clone(),
                ));
                tokio::spawn(scrape::run(
                    slot,
                    registry.clone(),
                    metrics.clone(),
                    client.clone(),
                    args.scrape_interval(),
                    cancel.clone(),
                ));
                signals.watch(&spec.url);
                tasks.insert(spec.url, cancel);
            }
            WorkerChange::Remove(url) => {
                if let Some(cancel) = tasks.remove(&url) {
                    cancel.cancel();
                }
                signals.unwatch(&url);
                registry.remove(&url);
            }
        }
    }
}

/// What `/readyz` reports.
#[derive(Clone)]
struct Health {
    /// Set once the gRPC server is about to serve.
    ready: Arc<AtomicBool>,
    registry: Arc<Registry>,
    signals: Arc<NodeSignals>,
}

impl Health {
    /// `/readyz`: 200 once gateways can watch, with the worker count and each node signal's state (eBPF or
    /// NVML being unavailable does not make the agent unready: it serves summaries without them).
    fn readyz(&self) -> (u16, String) {
        if !self.ready.load(Ordering::Acquire) {
            return (503, "starting\n".to_string());
        }
        let workers = self.registry.list().len();
        (
            200,
            format!("ready\nworkers: {workers}\n{}", self.signals.describe()),
        )
    }
}

/// Serves `/metrics` (Prometheus text), `/healthz` (the process answers) and `/readyz` (gateways can watch).
async fn serve_metrics(
    listener: TcpListener,
    prom: Arc<prometheus_client::registry::Registry>,
    health: Health,
    (max_connections, metrics): (usize, AgentMetrics),
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(max_connections.max(1)));
    let mut server = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // Bounded request heads and a deadline to send them; request bodies are never read.
    server
        .http1()
        .timer(TokioTimer::new())
        .max_buf_size(HTTP_MAX_HEADER_BYTES)
        .header_read_timeout(HTTP_HEADER_TIMEOUT);
    server
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(HTTP_MAX_HEADER_BYTES as u32)
        .max_concurrent_streams(16);
    let server = Arc::new(server);
    loop {
        let (stream, _) = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(error) => {
                    metrics.reject("metrics", "accept_error", &error);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(slot) = take_slot(&slots, "metrics", &metrics) else {
            continue;
        };
        let server = server.clone();
        let prom = prom.clone();
        let health = health.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                let prom = prom.clone();
                let health = health.clone();
                async move {
                    let (status, ctype, body) = match req.uri().path() {
                        "/metrics" => {
                            let mut text = String::new();
                            match prometheus_client::encoding::text::encode(&mut text, &prom) {
                                Ok(()) => (
                                    200,
                                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                                    text,
                                ),
                                Err(e) => (500, "text/plain", e.to_string()),
                            }
                        }
                        "/healthz" => (200, "text/plain", "ok\n".to_string()),
                        "/readyz" => {
                            let (status, body) = health.readyz();
                            (status, "text/plain", body)
                        }
                        _ => (404, "text/plain", "not found\n".to_string()),
                    };
                    Response::builder()
                        .status(status)
                        .header("content-type", ctype)
                        .body(Full::new(Bytes::from(body)))
                }
            });
            let _ = server.serve_connection(TokioIo::new(stream), service).await;
            drop(slot);
        });
    }
}
