//! The summary stream every gateway watches: `kinference.v1.NodeAgent/Watch`.
//!
//! One broadcaster task owns the stream's order. Woken by any change, it waits one coalescing window,
//! then drains every worker's net key changes into a single `Delta`, and hands it to each watcher's
//! bounded queue without waiting. A new watcher, or one whose queue was full (a slow gateway), gets a
//! fresh `Snapshot` built in the same pass instead: ingestion never waits for a gateway, and a gateway
//! that falls behind is made current again by one message. Keys travel as packed `fixed64`.
//!
//! A worker's load (scraped figures and the kernel's view of its port) is sent when it changes and at
//! least every second; the node's GPU state is in every snapshot and in the next delta after it changes.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kinference_api::summary::node_agent_server::NodeAgent;
use kinference_api::summary::{self as pb, summary::Kind};
use parking_lot::Mutex;
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::metrics::AgentMetrics;
use crate::registry::{KernelFigures, Load, Registry};

/// Load figures are resent at least this often, so `metrics_age_ms` and `event_lag_ms` stay meaningful.
const LOAD_REFRESH: Duration = Duration::from_secs(1);

/// One connected gateway.
struct Watcher {
    id: String,
    tx: mpsc::Sender<Result<pb::Summary, Status>>,
    /// Set for a new watcher and for one that fell behind: the next message it gets is a snapshot.
    needs_snapshot: AtomicBool,
}

/// Shared between the gRPC service (adds watchers) and the broadcaster (feeds them).
pub struct Broadcaster {
    registry: Arc<Registry>,
    metrics: AgentMetrics,
    node: String,
    epoch: u64,
    queue: usize,
    watchers: Mutex<Vec<Arc<Watcher>>>,
    /// Version of the node state the in-sync watchers have (see [`Registry::node_state`]).
    node_version: AtomicU64,
}

/// One cache the summary names: a worker, or one data-parallel rank of a ranked worker.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct CacheId {
    url: String,
    rank: Option<u32>,
}

/// What [`Broadcaster::tick_cache`] reads of one cache.
struct RankView<'a> {
    slot: &'a crate::registry::WorkerSlot,
    kv: &'a Mutex<crate::worker_state::WorkerState>,
    cache: CacheId,
    load: &'a Load,
    wire_load: pb::WorkerLoad,
}

/// What the broadcaster last told gateways about a worker.
struct Announced {
    generation: u64,
    block_size: u32,
    load: Option<LoadSent>,
}

#[derive(Clone, Copy, PartialEq)]
struct LoadSent {
    running: u32,
    waiting: u32,
    kv_usage: f32,
    num_gpu_blocks: u32,
    ok: bool,
    kernel: Option<KernelFigures>,
    at: Instant,
}

impl Broadcaster {
    /// A broadcaster for this node; `epoch` changes every process start.
    pub fn new(
        registry: Arc<Registry>,
        metrics: AgentMetrics,
        node: String,
        queue: usize,
    ) -> Arc<Self> {
        let epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Arc::new(Self {
            registry,
            metrics,
            node,
            epoch,
            queue: queue.max(2),
            watchers: Mutex::new(Vec::new()),
            node_version: AtomicU64::new(0),
        })
    }

    /// Registers a gateway; its stream starts with a snapshot.
    fn add_watcher(&self, id: String) -> mpsc::Receiver<Result<pb::Summary, Status>> {
        let (tx, rx) = mpsc::channel(self.queue);
        tracing::info!(gateway = %id, "gateway watching");
        self.watchers.lock().push(Arc::new(Watcher {
            id,
            tx,
            needs_snapshot: AtomicBool::new(true),
        }));
        self.metrics.watchers.inc();
        self.registry.notify();
        rx
    }

