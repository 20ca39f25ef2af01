//! The router's Prometheus metrics (prometheus-client), registered by the gateway through
//! [`super::Router::register_metrics`].

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Labels of a routing decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteDecisionLabels {
    /// Routing mode.
    pub mode: String,
    /// Decision reason (`cache_hit`, `least_loaded`, `tie_spread`, `load_guard`, `degraded_*`, ...).
    pub reason: String,
}

/// Labels naming one agent.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AgentLabels {
    /// Agent gRPC endpoint.
    pub agent: String,
}

/// Labels naming one worker.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerUrlLabels {
    /// Worker base URL.
    pub worker: String,
}

/// Labels of an estimate made without a worker's kernel view.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KernelMissingLabels {
    /// `no_agent`, `ebpf_off` or `stale` (see `estimate::KernelMissing`).
    pub reason: String,
}

/// Labels of replica notes that never reached a peer.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaDropLabels {
    /// `outbox_full` (more queued than the sender keeps) or `undelivered` (a peer did not take the
    /// batch: unreachable, slow or refusing; counted once per peer).
    pub reason: String,
}

/// Labels of a tokenization.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenizeLabels {
    /// Model name.
    pub model: String,
    /// `local`, `worker` (the /tokenize fallback) or `failed`.
    pub source: String,
}

/// Labels of a prefill/decode disaggregation decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PdLabels {
    /// `split` (a prefill worker and a decode worker), `whole` (too little left to compute on the
    /// best decode worker: one worker), `untokenized` (whole: the prompt could not be measured),
    /// `fallback` (whole, after the prefill failed) or `no_transfer_params` (the prefill answered
    /// without `kv_transfer_params`: its worker has no KV connector, the decode recomputes).
    pub outcome: String,
}

/// Labels of a timed stage of a routing decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// Routing mode.
    pub mode: String,
    /// `tokenize` (the prompt's tokens, local or from a worker) or `decide` (block keys, index lookups,
    /// estimates, the pick).
    pub stage: String,
}

/// Bucket bounds of the stage histograms, in seconds: 5 us to 0.3 s. A decision takes tens of
/// microseconds, a tokenization up to milliseconds, the `/tokenize` fallback a round trip. Fine from
/// 5 to 100 us, and 50 us (the decision target) is a bound of its own, so the share of decisions
/// within it is a bucket's count and a p99 near it is read within 10 us, not within 40-80 us as with
/// doubling buckets.
pub const STAGE_BUCKETS_S: [f64; 24] = [
    0.000_005, 0.000_010, 0.000_015, 0.000_020, 0.000_025, 0.000_030, 0.000_040, 0.000_050,
    0.000_060, 0.000_080, 0.000_100, 0.000_150, 0.000_200, 0.000_300, 0.000_500, 0.001, 0.002,
    0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3,
];

fn stage_histogram() -> Histogram {
    Histogram::new(STAGE_BUCKETS_S)
}

/// All router metrics; clones share the same values.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// Time spent routing, by stage: what the gateway adds to every request before it is sent on.
    pub stage_seconds: Family<StageLabels, Histogram, fn() -> Histogram>,
    /// Decisions by mode and reason.
    pub decisions: Family<RouteDecisionLabels, Counter>,
    /// Prompt tokens the router expected to be cached on the chosen worker.
    pub predicted_cached_tokens: Counter,
    /// (block, worker) pairs in the KV index.
    pub index_pairs: Gauge,
    /// Approximate KV index memory.
    pub index_bytes: Gauge,
    /// Keys dropped by the index memory cap.
    pub index_evictions: Counter,
    /// Keys held by speculative credits.
    pub speculative_keys: Gauge,
    /// Other gateway replicas heard from and not forgotten.
    pub replica_peers: Gauge,
    /// Requests of other gateway replicas held in this router's ledger.
    pub replica_tickets: Gauge,
    /// Notes for other replicas dropped, by reason.
    pub replica_notes_dropped: Family<ReplicaDropLabels, Counter>,
    /// Conversations whose previous turn's worker is remembered ([`super::sessions`]).
    pub sessions: Gauge,
    /// Whether each agent's stream is up (1) or not (0).
    pub agent_connected: Family<AgentLabels, Gauge>,
    /// Stream (re)connections per agent.
    pub agent_connects: Family<AgentLabels, Counter>,
    /// Summary messages applied per agent.
    pub agent_messages: Family<AgentLabels, Counter>,
    /// Times an agent's data was dropped as stale.
    pub agent_stale: Family<AgentLabels, Counter>,
    /// Tokenizations by model and source.
    pub tokenize: Family<TokenizeLabels, Counter>,
    /// Learned prefill throughput per worker, tokens/s.
    pub worker_tokens_per_s: Family<WorkerUrlLabels, Gauge<f64, AtomicU64>>,
    /// Learned fixed overhead per worker, seconds.
    pub worker_overhead_s: Family<WorkerUrlLabels, Gauge<f64, AtomicU64>>,
    /// Candidate estimates made without the worker's kernel view, by reason.
    pub kernel_view_missing: Family<KernelMissingLabels, Counter>,
    /// Prefill/decode disaggregation decisions by outcome.
    pub pd: Family<PdLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            stage_seconds: Family::new_with_constructor(stage_histogram as fn() -> Histogram),
            decisions: Family::default(),
            predicted_cached_tokens: Counter::default(),
            index_pairs: Gauge::default(),
            index_bytes: Gauge::default(),
            index_evictions: Counter::default(),
            speculative_keys: Gauge::default(),
            replica_peers: Gauge::default(),
            replica_tickets: Gauge::default(),
            replica_notes_dropped: Family::default(),
            sessions: Gauge::default(),
            agent_connected: Family::default(),
            agent_connects: Family::default(),
            agent_messages: Family::default(),
            agent_stale: Family::default(),
            tokenize: Family::default(),
            worker_tokens_per_s: Family::default(),
            worker_overhead_s: Family::default(),
            kernel_view_missing: Family::default(),
            pd: Family::default(),
        }
    }
}

