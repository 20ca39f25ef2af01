//! KV cache events over ZeroMQ, published exactly as vLLM's `ZmqEventPublisher` does
//! (`vllm/distributed/kv_events.py`):
//!
//! - a PUB socket that **binds** when the endpoint contains `*` or `::` or starts with `ipc://`, and
//!   **connects** otherwise (the subscriber binds, llm-d style);
//! - 3 frames per batch: `[topic, seq (8-byte big-endian, from 0), msgpack batch]`;
//! - a replay ROUTER socket (always bound) that answers `[identity, b"", start_seq]` with every
//!   buffered batch whose seq >= start_seq and then an end marker: `[topic, seq, payload]` ...
//!   `[b"", ff*8, b""]` (vLLM >= 0.26) or `[seq, payload]` ... `[ff*8, b""]` (<= 0.25).
//!
//! Batches sent before a connect-mode subscriber is reachable are lost (as with libzmq's PUB), but they
//! still take a sequence number and stay in the replay buffer.

pub mod encode;

#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

pub use encode::{EventFormat, encode_batch};

use crate::sim::cache::KvCacheEvent;

/// The replay end marker's sequence number: `(-1).to_bytes(8, "big", signed=True)`.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// Shape of replay replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ReplayFormat {
    /// `[topic, seq, payload]`, end `[b"", ff*8, b""]` (vLLM >= 0.26, the default).
    #[default]
    #[value(name = "v0.26")]
    V026,
    /// `[seq, payload]`, end `[ff*8, b""]` (vLLM 0.10 - 0.25).
    #[value(name = "v0.25")]
    V025,
}

/// Publisher settings (vLLM's `KVEventsConfig`, plus the simulator's format switches).
#[derive(Debug, Clone)]
pub struct KvEventsConfig {
    /// PUB endpoint, e.g. `tcp://127.0.0.1:25557` (connect) or `tcp://*:5557` (bind).
    pub endpoint: String,
    /// ROUTER endpoint for replay, always bound.
    pub replay_endpoint: Option<String>,
    /// First frame of every message.
    pub topic: String,
    /// Event encoding.
    pub format: EventFormat,
    /// Replay reply shape.
    pub replay_format: ReplayFormat,
    /// Batches kept for replay (`buffer_steps`).
    pub buffer_steps: usize,
    /// `data_parallel_rank` written in every batch.
    pub dp_rank: i64,
}

/// Why the publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum KvEventsError {
    /// The endpoint cannot be used by this implementation.
    #[error("unsupported ZMQ endpoint {0:?} (use tcp:// or ipc://)")]
    Unsupported(String),
    /// Binding failed (port in use, bad address ...).
    #[error("cannot bind {endpoint}: {source}")]
    Bind {
        endpoint: String,
        #[source]
        source: zeromq::ZmqError,
    },
}

impl KvEventsConfig {
    /// The publisher of data-parallel rank `rank`, as vLLM derives it: the endpoints shifted by the
    /// rank (a TCP port plus the rank, port 0 left alone; `_dp<rank>` after an `ipc://` path) and the
    /// rank written in every batch. Rank 0 keeps the endpoints as given.
    pub fn for_rank(mut self, rank: usize) -> Self {
        self.endpoint = shift_for_rank(&self.endpoint, rank);
        self.replay_endpoint = self.replay_endpoint.map(|ep| shift_for_rank(&ep, rank));
        self.dp_rank = rank as i64;
        self
    }
}

/// vLLM's endpoint for rank `rank` (`kv_events.py`, `offset_endpoint_port`).
fn shift_for_rank(endpoint: &str, rank: usize) -> String {
    if rank == 0 {
        return endpoint.to_string();
    }
    if let Some(rest) = endpoint.strip_prefix("tcp://")
        && let Some((host, port)) = rest.rsplit_once(':')
        && let Ok(port) = port.parse::<usize>()
    {
        return match port {
            0 => endpoint.to_string(),
            p => format!("tcp://{host}:{}", p + rank),
        };
    }
    format!("{endpoint}_dp{rank}")
}

/// vLLM's bind-or-connect rule.
pub fn binds(endpoint: &str) -> bool {
    endpoint.contains('*') || endpoint.contains("::") || endpoint.starts_with("ipc://")
}

