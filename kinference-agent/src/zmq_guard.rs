//! A guarding transport between the network and the agent's ZeroMQ sockets: every byte a ZeroMQ peer
//! (a vLLM publisher, a replay ROUTER, or anyone who reaches the port) sends passes a strict ZMTP 3.x
//! inspector ([`zmtp`]) before the `zeromq` crate sees it.
//!
//! Why a guard and not a fork of the codec: the `zeromq` crate (0.7) trusts a frame's declared size and
//! reserves it, so one 9-byte header declaring 2^40 bytes aborted the agent. It has no option to bound
//! that, nor connection limits, nor a handshake deadline. Forking it means carrying a patched copy of
//! a whole protocol library; writing our own ZeroMQ would give up its subscriptions, version handling and
//! reconnects. The guard keeps the crate unchanged and puts every limit in one small, fuzzed parser of
//! our own, which never allocates in proportion to a declared size:
//!
//! - bind mode (vLLM connects to us): the guard owns the public TCP (or IPC) listener; the SUB binds a
//!   private Unix socket in a `0700` directory, and each accepted connection is relayed to it.
//! - connect mode (the KV-event PUB or the replay ROUTER is bound by vLLM): the socket connects to a
//!   private Unix socket the guard listens on; for each such connection the guard dials the worker.
//!
//! Only the untrusted direction is inspected (the peer's greeting must say ZMTP 3 and the NULL
//! mechanism; READY must be well formed; frames and messages stay within [`Limits`]); what our socket
//! sends passes untouched. A connection must finish its handshake within `handshake_timeout`; at most
//! `max_pending` may be handshaking (the oldest is dropped for a newcomer, so idle connections cannot
//! lock a publisher out) and at most `max_connections` may be established (a newcomer past it drops the
//! established connection that has been silent longest). An established connection silent for
//! `idle_timeout` is closed. What a peer makes the ZeroMQ socket hold is bounded per guarded socket:
//! the `zeromq` crate reserves a frame's declared size when its header arrives and keeps a message's
//! frames until the last one, so the declared sizes of every connection's unfinished message count
//! against `max_buffered`; a frame that would pass it drops the connection whose unfinished message is
//! the oldest (a publisher's messages finish in microseconds, a peer that stops half-way does not), or
//! this one when its own is the oldest. A violation closes that one connection, counts
//! `kinference_agent_rejected_total{listener, reason}` and logs at a rate limit; the socket keeps
//! serving its other peers (vLLM's PUB reconnects by itself, the agent's own sockets redial, and a gap
//! in the sequence is replayed).

pub mod zmtp;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use std::time::Instant;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::metrics::AgentMetrics;
pub use zmtp::{Inspector, Limits, Progress, Violation};

/// How often connect mode dials a worker that does not answer before giving up on that connection.
pub const DIAL_ATTEMPTS: u32 = 10;

/// The guard's limits, one set for every guarded socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuardConfig {
    pub limits: Limits,
    /// Established connections per guarded socket.
    pub max_connections: usize,
    /// Connections still in their handshake per guarded socket; a newcomer drops the oldest.
    pub max_pending: usize,
    /// Time a connection has to send its greeting and READY.
    pub handshake_timeout: Duration,
    /// An established connection whose peer sent nothing for this long is closed.
    pub idle_timeout: Duration,
    /// Declared bytes of unfinished messages that all connections of one guarded socket together may
    /// make its ZeroMQ socket hold.
    pub max_buffered: u64,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            max_connections: 64,
            max_pending: 16,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(300),
            max_buffered: 32 << 20,
        }
    }
}

impl GuardConfig {
    /// Refuses limits that contradict each other or turn a protection off.
    pub fn validate(&self) -> Result<(), GuardError> {
        let bad = |why: String| Err(GuardError::Config(why));
        if self.max_buffered < self.limits.max_message {
            return bad(format!(
                "the buffer budget ({} bytes) must hold the largest message allowed ({} bytes)",
                self.max_buffered, self.limits.max_message
            ));
        }
        if self.limits.max_frame == 0 || self.limits.max_message == 0 {
            return bad("frame and message limits must be at least 1 byte".into());
        }
        if self.idle_timeout.is_zero() || self.handshake_timeout.is_zero() {
            return bad("the idle and handshake timeouts must be longer than 0".into());
        }
        if self.max_connections == 0 || self.max_pending == 0 {
            return bad("at least one connection must be allowed".into());
        }
        Ok(())
    }
}

