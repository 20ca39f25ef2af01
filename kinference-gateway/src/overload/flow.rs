//! Flow control: while a pool is saturated, requests wait in the gateway, not in the engine, in
//! priority bands, fair between tenants by tokens, and are let through, best band first, as the pool
//! gets room; one that waits past its band's deadline is shed (503 with `Retry-After`).
//!
//! Why in the gateway: vLLM serves its waiting queue first come first served, so a tenant's burst sent
//! on to it delays every other tenant's first token and no priority applies. Held here, the queue
//! has bands (the tenant's priority, or the request's `x-kinference-priority` where its tenant allows
//! it), deficit round robin between tenants by tokens within a band ([`fair_queue`]), and the request
//! is routed when it leaves the queue, with the caches and loads of that moment.
//!
//! - [`saturation`] judges a pool from the router's view of its workers ([`WorkerPressure`]): the
//!   agents' engine and kernel (eBPF) figures, the ledger, the estimate;
//! - a request with nobody of its band or above waiting is judged at once and goes on when the pool's
//!   room exceeds its band's reserve ([`reserve`]: the sum of what each band above needs, each sized
//!   from that band's recent arrivals against the pool's recent request ends, at least
//!   `--flow-band-reserve` each, 2 each at a cold start), or when the pool is idle (nothing in flight
//!   nor let through: an idle pool holds no reserve, so no band is ever kept out for good);
//! - otherwise it joins the pool's [`FairQueue`], and the pool's dispatcher re-judges the pool every
//!   `--flow-interval-ms` and whenever one of its requests ends, letting through at most the verdict's
//!   `room` (a request let through counts against the room for [`LANDING`], until the router's ledger
//!   shows it);
//! - shed: past its band's deadline (`queue_deadline`, 503); a full queue gives up the newest request
//!   of the lowest band below the arrival (`displaced`, 503), or refuses the arrival (`queue_full`,
//!   503); a tenant with `--flow-tenant-queue` requests waiting in a pool is refused at once
//!   (`tenant_queue_full`, 429). Every shed answers in the client's protocol with `Retry-After`, and
//!   is settled like any refusal (the tenant's reservation given back).
//!
//! Off by default (`--flow-control`).

pub mod fair_queue;
pub mod reserve;
pub mod saturation;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kinference_api::metrics::Described;
use kinference_crds::TenantPriority;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::sync::{Notify, oneshot};

use crate::routing::pools::WorkerPressure;
use fair_queue::{Entry, FairQueue, ORDER, rank};
use reserve::Rates;
use saturation::{Thresholds, Verdict};

/// How long a request let through counts against its pool's room: time for the router to record it.
pub const LANDING: Duration = Duration::from_millis(20);

