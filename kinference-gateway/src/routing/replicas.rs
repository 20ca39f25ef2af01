//! Gateway replicas that tell each other what they send.
//!
//! Behind a Service, each replica sees only its own requests in its in-flight ledger. The agents'
//! kernel and engine views count every replica's requests, but they run tens to hundreds of
//! milliseconds behind, and the KV events of a prefix come only once its prefill is done: two replicas
//! that each believe a worker idle both send to it, and a burst of a new prefix spread over replicas
//! scatters it over the workers. So each replica sends the others a [`Note`] per dispatch (the
//! worker, the prompt's leading block keys, its uncached tokens and estimated TTFT), per first token
//! and per end, and keeps the others' dispatches as tickets of their own ([`super::InFlight`], with no
//! rate learning): they enter the worker's ledger, its backlog, its in-flight prompts and the
//! speculative credit exactly as the replica's own requests do, so the estimate counts them as
//! "ours" and the agents' views, minus the whole ledger, show only the clients no replica knows.
//! A stored `/v1/responses` answer is told too ([`Note::Answer`]): its follow-ups must reach the
//! worker holding it whichever replica they reach ([`super::sessions`]).
//!
//! Transport: replica to replica, a JSON [`Batch`] posted to each peer's admin port
//! (`POST /internal/replicas`) whenever notes are queued, and an empty one every
//! [`ReplicasConfig::heartbeat_ms`]; no broker. A replica lost mid-run stops sending: each peer drops
//! its tickets once it has been silent for [`ReplicasConfig::forget_after_ms`] (checked on every batch
//! and every heartbeat period), so its in-flight work is forgotten within that bound plus one period.
//! A ticket whose end never came (a lost batch) goes after [`MAX_TICKET_AGE`].

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kinference_api::BlockKey;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use super::metrics::ReplicaDropLabels;
use super::sessions::{Owner, SessionKey};
use super::{InFlight, Shared};

#[cfg(test)]
mod tests;

/// The admin path a replica posts its batches to.
pub const PATH: &str = "/internal/replicas";

/// Leading block keys sent per dispatch: enough for a 16k-token prompt at 16 tokens per block (the
/// cached run a peer can credit is at most this long).
pub const MAX_KEYS: usize = 1024;

/// The longest answer id taken from a peer (as long as the pipeline reads from a worker's answer).
const MAX_ANSWER_ID_BYTES: usize = 256;

/// A peer's ticket older than this is dropped even if its end never came.
pub const MAX_TICKET_AGE: Duration = Duration::from_secs(600);

/// Most tickets kept per peer (a peer that never sends ends cannot grow the ledger without bound).
const MAX_TICKETS_PER_PEER: usize = 65_536;

/// Notes queued for the peers at most; past this (the peers slower than the dispatches) a note is
/// dropped and counted (`kinference_routing_replica_notes_dropped_total{reason="outbox_full"}`):
/// the peers then see less of this replica's load, which the agents' views still show.
const OUTBOX_CAPACITY: usize = 16_384;

/// The largest batch a replica's admin port takes.
pub const MAX_BATCH_BYTES: usize = 16 << 20;

/// Notes per posted batch at most: a dispatch note carries up to [`MAX_KEYS`] keys (about 20 KB of
/// JSON), so a batch stays well under [`MAX_BATCH_BYTES`].
const MAX_NOTES_PER_BATCH: usize = 256;

/// `replicas:` of `gateway.yaml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicasConfig {
    /// The other replicas' admin base URLs (`http://host:admin-port`); batches go there with this
    /// gateway's admin key (`--admin-key`, one for all replicas), which their admin port requires.
    #[serde(default)]
    pub peers: Vec<String>,
    /// An empty batch goes to each peer when nothing was sent for this long, milliseconds.
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// A peer silent this long is taken as gone and its in-flight requests are forgotten,
    /// milliseconds.
    #[serde(default = "default_forget_after_ms")]
    pub forget_after_ms: u64,
}

fn default_heartbeat_ms() -> u64 {
    200
}

fn default_forget_after_ms() -> u64 {
    1000
}

impl Default for ReplicasConfig {
    fn default() -> Self {
        Self {
            peers: Vec::new(),
            heartbeat_ms: default_heartbeat_ms(),
            forget_after_ms: default_forget_after_ms(),
        }
    }
}

