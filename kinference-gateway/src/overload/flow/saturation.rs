//! The saturation detector: whether a pool can take one more request now without it queueing inside
//! the engine, from what the gateway knows of each worker ([`WorkerPressure`]).
//!
//! A worker is **full** when any one of these holds (the first that does is its reason); thresholds
//! are the flags of [`Thresholds`], a zero turns a signal off:
//!
//! | reason           | signal (freshest first)                                  | default        |
//! |------------------|----------------------------------------------------------|----------------|
//! | `queue`          | requests before their first token, every client's (kernel view, else engine scrape, else this gateway's ledger) | >= 8 |
//! | `engine_waiting` | `vllm:num_requests_waiting` of a fresh scrape             | >= 4           |
//! | `kv_cache`       | `vllm:kv_cache_usage_perc` of a fresh scrape              | >= 0.95        |
//! | `accept_backlog` | the kernel's accept queue of the worker's port (eBPF)     | >= 8 (or half its limit) |
//! | `kernel_ttfb`    | the kernel's median first-byte time (eBPF)                | >= 2 x TTFT target |
//! | `est_ttft`       | the router's estimated TTFT of a short request sent now, while a request waits for its first token there | >= TTFT target (2 s) |
//! | `in_flight`      | requests in flight, every client's (the same views)       | off (e.g. vLLM's `--max-num-seqs`) |
//!
//! The estimate fills a worker only while a request there still waits for its first token: the
//! estimate's rates are corrected by first tokens, and with none on its way an estimate past the
//! target would stay there for good. A pool judged full on rates learned under a load that has gone
//! (say, with the engine scrape slow and no kernel view) would let nothing through, so no first
//! token would ever come to correct them, and every request would be shed: the lock-up the
//! noisy-neighbour benchmark found. With this rule a worker with no first token on its way takes a
//! request, whose first token teaches the rates; the estimate fills the worker again only if they
//! still say so.
//!
//! A **pool is saturated when every one of its healthy workers is full**: as long as one worker has
//! room the router sends the request there. Requests the flow control let through in the last
//! moments but the router has not recorded yet take the room first. The verdict names the reason
//! most of its workers gave and explains each worker in one line (`x-kinference-decision`, logs),
//! and counts `room`: how many more requests the workers' queues take before every one is full,
//! which bounds how many waiting requests the flow control lets through at once (the engine's
//! figures lag by a scrape). A pool with nothing in flight and nothing let through is `idle`: the
//! flow control holds no band reserve from it.

use std::time::Duration;

use crate::routing::pools::WorkerPressure;

/// When a worker counts as full (flags of `kinference-gateway`; 0 turns a signal off).
#[derive(Debug, Clone, clap::Args)]
pub struct Thresholds {
    /// Requests before their first token (queued or in prefill, every client's) at which a worker
    /// is full.
    #[arg(
        long = "flow-max-queue",
        env = "KINFERENCE_FLOW_MAX_QUEUE",
        default_value_t = 8
    )]
    pub queue: usize,
    /// `vllm:num_requests_waiting` at which a worker is full.
    #[arg(
        long = "flow-max-engine-waiting",
        env = "KINFERENCE_FLOW_MAX_ENGINE_WAITING",
        default_value_t = 4
    )]
    pub engine_waiting: u32,
    /// KV cache usage (0..1) at which a worker is full.
    #[arg(
        long = "flow-max-kv-usage",
        env = "KINFERENCE_FLOW_MAX_KV_USAGE",
        default_value_t = 0.95
    )]
    pub kv_usage: f32,
    /// Connections in the kernel's accept queue of a worker's port (eBPF) at which it is full; half
    /// the queue's limit when that is lower.
    #[arg(
        long = "flow-max-accept-backlog",
        env = "KINFERENCE_FLOW_MAX_ACCEPT_BACKLOG",
        default_value_t = 8
    )]
    pub accept_backlog: u32,
    /// The time to first token the pools are run for, in milliseconds: a worker whose estimated TTFT
    /// for a short request reaches it (while a request there waits for its first token), or whose
    /// kernel median first-byte time reaches twice it, is full.
    #[arg(
        long = "flow-ttft-target-ms",
        env = "KINFERENCE_FLOW_TTFT_TARGET_MS",
        default_value_t = 2_000
    )]
    pub ttft_target_ms: u64,
    /// Requests in flight on a worker, every client's, at which it is full (0: no limit). Set to the
    /// engine's batch size (`--max-num-seqs`) to keep its waiting queue empty, so that the gateway's
    /// bands order every request that waits.
    #[arg(
        long = "flow-max-in-flight",
        env = "KINFERENCE_FLOW_MAX_IN_FLIGHT",
        default_value_t = 0
    )]
    pub in_flight: usize,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            queue: 8,
            engine_waiting: 4,
            kv_usage: 0.95,
            accept_backlog: 8,
            ttft_target_ms: 2_000,
            in_flight: 0,
        }
    }
}

impl Thresholds {
    fn ttft_target(&self) -> Option<Duration> {
        (self.ttft_target_ms > 0).then(|| Duration::from_millis(self.ttft_target_ms))
    }
}