/// Why a guard could not start.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("ZeroMQ guard limits: {0}")]
    Config(String),
    #[error("unsupported ZeroMQ endpoint {0:?} (tcp://host:port or ipc://path)")]
    Endpoint(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> GuardError {
    let what = what.into();
    move |source| GuardError::Io { what, source }
}

/// A ZeroMQ endpoint the guard can listen on or dial.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Tcp { host: String, port: u16 },
    Ipc(PathBuf),
}

impl Endpoint {
    /// Parses `tcp://host:port` (`*` for every address, `[v6]` allowed) or `ipc://path`.
    pub fn parse(s: &str) -> Result<Self, GuardError> {
        let bad = || GuardError::Endpoint(s.to_string());
        if let Some(path) = s.strip_prefix("ipc://") {
            return if path.is_empty() {
                Err(bad())
            } else {
                Ok(Endpoint::Ipc(path.into()))
            };
        }
        let rest = s.strip_prefix("tcp://").ok_or_else(bad)?;
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        let port = port.parse().map_err(|_| bad())?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let host = if host == "*" { "0.0.0.0" } else { host };
        if host.is_empty() {
            return Err(bad());
        }
        Ok(Endpoint::Tcp {
            host: host.to_string(),
            port,
        })
    }
}

/// Bytes from either side of a relay.
trait Io: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Io for T {}

/// A running guard; dropping it stops its listener and closes every connection it relays.
pub struct Guard {
    internal: PathBuf,
    endpoint: String,
    _stop: DropGuard,
}

impl Guard {
    /// Bind mode: listens on `public` and relays each accepted peer to the Unix socket returned, which the
    /// caller's ZeroMQ socket must adopt (`bind_listener`).
    pub async fn bind(
        public: &str,
        listener: &'static str,
        config: GuardConfig,
        metrics: AgentMetrics,
    ) -> Result<(Self, std::os::unix::net::UnixListener), GuardError> {
        let public = Endpoint::parse(public)?;
        let internal = private_socket_path()?;
        let internal_listener = std::os::unix::net::UnixListener::bind(&internal)
            .map_err(io(format!("binding {}", internal.display())))?;
        let accept = match &public {
            Endpoint::Tcp { host, port } => Accept::Tcp(
                TcpListener::bind((host.as_str(), *port))
                    .await
                    .map_err(io(format!("binding {host}:{port}")))?,
            ),
            Endpoint::Ipc(path) => Accept::Unix(
                UnixListener::bind(path).map_err(io(format!("binding {}", path.display())))?,
            ),
        };
        let stop = CancellationToken::new();
        let shared = Arc::new(Shared::new(listener, true, config, metrics));
        let target = internal.clone();
        tokio::spawn(accept_loop(accept, stop.clone(), shared, move || {
            let target = target.clone();
            async move {
                UnixStream::connect(&target)
                    .await
                    .map(|s| Box::new(s) as Box<dyn Io>)
            }
        }));
        let guard = Self {
            endpoint: format!("ipc://{}", internal.display()),
            internal,
            _stop: stop.drop_guard(),
        };
        Ok((guard, internal_listener))
    }