/// One thing a replica tells the others.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Note {
    /// A request was sent to `worker`.
    Dispatch {
        /// The sender's number for the request.
        id: u64,
        /// The worker's base URL.
        worker: String,
        /// The worker's data-parallel rank (none: a rank-less worker).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        dp_rank: Option<u32>,
        /// The prompt's leading block keys at the worker's block size (at most [`MAX_KEYS`]).
        keys: Vec<BlockKey>,
        /// Prompt tokens the worker must compute (not cached there, as the sender estimated).
        uncached_tokens: f64,
        /// The sender's estimated time to first token, seconds.
        est_ttft_s: f64,
    },
    /// Request `id` got its first token.
    FirstToken {
        /// The sender's number for the request.
        id: u64,
    },
    /// Request `id` ended (or failed).
    End {
        /// The sender's number for the request.
        id: u64,
    },
    /// `worker` made and stored the answer `id` of `owner` ([`super::sessions`]): a request
    /// continuing it must go there, whichever replica it reaches.
    Answer {
        /// The answer's id (`resp_...`).
        id: String,
        /// Whose it is ([`super::sessions::Owner::to_wire`]).
        owner: u64,
        /// The worker's base URL.
        worker: String,
        /// The worker's data-parallel rank (none: a rank-less worker).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        dp_rank: Option<u32>,
    },
}

/// What one replica posts to another.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Batch {
    /// The sender's instance (differs after a restart, so a restarted replica's numbers start over).
    pub from: String,
    /// Notes in the order they happened (may be empty: a heartbeat).
    pub notes: Vec<Note>,
}

/// This replica's side: numbers its dispatches and queues their notes for the sender task.
#[derive(Debug)]
pub struct Outbox {
    tx: mpsc::Sender<Note>,
    next_id: AtomicU64,
    dropped: Family<ReplicaDropLabels, Counter>,
    /// This instance's name in its batches.
    from: String,
}

impl Outbox {
    /// Whether `batch` is this replica's own (sent to itself through a discovered peer list).
    pub fn is_mine(&self, batch: &Batch) -> bool {
        batch.from == self.from
    }

    /// A new request number.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Queues `note` for every peer; a full outbox drops it, counted. Never waits: this runs on
    /// the request path.
    pub fn send(&self, note: Note) {
        match self.tx.try_send(note) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => drop_notes(&self.dropped, "outbox_full", 1),
            // Closed only when the sender task ended with the router.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }
}

impl super::ticket::Announce for Outbox {
    fn first_token(&self, id: u64) {
        self.send(Note::FirstToken { id });
    }

    fn ended(&self, id: u64) {
        self.send(Note::End { id });
    }
}

/// The other replicas' tickets, by sender instance.
#[derive(Debug, Default)]
pub struct PeerLedger {
    peers: Mutex<HashMap<String, Peer>>,
}

#[derive(Debug)]
struct Peer {
    last_heard: Instant,
    tickets: HashMap<u64, PeerTicket>,
}

#[derive(Debug)]
struct PeerTicket {
    ticket: InFlight,
    since: Instant,
}

impl PeerLedger {
    /// Peers heard from and not forgotten.
    pub fn peers(&self) -> usize {
        self.peers.lock().len()
    }