    /// Runs the broadcast loop until cancelled.
    pub async fn run(self: Arc<Self>, coalesce: Duration, cancel: CancellationToken) {
        let mut announced: HashMap<CacheId, Announced> = HashMap::new();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = self.registry.changed() => {}
                _ = tokio::time::sleep(LOAD_REFRESH) => {}
            }
            if !coalesce.is_zero() {
                tokio::time::sleep(coalesce).await;
            }
            self.tick(&mut announced);
        }
    }

    /// One pass: drains every worker's changes into a delta, and builds a snapshot if a watcher needs one.
    fn tick(&self, announced: &mut HashMap<CacheId, Announced>) {
        let watchers: Vec<Arc<Watcher>> = self.watchers.lock().clone();
        // A watcher behind with a still-full queue cannot take a snapshot yet: do not build one for it.
        let need_snapshot = watchers
            .iter()
            .any(|w| w.needs_snapshot.load(Ordering::Relaxed) && w.tx.capacity() > 0);
        let now = Instant::now();
        let slots = self.registry.list();
        let (node_version, node_state) = self.registry.node_state();
        let mut delta = pb::Delta::default();
        if self.node_version.swap(node_version, Ordering::Relaxed) != node_version {
            delta.node_state = node_state.clone();
        }
        let mut snapshot = need_snapshot.then(|| pb::Snapshot {
            node: self.node.clone(),
            epoch: self.epoch,
            workers: Vec::with_capacity(slots.len()),
            node_state,
        });
        let mut key_changes = 0u64;

        for slot in &slots {
            let url = &slot.spec.url;
            let load = slot.load.lock().clone();
            let whole = to_wire_load(&load, now);
            for (rank, kv) in slot.ranks().iter().enumerate() {
                let cache = CacheId {
                    url: url.clone(),
                    rank: slot.wire_rank(rank),
                };
                let wire_load = rank_load(whole, &load.engines, cache.rank, slot.ranks().len());
                let entry = RankView {
                    slot,
                    kv,
                    cache,
                    load: &load,
                    wire_load,
                };
                key_changes +=
                    self.tick_cache(entry, now, announced, &mut delta, snapshot.as_mut());
            }
        }
        // Workers (or ranks) that left since the last pass.
        let gone: Vec<CacheId> = announced
            .keys()
            .filter(|c| {
                !slots.iter().any(|s| {
                    s.spec.url == c.url
                        && c.rank.is_none_or(|r| (r as usize) < s.ranks().len())
                        && c.rank.is_some() == s.spec.ranked()
                })
            })
            .cloned()
            .collect();
        for cache in gone {
            announced.remove(&cache);
            delta.workers.push(pb::WorkerDelta {
                worker_id: cache.url,
                data_parallel_rank: cache.rank,
                gone: true,
                ..Default::default()
            });
        }

        let delta =
            (!delta.workers.is_empty() || delta.node_state.is_some()).then_some(pb::Summary {
                kind: Some(Kind::Delta(delta)),
            });
        let snapshot = snapshot.map(|s| pb::Summary {
            kind: Some(Kind::Snapshot(s)),
        });
        let mut closed = false;
        for w in &watchers {
            let msg = if w.needs_snapshot.load(Ordering::Relaxed) {
                snapshot.as_ref()
            } else {
                delta.as_ref()
            };
            let Some(msg) = msg else { continue };
            match w.tx.try_send(Ok(msg.clone())) {
                Ok(()) => {
                    self.metrics.summary_messages.inc();
                    self.metrics.summary_bytes.inc_by(msg.encoded_len() as u64);
                    if matches!(msg.kind, Some(Kind::Delta(_))) {
                        self.metrics.summary_key_changes.inc_by(key_changes);
                    }
                    w.needs_snapshot.store(false, Ordering::Relaxed);
                }
                Err(mpsc::error::TrySendError::Full(_)) => {
                    if !w.needs_snapshot.swap(true, Ordering::Relaxed) {
                        self.metrics.watcher_resyncs.inc();
                        tracing::warn!(gateway = %w.id, "gateway fell behind; it will get a fresh snapshot");
                    }
                }
                Err(mpsc::error::TrySendError::Closed(_)) => closed = true,
            }
        }
        if closed {
            self.watchers.lock().retain(|w| {
                let open = !w.tx.is_closed();
                if !open {
                    tracing::info!(gateway = %w.id, "gateway stopped watching");
                    self.metrics.watchers.dec();
                }
                open
            });
        }
    }

    /// One cache (a worker, or one rank of a ranked worker): its changes into `delta`, its full state
    /// into `snapshot` when one is built. Returns how many keys changed.
    fn tick_cache(
        &self,
        view: RankView<'_>,
        now: Instant,
        announced: &mut HashMap<CacheId, Announced>,
        delta: &mut pb::Delta,
        mut snapshot: Option<&mut pb::Snapshot>,
    ) -> u64 {
        let RankView {
            slot,
            kv,
            cache,
            load,
            wire_load,
        } = view;
        let mut key_changes = 0u64;
        {
            // Drain and (if needed) copy the keys under one lock, so snapshot and delta agree.
            let (mut change, block_size, keys) = {
                let mut kv = kv.lock();
                let change = kv.take_delta();
                let keys = snapshot.is_some().then(|| (kv.keys(), kv.offloaded_keys()));
                (change, kv.block_size(), keys)
            };
            let block_size = block_size.or(load.block_size).unwrap_or(0);
            let sent = LoadSent {
                running: wire_load.running,
                waiting: wire_load.waiting,
                kv_usage: wire_load.kv_usage,
                num_gpu_blocks: wire_load.num_gpu_blocks,
                ok: wire_load.metrics_ok,
                kernel: load.kernel,
                at: now,
            };
            if let (Some(snap), Some((keys, offloaded_keys))) = (snapshot.as_mut(), keys) {
                snap.workers.push(pb::WorkerState {
                    worker_id: cache.url.clone(),
                    model: slot.spec.model.clone(),
                    block_size,
                    keys,
                    load: Some(wire_load),
                    role: wire_role(&slot.spec),
                    offloaded_keys,
                    data_parallel_rank: cache.rank,
                });
            }

            let entry = announced
                .get_mut(&cache)
                .filter(|a| a.generation == slot.generation);
            let mut wd = pb::WorkerDelta {
                worker_id: cache.url.clone(),
                data_parallel_rank: cache.rank,
                ..Default::default()
            };
            let mut send = false;
            match entry {
                None => {
                    // New to the in-sync watchers (or replaced with fresh state): announce it in full.
                    let kv = kv.lock();
                    change = crate::worker_state::KeyDelta {
                        cleared: true,
                        added: kv.keys(),
                        offloaded_added: kv.offloaded_keys(),
                        ..Default::default()
                    };
                    drop(kv);
                    wd.model = slot.spec.model.clone();
                    wd.role = wire_role(&slot.spec);
                    wd.block_size = block_size;
                    wd.load = Some(wire_load);
                    send = true;
                    announced.insert(
                        cache.clone(),
                        Announced {
                            generation: slot.generation,
                            block_size,
                            load: Some(sent),
                        },
                    );
                }
                Some(a) => {
                    if a.block_size != block_size {
                        wd.model = slot.spec.model.clone();
                        wd.role = wire_role(&slot.spec);
                        wd.block_size = block_size;
                        a.block_size = block_size;
                        send = true;
                    }
                    let load_changed = a.load.is_none_or(|p| {
                        (
                            p.running,
                            p.waiting,
                            p.kv_usage,
                            p.num_gpu_blocks,
                            p.ok,
                            p.kernel,
                        ) != (
                            sent.running,
                            sent.waiting,
                            sent.kv_usage,
                            sent.num_gpu_blocks,
                            sent.ok,
                            sent.kernel,
                        ) || now.duration_since(p.at) >= LOAD_REFRESH
                    });
                    if load_changed {
                        wd.load = Some(wire_load);
                        a.load = Some(sent);
                        send = true;
                    }
                }
            }
            if !change.is_empty() {
                key_changes += (change.added.len()
                    + change.removed.len()
                    + change.offloaded_added.len()
                    + change.offloaded_removed.len()) as u64;
                wd.cleared = change.cleared;
                wd.added = change.added;
                wd.removed = change.removed;
                wd.offloaded_added = change.offloaded_added;
                wd.offloaded_removed = change.offloaded_removed;
                send = true;
            }
            if send {
                delta.workers.push(wd);
            }
        }
        key_changes
    }
}