/// One routing mode's stage histograms, looked up once when the router is built, so a request observes
/// them without a label lookup; `tokenize` only where the mode tokenizes (the baselines do not). They
/// exist from the start: a histogram family prints nothing until it has a series.
#[derive(Clone, Debug)]
pub struct StageTimers {
    /// `stage="tokenize"`.
    pub tokenize: Option<Histogram>,
    /// `stage="decide"`.
    pub decide: Histogram,
}

impl Metrics {
    /// The stage histograms of routing mode `mode`.
    pub fn stage_timers(&self, mode: &str, tokenizes: bool) -> StageTimers {
        let stage = |stage: &str| {
            self.stage_seconds
                .get_or_create(&StageLabels {
                    mode: mode.to_string(),
                    stage: stage.to_string(),
                })
                .clone()
        };
        StageTimers {
            tokenize: tokenizes.then(|| stage("tokenize")),
            decide: stage("decide"),
        }
    }

    /// Registers every metric under `kinference_routing_*`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("kinference_routing");
        r.register(
            "stage_seconds",
            "Time spent routing a request, by mode and stage (tokenize, decide)",
            self.stage_seconds.clone(),
        );
        r.register(
            "decisions",
            "Routing decisions by mode and reason",
            kinference_api::metrics::Described(self.decisions.clone()),
        );
        r.register(
            "predicted_cached_tokens",
            "Prompt tokens the router expected the chosen worker to have cached",
            kinference_api::metrics::Described(self.predicted_cached_tokens.clone()),
        );
        r.register(
            "index_pairs",
            "(block, worker) pairs in the KV index",
            kinference_api::metrics::Described(self.index_pairs.clone()),
        );
        r.register(
            "index_bytes",
            "Approximate KV index memory in bytes",
            kinference_api::metrics::Described(self.index_bytes.clone()),
        );
        r.register(
            "index_evictions",
            "Keys dropped by the KV index memory cap",
            kinference_api::metrics::Described(self.index_evictions.clone()),
        );
        r.register(
            "speculative_keys",
            "Keys held by speculative credits",
            kinference_api::metrics::Described(self.speculative_keys.clone()),
        );
        r.register(
            "replica_peers",
            "Other gateway replicas this one hears from (replicas.peers)",
            kinference_api::metrics::Described(self.replica_peers.clone()),
        );
        r.register(
            "replica_requests_in_flight",
            "Requests other gateway replicas told this one they have in flight",
            kinference_api::metrics::Described(self.replica_tickets.clone()),
        );
        r.register(
            "replica_notes_dropped",
            "Dispatch, first-token and end notes that did not reach another replica (outbox_full, undelivered)",
            kinference_api::metrics::Described(self.replica_notes_dropped.clone()),
        );
        r.register(
            "sessions",
            "Conversations whose previous turn's worker the router remembers (sessions.max_entries)",
            kinference_api::metrics::Described(self.sessions.clone()),
        );
        r.register(
            "agent_connected",
            "Whether the agent's summary stream is up",
            kinference_api::metrics::Described(self.agent_connected.clone()),
        );
        r.register(
            "agent_connects",
            "Summary stream connections per agent",
            kinference_api::metrics::Described(self.agent_connects.clone()),
        );
        r.register(
            "agent_messages",
            "Summary messages applied per agent",
            kinference_api::metrics::Described(self.agent_messages.clone()),
        );
        r.register(
            "agent_stale",
            "Times an agent's data was dropped as stale",
            kinference_api::metrics::Described(self.agent_stale.clone()),
        );
        r.register(
            "tokenize",
            "Prompt tokenizations by model and source",
            kinference_api::metrics::Described(self.tokenize.clone()),
        );
        r.register(
            "worker_tokens_per_second",
            "Learned prefill throughput per worker",
            kinference_api::metrics::Described(self.worker_tokens_per_s.clone()),
        );
        r.register(
            "worker_overhead_seconds",
            "Learned fixed overhead per worker",
            kinference_api::metrics::Described(self.worker_overhead_s.clone()),
        );
        r.register(
            "kernel_view_missing",
            "Candidate TTFT estimates made without the worker's kernel-level queue view (eBPF), by reason",
            kinference_api::metrics::Described(self.kernel_view_missing.clone()),
        );
        r.register(
            "pd",
            "Requests to pools with prefill workers by outcome: split between a prefill and a decode worker, or whole on one worker (too short, untokenized, the prefill failed), and prefills answered without kv_transfer_params",
            kinference_api::metrics::Described(self.pd.clone()),
        );
    }
}
