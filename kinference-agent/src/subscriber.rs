//! Follows one worker's KV event stream (ZMQ SUB) and keeps its block-key state exact.
//!
//! Messages are `[topic, seq (8 bytes BE), payload]`. The sequence is tracked per worker: on start and on
//! every gap the missing batches are fetched from the worker's replay socket (a ROUTER; we use a DEALER
//! and send `[b"", start_seq]`), accepting both reply shapes (`[seq, payload]` up to vLLM 0.25,
//! `[topic, seq, payload]` from 0.26, each ending with an `ff x 8` sequence). Batches already applied
//! are skipped. A sequence that goes back means the engine restarted: its state is cleared (unless the
//! worker's metrics showed that restart first, [`crate::scrape`]: then it is counted once).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use std::sync::atomic::AtomicU64;
use tokio_util::sync::CancellationToken;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::config::WorkerSpec;
use crate::kv_events::decode_batch;
use crate::metrics::{self, AgentMetrics};
use crate::registry::{Registry, WorkerSlot};
use crate::zmq_guard::{Guard, GuardConfig, GuardError};

/// vLLM's end-of-replay sequence: -1 as 8 big-endian bytes.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// How long to wait for each replay reply; vLLM serves replays between engine steps, at least every 100 ms.
const REPLAY_REPLY_TIMEOUT: Duration = Duration::from_secs(5);
const REPLAY_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a subscription or a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    #[error("zmq: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error("guard: {0}")]
    Guard(#[from] GuardError),
    #[error("replay timed out")]
    ReplayTimeout,
    #[error("malformed replay reply ({0} frames)")]
    BadReply(usize),
    #[error("malformed live message ({0} frames; want topic, 8-byte sequence, payload)")]
    BadLive(usize),
}

/// What to do with a message, given the sequence numbers applied so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The next expected batch.
    Apply,
    /// Already applied (overlap between a replay and the live stream).
    Duplicate,
    /// Batches `from..seq` were missed.
    Gap { from: u64 },
    /// The sequence went back: the engine restarted.
    Restart,
}

/// Sequence bookkeeping for one worker's stream.
#[derive(Clone, Copy, Debug, Default)]
pub struct SeqTracker {
    /// The last sequence number applied.
    pub last: Option<u64>,
    /// After a replay from this sequence, live messages in `floor..=last` are duplicates, not a restart.
    dup_floor: Option<u64>,
}

impl SeqTracker {
    /// Classifies a live message's sequence number.
    pub fn classify(&self, seq: u64) -> Verdict {
        let expected = self.last.map_or(0, |l| l.saturating_add(1));
        if seq == expected {
            Verdict::Apply
        } else if seq > expected {
            Verdict::Gap { from: expected }
        } else if self.dup_floor.is_some_and(|floor| seq >= floor) {
            Verdict::Duplicate
        } else {
            Verdict::Restart
        }
    }

    /// A live message already applied by a replay: once live reaches the replay's end, later live
    /// messages must be newer, so going back again would be a restart.
    pub fn caught_up(&mut self, seq: u64) {
        if self.last == Some(seq) {
            self.dup_floor = None;
        }
    }

    /// Records that `seq` was applied from the live stream.
    pub fn applied_live(&mut self, seq: u64) {
        self.last = Some(seq);
        self.dup_floor = None;
    }
}

/// One reply from a replay socket.
#[derive(Debug, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    Batch { seq: u64, payload: &'a Bytes },
    End,
}

/// Parses a replay reply as a DEALER receives it, in either vLLM shape, with or without the delimiter.
pub fn parse_replay_reply(frames: &[Bytes]) -> Result<ReplayReply<'_>, SubscribeError> {
    let body = match frames {
        [delim, rest @ ..] if delim.is_empty() && frames.len() >= 3 => rest,
        _ => frames,
    };
    let (seq, payload) = match body {
        [seq, payload] => (seq, payload),
        [_topic, seq, payload] => (seq, payload),
        _ => return Err(SubscribeError::BadReply(frames.len())),
    };
    let seq: [u8; 8] = seq
        .as_ref()
        .try_into()
        .map_err(|_| SubscribeError::BadReply(frames.len()))?;
    if seq == END_SEQ {
        return Ok(ReplayReply::End);
    }
    Ok(ReplayReply::Batch {
        seq: u64::from_be_bytes(seq),
        payload,
    })
}

/// One live message from a worker's PUB socket.
#[derive(Debug, PartialEq, Eq)]
pub struct LiveMessage<'a> {
    pub topic: &'a [u8],
    pub seq: u64,
    pub payload: &'a [u8],
}