/// The role a worker's spec gives it, as the summary carries it ("" when not given).
fn wire_role(spec: &crate::config::WorkerSpec) -> String {
    spec.role
        .map(|r| r.as_str().to_string())
        .unwrap_or_default()
}

/// One rank's load, of a worker whose whole load is `whole` and whose metrics label `engines`: the
/// engine of the rank's number when the worker reports it (vLLM labels each engine's series with
/// its data-parallel rank), else an even share ([`share_of_load`]). The kernel's view covers the
/// whole endpoint and is always shared.
fn rank_load(
    whole: pb::WorkerLoad,
    engines: &[kinference_api::vllm::metrics::EngineLoad],
    rank: Option<u32>,
    ranks: usize,
) -> pb::WorkerLoad {
    let shared = share_of_load(whole, ranks);
    let Some(own) = rank.and_then(|r| engines.iter().find(|e| e.engine == r)) else {
        return shared;
    };
    let count = |v: f64| v.clamp(0.0, u32::MAX as f64) as u32;
    pb::WorkerLoad {
        running: count(own.running),
        waiting: count(own.waiting),
        kv_usage: own.kv_usage.clamp(0.0, 1.0) as f32,
        ..shared
    }
}

/// One rank's share of its worker's load: the counts divided over `ranks` (rounded up, so a busy
/// worker never looks idle), the per-engine figures (KV usage, capacity, latency) as they are.
fn share_of_load(load: pb::WorkerLoad, ranks: usize) -> pb::WorkerLoad {
    if ranks <= 1 {
        return load;
    }
    let share = |n: u32| n.div_ceil(ranks as u32);
    pb::WorkerLoad {
        running: share(load.running),
        waiting: share(load.waiting),
        kernel_in_flight: share(load.kernel_in_flight),
        kernel_waiting: share(load.kernel_waiting),
        ..load
    }
}