    /// Requests of other replicas held as in flight.
    pub fn tickets(&self) -> usize {
        self.peers.lock().values().map(|p| p.tickets.len()).sum()
    }
}

/// Applies a peer's batch received at `now`: its dispatches become tickets on their workers, its first
/// tokens and ends update or release them; then forgets peers silent past `forget_after`.
pub(super) fn apply(shared: &Arc<Shared>, batch: Batch, now: Instant, forget_after: Duration) {
    let mut peers = shared.peer_ledger.peers.lock();
    let peer = peers.entry(batch.from).or_insert_with(|| Peer {
        last_heard: now,
        tickets: HashMap::new(),
    });
    peer.last_heard = now;
    for note in batch.notes {
        match note {
            Note::Dispatch {
                id,
                worker,
                dp_rank,
                keys,
                uncached_tokens,
                est_ttft_s,
            } => {
                if peer.tickets.len() >= MAX_TICKETS_PER_PEER {
                    continue;
                }
                let Some(worker) = shared.workers.read().get_cache(&worker, dp_rank).cloned()
                else {
                    continue;
                };
                let ticket = mirror(shared, worker, keys, uncached_tokens, est_ttft_s, now);
                peer.tickets.insert(id, PeerTicket { ticket, since: now });
            }
            Note::FirstToken { id } => {
                if let Some(t) = peer.tickets.get_mut(&id) {
                    t.ticket.first_token();
                }
            }
            Note::End { id } => {
                if let Some(t) = peer.tickets.remove(&id) {
                    t.ticket.finish(true, 0, None);
                }
            }
            Note::Answer {
                id,
                owner,
                worker,
                dp_rank,
            } => {
                let Some(worker) = shared.workers.read().get_cache(&worker, dp_rank).cloned()
                else {
                    continue;
                };
                // A longer id is no answer a worker made (the pipeline reads none longer).
                let key = SessionKey::answer(&id).filter(|_| id.len() <= MAX_ANSWER_ID_BYTES);
                if let Some(key) = key {
                    let mut sessions = shared.sessions.lock();
                    sessions.record_answer(key, Owner::from_wire(owner), worker.id, now);
                    shared.metrics.sessions.set(sessions.len() as i64);
                }
            }
        }
    }
    forget_silent(&mut peers, now, forget_after);
    update_metrics(shared, &peers);
}

/// Forgets the peers silent since `now - forget_after` (their tickets are released) and tickets older
/// than [`MAX_TICKET_AGE`].
pub(super) fn sweep(shared: &Shared, now: Instant, forget_after: Duration) {
    let mut peers = shared.peer_ledger.peers.lock();
    forget_silent(&mut peers, now, forget_after);
    update_metrics(shared, &peers);
}

fn forget_silent(peers: &mut HashMap<String, Peer>, now: Instant, forget_after: Duration) {
    peers.retain(|from, p| {
        let alive = now.saturating_duration_since(p.last_heard) <= forget_after;
        if !alive && !p.tickets.is_empty() {
            tracing::warn!(
                peer = %from,
                in_flight = p.tickets.len(),
                "gateway replica silent: forgetting its requests in flight"
            );
        }
        p.tickets
            .retain(|_, t| now.saturating_duration_since(t.since) <= MAX_TICKET_AGE);
        alive
    });
}

fn update_metrics(shared: &Shared, peers: &HashMap<String, Peer>) {
    let tickets: usize = peers.values().map(|p| p.tickets.len()).sum();
    shared.metrics.replica_peers.set(peers.len() as i64);
    shared.metrics.replica_tickets.set(tickets as i64);
}

/// A peer's dispatch as a ticket of this router: in the worker's ledger, backlog and in-flight prompts,
/// and credited speculatively, like the router's own decision ([`super::Router`]'s `decide`), but
/// teaching no rates.
fn mirror(
    shared: &Arc<Shared>,
    worker: Arc<super::Worker>,
    keys: Vec<BlockKey>,
    uncached_tokens: f64,
    est_ttft_s: f64,
    now: Instant,
) -> InFlight {
    let keys: Option<Arc<[BlockKey]>> = (!keys.is_empty()).then(|| Arc::from(keys));
    let (position, prompt, live) = {
        let mut st = worker.state.lock();
        st.in_flight += 1;
        st.awaiting_first_token += 1;
        st.log.started(now);
        let prompt = keys
            .as_ref()
            .map(|k| st.prompts.add(Arc::clone(k), now, est_ttft_s.max(0.0)));
        let s_per_token = st.rates.s_per_token;
        let live = st.load.is_some();
        (
            st.backlog.push(uncached_tokens.max(0.0), now, s_per_token),
            prompt,
            live,
        )
    };
    if let Some(keys) = &keys {
        let ttl = if live {
            shared.tuning.speculative_ttl
        } else {
            shared.tuning.speculative_ttl_no_agent
        };
        shared
            .spec
            .lock()
            .credit(Arc::clone(keys), worker.id, now, now + ttl);
    }
    InFlight::new(
        Arc::clone(shared),
        worker,
        Some(position),
        None,
        keys.filter(|_| live),
        prompt,
    )
}

/// Starts sharing with `config.peers`: the outbox's sender task and the sweep of silent peers. Both
/// end with the router (the sender when the outbox's channel closes, the sweep when the router is
/// gone).
pub(super) fn start(
    shared: &Arc<Shared>,
    config: &ReplicasConfig,
    admin_key: Option<String>,
    discovered: Option<watch::Receiver<BTreeSet<String>>>,
) -> Option<Arc<Outbox>> {
    let handle = tokio::runtime::Handle::try_current().ok()?;
    let forget_after = Duration::from_millis(config.forget_after_ms.max(1));
    let period = Duration::from_millis(config.heartbeat_ms.max(1));
    let weak = Arc::downgrade(shared);
    handle.spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(shared) = weak.upgrade() else { return };
            sweep(&shared, Instant::now(), forget_after);
        }
    });
    if config.peers.is_empty() && discovered.is_none() {
        return None;
    }
    let (tx, rx) = mpsc::channel(OUTBOX_CAPACITY);
    let dropped = shared.metrics.replica_notes_dropped.clone();
    let from = format!(
        "{}-{}",
        shared.gateway_id,
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let peers = Peers {
        fixed: config.peers.clone(),
        discovered,
        own_ip: std::env::var("POD_IP").ok().filter(|ip| !ip.is_empty()),
    };
    handle.spawn(send_loop(
        rx,
        from.clone(),
        peers,
        admin_key,
        period,
        dropped.clone(),
    ));
    Some(Arc::new(Outbox {
        tx,
        next_id: AtomicU64::new(0),
        dropped,
        from,
    }))
}