/// Parses a live message: exactly `[topic, seq (8 bytes BE), payload]`.
pub fn parse_live_message(frames: &[Bytes]) -> Result<LiveMessage<'_>, SubscribeError> {
    let [topic, seq, payload] = frames else {
        return Err(SubscribeError::BadLive(frames.len()));
    };
    let seq = <[u8; 8]>::try_from(seq.as_ref()).map_err(|_| SubscribeError::BadLive(3))?;
    Ok(LiveMessage {
        topic,
        seq: u64::from_be_bytes(seq),
        payload,
    })
}

/// Handles to one worker's metrics (resolved once: the hot path never touches the label map).
struct WorkerMetrics {
    blocks: Gauge,
    state_bytes: Gauge,
    block_events: Counter,
    batches: Counter,
    gaps: Counter,
    replays: Counter,
    replay_failures: Counter,
    restarts: Counter,
    decode_errors: Counter,
    unresolved_parents: Counter,
    unknown_removals: Counter,
    dropped_over_cap: Counter,
    lag: Gauge<f64, AtomicU64>,
}

impl WorkerMetrics {
    fn new(m: &AgentMetrics, url: &str) -> Self {
        let l = metrics::worker(url);
        Self {
            blocks: m.kv_blocks.get_or_create(&l).clone(),
            state_bytes: m.kv_state_bytes.get_or_create(&l).clone(),
            block_events: m.kv_block_events.get_or_create(&l).clone(),
            batches: m.kv_batches.get_or_create(&l).clone(),
            gaps: m.kv_seq_gaps.get_or_create(&l).clone(),
            replays: m.kv_replays.get_or_create(&l).clone(),
            replay_failures: m.kv_replay_failures.get_or_create(&l).clone(),
            restarts: m.kv_engine_restarts.get_or_create(&l).clone(),
            decode_errors: m.kv_decode_errors.get_or_create(&l).clone(),
            unresolved_parents: m.kv_unresolved_parents.get_or_create(&l).clone(),
            unknown_removals: m.kv_unknown_removals.get_or_create(&l).clone(),
            dropped_over_cap: m.kv_dropped_over_cap.get_or_create(&l).clone(),
            lag: m.kv_event_lag_seconds.get_or_create(&l).clone(),
        }
    }
}

/// The ingestion side of one worker's publisher (one per data-parallel rank): decodes batches and
/// applies them to its slot.
struct Ingest {
    slot: Arc<WorkerSlot>,
    /// The rank whose publisher this follows (0 for a rank-less worker).
    rank: usize,
    registry: Arc<Registry>,
    m: WorkerMetrics,
    cap_warned: bool,
}

impl Ingest {
    fn url(&self) -> &str {
        &self.slot.spec.url
    }