    /// Connect mode: listens on a private Unix socket ([`Guard::endpoint`]) for the caller's ZeroMQ socket
    /// to connect to; each connection it makes is relayed to `remote` (dialled once a second, up to
    /// [`DIAL_ATTEMPTS`] times, so a worker that restarts is not noticed by the ZeroMQ socket).
    pub fn connect(
        remote: &str,
        listener: &'static str,
        config: GuardConfig,
        metrics: AgentMetrics,
    ) -> Result<Self, GuardError> {
        let remote = Endpoint::parse(remote)?;
        let internal = private_socket_path()?;
        let accept = Accept::Unix(
            UnixListener::bind(&internal).map_err(io(format!("binding {}", internal.display())))?,
        );
        let stop = CancellationToken::new();
        let shared = Arc::new(Shared::new(listener, false, config, metrics));
        let dial_stop = stop.clone();
        tokio::spawn(accept_loop(accept, stop.clone(), shared, move || {
            let remote = remote.clone();
            let stop = dial_stop.clone();
            async move {
                let mut attempts = 0;
                loop {
                    attempts += 1;
                    let r = match &remote {
                        Endpoint::Tcp { host, port } => {
                            TcpStream::connect((host.as_str(), *port)).await.map(|s| {
                                let _ = s.set_nodelay(true);
                                Box::new(s) as Box<dyn Io>
                            })
                        }
                        Endpoint::Ipc(path) => UnixStream::connect(path)
                            .await
                            .map(|s| Box::new(s) as Box<dyn Io>),
                    };
                    match r {
                        Ok(s) => return Ok(s),
                        // Then the ZeroMQ socket's own reconnect (with backoff) takes over.
                        Err(e) if attempts >= DIAL_ATTEMPTS => return Err(e),
                        Err(_) => tokio::select! {
                            _ = stop.cancelled() => return Err(std::io::ErrorKind::Interrupted.into()),
                            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        },
                    }
                }
            }
        }));
        Ok(Self {
            endpoint: format!("ipc://{}", internal.display()),
            internal,
            _stop: stop.drop_guard(),
        })
    }

    /// The private endpoint of the ZeroMQ socket behind this guard (`ipc://...`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.internal);
    }
}

/// A fresh path in this process's private directory (`0700`, created once, never reused).
fn private_socket_path() -> Result<PathBuf, GuardError> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = DIR
        .get_or_init(|| {
            use std::os::unix::fs::DirBuilderExt;
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let dir = std::env::temp_dir()
                .join(format!("kinference-agent-{}-{nanos:x}", std::process::id()));
            // `create`, not `create_dir_all`: a directory someone else prepared is refused.
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&dir)
                .map(|()| dir.clone())
                .map_err(|e| format!("creating {}: {e}", dir.display()))
        })
        .as_ref()
        .map_err(|e| GuardError::Io {
            what: e.clone(),
            source: std::io::ErrorKind::Other.into(),
        })?;
    Ok(dir.join(format!("z{}.sock", NEXT.fetch_add(1, Ordering::Relaxed))))
}

enum Accept {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Accept {
    async fn accept(&self) -> std::io::Result<Box<dyn Io>> {
        match self {
            Accept::Tcp(l) => l.accept().await.map(|(s, _)| {
                let _ = s.set_nodelay(true);
                Box::new(s) as Box<dyn Io>
            }),
            Accept::Unix(l) => l.accept().await.map(|(s, _)| Box::new(s) as Box<dyn Io>),
        }
    }
}

/// State shared by one guard's connections.
struct Shared {
    listener: &'static str,
    /// Bind-mode guards accept the untrusted peer; connect-mode ones dial it.
    bind_side: bool,
    config: GuardConfig,
    metrics: AgentMetrics,
    /// Connections still in their handshake, oldest first.
    pending: Mutex<VecDeque<(u64, CancellationToken)>>,
    /// Connections past their handshake.
    established: Mutex<HashMap<u64, Conn>>,
    next_id: AtomicU64,
}

/// An established connection, as the guard's limits see it.
struct Conn {
    /// Ends the connection.
    stop: CancellationToken,
    /// When its peer last sent a byte.
    last_read: Instant,
    /// Declared bytes of its unfinished message ([`Inspector::open_bytes`]).
    open: u64,
    /// When that message began.
    open_since: Instant,
}

impl Shared {
    fn new(
        listener: &'static str,
        bind_side: bool,
        config: GuardConfig,
        metrics: AgentMetrics,
    ) -> Self {
        Self {
            listener,
            bind_side,
            config,
            metrics,
            pending: Mutex::new(VecDeque::new()),
            established: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
        }
    }

    fn reject(&self, reason: &'static str, detail: &dyn std::fmt::Display) {
        self.metrics.reject(self.listener, reason, detail);
    }

