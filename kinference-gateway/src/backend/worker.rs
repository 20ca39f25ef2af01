//! The connection to the workers: a pooled hyper client with the configured timeouts, and the
//! translation of transport failures into [`GatewayError`]s.
//!
//! Connections are kept alive and reused (the pool is what keeps the gateway's added latency well
//! under a millisecond); Nagle is off so small SSE chunks leave at once. The pool is bounded per
//! worker ([`BoundedConnector`]): past `--upstream-max-connections-per-worker` a request waits for
//! one of that worker's connections to come free instead of opening another.
//!
//! What a backend sends back is bounded ([`UpstreamLimits`]): a whole answer at
//! `--upstream-max-body-bytes`, a streamed one's lines and events at `--upstream-max-line-bytes` and
//! `--upstream-max-event-bytes` ([`crate::backend::sse`]). Remote pools and providers are third
//! parties: an answer past a limit is a bad upstream (502 in the client's protocol) and, for a
//! worker, one failed outcome toward its health (outlier detection).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::RwLock;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::backend::sse::SseLimits;
use crate::errors::GatewayError;

/// The request header vLLM's OpenAI server reads to pick a data-parallel rank
/// (`OpenAIServing._get_data_parallel_rank`: `X-data-parallel-rank`, an int; anything else is
/// ignored). Header names are case-insensitive.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

pub mod credentials;

/// Where a worker's failed outcomes are counted (the health record,
/// [`crate::backend::health::Health`], implements it).
pub trait Outcomes: Send + Sync {
    /// One outcome of `worker`'s: `ok` or failed.
    fn observe(&self, worker: &str, ok: bool);
}

/// How much of one backend's answer the gateway holds, and the health record an answer past it
/// counts against.
#[derive(Clone)]
pub struct UpstreamLimits {
    /// A whole (not streamed) answer's body, in bytes.
    pub max_body: usize,
    /// A streamed answer's lines and events.
    pub sse: SseLimits,
    health: Option<Arc<dyn Outcomes>>,
}

impl std::fmt::Debug for UpstreamLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamLimits")
            .field("max_body", &self.max_body)
            .field("sse", &self.sse)
            .field("counts_health", &self.health.is_some())
            .finish()
    }
}

impl Default for UpstreamLimits {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_BODY, SseLimits::default())
    }
}

/// Default largest whole answer: 64 MiB (an embeddings batch of 2,048 inputs of 4,096 dimensions
/// is about 100 MB as JSON: raise it for those).
pub const DEFAULT_MAX_BODY: usize = 64 << 20;

impl UpstreamLimits {
    /// These limits, counting against no health record.
    pub fn new(max_body: usize, sse: SseLimits) -> Self {
        Self {
            max_body,
            sse,
            health: None,
        }
    }

    /// The error for `backend`'s answer past a limit (`what`); for a worker (not a
    /// `provider/<name>`: providers have no health record), one failed outcome toward its health.
    pub fn exceeded(&self, backend: &str, what: impl std::fmt::Display) -> GatewayError {
        if let Some(health) = &self.health
            && !backend.starts_with("provider/")
        {
            health.observe(backend, false);
        }
        GatewayError::BadUpstream {
            worker: backend.to_string(),
            detail: format!("the answer was refused: {what}"),
        }
    }
}

/// Pooled HTTP/1.1 client for worker requests.
#[derive(Clone, Debug)]
pub struct Upstream {
    client: Client<BoundedConnector, Full<Bytes>>,
    probe: Client<HttpConnector, Empty<Bytes>>,
    first_byte_timeout: Duration,
    idle_timeout: Duration,
    /// Sent with every request to a worker (its API key, configured headers).
    headers: http::HeaderMap,
    /// Workers whose `InferencePool` has its own key or headers: these instead of `headers`.
    per_worker: Arc<RwLock<HashMap<String, http::HeaderMap>>>,
    limits: UpstreamLimits,
}