/// The flow control's flags (`kinference-gateway`).
#[derive(Debug, Clone, clap::Args)]
pub struct FlowSettings {
    /// Hold requests in the gateway while their pool is saturated (see `overload::flow`).
    #[arg(
        long = "flow-control",
        env = "KINFERENCE_FLOW_CONTROL",
        default_value_t = false
    )]
    pub enabled: bool,
    /// When a worker is full.
    #[command(flatten)]
    pub thresholds: Thresholds,
    /// Longest wait in the queue of the high, medium and low bands, in milliseconds, before the
    /// request is shed (503 with `Retry-After`); the lowest band's is shortest, so it is shed first
    /// (a band without a value: the last one given).
    #[arg(
        long = "flow-deadline-ms",
        env = "KINFERENCE_FLOW_DEADLINE_MS",
        value_delimiter = ',',
        default_value = "20000,10000,5000"
    )]
    pub deadline_ms: Vec<u64>,
    /// Most requests waiting in one pool's queue; past it the newest request of a lower band gives
    /// way to an arrival, or the arrival is shed (503).
    #[arg(
        long = "flow-queue-capacity",
        env = "KINFERENCE_FLOW_QUEUE_CAPACITY",
        default_value_t = 1_024
    )]
    pub capacity: usize,
    /// Most requests one tenant may have waiting in one pool; past it its requests are refused at
    /// once (429 with `Retry-After`).
    #[arg(
        long = "flow-tenant-queue",
        env = "KINFERENCE_FLOW_TENANT_QUEUE",
        default_value_t = 256
    )]
    pub per_tenant: usize,
    /// Tokens a tenant of weight 1 sends per turn of the fair queue (a request costs its prompt and
    /// reserved output tokens, at most 32 turns' worth).
    #[arg(
        long = "flow-quantum-tokens",
        env = "KINFERENCE_FLOW_QUANTUM_TOKENS",
        default_value_t = 1_024
    )]
    pub quantum_tokens: u64,
    /// How often a pool with requests waiting is judged again, in milliseconds (also whenever one
    /// of its requests ends).
    #[arg(
        long = "flow-interval-ms",
        env = "KINFERENCE_FLOW_INTERVAL_MS",
        default_value_t = 10
    )]
    pub interval_ms: u64,
    /// Least room kept for each band above: a medium-band request is let through only while the
    /// pool has more room than this, a low-band one more than twice this (room: requests the pool
    /// takes before it is saturated), so that a flood of low-priority requests leaves headroom for
    /// the latency-critical ones. The need sized from a band's traffic (`--flow-reserve-miss`) may
    /// keep more for it.
    #[arg(
        long = "flow-band-reserve",
        env = "KINFERENCE_FLOW_BAND_RESERVE",
        default_value_t = 0
    )]
    pub band_reserve: usize,
    /// The chance a request of a higher band may have of finding no room because a lower band took
    /// it: each band leaves free the sum of the room each band above needs, from that band's recent
    /// arrivals against the pool's recent request ends, 2 slots each before any end is seen
    /// (`overload::flow::reserve`); 0 turns this off (only `--flow-band-reserve` then).
    #[arg(
        long = "flow-reserve-miss",
        env = "KINFERENCE_FLOW_RESERVE_MISS",
        default_value_t = 0.05
    )]
    pub reserve_miss: f64,
    /// Most room sized from the traffic kept for one band (a lower band's reserve is the sum over
    /// the bands above it).
    #[arg(
        long = "flow-reserve-max",
        env = "KINFERENCE_FLOW_RESERVE_MAX",
        default_value_t = 4
    )]
    pub reserve_max: usize,
    /// `Retry-After` of a request the flow control sheds, in seconds.
    #[arg(
        long = "flow-retry-after-seconds",
        env = "KINFERENCE_FLOW_RETRY_AFTER_SECONDS",
        default_value_t = 2
    )]
    pub retry_after_s: u64,
}

impl Default for FlowSettings {
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            flow: FlowSettings,
        }
        <Only as clap::Parser>::parse_from(["kinference-gateway"]).flow
    }
}

impl FlowSettings {
    /// The room a request of `band` leaves to the bands above it now: for each of them, the larger
    /// of `--flow-band-reserve` and its need sized from its recent arrivals ([`reserve::need`]),
    /// summed, so that the reserves nest (the low band leaves the medium band's room and the high
    /// band's).
    fn reserve(&self, band: TenantPriority, rates: &mut Rates, now: Instant) -> usize {
        let mu = rates.ends(now);
        ORDER[..rank(band)]
            .iter()
            .map(|&above| {
                let sized = reserve::need(
                    rates.arrivals(above, now),
                    mu,
                    self.reserve_miss,
                    self.reserve_max,
                );
                self.band_reserve.max(sized)
            })
            .sum()
    }

    /// The queue deadline of `band`.
    pub fn deadline(&self, band: TenantPriority) -> Duration {
        let ms = self
            .deadline_ms
            .get(rank(band))
            .or(self.deadline_ms.last())
            .copied()
            .unwrap_or(5_000);
        Duration::from_millis(ms)
    }
}

/// Why a request was shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShedReason {
    /// It waited past its band's deadline.
    QueueDeadline,
    /// The queue was full and nothing of a lower band could give way.
    QueueFull,
    /// It gave way to a request of a higher band in a full queue.
    Displaced,
    /// Its tenant has as many requests waiting as it may.
    TenantQueueFull,
    /// No worker is estimated to meet its latency objective, and nothing else may serve it.
    ObjectiveUnmet,
}

impl ShedReason {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ShedReason::QueueDeadline => "queue_deadline",
            ShedReason::QueueFull => "queue_full",
            ShedReason::Displaced => "displaced",
            ShedReason::TenantQueueFull => "tenant_queue_full",
            ShedReason::ObjectiveUnmet => "objective_unmet",
        }
    }

    /// Whether the tenant's own share is the cause (429) rather than the pool's load (503).
    pub fn tenants_own(self) -> bool {
        self == ShedReason::TenantQueueFull
    }
}