    /// Registers a new connection as pending, dropping the oldest pending one when there are too many.
    fn admit(&self, stop: &CancellationToken) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let evicted = {
            let mut pending = self.pending.lock();
            let evicted =
                (pending.len() >= self.config.max_pending.max(1)).then(|| pending.pop_front());
            pending.push_back((id, stop.child_token()));
            evicted.flatten()
        };
        if let Some((_, token)) = evicted {
            token.cancel();
            self.reject(
                "handshake_evicted",
                &"too many connections in their handshake; the oldest was dropped",
            );
        }
        id
    }

    /// The token that ends connection `id` (evicted while pending, or the guard stopping).
    fn token(&self, id: u64) -> Option<CancellationToken> {
        self.pending
            .lock()
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, t)| t.clone())
    }

    fn unpend(&self, id: u64) {
        self.pending.lock().retain(|(i, _)| *i != id);
    }

    /// Connection `id` finished its handshake: it takes an established place, dropping the one
    /// silent longest when every place is taken (so that idle peers cannot lock a publisher out).
    fn establish(&self, id: u64, stop: CancellationToken) -> Established<'_> {
        let now = Instant::now();
        let evicted = {
            let mut conns = self.established.lock();
            let evicted = if conns.len() >= self.config.max_connections.max(1) {
                let idlest = conns
                    .iter()
                    .min_by_key(|(_, c)| c.last_read)
                    .map(|(i, _)| *i);
                idlest.and_then(|i| conns.remove(&i))
            } else {
                None
            };
            conns.insert(
                id,
                Conn {
                    stop,
                    last_read: now,
                    open: 0,
                    open_since: now,
                },
            );
            evicted
        };
        if let Some(conn) = evicted {
            conn.stop.cancel();
            self.reject(
                "idle_evicted",
                &format_args!(
                    "all {} established connections taken; the one silent longest was dropped",
                    self.config.max_connections
                ),
            );
        }
        Established { shared: self, id }
    }

    /// Connection `id`'s peer sent bytes after which its unfinished message declares `open` bytes
    /// (`ended`: a message ended within them, so a message still open began in them). Past the
    /// buffer budget, the connections whose unfinished messages began before this one's are
    /// dropped, oldest first, until it fits; when that is not enough, this connection is refused.
    fn hold(&self, id: u64, open: u64, ended: bool) -> Result<(), End> {
        let now = Instant::now();
        let mut evicted = Vec::new();
        let fits = {
            let mut conns = self.established.lock();
            let Some(me) = conns.get_mut(&id) else {
                // Dropped meanwhile: its end is on its way.
                return Ok(());
            };
            me.last_read = now;
            if me.open == 0 || ended {
                me.open_since = now;
            }
            if me.open == open {
                return Ok(());
            }
            me.open = open;
            let mine = me.open_since;
            let mut total: u64 = conns.values().map(|c| c.open).sum();
            while total > self.config.max_buffered {
                let oldest = conns
                    .iter()
                    .filter(|(i, c)| **i != id && c.open > 0 && c.open_since <= mine)
                    .min_by_key(|(_, c)| c.open_since)
                    .map(|(i, _)| *i);
                let Some(conn) = oldest.and_then(|i| conns.remove(&i)) else {
                    break;
                };
                total -= conn.open;
                evicted.push(conn.stop);
            }
            let fits = total <= self.config.max_buffered;
            if !fits && let Some(me) = conns.get_mut(&id) {
                me.open = 0;
            }
            fits
        };
        for stop in evicted {
            stop.cancel();
            self.reject(
                "buffer_evicted",
                &format_args!(
                    "unfinished messages over the {}-byte buffer budget; the oldest was dropped",
                    self.config.max_buffered
                ),
            );
        }
        if fits { Ok(()) } else { Err(End::BufferFull) }
    }
}

/// Holds an established place until the connection ends.
struct Established<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for Established<'_> {
    fn drop(&mut self) {
        self.shared.established.lock().remove(&self.id);
    }
}