impl Upstream {
    /// A client with the given timeouts and pool size.
    pub fn new(settings: &HttpSettings) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(settings.connect_timeout()));
        connector.set_keepalive(Some(Duration::from_secs(30)));
        let bounded = BoundedConnector::new(
            connector.clone(),
            settings.upstream_max_connections_per_worker,
            settings.first_byte_timeout(),
        );
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(settings.pool_max_idle_per_host)
            .pool_idle_timeout(Duration::from_secs(60))
            .build(bounded);
        let probe = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(2)
            .build(connector);
        Upstream {
            client,
            probe,
            first_byte_timeout: settings.first_byte_timeout(),
            idle_timeout: settings.idle_timeout(),
            headers: http::HeaderMap::new(),
            per_worker: Default::default(),
            limits: settings.upstream_limits(),
        }
    }

    /// This client, counting answers past the limits against `health`.
    pub fn with_health(mut self, health: Arc<dyn Outcomes>) -> Self {
        self.limits.health = Some(health);
        self
    }

    /// How much of an answer is held ([`UpstreamLimits`]), for the relay.
    pub fn limits(&self) -> UpstreamLimits {
        self.limits.clone()
    }

    /// This client, sending `headers` with every request to a worker
    /// ([`credentials::worker_headers`]).
    pub fn with_headers(mut self, headers: http::HeaderMap) -> Self {
        self.headers = headers;
        self
    }

    /// The gateway-wide headers ([`Upstream::with_headers`]).
    pub fn headers(&self) -> &http::HeaderMap {
        &self.headers
    }

    /// Sends `headers` (worker URL -> headers) to those workers instead of the gateway-wide ones,
    /// replacing what was set before (every client cloned from this one follows).
    pub fn set_worker_headers(&self, headers: HashMap<String, http::HeaderMap>) {
        *self.per_worker.write() = headers;
    }

    /// What a request to `worker` carries: its pool's headers, else the gateway-wide ones.
    pub fn headers_for(&self, worker: &str) -> http::HeaderMap {
        self.per_worker
            .read()
            .get(worker)
            .unwrap_or(&self.headers)
            .clone()
    }

    /// Longest silence allowed between two body chunks.
    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// POSTs a JSON body to `worker` + `path` and waits for the response headers. Inside a request
    /// the worker gets its `x-request-id` and `traceparent` ([`crate::telemetry::current_headers`]).
    pub async fn post_json(
        &self,
        worker: &str,
        path: &str,
        body: Bytes,
    ) -> Result<Response<Incoming>, GatewayError> {
        self.post_json_to_rank(worker, None, path, body).await
    }

    /// [`Upstream::post_json`] to one data-parallel rank of `worker`: vLLM's API server hands a
    /// request with [`DP_RANK_HEADER`] to that rank's engine instead of balancing it itself.
    pub async fn post_json_to_rank(
        &self,
        worker: &str,
        dp_rank: Option<u32>,
        path: &str,
        body: Bytes,
    ) -> Result<Response<Incoming>, GatewayError> {
        let uri = format!("{worker}{path}");
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )
            .body(Full::new(body))
            .map_err(|e| GatewayError::BadUpstream {
                worker: worker.to_string(),
                detail: format!("building the request: {e}"),
            })?;
        request
            .headers_mut()
            .extend(crate::telemetry::current_headers());
        request.headers_mut().extend(self.headers_for(worker));
        if let Some(rank) = dp_rank {
            request
                .headers_mut()
                .insert(DP_RANK_HEADER, HeaderValue::from(rank));
        }
        match tokio::time::timeout(self.first_byte_timeout, self.client.request(request)).await {
            Err(_) => Err(GatewayError::UpstreamTimeout {
                worker: worker.to_string(),
                what: "no response headers within the first-byte timeout",
            }),
            Ok(Err(e)) if e.is_connect() => Err(GatewayError::WorkerUnreachable {
                worker: worker.to_string(),
                detail: error_chain(&e),
            }),
            Ok(Err(e)) => Err(GatewayError::BadUpstream {
                worker: worker.to_string(),
                detail: error_chain(&e),
            }),
            Ok(Ok(response)) => Ok(response),
        }
    }

    /// Reads a whole (non-streamed) response body, allowing `idle_timeout` between chunks and at
    /// most the body limit (past it: a bad upstream, counted against the worker's health).
    pub async fn read_body(&self, worker: &str, body: Incoming) -> Result<Bytes, GatewayError> {
        read_body(body, self.idle_timeout, worker, &self.limits).await
    }

    /// GETs `worker` + `path` within `timeout`, with the configured worker headers (its API key):
    /// the status and the whole body, or why there is none.
    pub async fn get(
        &self,
        worker: &str,
        path: &str,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), String> {
        let mut request = Request::builder()
            .method(Method::GET)
            .uri(format!("{worker}{path}"))
            .body(Empty::new())
            .map_err(|e| e.to_string())?;
        request.headers_mut().extend(self.headers_for(worker));
        let exchange = async {
            let response = self
                .probe
                .request(request)
                .await
                .map_err(|e| error_chain(&e))?;
            let status = response.status();
            let body = http_body_util::Limited::new(response.into_body(), self.limits.max_body)
                .collect()
                .await
                .map_err(|e| error_chain(e.as_ref()))?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| "timed out".to_string())?
    }

    /// GETs `worker` + `path` within `timeout`; the status, or why there is none.
    pub async fn probe(
        &self,
        worker: &str,
        path: &str,
        timeout: Duration,
    ) -> Result<StatusCode, String> {
        let request = Request::builder()
            .method(Method::GET)
            .uri(format!("{worker}{path}"))
            .body(Empty::new())
            .map_err(|e| e.to_string())?;
        match tokio::time::timeout(timeout, self.probe.request(request)).await {
            Err(_) => Err("timed out".to_string()),
            Ok(Err(e)) => Err(error_chain(&e)),
            Ok(Ok(response)) => {
                let status = response.status();
                // Drain so the connection goes back to the pool.
                let _ = response.into_body().collect().await;
                Ok(status)
            }
        }
    }
}