/// A request the flow control will not let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shed {
    /// Why.
    pub reason: ShedReason,
    /// `Retry-After`, in seconds.
    pub retry_after_s: u64,
    /// How long it waited.
    pub waited: Duration,
}

/// What the flow control needs to know of a request.
#[derive(Debug, Clone)]
pub struct Ticket {
    /// Its band.
    pub band: TenantPriority,
    /// Its tenant (metric label and fairness flow).
    pub tenant: String,
    /// The tenant's weight in its band (at least 1).
    pub weight: u32,
    /// Its prompt and reserved output tokens.
    pub cost: u64,
    /// The tenant's own queue deadline, over the band's.
    pub deadline: Option<Duration>,
}

/// How a pool's workers are read: the router's [`crate::routing::Router::pressure`] of the pool.
pub type Probe = Arc<dyn Fn() -> Vec<WorkerPressure> + Send + Sync>;

/// A request let through: tells its pool when the request ends, so the waiting ones are judged
/// again at once. Held by the request's settlement.
#[derive(Debug)]
pub struct Passed {
    pool: Option<Arc<PoolFlow>>,
    /// How long it waited (zero: it went on at once).
    pub waited: Duration,
    /// The verdict that let it through, in one line (for `x-kinference-decision`).
    pub explain: Option<String>,
}

impl Drop for Passed {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            pool.state.lock().rates.ended(Instant::now());
            pool.wake.notify_one();
        }
    }
}

#[derive(Debug)]
enum Outcome {
    Pass(String),
    Shed(ShedReason),
}

type Waker = oneshot::Sender<Outcome>;

struct PoolState {
    queue: FairQueue<Waker>,
    next_id: u64,
    /// When requests were let through within [`LANDING`].
    recent: VecDeque<Instant>,
    /// Recent arrivals by band and request ends (the band reserves).
    rates: Rates,
    dispatching: bool,
}

impl PoolState {
    fn pending(&mut self, now: Instant) -> usize {
        while self
            .recent
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > LANDING)
        {
            self.recent.pop_front();
        }
        self.recent.len()
    }
}

/// One pool's waiting room.
pub struct PoolFlow {
    name: String,
    state: Mutex<PoolState>,
    probe: Mutex<Probe>,
    wake: Notify,
}

impl std::fmt::Debug for PoolFlow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolFlow")
            .field("name", &self.name)
            .finish()
    }
}

