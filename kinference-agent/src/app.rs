//! Wires the agent together: discovery -> per-worker subscriber, scraper and kernel watch -> registry ->
//! broadcaster -> gRPC; the node signals (eBPF, NVML) -> registry; plus the metrics port (`/metrics`,
//! `/healthz`, `/readyz`). `main` only parses flags and calls [`run`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use kinference_api::summary::node_agent_server::NodeAgentServer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
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
    #[error("starting the node signals (eBPF, NVML): {0}")]
    Signals(#[from] tokio::task::JoinError),
}

/// Runs the agent until `shutdown` is cancelled.
pub async fn run(args: Args, shutdown: CancellationToken) -> Result<(), StartError> {
    // Fail fast on a bad file at start; later edits that do not parse are only logged.
    WorkersFile::load(&args.workers)?;

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

    let service = NodeAgentServer::new(NodeAgentService::new(broadcaster));
    // Listening, signals started, discovery running: gateways may connect.
    ready.store(true, Ordering::Release);
    tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming_shutdown(
            TcpListenerStream::new(grpc_listener),
            shutdown.cancelled_owned(),
        )
        .await?;
    Ok(())
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
    shutdown: CancellationToken,
) {
    loop {
        let (stream, _) = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(error) => {
                    tracing::warn!(%error, "metrics accept failed");
                    continue;
                }
            },
        };
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
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
