//! The agent's view of its local workers, shared by ingestion, scraping and the summary stream.
//!
//! Each worker has a [`WorkerSlot`]: its spec, its block-key state and its load. Ingestion and scraping
//! write one slot each (one task per worker, so the per-slot locks are uncontended), the node signals
//! ([`crate::signals`]) write the kernel figures and the node's GPU state; the summary broadcaster reads
//! all of them once per coalescing window.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kinference_api::summary::NodeState;
use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;

use crate::config::WorkerSpec;
use crate::worker_state::WorkerState;

/// A worker's load, from its `/metrics` and its event stream.
#[derive(Clone, Debug, Default)]
pub struct Load {
    pub running: u32,
    pub waiting: u32,
    pub kv_usage: f32,
    /// When the last successful scrape finished.
    pub scraped_at: Option<Instant>,
    /// Whether the last scrape succeeded.
    pub metrics_ok: bool,
    /// Block size from `vllm:cache_config_info`, when the worker reports it.
    pub block_size: Option<u32>,
    /// KV cache capacity in blocks (`num_gpu_blocks` of `vllm:cache_config_info`), when reported.
    pub num_gpu_blocks: Option<u32>,
    /// When the worker's process started, Unix seconds (`process_start_time_seconds`), when reported.
    pub process_start_s: Option<f64>,
    /// Publisher timestamp (Unix seconds) of the newest batch applied.
    pub last_event_ts: Option<f64>,
    /// The kernel's view of the worker's port (eBPF); `None` when eBPF is off or does not watch it.
    pub kernel: Option<KernelFigures>,
    /// Each engine's own figures (a data-parallel worker's ranks), when its metrics label them.
    pub engines: Vec<kinference_api::vllm::metrics::EngineLoad>,
}

/// The kernel-level figures of one worker port, as the summary carries them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelFigures {
    /// Requests received and not finished, from every client.
    pub in_flight: u32,
    /// How long a finished response may still count in `in_flight`, in milliseconds.
    pub idle_gap_ms: u32,
    /// Of which no response byte has been sent yet.
    pub waiting: u32,
    /// `waiting` lasts until an event-stream response's first body byte, not its headers.
    pub waits_for_body: bool,
    /// The listener's accept queue (the peak since the previous read).
    pub accept_backlog: u32,
    /// The listener's accept queue limit.
    pub accept_backlog_max: u32,
    /// Recent median time from a request's first byte in to its first response byte out (0: none).
    pub ttfb_p50_us: u32,
}

/// One local worker.
pub struct WorkerSlot {
    pub spec: WorkerSpec,
    /// Unique per slot: a worker replaced under the same url gets a new one.
    pub generation: u64,
    /// One cache view per data-parallel rank (a single one for a rank-less worker): each rank's engine
    /// has its own KV cache, and a block held by rank 0 is no hit for a request sent to rank 1.
    ranks: Box<[Mutex<WorkerState>]>,
    pub load: Mutex<Load>,
}

impl WorkerSlot {
    /// The cache view of a rank-less worker (rank 0's of a ranked one).
    pub fn kv(&self) -> &Mutex<WorkerState> {
        &self.ranks[0]
    }

    /// Every rank's cache view, in rank order.
    pub fn ranks(&self) -> &[Mutex<WorkerState>] {
        &self.ranks
    }

    /// The rank a summary entry names: `None` for a rank-less worker.
    pub fn wire_rank(&self, rank: usize) -> Option<u32> {
        self.spec.ranked().then_some(rank as u32)
    }

    /// Tokens per block: from the events, else from the worker's metrics, else unknown (0).
    pub fn block_size(&self) -> u32 {
        self.ranks
            .iter()
            .find_map(|kv| kv.lock().block_size())
            .or(self.load.lock().block_size)
            .unwrap_or(0)
    }

    /// Blocks held over all ranks.
    pub fn blocks(&self) -> usize {
        self.ranks.iter().map(|kv| kv.lock().len()).sum()
    }
}

/// Every local worker, by url, and the node's GPU state.
#[derive(Default)]
pub struct Registry {
    workers: RwLock<BTreeMap<String, Arc<WorkerSlot>>>,
    changed: Notify,
    generations: AtomicU64,
    /// The node's GPU state and a version that changes with it (0: never set).
    node: Mutex<(u64, Option<NodeState>)>,
}

impl Registry {
    /// Adds (or replaces, with fresh state) a worker; returns its slot.
    pub fn upsert(&self, spec: WorkerSpec, max_blocks: usize) -> Arc<WorkerSlot> {
        let slot = Arc::new(WorkerSlot {
            ranks: (0..spec.ranks())
                .map(|_| Mutex::new(WorkerState::new(&spec.model, max_blocks)))
                .collect(),
            load: Mutex::new(Load::default()),
            generation: self.generations.fetch_add(1, Ordering::Relaxed),
            spec,
        });
        self.workers
            .write()
            .insert(slot.spec.url.clone(), slot.clone());
        self.notify();
        slot
    }

    /// Forgets a worker.
    pub fn remove(&self, url: &str) -> Option<Arc<WorkerSlot>> {
        let slot = self.workers.write().remove(url);
        self.notify();
        slot
    }

    /// Every worker, ordered by url.
    pub fn list(&self) -> Vec<Arc<WorkerSlot>> {
        self.workers.read().values().cloned().collect()
    }

    /// Records the node's GPU state; wakes the broadcaster and returns true when it differs from the last.
    pub fn set_node_state(&self, state: NodeState) -> bool {
        let changed = {
            let mut node = self.node.lock();
            if node.1.as_ref() == Some(&state) {
                false
            } else {
                node.0 += 1;
                node.1 = Some(state);
                true
            }
        };
        if changed {
            self.notify();
        }
        changed
    }

    /// The node's GPU state with its version (0 and `None` before the first sample).
    pub fn node_state(&self) -> (u64, Option<NodeState>) {
        self.node.lock().clone()
    }

    /// Wakes the summary broadcaster: something changed.
    pub fn notify(&self) {
        self.changed.notify_one();
    }

    /// Waits for the next [`Registry::notify`].
    pub async fn changed(&self) {
        self.changed.notified().await
    }
}