    fn apply_payload(&mut self, seq: u64, payload: &[u8]) {
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(error) => {
                self.m.decode_errors.inc();
                tracing::warn!(worker = %self.url(), seq, %error, "undecodable KV event batch skipped");
                return;
            }
        };
        // vLLM's publisher stamps its own rank in every batch: a ranked worker's blocks go to the cache
        // of that rank (the socket's rank when the batch names none, or one the worker does not have).
        let rank = batch
            .data_parallel_rank
            .and_then(|r| usize::try_from(r).ok())
            .filter(|r| self.slot.spec.ranked() && *r < self.slot.ranks().len())
            .unwrap_or(self.rank);
        let stats = {
            let mut kv = self.slot.ranks()[rank].lock();
            let stats = kv.apply_all(&batch.events);
            self.m.state_bytes.set(kv.approx_bytes() as i64);
            stats
        };
        self.m.blocks.set(self.slot.blocks() as i64);
        self.m.batches.inc();
        self.m.block_events.inc_by(stats.block_events);
        if stats.unresolved_parents > 0 {
            self.m.unresolved_parents.inc_by(stats.unresolved_parents);
            tracing::debug!(worker = %self.url(), seq, blocks = stats.unresolved_parents, "stored blocks with an unknown parent skipped");
        }
        if stats.unknown_removals > 0 {
            self.m.unknown_removals.inc_by(stats.unknown_removals);
        }
        if stats.dropped_over_cap > 0 {
            self.m.dropped_over_cap.inc_by(stats.dropped_over_cap);
            if !self.cap_warned {
                self.cap_warned = true;
                tracing::warn!(worker = %self.url(), "worker reports more blocks than --max-blocks-per-worker; new blocks dropped");
            }
        }
        if batch.ts > 0.0 {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            self.m.lag.set((now - batch.ts).max(0.0));
            self.slot.load.lock().last_event_ts = Some(batch.ts);
        }
        self.registry.notify();
    }

    fn clear(&mut self) {
        self.slot.ranks()[self.rank].lock().clear();
        self.m.blocks.set(self.slot.blocks() as i64);
        self.registry.notify();
    }

    /// Fetches batches `from..` from the replay socket and applies those not yet applied.
    async fn replay(
        &mut self,
        endpoint: &str,
        from: u64,
        tracker: &mut SeqTracker,
    ) -> Result<usize, SubscribeError> {
        self.m.replays.inc();
        let mut opts = SocketOptions::default();
        opts.connect_timeout(REPLAY_CONNECT_TIMEOUT);
        let mut dealer = DealerSocket::with_options(opts);
        let result = async {
            tokio::time::timeout(REPLAY_CONNECT_TIMEOUT * 2, dealer.connect(endpoint))
                .await
                .map_err(|_| SubscribeError::ReplayTimeout)??;
            let request = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())])
                .map_err(|_| SubscribeError::BadReply(0))?;
            dealer.send(request).await?;
            let mut applied = 0;
            loop {
                let msg = tokio::time::timeout(REPLAY_REPLY_TIMEOUT, dealer.recv())
                    .await
                    .map_err(|_| SubscribeError::ReplayTimeout)??;
                let frames = msg.into_vec();
                match parse_replay_reply(&frames)? {
                    ReplayReply::End => break,
                    ReplayReply::Batch { seq, payload } => {
                        if tracker.last.is_some_and(|l| seq <= l) {
                            continue;
                        }
                        let expected = tracker.last.map_or(0, |l| l + 1);
                        if seq > expected && tracker.last.is_some() {
                            tracing::warn!(worker = %self.url(), expected, first = seq, "replay buffer no longer holds every missed batch");
                        }
                        self.apply_payload(seq, payload);
                        tracker.last = Some(seq);
                        applied += 1;
                    }
                }
            }
            Ok(applied)
        }
        .await;
        dealer.close().await;
        match &result {
            Ok(n) => {
                tracker.dup_floor = Some(from);
                tracing::info!(worker = %self.url(), from, applied = n, "replay done");
            }
            Err(error) => {
                self.m.replay_failures.inc();
                tracing::warn!(worker = %self.url(), from, %error, "replay failed");
            }
        }
        result
    }

    /// Handles one live message.
    async fn on_live(
        &mut self,
        seq: u64,
        payload: &[u8],
        replay: Option<&str>,
        tracker: &mut SeqTracker,
    ) {
        match tracker.classify(seq) {
            Verdict::Apply => {}
            Verdict::Duplicate => {
                tracker.caught_up(seq);
                return;
            }
            Verdict::Gap { from } => {
                if tracker.last.is_some() {
                    self.m.gaps.inc();
                    tracing::warn!(worker = %self.url(), expected = from, got = seq, "KV event sequence gap");
                }
                if let Some(ep) = replay {
                    let _ = self.replay(ep, from, tracker).await;
                }
            }
            Verdict::Restart => {
                // The worker's metrics may have shown this restart first (its process start time):
                // counted and cleared then, and nothing of the new engine applied since.
                if self.slot.ranks()[self.rank].lock().take_restart_note() {
                    tracing::debug!(worker = %self.url(), got = seq, "KV event sequence went back: the restart seen in the worker's metrics");
                } else {
                    self.m.restarts.inc();
                    tracing::warn!(worker = %self.url(), last = ?tracker.last, got = seq, "KV event sequence went back: engine restarted, state cleared");
                }
                self.clear();
                *tracker = SeqTracker::default();
                if let (Some(ep), true) = (replay, seq > 0) {
                    let _ = self.replay(ep, 0, tracker).await;
                }
            }
        }
        // After any replay the message is either now a duplicate, or still the newest: apply it (a gap
        // the replay could not fill is accepted; the blocks it held are lost until they are stored again).
        if tracker.last.is_none_or(|l| seq > l) {
            self.apply_payload(seq, payload);
            tracker.applied_live(seq);
        } else {
            tracker.caught_up(seq);
        }
    }
}