/// Rewrites libzmq wildcard syntax into what the `zeromq` crate accepts: host `*` -> `0.0.0.0`,
/// port `*` -> `0` (an ephemeral port).
fn normalize(endpoint: &str) -> Result<String, KvEventsError> {
    if endpoint.starts_with("ipc://") {
        return Ok(endpoint.to_owned());
    }
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return Err(KvEventsError::Unsupported(endpoint.to_owned()));
    };
    let Some((host, port)) = rest.rsplit_once(':') else {
        return Err(KvEventsError::Unsupported(endpoint.to_owned()));
    };
    let host = if host == "*" { "0.0.0.0" } else { host };
    let port = if port == "*" { "0" } else { port };
    Ok(format!("tcp://{host}:{port}"))
}

/// A batch and its sequence number, as kept for replay.
type Buffered = (u64, Bytes);

/// Handle used by the engine to publish one batch per step.
#[derive(Debug, Clone)]
pub struct KvPublisher {
    tx: mpsc::UnboundedSender<(f64, Vec<KvCacheEvent>)>,
    /// The endpoints actually bound (PUB if it binds, then ROUTER), for logs and tests.
    pub bound: Vec<String>,
}

impl KvPublisher {
    /// Opens the sockets (bind errors surface here) and spawns the publisher and replay tasks; they
    /// stop when `shutdown` is cancelled.
    pub async fn start(
        cfg: KvEventsConfig,
        shutdown: CancellationToken,
    ) -> Result<Self, KvEventsError> {
        let buffer: Arc<Mutex<VecDeque<Buffered>>> = Arc::new(Mutex::new(VecDeque::new()));
        let mut bound = Vec::new();
        let endpoint = normalize(&cfg.endpoint)?;
        let (sock_tx, sock_rx) = oneshot::channel::<zeromq::PubSocket>();
        if binds(&cfg.endpoint) {
            let mut socket = zeromq::PubSocket::new();
            let ep = socket
                .bind(&endpoint)
                .await
                .map_err(|source| KvEventsError::Bind {
                    endpoint: endpoint.clone(),
                    source,
                })?;
            bound.push(ep.to_string());
            let _ = sock_tx.send(socket);
        } else {
            // Like libzmq, connect in the background and keep retrying until the subscriber binds.
            let token = shutdown.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = token.cancelled() => {}
                    socket = connect_until_bound(&endpoint) => {
                        tracing::info!(%endpoint, "kv events: connected");
                        let _ = sock_tx.send(socket);
                    }
                }
            });
        }

        if let Some(replay) = &cfg.replay_endpoint {
            let replay = normalize(replay)?;
            let mut router = zeromq::RouterSocket::new();
            let ep = router
                .bind(&replay)
                .await
                .map_err(|source| KvEventsError::Bind {
                    endpoint: replay.clone(),
                    source,
                })?;
            bound.push(ep.to_string());
            tokio::spawn(serve_replay(
                router,
                buffer.clone(),
                cfg.topic.clone(),
                cfg.replay_format,
                shutdown.clone(),
            ));
        }

        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run_publisher(cfg, rx, sock_rx, buffer, shutdown));
        Ok(Self { tx, bound })
    }

    /// Queues one batch (one engine step's events) stamped with the current time.
    pub fn publish(&self, events: Vec<KvCacheEvent>) {
        if events.is_empty() {
            return;
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_secs_f64();
        // The publisher task only ends at shutdown, when losing events no longer matters.
        let _ = self.tx.send((ts, events));
    }
}

/// How often a connect-mode publisher dials a subscriber that is not bound yet: libzmq's default
/// `ZMQ_RECONNECT_IVL` (100 ms, with no backoff since `ZMQ_RECONNECT_IVL_MAX` is 0), which vLLM's
/// publisher keeps. The `zeromq` crate's own retry doubles its wait up to 30 s, so a worker started well
/// before its agent would reach the agent only seconds after it binds.
const RECONNECT_INTERVAL: Duration = Duration::from_millis(100);

/// How long one connect call may take, handshake included, before it is given up and made again. Inside
/// it the crate dials at 0, 50 and 150 ms, so no two dials are more than 200 ms apart.
const DIAL_TIMEOUT: Duration = Duration::from_millis(250);