/// An [`HttpConnector`] that opens at most `limit` connections to each worker at once. A
/// connection holds its place until it closes; while a worker is at its limit, a new connection
/// waits, and the client's pool hands the waiting request the first connection that comes back.
/// The pool then finishes the abandoned connect in the background; `wait` (the first-byte timeout,
/// which ends the request itself first) bounds how long such a connect may wait for a place.
#[derive(Clone, Debug)]
pub struct BoundedConnector {
    inner: HttpConnector,
    limit: usize,
    wait: Duration,
    per_worker: Arc<parking_lot::Mutex<HashMap<String, Arc<Semaphore>>>>,
}

impl BoundedConnector {
    /// `inner`, bounded to `limit` connections per worker (`host:port`; at least one), a new one
    /// waiting at most `wait` for a place.
    pub fn new(inner: HttpConnector, limit: usize, wait: Duration) -> Self {
        BoundedConnector {
            inner,
            limit: limit.clamp(1, Semaphore::MAX_PERMITS),
            wait,
            per_worker: Arc::default(),
        }
    }

    /// The places of `dst`'s worker (made on first use; a fleet's worth of entries).
    fn places(&self, dst: &http::Uri) -> Arc<Semaphore> {
        let key = dst
            .authority()
            .map_or_else(String::new, |a| a.as_str().to_string());
        let mut per_worker = self.per_worker.lock();
        Arc::clone(
            per_worker
                .entry(key)
                .or_insert_with(|| Arc::new(Semaphore::new(self.limit))),
        )
    }
}

type ConnectFuture = Pin<
    Box<dyn Future<Output = Result<BoundedIo, Box<dyn std::error::Error + Send + Sync>>> + Send>,
>;

impl tower_service::Service<http::Uri> for BoundedConnector {
    type Response = BoundedIo;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = ConnectFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower_service::Service::<http::Uri>::poll_ready(&mut self.inner, cx).map_err(Into::into)
    }

    fn call(&mut self, dst: http::Uri) -> Self::Future {
        let places = self.places(&dst);
        let mut inner = self.inner.clone();
        let wait = self.wait;
        Box::pin(async move {
            let place = tokio::time::timeout(wait, places.acquire_owned())
                .await
                .map_err(|_| "every connection to the worker stayed busy")??;
            let io = tower_service::Service::call(&mut inner, dst).await?;
            Ok(BoundedIo { io, _place: place })
        })
    }
}