/// Follows one worker until cancelled: one publisher, or one per data-parallel rank on the endpoints
/// shifted by the rank ([`WorkerSpec::rank_endpoint`]). Without a `kv_events_endpoint` there is nothing
/// to follow. Every ZeroMQ socket sits behind a [`Guard`] with the limits of `guard`.
pub async fn run(
    slot: Arc<WorkerSlot>,
    registry: Arc<Registry>,
    metrics: AgentMetrics,
    guard: GuardConfig,
    cancel: CancellationToken,
) {
    if slot.spec.kv_events_endpoint.is_none() {
        tracing::info!(worker = %slot.spec.url, "no kv_events_endpoint: only load is tracked for this worker");
        return;
    }
    let ranks = (0..slot.ranks().len()).map(|rank| {
        follow_rank(
            slot.clone(),
            rank,
            registry.clone(),
            metrics.clone(),
            guard,
            cancel.clone(),
        )
    });
    futures::future::join_all(ranks).await;
}

/// Follows the publisher of one rank (the only one of a rank-less worker) until cancelled.
async fn follow_rank(
    slot: Arc<WorkerSlot>,
    rank: usize,
    registry: Arc<Registry>,
    metrics: AgentMetrics,
    guard: GuardConfig,
    cancel: CancellationToken,
) {
    let Some(endpoint) = slot.spec.kv_events_endpoint.as_deref() else {
        return;
    };
    let endpoint = WorkerSpec::rank_endpoint(endpoint, rank);
    let m = WorkerMetrics::new(&metrics, &slot.spec.url);
    let mut ingest = Ingest {
        slot,
        rank,
        registry,
        m,
        cap_warned: false,
    };
    let mut tracker = SeqTracker::default();
    loop {
        match session(
            &mut ingest,
            &endpoint,
            &mut tracker,
            &metrics,
            guard,
            &cancel,
        )
        .await
        {
            Ok(()) => return,
            Err(error) => {
                tracing::warn!(worker = %ingest.url(), endpoint, %error, "KV event subscription failed; retrying")
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

async fn session(
    ingest: &mut Ingest,
    endpoint: &str,
    tracker: &mut SeqTracker,
    metrics: &AgentMetrics,
    guard: GuardConfig,
    cancel: &CancellationToken,
) -> Result<(), SubscribeError> {
    let spec = ingest.slot.spec.clone();
    let mut opts = SocketOptions::default();
    opts.no_connect_timeout();
    let mut sub = SubSocket::with_options(opts);
    // The guards live as long as this session: dropping them closes every relayed connection.
    let _events_guard = if spec.kv_events_bind {
        let (g, private) = Guard::bind(endpoint, "kv_events", guard, metrics.clone()).await?;
        sub.bind_listener(private).await?;
        g
    } else {
        let g = Guard::connect(endpoint, "kv_events", guard, metrics.clone())?;
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            r = sub.connect(g.endpoint()) => r?,
        }
        g
    };
    let replay_guard = spec
        .kv_replay_endpoint
        .as_deref()
        .map(|ep| WorkerSpec::rank_endpoint(ep, ingest.rank))
        .map(|ep| Guard::connect(&ep, "replay", guard, metrics.clone()))
        .transpose()?;
    // vLLM topics are exact names; a ZMQ prefix subscription would also match longer topics.
    sub.subscribe("").await?;
    tracing::info!(worker = %spec.url, endpoint, rank = ingest.rank, bind = spec.kv_events_bind, "following KV events");
    let replay = replay_guard.as_ref().map(Guard::endpoint);
    if let Some(ep) = replay {
        // Learn what the worker already holds (agent start, or resubscription after an error).
        let from = tracker.last.map_or(0, |l| l + 1);
        let _ = ingest.replay(ep, from, tracker).await;
    }
    let mut errors = 0u32;
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => {
                sub.close().await;
                return Ok(());
            }
            m = sub.recv() => m,
        };
        let msg = match msg {
            Ok(m) => m,
            Err(error) => {
                // A publisher going away (engine restart) surfaces here; the socket itself stays usable.
                errors += 1;
                tracing::debug!(worker = %spec.url, %error, "KV event receive error");
                if errors > 100 {
                    return Err(error.into());
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        errors = 0;
        let frames = msg.into_vec();
        let live = match parse_live_message(&frames) {
            Ok(live) => live,
            Err(error) => {
                ingest.m.decode_errors.inc();
                tracing::warn!(worker = %spec.url, %error, "KV event message skipped");
                continue;
            }
        };
        if spec
            .kv_topic
            .as_deref()
            .is_some_and(|t| t.as_bytes() != live.topic)
        {
            continue;
        }
        ingest
            .on_live(live.seq, live.payload, replay, tracker)
            .await;
    }
}

#[cfg(test)]
mod tests;
