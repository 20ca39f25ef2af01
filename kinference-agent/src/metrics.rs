//! The agent's own Prometheus metrics (node-level, served on `--metrics-listen`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use kinference_api::metrics::Described;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Per-worker label set.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    pub worker: String,
}

/// A listener at the trust boundary and why it refused something; both values come from fixed sets.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectLabel {
    /// `kv_events`, `replay`, `grpc` or `metrics`.
    pub listener: &'static str,
    /// A fixed reason (`frame_too_large`, `mechanism`, `handshake_timeout`, `too_many_connections`...).
    pub reason: &'static str,
}

/// A guarded listener.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabel {
    pub listener: &'static str,
}

/// How often each listener may log a refusal; the others in the window are counted, then summarised.
const REJECTION_LOG_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct LogWindow {
    last: Instant,
    suppressed: u64,
}

/// Every metric the agent exports. Cheap to clone (handles to shared atomics).
#[derive(Clone, Default)]
pub struct AgentMetrics {
    pub kv_blocks: Family<WorkerLabel, Gauge>,
    pub kv_state_bytes: Family<WorkerLabel, Gauge>,
    pub kv_block_events: Family<WorkerLabel, Counter>,
    pub kv_batches: Family<WorkerLabel, Counter>,
    pub kv_seq_gaps: Family<WorkerLabel, Counter>,
    pub kv_replays: Family<WorkerLabel, Counter>,
    pub kv_replay_failures: Family<WorkerLabel, Counter>,
    pub kv_engine_restarts: Family<WorkerLabel, Counter>,
    pub kv_decode_errors: Family<WorkerLabel, Counter>,
    pub kv_unresolved_parents: Family<WorkerLabel, Counter>,
    pub kv_unknown_removals: Family<WorkerLabel, Counter>,
    pub kv_dropped_over_cap: Family<WorkerLabel, Counter>,
    pub kv_event_lag_seconds: Family<WorkerLabel, Gauge<f64, AtomicU64>>,
    pub scrape_failures: Family<WorkerLabel, Counter>,
    pub scrape_ok: Family<WorkerLabel, Gauge>,
    pub watchers: Gauge,
    pub watcher_resyncs: Counter,
    pub summary_messages: Counter,
    pub summary_bytes: Counter,
    pub summary_key_changes: Counter,
    /// What the trust boundary refused, by listener and reason (see [`Rejections`]).
    pub rejected: Family<RejectLabel, Counter>,
    /// Open connections on each guarded listener (ZeroMQ guards, gRPC, metrics port).
    pub connections: Family<ListenerLabel, Gauge>,
    rejection_log: Arc<Mutex<HashMap<&'static str, LogWindow>>>,
}

impl AgentMetrics {
    /// Registers every metric under the `kinference_agent` prefix.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("kinference_agent");
        r.register(
            "kv_blocks",
            "Distinct block keys held per worker",
            Described(self.kv_blocks.clone()),
        );
        r.register(
            "kv_state_bytes",
            "Approximate memory of a worker's block-key state",
            Described(self.kv_state_bytes.clone()),
        );
        r.register(
            "kv_block_events",
            "Block events applied (stored, removed, cleared)",
            Described(self.kv_block_events.clone()),
        );
        r.register(
            "kv_batches",
            "KV event batches applied",
            Described(self.kv_batches.clone()),
        );
        r.register(
            "kv_seq_gaps",
            "Sequence gaps seen on a worker's KV event stream",
            Described(self.kv_seq_gaps.clone()),
        );
        r.register(
            "kv_replays",
            "Replays requested from a worker's replay socket",
            Described(self.kv_replays.clone()),
        );
        r.register(
            "kv_replay_failures",
            "Replays that failed or timed out",
            Described(self.kv_replay_failures.clone()),
        );
        r.register(
            "kv_engine_restarts",
            "Engine restarts detected (the worker's process start time changed, or its KV event sequence went back)",
            Described(self.kv_engine_restarts.clone()),
        );
        r.register(
            "kv_decode_errors",
            "KV event messages that could not be decoded",
            Described(self.kv_decode_errors.clone()),
        );
        r.register(
            "kv_unresolved_parents",
            "Stored blocks skipped because their parent block was unknown",
            Described(self.kv_unresolved_parents.clone()),
        );
        r.register(
            "kv_unknown_removals",
            "Removals of blocks the agent never saw stored",
            Described(self.kv_unknown_removals.clone()),
        );
        r.register(
            "kv_dropped_over_cap",
            "Stored blocks dropped because the worker exceeded the block cap",
            Described(self.kv_dropped_over_cap.clone()),
        );
        r.register(
            "kv_event_lag_seconds",
            "Now minus the timestamp of the newest KV event batch applied",
            Described(self.kv_event_lag_seconds.clone()),
        );
        r.register(
            "scrape_failures",
            "Failed scrapes of a worker's /metrics",
            Described(self.scrape_failures.clone()),
        );
        r.register(
            "scrape_ok",
            "1 when the worker's last /metrics scrape succeeded",
            Described(self.scrape_ok.clone()),
        );
        r.register(
            "watchers",
            "Gateways currently watching this agent",
            Described(self.watchers.clone()),
        );
        r.register(
            "watcher_resyncs",
            "Snapshots resent to watchers that fell behind",
            Described(self.watcher_resyncs.clone()),
        );
        r.register(
            "summary_messages",
            "Summary messages sent to watchers",
            Described(self.summary_messages.clone()),
        );
        r.register(
            "summary_bytes",
            "Encoded bytes of summary messages sent to watchers",
            Described(self.summary_bytes.clone()),
        );
        r.register(
            "rejected",
            "Frames, messages and connections refused at the trust boundary, by listener and reason",
            Described(self.rejected.clone()),
        );
        r.register(
            "connections",
            "Open connections per guarded listener",
            Described(self.connections.clone()),
        );
        r.register(
            "summary_key_changes",
            "Block keys added or removed in delta messages sent",
            Described(self.summary_key_changes.clone()),
        );
    }
}

impl AgentMetrics {
    /// Counts one refusal and logs it, at most once per listener every 10 s (a flood of hostile
    /// connections must not become a flood of log lines); the next line says how many were not logged.
    pub fn reject(
        &self,
        listener: &'static str,
        reason: &'static str,
        detail: &dyn std::fmt::Display,
    ) {
        self.rejected
            .get_or_create(&RejectLabel { listener, reason })
            .inc();
        let suppressed = {
            let mut log = self.rejection_log.lock();
            let now = Instant::now();
            match log.get_mut(listener) {
                Some(w) if now.duration_since(w.last) < REJECTION_LOG_EVERY => {
                    w.suppressed += 1;
                    return;
                }
                Some(w) => {
                    w.last = now;
                    std::mem::take(&mut w.suppressed)
                }
                None => {
                    log.insert(
                        listener,
                        LogWindow {
                            last: now,
                            suppressed: 0,
                        },
                    );
                    0
                }
            }
        };
        tracing::warn!(listener, reason, %detail, suppressed, "refused at the trust boundary");
    }

    /// The open-connections gauge of a listener.
    pub fn connections(&self, listener: &'static str) -> Gauge {
        self.connections
            .get_or_create(&ListenerLabel { listener })
            .clone()
    }
}

/// The label for a worker.
pub fn worker(url: &str) -> WorkerLabel {
    WorkerLabel {
        worker: url.to_string(),
    }
}