async fn accept_loop<D, F>(accept: Accept, stop: CancellationToken, shared: Arc<Shared>, dial: D)
where
    D: Fn() -> F + Send + Sync + 'static,
    F: std::future::Future<Output = std::io::Result<Box<dyn Io>>> + Send + 'static,
{
    let dial = Arc::new(dial);
    loop {
        let conn = tokio::select! {
            _ = stop.cancelled() => return,
            c = accept.accept() => c,
        };
        let conn = match conn {
            Ok(c) => c,
            Err(error) => {
                // Out of descriptors, most likely: back off instead of spinning.
                shared.reject("accept_error", &error);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let id = shared.admit(&stop);
        let Some(token) = shared.token(id) else {
            continue;
        };
        let shared = shared.clone();
        let dial = dial.clone();
        tokio::spawn(async move {
            let gauge = shared.metrics.connections(shared.listener);
            gauge.inc();
            tokio::select! {
                _ = token.cancelled() => {}
                _ = async {
                    match dial().await {
                        Ok(other) => serve(conn, other, &shared, id, &token).await,
                        Err(error) => tracing::debug!(listener = shared.listener, %error, "guard could not reach the other side"),
                    }
                } => {}
            }
            shared.unpend(id);
            gauge.dec();
        });
    }
}

/// Relays one connection: `untrusted` is inspected, `trusted` (our own ZeroMQ socket) is not. In bind mode
/// the untrusted side is the accepted peer; in connect mode it is the worker the guard dialled.
async fn serve(
    accepted: Box<dyn Io>,
    dialled: Box<dyn Io>,
    shared: &Shared,
    id: u64,
    stop: &CancellationToken,
) {
    let (untrusted, trusted) = if shared.bind_side {
        (accepted, dialled)
    } else {
        (dialled, accepted)
    };
    if let Err(end) = relay(untrusted, trusted, shared, id, stop).await {
        match end {
            End::Violation(v) => shared.reject(v.reason(), &v),
            End::HandshakeTimeout => shared.reject(
                "handshake_timeout",
                &format_args!(
                    "no complete greeting and READY within {:?}",
                    shared.config.handshake_timeout
                ),
            ),
            End::IdleTimeout => shared.reject(
                "idle_timeout",
                &format_args!("nothing received for {:?}", shared.config.idle_timeout),
            ),
            End::BufferFull => shared.reject(
                "buffer_full",
                &format_args!(
                    "an unfinished message over the {}-byte buffer budget",
                    shared.config.max_buffered
                ),
            ),
        }
    }
}

enum End {
    Violation(Violation),
    HandshakeTimeout,
    IdleTimeout,
    BufferFull,
}

async fn relay(
    untrusted: Box<dyn Io>,
    trusted: Box<dyn Io>,
    shared: &Shared,
    id: u64,
    stop: &CancellationToken,
) -> Result<(), End> {
    let (mut ur, mut uw) = tokio::io::split(untrusted);
    let (mut tr, mut tw) = tokio::io::split(trusted);
    let outbound = async {
        let _ = tokio::io::copy(&mut tr, &mut uw).await;
    };
    let inbound = async {
        let mut inspector = Inspector::new(shared.config.limits);
        let mut place = None;
        let deadline = tokio::time::Instant::now() + shared.config.handshake_timeout;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let read = if inspector.handshake_done() {
                tokio::time::timeout(shared.config.idle_timeout, ur.read(&mut buf))
                    .await
                    .map_err(|_| End::IdleTimeout)?
            } else {
                tokio::time::timeout_at(deadline, ur.read(&mut buf))
                    .await
                    .map_err(|_| End::HandshakeTimeout)?
            };
            let n = match read {
                Ok(0) | Err(_) => return Ok(()),
                Ok(n) => n,
            };
            let progress = inspector.feed(&buf[..n]).map_err(End::Violation)?;
            if progress.handshake_done {
                shared.unpend(id);
                place = Some(shared.establish(id, stop.clone()));
            }
            if place.is_some() {
                // Checked before the bytes reach the ZeroMQ socket, which reserves a frame's size
                // as soon as its header arrives.
                shared.hold(id, inspector.open_bytes(), progress.messages > 0)?;
            }
            if tw.write_all(&buf[..n]).await.is_err() {
                return Ok(());
            }
        }
    };
    tokio::select! {
        () = outbound => Ok(()),
        r = inbound => r,
    }
}

#[cfg(test)]
mod tests;