/// Why a worker is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// Too many requests before their first token.
    Queue,
    /// The engine's own waiting queue.
    EngineWaiting,
    /// The KV cache is nearly full.
    KvCache,
    /// Connections wait in the kernel's accept queue.
    AcceptBacklog,
    /// The kernel's median time to first byte is far past the target.
    KernelTtfb,
    /// The estimated TTFT is past the target.
    EstTtft,
    /// As many requests in flight as the worker takes.
    InFlight,
}

impl Reason {
    /// Label value (metrics, explanations).
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Queue => "queue",
            Reason::EngineWaiting => "engine_waiting",
            Reason::KvCache => "kv_cache",
            Reason::AcceptBacklog => "accept_backlog",
            Reason::KernelTtfb => "kernel_ttfb",
            Reason::EstTtft => "est_ttft",
            Reason::InFlight => "in_flight",
        }
    }
}

/// The detector's decision on one pool.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// Every healthy worker is full.
    pub saturated: bool,
    /// The reason most full workers gave (`None` when none is full).
    pub reason: Option<Reason>,
    /// How many more requests the pool's queues take before every worker is full (0 when saturated).
    pub room: usize,
    /// Healthy workers, and how many of them are full.
    pub workers: usize,
    /// Of `workers`.
    pub full: usize,
    /// Nothing in flight on any worker and nothing let through not yet routed: the flow control
    /// holds no band reserve from an idle pool.
    pub idle: bool,
    /// One clause per worker: `url full:reason (figure)` or `url room:N`.
    pub explain: String,
}

/// Whether `worker` is full, why, and the figure that decided (for the explanation).
pub fn worker_full(worker: &WorkerPressure, t: &Thresholds) -> Option<(Reason, String)> {
    if t.in_flight > 0 && worker.in_flight >= t.in_flight {
        return Some((Reason::InFlight, format!("{} in flight", worker.in_flight)));
    }
    let queue = worker.before_first_token;
    if t.queue > 0 && queue >= t.queue {
        return Some((
            Reason::Queue,
            format!("{queue} before first token ({})", worker.signal),
        ));
    }
    if let Some(waiting) = worker
        .engine_waiting
        .filter(|&w| t.engine_waiting > 0 && w >= t.engine_waiting)
    {
        return Some((Reason::EngineWaiting, format!("engine waiting {waiting}")));
    }
    if let Some(kv) = worker
        .kv_usage
        .filter(|&kv| t.kv_usage > 0.0 && kv >= t.kv_usage)
    {
        return Some((Reason::KvCache, format!("kv {kv:.2}")));
    }
    if let Some((backlog, limit)) = worker.accept_backlog {
        let at = match limit {
            0 => t.accept_backlog,
            limit => t.accept_backlog.min((limit / 2).max(1)),
        };
        if t.accept_backlog > 0 && backlog >= at {
            return Some((
                Reason::AcceptBacklog,
                format!("accept backlog {backlog}/{limit}"),
            ));
        }
    }
    if let Some(target) = t.ttft_target() {
        if let Some(ttfb) = worker.kernel_ttfb.filter(|&d| d >= target * 2) {
            return Some((
                Reason::KernelTtfb,
                format!("kernel ttfb {} ms", ttfb.as_millis()),
            ));
        }
        // Only with a first token on its way there, which corrects the rates (module docs).
        if worker.before_first_token > 0 && worker.est_ttft_s >= target.as_secs_f64() {
            return Some((
                Reason::EstTtft,
                format!("est ttft {:.2} s", worker.est_ttft_s),
            ));
        }
    }
    None
}

/// The verdict on a pool of `workers` (its healthy ones), with `pending` requests let through but
/// not routed yet: they take room first (the router sends them where there is room).
pub fn judge(workers: &[WorkerPressure], pending: usize, t: &Thresholds) -> Verdict {
    let n = workers.len();
    let mut counts: Vec<(Reason, usize)> = Vec::new();
    let mut full = 0;
    let mut room = 0usize;
    let mut explain = Vec::with_capacity(n);
    for w in workers {
        match worker_full(w, t) {
            Some((reason, figure)) => {
                full += 1;
                match counts.iter_mut().find(|(r, _)| *r == reason) {
                    Some((_, c)) => *c += 1,
                    None => counts.push((reason, 1)),
                }
                explain.push(format!("{} full:{} ({figure})", w.worker, reason.as_str()));
            }
            None => {
                // What the queue and in-flight thresholds leave; without either, one at a time.
                let queue_left =
                    (t.queue > 0).then(|| t.queue.saturating_sub(w.before_first_token));
                let flight_left =
                    (t.in_flight > 0).then(|| t.in_flight.saturating_sub(w.in_flight));
                let left = match (queue_left, flight_left) {
                    (Some(q), Some(f)) => q.min(f),
                    (Some(q), None) => q,
                    (None, Some(f)) => f,
                    (None, None) => 1,
                }
                .max(1);
                room += left;
                explain.push(format!("{} room:{left}", w.worker));
            }
        }
    }
    counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let room = room.saturating_sub(pending);
    if pending > 0 {
        explain.push(format!("{pending} let through not yet routed"));
    }
    Verdict {
        // No healthy worker is not saturation: the router answers that itself.
        saturated: n > 0 && room == 0,
        reason: counts.first().map(|(r, _)| *r),
        room,
        workers: n,
        full,
        idle: pending == 0
            && workers
                .iter()
                .all(|w| w.in_flight == 0 && w.before_first_token == 0),
        explain: explain.join("; "),
    }
}