/// Where the batches go: the configured admin base URLs and, in a cluster, the gateway Service's
/// replicas as discovered now, less this pod's own address (`POD_IP`; a batch that reaches its
/// sender anyway is ignored there, see [`Outbox::is_mine`]).
struct Peers {
    fixed: Vec<String>,
    discovered: Option<watch::Receiver<BTreeSet<String>>>,
    own_ip: Option<String>,
}

impl Peers {
    /// The batch URLs at this moment.
    fn urls(&self) -> Vec<String> {
        let mut bases: BTreeSet<String> = self
            .fixed
            .iter()
            .map(|p| p.trim_end_matches('/').to_string())
            .collect();
        if let Some(found) = &self.discovered {
            bases.extend(found.borrow().iter().cloned());
        }
        bases
            .into_iter()
            .filter(|base| !self.is_own(base))
            .map(|base| format!("{base}{PATH}"))
            .collect()
    }

    fn is_own(&self, base: &str) -> bool {
        let Some(ip) = &self.own_ip else {
            return false;
        };
        let host = base
            .strip_prefix("http://")
            .unwrap_or(base)
            .rsplit_once(':')
            .map_or(base, |(host, _)| host);
        host.trim_start_matches('[').trim_end_matches(']') == ip
    }
}

fn drop_notes(dropped: &Family<ReplicaDropLabels, Counter>, reason: &str, notes: usize) {
    dropped
        .get_or_create(&ReplicaDropLabels {
            reason: reason.to_string(),
        })
        .inc_by(notes as u64);
}

/// Posts the queued notes to every peer, up to [`MAX_NOTES_PER_BATCH`] per batch, and an empty
/// batch when nothing was sent for `heartbeat`. A peer that does not take a batch loses its notes
/// (counted, logged at most every 30 s): a late note would describe load that has moved on.
async fn send_loop(
    mut rx: mpsc::Receiver<Note>,
    from: String,
    peers: Peers,
    admin_key: Option<String>,
    heartbeat: Duration,
    dropped: Family<ReplicaDropLabels, Counter>,
) {
    let authorization = admin_key.map(|key| format!("Bearer {key}"));
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let mut last_error_log: Option<Instant> = None;
    loop {
        let mut notes = Vec::new();
        match tokio::time::timeout(heartbeat, rx.recv()).await {
            Ok(Some(note)) => notes.push(note),
            Ok(None) => return,
            Err(_) => {}
        }
        while notes.len() < MAX_NOTES_PER_BATCH {
            match rx.try_recv() {
                Ok(note) => notes.push(note),
                Err(_) => break,
            }
        }
        let sent = notes.len();
        let batch = Batch {
            from: from.clone(),
            notes,
        };
        let body = match serde_json::to_vec(&batch) {
            Ok(b) => Bytes::from(b),
            Err(_) => continue,
        };
        // Every peer at once, each bounded: a dead peer delays the next batch by at most that.
        let urls = peers.urls();
        let posts = urls.iter().map(|url| {
            let mut request =
                hyper::Request::post(url).header(hyper::header::CONTENT_TYPE, "application/json");
            if let Some(value) = &authorization {
                request = request.header(hyper::header::AUTHORIZATION, value);
            }
            let request = request.body(Full::new(body.clone()));
            let client = &client;
            async move {
                let request = request.map_err(|e| e.to_string())?;
                match tokio::time::timeout(heartbeat, client.request(request)).await {
                    Ok(Ok(r)) if r.status().is_success() => Ok(()),
                    Ok(Ok(r)) => Err(format!("{url}: status {}", r.status())),
                    Ok(Err(e)) => Err(format!("{url}: {e}")),
                    Err(_) => Err(format!("{url}: no answer within {heartbeat:?}")),
                }
            }
        });
        let failures: Vec<String> = futures::future::join_all(posts)
            .await
            .into_iter()
            .filter_map(Result::err)
            .collect();
        if let Some(first) = failures.first() {
            drop_notes(&dropped, "undelivered", sent * failures.len());
            let now = Instant::now();
            if last_error_log.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(30)) {
                last_error_log = Some(now);
                tracing::warn!(error = %first, failed = failures.len(), "telling a gateway replica what was sent failed");
            }
        }
    }
}