/// A worker connection holding its place under the per-worker limit until it closes.
#[derive(Debug)]
pub struct BoundedIo {
    io: TokioIo<TcpStream>,
    _place: OwnedSemaphorePermit,
}

impl Connection for BoundedIo {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

impl hyper::rt::Read for BoundedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for BoundedIo {
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

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
}

/// Reads a whole response body of `backend` (worker URL or `provider/<name>`), allowing `idle`
/// between chunks and at most `limits.max_body` bytes: past it the read stops, and the answer is a
/// bad upstream counted against the worker's health ([`UpstreamLimits::exceeded`]).
pub async fn read_body(
    body: Incoming,
    idle: Duration,
    backend: &str,
    limits: &UpstreamLimits,
) -> Result<Bytes, GatewayError> {
    let mut body = body;
    let mut out = bytes::BytesMut::new();
    loop {
        match tokio::time::timeout(idle, body.frame()).await {
            Err(_) => {
                return Err(GatewayError::UpstreamTimeout {
                    worker: backend.to_string(),
                    what: "the response body stalled past the idle timeout",
                });
            }
            Ok(None) => return Ok(out.freeze()),
            Ok(Some(Err(e))) => {
                return Err(GatewayError::BadUpstream {
                    worker: backend.to_string(),
                    detail: format!("reading the response body: {}", error_chain(&e)),
                });
            }
            Ok(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if out.len() + data.len() > limits.max_body {
                        return Err(limits.exceeded(
                            backend,
                            format_args!(
                                "a body over the {}-byte limit (--upstream-max-body-bytes)",
                                limits.max_body
                            ),
                        ));
                    }
                    out.extend_from_slice(data);
                }
            }
        }
    }
}

/// An error with its causes, e.g. "client error (Connect): tcp connect error: Connection refused".
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Limits and timeouts of the HTTP path (client side and upstream side).
#[derive(Debug, Clone, clap::Args)]
pub struct HttpSettings {
    /// Largest accepted request body in bytes; larger bodies get 413.
    #[arg(long, env = "KINFERENCE_BODY_LIMIT_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub body_limit_bytes: usize,

    /// Deadline for reading a whole request body, in milliseconds; a client that has not sent it
    /// by then gets 408 and its in-flight slot is freed.
    #[arg(
        long,
        env = "KINFERENCE_BODY_READ_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    pub body_read_timeout_ms: u64,

    /// Longest a write to a client may stay blocked (the client stopped reading), in milliseconds;
    /// then the connection is cut and the upstream request cancelled.
    #[arg(
        long,
        env = "KINFERENCE_CLIENT_WRITE_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    pub client_write_timeout_ms: u64,

    /// Timeout for opening a TCP connection to a worker, in milliseconds. A worker that does not
    /// accept within it is treated like one that refuses (marked unhealthy, request retried once).
    #[arg(long, env = "KINFERENCE_CONNECT_TIMEOUT_MS", default_value_t = 2_000)]
    pub connect_timeout_ms: u64,