fn to_wire_load(load: &Load, now: Instant) -> pb::WorkerLoad {
    let now_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let kernel = load.kernel.unwrap_or_default();
    pb::WorkerLoad {
        running: load.running,
        waiting: load.waiting,
        kv_usage: load.kv_usage,
        num_gpu_blocks: load.num_gpu_blocks.unwrap_or(0),
        metrics_age_ms: load.scraped_at.map_or(u32::MAX, |t| {
            now.duration_since(t).as_millis().min(u32::MAX as u128) as u32
        }),
        metrics_ok: load.metrics_ok,
        event_lag_ms: load.last_event_ts.map_or(0, |ts| {
            ((now_unix - ts).max(0.0) * 1000.0).min(u32::MAX as f64) as u32
        }),
        kernel_ok: load.kernel.is_some(),
        kernel_in_flight: kernel.in_flight,
        kernel_waiting: kernel.waiting,
        kernel_idle_gap_ms: kernel.idle_gap_ms,
        kernel_waits_for_body: kernel.waits_for_body,
        accept_backlog: kernel.accept_backlog,
        accept_backlog_max: kernel.accept_backlog_max,
        kernel_ttfb_p50_us: kernel.ttfb_p50_us,
    }
}

/// The tonic service.
pub struct NodeAgentService {
    broadcaster: Arc<Broadcaster>,
}

impl NodeAgentService {
    pub fn new(broadcaster: Arc<Broadcaster>) -> Self {
        Self { broadcaster }
    }
}

type SummaryStream = Pin<Box<dyn Stream<Item = Result<pb::Summary, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl NodeAgent for NodeAgentService {
    type WatchStream = SummaryStream;

    async fn watch(
        &self,
        request: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let id = request.into_inner().gateway_id;
        let rx = self.broadcaster.add_watcher(if id.is_empty() {
            "anonymous".into()
        } else {
            id
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

#[cfg(test)]
mod tests;