/// Labels of the per-pool metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolReasonLabels {
    pool: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolBandLabels {
    pool: String,
    band: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BandTenantLabels {
    band: &'static str,
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShedLabels {
    band: &'static str,
    tenant: String,
    reason: &'static str,
}

#[derive(Clone, Debug)]
struct FlowMetrics {
    saturated: Family<PoolReasonLabels, Gauge>,
    full_workers: Family<PoolLabels, Gauge>,
    queued: Family<PoolBandLabels, Gauge>,
    tenant_queued: Family<BandTenantLabels, Gauge>,
    wait: Family<BandTenantLabels, Histogram, fn() -> Histogram>,
    shed: Family<ShedLabels, Counter>,
}

fn wait_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

const REASONS: [saturation::Reason; 7] = [
    saturation::Reason::Queue,
    saturation::Reason::EngineWaiting,
    saturation::Reason::KvCache,
    saturation::Reason::AcceptBacklog,
    saturation::Reason::KernelTtfb,
    saturation::Reason::EstTtft,
    saturation::Reason::InFlight,
];

impl FlowMetrics {
    fn new(registry: &mut Registry) -> Self {
        let m = FlowMetrics {
            saturated: Family::default(),
            full_workers: Family::default(),
            queued: Family::default(),
            tenant_queued: Family::default(),
            wait: Family::new_with_constructor(wait_buckets as fn() -> Histogram),
            shed: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("kinference_gateway_flow");
        r.register(
            "saturated",
            "1 while the pool is saturated (every healthy worker full), labelled with the reason most of its workers gave; 0 otherwise",
            Described(m.saturated.clone()),
        );
        r.register(
            "full_workers",
            "Workers of the pool the saturation detector found full at its last judgement",
            Described(m.full_workers.clone()),
        );
        r.register(
            "queued",
            "Requests waiting in the gateway for room in their pool, by pool and band",
            Described(m.queued.clone()),
        );
        r.register(
            "tenant_queued",
            "Requests waiting in the gateway for room in their pool, by band and tenant",
            Described(m.tenant_queued.clone()),
        );
        r.register(
            "wait_seconds",
            "Time requests let through waited in the gateway's queue, by band and tenant",
            Described(m.wait.clone()),
        );
        r.register(
            "shed",
            "Requests the flow control refused (429/503 with Retry-After), by band, tenant and reason",
            Described(m.shed.clone()),
        );
        m
    }

    fn verdict(&self, pool: &str, verdict: &Verdict) {
        for reason in REASONS {
            let on = verdict.saturated && verdict.reason == Some(reason);
            self.saturated
                .get_or_create(&PoolReasonLabels {
                    pool: pool.to_string(),
                    reason: reason.as_str(),
                })
                .set(i64::from(on));
        }
        self.full_workers
            .get_or_create(&PoolLabels {
                pool: pool.to_string(),
            })
            .set(verdict.full as i64);
    }

    fn depth(&self, pool: &str, queue: &FairQueue<Waker>) {
        for band in ORDER {
            self.queued
                .get_or_create(&PoolBandLabels {
                    pool: pool.to_string(),
                    band: band.as_str(),
                })
                .set(queue.band_len(band) as i64);
        }
    }

    fn tenant_gauge(&self, band: TenantPriority, tenant: &str) -> Gauge {
        self.tenant_queued
            .get_or_create(&BandTenantLabels {
                band: band.as_str(),
                tenant: tenant.to_string(),
            })
            .clone()
    }

    fn waited(&self, band: TenantPriority, tenant: &str, waited: Duration) {
        self.wait
            .get_or_create(&BandTenantLabels {
                band: band.as_str(),
                tenant: tenant.to_string(),
            })
            .observe(waited.as_secs_f64());
    }

    fn shed(&self, band: TenantPriority, tenant: &str, reason: ShedReason) {
        self.shed
            .get_or_create(&ShedLabels {
                band: band.as_str(),
                tenant: tenant.to_string(),
                reason: reason.as_str(),
            })
            .inc();
    }
}

/// Every pool's waiting room (one per gateway, shared by both front doors).
#[derive(Debug, Clone)]
pub struct FlowControl {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    settings: FlowSettings,
    pools: Mutex<HashMap<String, Arc<PoolFlow>>>,
    metrics: FlowMetrics,
}

impl FlowControl {
    /// The flow control of `settings`, its metrics registered as `kinference_gateway_flow_*`.
    pub fn new(settings: FlowSettings, registry: &mut Registry) -> Self {
        FlowControl {
            inner: Arc::new(Inner {
                settings,
                pools: Mutex::default(),
                metrics: FlowMetrics::new(registry),
            }),
        }
    }

    /// Whether requests may wait here at all.
    pub fn enabled(&self) -> bool {
        self.inner.settings.enabled
    }

    /// The settings.
    pub fn settings(&self) -> &FlowSettings {
        &self.inner.settings
    }

    /// Refuses `ticket`'s request at once for `reason` (counted with the sheds), with the
    /// configured `Retry-After`; flow control on or off.
    pub fn refuse(&self, ticket: &Ticket, reason: ShedReason) -> Shed {
        self.inner.metrics.shed(ticket.band, &ticket.tenant, reason);
        Shed {
            reason,
            retry_after_s: self.inner.settings.retry_after_s,
            waited: Duration::ZERO,
        }
    }

    /// The saturation verdict on `probe`'s pool now (nothing let through counted).
    pub fn judge(&self, probe: &Probe) -> Verdict {
        saturation::judge(&probe(), 0, &self.inner.settings.thresholds)
    }

    /// Lets `ticket`'s request on to `pool` (read through `probe`) at once when the pool has room
    /// and nobody waits; else holds it until the dispatcher lets it through, or sheds it.
    pub async fn wait(&self, pool: &str, probe: Probe, ticket: Ticket) -> Result<Passed, Shed> {
        if !self.enabled() {
            return Ok(Passed {
                pool: None,
                waited: Duration::ZERO,
                explain: None,
            });
        }
        let inner = &self.inner;
        let flow = self.pool(pool, probe);
        let since = Instant::now();
        let rx = {
            let probe = Arc::clone(&*flow.probe.lock());
            // Read the workers outside the queue's lock; a judgement a moment old is as good.
            let workers = probe();
            let mut st = flow.state.lock();
            st.rates.arrived(ticket.band, since);
            // Nobody of its band or above waits: it need not queue behind lower bands' requests
            // (they wait for room it may take) nor wait for the dispatcher's next turn.
            if !st.queue.waiting_at_or_above(ticket.band) {
                let pending = st.pending(since);
                let verdict = saturation::judge(&workers, pending, &inner.settings.thresholds);
                inner.metrics.verdict(&flow.name, &verdict);
                let reserve = if verdict.idle {
                    0
                } else {
                    inner.settings.reserve(ticket.band, &mut st.rates, since)
                };
                if verdict.room > reserve {
                    st.recent.push_back(since);
                    return Ok(Passed {
                        pool: Some(Arc::clone(&flow)),
                        waited: Duration::ZERO,
                        explain: None,
                    });
                }
                tracing::debug!(pool = %flow.name, reason = verdict.reason.map(|r| r.as_str()), explain = %verdict.explain, "no room for the request's band: it waits");
            }
            let refuse = |reason| Shed {
                reason,
                retry_after_s: inner.settings.retry_after_s,
                waited: Duration::ZERO,
            };
            if st.queue.tenant_len(&ticket.tenant) >= inner.settings.per_tenant {
                inner
                    .metrics
                    .shed(ticket.band, &ticket.tenant, ShedReason::TenantQueueFull);
                return Err(refuse(ShedReason::TenantQueueFull));
            }
            if st.queue.len() >= inner.settings.capacity {
                match st.queue.displace_for(ticket.band) {
                    Some(victim) => {
                        self.settle_shed(&victim, ShedReason::Displaced);
                        let _ = victim.item.send(Outcome::Shed(ShedReason::Displaced));
                    }
                    None => {
                        inner
                            .metrics
                            .shed(ticket.band, &ticket.tenant, ShedReason::QueueFull);
                        return Err(refuse(ShedReason::QueueFull));
                    }
                }
            }
            let id = st.next_id;
            st.next_id += 1;
            let (tx, rx) = oneshot::channel();
            let deadline = ticket
                .deadline
                .unwrap_or_else(|| inner.settings.deadline(ticket.band));
            let cap = inner.settings.quantum_tokens.max(1) * 32;
            st.queue.push(
                Entry {
                    id,
                    band: ticket.band,
                    tenant: ticket.tenant.clone(),
                    cost: ticket.cost.clamp(1, cap),
                    since,
                    deadline: since + deadline,
                    item: tx,
                },
                ticket.weight,
            );
            inner
                .metrics
                .tenant_gauge(ticket.band, &ticket.tenant)
                .inc();
            inner.metrics.depth(&flow.name, &st.queue);
            if !st.dispatching {
                st.dispatching = true;
                tokio::spawn(dispatch(self.clone(), Arc::clone(&flow)));
            }
            Waiting {
                control: self,
                flow: &flow,
                id,
                rx: Some(rx),
            }
        };
        self.await_turn(rx, &ticket, since).await
    }

    async fn await_turn(
        &self,
        mut waiting: Waiting<'_>,
        ticket: &Ticket,
        since: Instant,
    ) -> Result<Passed, Shed> {
        let outcome = match waiting.rx.as_mut() {
            Some(rx) => rx.await,
            None => return Err(self.shed_now(ShedReason::QueueDeadline, since)),
        };
        waiting.rx = None;
        let waited = since.elapsed();
        match outcome {
            Ok(Outcome::Pass(explain)) => {
                self.inner
                    .metrics
                    .waited(ticket.band, &ticket.tenant, waited);
                Ok(Passed {
                    pool: Some(Arc::clone(waiting.flow)),
                    waited,
                    explain: Some(explain),
                })
            }
            Ok(Outcome::Shed(reason)) => Err(self.shed_now(reason, since)),
            // The dispatcher went away with the entry (it cannot while the gateway runs).
            Err(_) => Err(self.shed_now(ShedReason::QueueDeadline, since)),
        }
    }

    fn shed_now(&self, reason: ShedReason, since: Instant) -> Shed {
        Shed {
            reason,
            retry_after_s: self.inner.settings.retry_after_s,
            waited: since.elapsed(),
        }
    }

    /// The books of an entry leaving the queue shed: its tenant's gauge and the shed counter.
    fn settle_shed(&self, entry: &Entry<Waker>, reason: ShedReason) {
        let m = &self.inner.metrics;
        m.tenant_gauge(entry.band, &entry.tenant).dec();
        m.shed(entry.band, &entry.tenant, reason);
    }

    fn pool(&self, name: &str, probe: Probe) -> Arc<PoolFlow> {
        let mut pools = self.inner.pools.lock();
        let flow = pools.entry(name.to_string()).or_insert_with(|| {
            Arc::new(PoolFlow {
                name: name.to_string(),
                state: Mutex::new(PoolState {
                    queue: FairQueue::new(self.inner.settings.quantum_tokens),
                    next_id: 0,
                    recent: VecDeque::new(),
                    rates: Rates::default(),
                    dispatching: false,
                }),
                probe: Mutex::new(Arc::clone(&probe)),
                wake: Notify::new(),
            })
        });
        // The pool's workers as the latest request's plan names them.
        *flow.probe.lock() = probe;
        Arc::clone(flow)
    }

    /// Requests waiting for `pool` now.
    pub fn queued(&self, pool: &str) -> usize {
        self.inner
            .pools
            .lock()
            .get(pool)
            .map_or(0, |f| f.state.lock().queue.len())
    }
}

/// A queued request; dropped before its turn (the client went away), it leaves the queue.
struct Waiting<'a> {
    control: &'a FlowControl,
    flow: &'a Arc<PoolFlow>,
    id: u64,
    /// `None` once settled.
    rx: Option<oneshot::Receiver<Outcome>>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.rx.is_none() {
            return;
        }
        let mut st = self.flow.state.lock();
        if let Some(entry) = st.queue.remove(self.id) {
            let m = &self.control.inner.metrics;
            m.tenant_gauge(entry.band, &entry.tenant).dec();
            m.depth(&self.flow.name, &st.queue);
        }
        // Else the dispatcher let it through (counted in `recent`) or shed it just now: the slot
        // it would have taken is re-judged at the next tick.
    }
}

/// The dispatcher of one pool: runs while requests wait there, judging the pool every interval and
/// whenever one of its requests ends, shedding those past their deadline and letting through as
/// many as the pool has room for, best band first, fair within a band.
async fn dispatch(control: FlowControl, flow: Arc<PoolFlow>) {
    let inner = &control.inner;
    let interval = Duration::from_millis(inner.settings.interval_ms.max(1));
    loop {
        let _ = tokio::time::timeout(interval, flow.wake.notified()).await;
        let now = Instant::now();
        let pending = {
            let mut st = flow.state.lock();
            for entry in st.queue.expired(now) {
                control.settle_shed(&entry, ShedReason::QueueDeadline);
                let _ = entry.item.send(Outcome::Shed(ShedReason::QueueDeadline));
            }
            inner.metrics.depth(&flow.name, &st.queue);
            if st.queue.is_empty() {
                st.dispatching = false;
                return;
            }
            st.pending(now)
        };
        let probe = Arc::clone(&*flow.probe.lock());
        let verdict = saturation::judge(&probe(), pending, &inner.settings.thresholds);
        inner.metrics.verdict(&flow.name, &verdict);
        if verdict.saturated {
            continue;
        }
        let explain = format!(
            "flow: let through ({}/{} workers full; {})",
            verdict.full, verdict.workers, verdict.explain
        );
        let mut st = flow.state.lock();
        let mut room = verdict.room;
        // An idle pool holds no reserve, for its first request only: then it is busy.
        let mut idle = verdict.idle;
        while let Some(band) = st.queue.next_band() {
            let reserve = if idle {
                0
            } else {
                inner.settings.reserve(band, &mut st.rates, now)
            };
            if room <= reserve {
                break;
            }
            let Some(entry) = st.queue.pop() else { break };
            inner.metrics.tenant_gauge(entry.band, &entry.tenant).dec();
            // A waiter that is gone takes no room.
            if entry.item.send(Outcome::Pass(explain.clone())).is_ok() {
                st.recent.push_back(now);
                room -= 1;
                idle = false;
            }
        }
        inner.metrics.depth(&flow.name, &st.queue);
    }
}

#[cfg(test)]
mod tests;