    /// Timeout for the worker's response headers, in milliseconds. For a non-streaming request vLLM
    /// sends headers only when generation is complete, so this bounds the whole generation; 504 after it.
    #[arg(
        long,
        env = "KINFERENCE_FIRST_BYTE_TIMEOUT_MS",
        default_value_t = 600_000
    )]
    pub first_byte_timeout_ms: u64,

    /// Longest silence allowed between two body chunks from a worker, in milliseconds; a stream that
    /// stalls longer ends with an error event.
    #[arg(long, env = "KINFERENCE_IDLE_TIMEOUT_MS", default_value_t = 120_000)]
    pub idle_timeout_ms: u64,

    /// Largest whole (not streamed) answer read from a worker or provider, in bytes; past it the
    /// request fails with 502 and the worker's health counts a failure. Also bounds what a worker's
    /// `/v1/models` may send.
    #[arg(
        long,
        env = "KINFERENCE_UPSTREAM_MAX_BODY_BYTES",
        default_value_t = DEFAULT_MAX_BODY,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1024..)
    )]
    pub upstream_max_body_bytes: usize,

    /// Largest event of a streamed answer, in bytes; past it the stream ends with an error event
    /// and the worker's health counts a failure.
    #[arg(
        long,
        env = "KINFERENCE_UPSTREAM_MAX_EVENT_BYTES",
        default_value_t = crate::backend::sse::DEFAULT_MAX_EVENT,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1024..)
    )]
    pub upstream_max_event_bytes: usize,

    /// Longest line of a streamed answer (a `data:` line carries a whole chunk), in bytes; at most
    /// `--upstream-max-event-bytes`.
    #[arg(
        long,
        env = "KINFERENCE_UPSTREAM_MAX_LINE_BYTES",
        default_value_t = crate::backend::sse::DEFAULT_MAX_LINE,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1024..)
    )]
    pub upstream_max_line_bytes: usize,

    /// Interval between two `/health` probes of each worker, in milliseconds.
    #[arg(long, env = "KINFERENCE_HEALTH_INTERVAL_MS", default_value_t = 2_000)]
    pub health_interval_ms: u64,

    /// Timeout of one `/health` probe, in milliseconds.
    #[arg(long, env = "KINFERENCE_HEALTH_TIMEOUT_MS", default_value_t = 1_000)]
    pub health_timeout_ms: u64,

    /// Idle pooled connections kept per worker (connection reuse keeps the added latency low).
    #[arg(long, env = "KINFERENCE_POOL_MAX_IDLE_PER_HOST", default_value_t = 256)]
    pub pool_max_idle_per_host: usize,

    /// Most open connections to one worker (busy and idle); past it a request waits for one of
    /// them to come free, bounded by the first-byte timeout.
    #[arg(
        long,
        env = "KINFERENCE_UPSTREAM_MAX_CONNECTIONS_PER_WORKER",
        default_value_t = 1_024
    )]
    pub upstream_max_connections_per_worker: usize,
}

impl HttpSettings {
    /// Refuses settings that contradict each other.
    pub fn validate(&self) -> Result<(), String> {
        if self.upstream_max_line_bytes > self.upstream_max_event_bytes {
            return Err(format!(
                "--upstream-max-line-bytes ({}) is over --upstream-max-event-bytes ({}): a line is part of an event",
                self.upstream_max_line_bytes, self.upstream_max_event_bytes
            ));
        }
        Ok(())
    }

    /// How much of an answer is held ([`UpstreamLimits`]).
    pub fn upstream_limits(&self) -> UpstreamLimits {
        UpstreamLimits::new(
            self.upstream_max_body_bytes,
            SseLimits {
                max_line: self.upstream_max_line_bytes,
                max_event: self.upstream_max_event_bytes,
            },
        )
    }

    /// Connect timeout as a [`Duration`].
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    /// First-byte (response header) timeout as a [`Duration`].
    pub fn first_byte_timeout(&self) -> Duration {
        Duration::from_millis(self.first_byte_timeout_ms)
    }
    /// Idle timeout between body chunks as a [`Duration`].
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }
    /// Health probe interval as a [`Duration`].
    pub fn health_interval(&self) -> Duration {
        Duration::from_millis(self.health_interval_ms)
    }
    /// Health probe timeout as a [`Duration`].
    pub fn health_timeout(&self) -> Duration {
        Duration::from_millis(self.health_timeout_ms)
    }
    /// Request-body read deadline as a [`Duration`].
    pub fn body_read_timeout(&self) -> Duration {
        Duration::from_millis(self.body_read_timeout_ms)
    }
    /// Client write-stall deadline as a [`Duration`].
    pub fn client_write_timeout(&self) -> Duration {
        Duration::from_millis(self.client_write_timeout_ms)
    }
}

impl Default for HttpSettings {
    fn default() -> Self {
        // Same values as the clap defaults: parse an empty command line.
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            http: HttpSettings,
        }
        Only::parse_from(["kinference-gateway"]).http
    }
}

#[cfg(test)]
mod tests;