/// Connects a PUB socket to `endpoint`, dialling again until the peer answers.
async fn connect_until_bound(endpoint: &str) -> zeromq::PubSocket {
    loop {
        let mut opts = SocketOptions::default();
        opts.connect_timeout(DIAL_TIMEOUT);
        let mut socket = zeromq::PubSocket::with_options(opts);
        match socket.connect(endpoint).await {
            Ok(()) => return socket,
            Err(e) => {
                tracing::debug!(%endpoint, error = %e, "kv events: subscriber not reachable yet")
            }
        }
        tokio::time::sleep(RECONNECT_INTERVAL).await;
    }
}

async fn run_publisher(
    cfg: KvEventsConfig,
    mut rx: mpsc::UnboundedReceiver<(f64, Vec<KvCacheEvent>)>,
    mut sock_rx: oneshot::Receiver<zeromq::PubSocket>,
    buffer: Arc<Mutex<VecDeque<Buffered>>>,
    shutdown: CancellationToken,
) {
    let topic = Bytes::from(cfg.topic.clone().into_bytes());
    let mut socket: Option<zeromq::PubSocket> = None;
    let mut seq: u64 = 0;
    // A completed oneshot must not be polled again.
    let mut waiting_socket = true;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            s = &mut sock_rx, if waiting_socket => {
                waiting_socket = false;
                socket = s.ok();
            }
            msg = rx.recv() => {
                let Some((ts, events)) = msg else { break };
                let payload = Bytes::from(encode_batch(ts, &events, cfg.dp_rank, cfg.format));
                {
                    let mut buf = buffer.lock();
                    if buf.len() >= cfg.buffer_steps.max(1) {
                        buf.pop_front();
                    }
                    buf.push_back((seq, payload.clone()));
                }
                if let Some(sock) = socket.as_mut() {
                    let frames = vec![topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload];
                    if let Ok(m) = ZmqMessage::try_from(frames)
                        && let Err(e) = sock.send(m).await
                    {
                        tracing::warn!(error = %e, seq, "kv events: send failed");
                    }
                }
                tracing::debug!(seq, n = events.len(), "kv events: batch");
                seq += 1;
            }
        }
    }
}

async fn serve_replay(
    mut router: zeromq::RouterSocket,
    buffer: Arc<Mutex<VecDeque<Buffered>>>,
    topic: String,
    format: ReplayFormat,
    shutdown: CancellationToken,
) {
    let topic = Bytes::from(topic.into_bytes());
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = router.recv() => m,
        };
        let frames = match msg {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::warn!(error = %e, "kv replay: receive failed");
                continue;
            }
        };
        // vLLM expects exactly [identity, b"", start_seq(8 bytes)] and ignores anything else.
        let [identity, empty, start] = frames.as_slice() else {
            tracing::warn!(
                frames = frames.len(),
                "kv replay: malformed request ignored"
            );
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            tracing::warn!("kv replay: start_seq is not 8 bytes");
            continue;
        };
        let start = u64::from_be_bytes(start);
        let replies: Vec<Buffered> = buffer
            .lock()
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        tracing::debug!(start, n = replies.len(), "kv replay");
        let end: Vec<Bytes> = match format {
            ReplayFormat::V026 => vec![Bytes::new(), Bytes::from_static(&END_SEQ), Bytes::new()],
            ReplayFormat::V025 => vec![Bytes::from_static(&END_SEQ), Bytes::new()],
        };
        let bodies = replies
            .into_iter()
            .map(|(s, payload)| {
                let seq = Bytes::copy_from_slice(&s.to_be_bytes());
                match format {
                    ReplayFormat::V026 => vec![topic.clone(), seq, payload],
                    ReplayFormat::V025 => vec![seq, payload],
                }
            })
            .chain(std::iter::once(end));
        for body in bodies {
            let mut frames = vec![identity.clone(), empty.clone()];
            frames.extend(body);
            let Ok(m) = ZmqMessage::try_from(frames) else {
                continue;
            };
            if let Err(e) = router.send(m).await {
                tracing::warn!(error = %e, "kv replay: send failed");
                break;
            }
        }
    }
}
