//! Worker health: a background prober of each worker's `/health`, and the [`Health`] record that
//! turns probes and real traffic into whether the router may pick a worker.
//!
//! - Hysteresis: a worker is ejected after `--health-unhealthy-threshold` consecutive failed
//!   probes (one slow probe ejects nothing) and comes back after `--health-healthy-threshold`
//!   consecutive good ones. The first probe of a worker decides at once, so nothing routes to a
//!   worker that was down when the gateway started, and until a worker has once been healthy one
//!   good probe brings it in (as Envoy does at start-up): a fleet still loading joins as soon as it
//!   answers.
//! - A refused connection from real traffic (the request is retried elsewhere) is one more failure
//!   toward the same `--health-unhealthy-threshold` as a failed probe, not an ejection by itself:
//!   one refusal can be a passing accident (a full listen backlog in a burst, a server restarting
//!   its socket), and ejecting on it moves the worker's whole load onto the others at once, the
//!   cascade hysteresis is there to prevent. A worker that is really gone refuses every request,
//!   so under traffic the threshold is reached within a few requests anyway, and without traffic
//!   the probes find it. The one fast path: a refusal ejects at once when the worker's last probe
//!   failed too, since then the two signals agree. Either way it needs the good probes to return.
//! - Outlier detection: a worker whose real requests fail (5xx, broken connections, timeouts) at
//!   `--outlier-error-rate` or more within a window, over at least `--outlier-min-requests`, is
//!   ejected for `--outlier-ejection-ms` although its probes pass.
//! - The cap (Envoy's panic threshold idea): no more than `--outlier-max-ejected-percent` of a
//!   model's workers are out at once counting both kinds; an outlier past the cap stays in
//!   service (state `spared`), because an error rate shared by most of the fleet says more about
//!   the traffic than about the workers.
//!
//! Each worker's state is the gauge `kinference_gateway_worker_health{worker,state}` (1 for its
//! state, 0 for the others) and every transition is logged.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

use super::worker::Upstream;

/// Time between two probe rounds while a worker has failed every probe so far (a worker still
/// starting, or a gateway started beside its workers): it comes in within this, not a full interval.
const STARTING_PROBE_INTERVAL: Duration = Duration::from_millis(250);
use crate::metrics::Metrics;
use crate::routing::{Router, WorkerView};

/// Hysteresis and outlier detection (flags of `kinference-gateway`).
#[derive(Debug, Clone, clap::Args)]
pub struct HealthSettings {
    /// Consecutive failed `/health` probes that eject a worker.
    #[arg(long, env = "KINFERENCE_HEALTH_UNHEALTHY_THRESHOLD", default_value_t = 3,
        value_parser = clap::value_parser!(u32).range(1..))]
    pub health_unhealthy_threshold: u32,

    /// Consecutive good `/health` probes that bring an ejected worker back.
    #[arg(long, env = "KINFERENCE_HEALTH_HEALTHY_THRESHOLD", default_value_t = 2,
        value_parser = clap::value_parser!(u32).range(1..))]
    pub health_healthy_threshold: u32,

    /// Share of a worker's requests in the window that failed (5xx, broken connection, timeout)
    /// that ejects it as an outlier; 0 turns outlier detection off.
    #[arg(long, env = "KINFERENCE_OUTLIER_ERROR_RATE", default_value_t = 0.5)]
    pub outlier_error_rate: f64,

    /// Fewest requests in the window before a worker's error rate counts.
    #[arg(long, env = "KINFERENCE_OUTLIER_MIN_REQUESTS", default_value_t = 20)]
    pub outlier_min_requests: u32,

    /// Length of the error-rate window, in milliseconds.
    #[arg(long, env = "KINFERENCE_OUTLIER_WINDOW_MS", default_value_t = 10_000)]
    pub outlier_window_ms: u64,

    /// How long an outlier stays ejected, in milliseconds.
    #[arg(long, env = "KINFERENCE_OUTLIER_EJECTION_MS", default_value_t = 30_000)]
    pub outlier_ejection_ms: u64,

    /// Most of a model's workers out at once (ejected by probes or as outliers), in percent;
    /// outliers past it stay in service.
    #[arg(long, env = "KINFERENCE_OUTLIER_MAX_EJECTED_PERCENT", default_value_t = 50,
        value_parser = clap::value_parser!(u8).range(0..=100))]
    pub outlier_max_ejected_percent: u8,
}

impl Default for HealthSettings {
    fn default() -> Self {
        // The clap defaults: parse an empty command line.
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            health: HealthSettings,
        }
        <Only as clap::Parser>::parse_from(["kinference-gateway"]).health
    }
}

/// Where a worker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkerState {
    /// Picked by the router.
    Healthy,
    /// Out: its probes (or connections) failed, until enough good probes.
    Ejected,
    /// Out: its real traffic failed too often, until the ejection time has passed.
    Outlier,
    /// Its traffic fails too often, but the cap on ejections keeps it in service.
    Spared,
}

impl WorkerState {
    const ALL: [WorkerState; 4] = [
        WorkerState::Healthy,
        WorkerState::Ejected,
        WorkerState::Outlier,
        WorkerState::Spared,
    ];

    /// Label value of the state gauge.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Healthy => "healthy",
            WorkerState::Ejected => "ejected",
            WorkerState::Outlier => "outlier",
            WorkerState::Spared => "spared",
        }
    }

    /// Whether the router may pick the worker.
    pub fn routable(self) -> bool {
        matches!(self, WorkerState::Healthy | WorkerState::Spared)
    }
}

/// Labels of the state gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    /// Worker base URL (from the configuration or discovery, so bounded).
    worker: String,
    /// `healthy`, `ejected`, `outlier`, `spared`.
    state: &'static str,
}

/// What is known of one worker.
#[derive(Debug)]
struct Tracked {
    /// Probed at least once (the first probe decides at once).
    probed: bool,
    /// Out by probes (or refused connections).
    down: bool,
    /// The last probe failed (a refused connection then ejects at once).
    probe_failing: bool,
    /// Has been in service once (before that, one good probe brings it in).
    served: bool,
    consecutive_failures: u32,
    consecutive_successes: u32,
    /// Flagged by its error rate (since when), whether or not the cap let it be ejected.
    outlier_since: Option<Instant>,
    window_start: Instant,
    requests: u32,
    errors: u32,
    /// The state last published.
    shown: Option<WorkerState>,
}

impl Tracked {
    fn new(now: Instant) -> Self {
        Tracked {
            probed: false,
            down: false,
            probe_failing: false,
            served: false,
            consecutive_failures: 0,
            consecutive_successes: 0,
            outlier_since: None,
            window_start: now,
            requests: 0,
            errors: 0,
            shown: None,
        }
    }

    fn reset_window(&mut self, now: Instant) {
        self.window_start = now;
        self.requests = 0;
        self.errors = 0;
    }
}

/// The health record of every worker; tells the router which ones it may pick.
#[derive(Debug)]
pub struct Health {
    settings: HealthSettings,
    router: Arc<Router>,
    metrics: Metrics,
    states: Family<StateLabels, Gauge>,
    workers: Mutex<HashMap<String, Tracked>>,
}

impl super::worker::Outcomes for Health {
    fn observe(&self, worker: &str, ok: bool) {
        Health::observe(self, worker, ok);
    }
}

impl Health {
    /// A record for `router`'s workers, its gauge registered as `kinference_gateway_worker_health`.
    pub fn new(
        settings: HealthSettings,
        router: Arc<Router>,
        metrics: Metrics,
        registry: &mut Registry,
    ) -> Self {
        let states = Family::<StateLabels, Gauge>::default();
        registry.sub_registry_with_prefix("kinference_gateway").register(
            "worker_health",
            "1 for the worker's health state (healthy, ejected by probes, outlier by error rate, spared by the ejection cap), 0 for the others",
            kinference_api::metrics::Described(states.clone()),
        );
        Health {
            settings,
            router,
            metrics,
            states,
            workers: Mutex::default(),
        }
    }

    /// A probe's outcome.
    pub fn probe(&self, worker: &str, ok: bool) {
        let now = Instant::now();
        {
            let mut workers = self.workers.lock();
            let t = workers
                .entry(worker.to_string())
                .or_insert_with(|| Tracked::new(now));
            t.probe_failing = !ok;
            if !t.probed {
                t.probed = true;
                t.down = !ok;
                t.served = ok;
            } else if ok {
                t.consecutive_failures = 0;
                if t.down {
                    t.consecutive_successes += 1;
                    if !t.served
                        || t.consecutive_successes >= self.settings.health_healthy_threshold
                    {
                        t.down = false;
                        t.consecutive_successes = 0;
                    }
                }
                t.served |= !t.down;
            } else {
                t.consecutive_successes = 0;
                t.consecutive_failures += 1;
                if t.consecutive_failures >= self.settings.health_unhealthy_threshold {
                    t.down = true;
                }
            }
        }
        self.apply();
    }

    /// A request could not connect to `worker` (refused, or no answer within the connect timeout):
    /// one failure toward the ejection threshold, or an ejection at once when its last probe
    /// failed too.
    pub fn connect_failed(&self, worker: &str) {
        let now = Instant::now();
        {
            let mut workers = self.workers.lock();
            let t = workers
                .entry(worker.to_string())
                .or_insert_with(|| Tracked::new(now));
            t.consecutive_successes = 0;
            t.consecutive_failures += 1;
            if t.probe_failing || t.consecutive_failures >= self.settings.health_unhealthy_threshold
            {
                t.down = true;
            }
        }
        self.apply();
        self.observe(worker, false);
    }

    /// A real request's outcome at `worker`: `ok` unless it failed on the worker's side (5xx, a
    /// broken connection, a timeout).
    pub fn observe(&self, worker: &str, ok: bool) {
        let rate = self.settings.outlier_error_rate;
        if rate <= 0.0 {
            return;
        }
        let now = Instant::now();
        let flagged = {
            let mut workers = self.workers.lock();
            // Looked up without a new key on the hot path: probes have met every worker already.
            if !workers.contains_key(worker) {
                workers.insert(worker.to_string(), Tracked::new(now));
            }
            let Some(t) = workers.get_mut(worker) else {
                return;
            };
            if now.duration_since(t.window_start) > self.window() {
                t.reset_window(now);
            }
            t.requests += 1;
            t.errors += u32::from(!ok);
            let outlier = t.outlier_since.is_none()
                && t.requests >= self.settings.outlier_min_requests
                && f64::from(t.errors) >= rate * f64::from(t.requests);
            if outlier {
                t.outlier_since = Some(now);
                t.reset_window(now);
            }
            outlier
        };
        if flagged {
            self.apply();
        }
    }

    /// Ends the ejections that have lasted long enough (the prober calls it every round).
    pub fn expire(&self) {
        let now = Instant::now();
        let ejection = Duration::from_millis(self.settings.outlier_ejection_ms);
        let expired = {
            let mut workers = self.workers.lock();
            let mut expired = false;
            for t in workers.values_mut() {
                if t.outlier_since
                    .is_some_and(|s| now.duration_since(s) >= ejection)
                {
                    t.outlier_since = None;
                    t.reset_window(now);
                    expired = true;
                }
            }
            expired
        };
        if expired {
            self.apply();
        }
    }

    /// Drops the record, state gauges and `worker_healthy` series of every worker the router no longer lists (discovery
    /// removed it): a worker that comes back at the same URL, a new pod with a reused IP, starts afresh.
    fn forget_unlisted(&self, listed: &[WorkerView]) {
        let listed: HashSet<&str> = listed.iter().map(|w| w.url.as_str()).collect();
        let mut forgotten = Vec::new();
        self.workers.lock().retain(|url, _| {
            let keep = listed.contains(url.as_str());
            if !keep {
                forgotten.push(url.clone());
            }
            keep
        });
        for worker in forgotten {
            self.metrics.forget_worker(&worker);
            for s in WorkerState::ALL {
                self.states.remove(&StateLabels {
                    worker: worker.clone(),
                    state: s.as_str(),
                });
            }
        }
    }

    fn window(&self) -> Duration {
        Duration::from_millis(self.settings.outlier_window_ms)
    }

    /// Whether a worker has been probed but never come into service yet.
    pub fn any_starting(&self) -> bool {
        self.workers
            .lock()
            .values()
            .any(|t| t.probed && t.down && !t.served)
    }

    /// Each worker's state now.
    pub fn states(&self) -> Vec<(String, WorkerState)> {
        self.decide()
    }

    /// Each worker's state from what is known, with the cap applied per model: the workers down
    /// by probes count first, then outliers in the order they were flagged while room is left.
    fn decide(&self) -> Vec<(String, WorkerState)> {
        let views = self.router.workers();
        let workers = self.workers.lock();
        let mut by_model: HashMap<&str, Vec<&str>> = HashMap::new();
        for v in &views {
            by_model.entry(&v.model).or_default().push(&v.url);
        }
        let mut out = Vec::with_capacity(views.len());
        for urls in by_model.values() {
            let cap = urls.len() * usize::from(self.settings.outlier_max_ejected_percent) / 100;
            let down = urls
                .iter()
                .filter(|u| workers.get(**u).is_some_and(|t| t.down))
                .count();
            let mut room = cap.saturating_sub(down);
            let mut outliers: Vec<(&str, Instant)> = urls
                .iter()
                .filter_map(|u| {
                    let t = workers.get(*u)?;
                    (!t.down).then_some((*u, t.outlier_since?))
                })
                .collect();
            outliers.sort_by_key(|(_, since)| *since);
            let mut outlier_state: HashMap<&str, WorkerState> = HashMap::new();
            for (url, _) in outliers {
                let state = if room > 0 {
                    room -= 1;
                    WorkerState::Outlier
                } else {
                    WorkerState::Spared
                };
                outlier_state.insert(url, state);
            }
            for url in urls {
                let state = match workers.get(*url) {
                    Some(t) if t.down => WorkerState::Ejected,
                    _ => outlier_state
                        .get(url)
                        .copied()
                        .unwrap_or(WorkerState::Healthy),
                };
                out.push((url.to_string(), state));
            }
        }
        out
    }

    /// Publishes every worker's state: to the router, the gauges and the log (on a change).
    fn apply(&self) {
        for (worker, state) in self.decide() {
            let previous = {
                let mut workers = self.workers.lock();
                let t = workers
                    .entry(worker.clone())
                    .or_insert_with(|| Tracked::new(Instant::now()));
                t.shown.replace(state)
            };
            if previous == Some(state) {
                continue;
            }
            match (previous, state) {
                (None, WorkerState::Healthy) => {}
                (_, WorkerState::Healthy) => tracing::info!(%worker, "worker healthy"),
                (_, WorkerState::Ejected) => {
                    tracing::warn!(%worker, "worker ejected: its probes or connections fail");
                }
                (_, WorkerState::Outlier) => tracing::warn!(%worker,
                    ejection_ms = self.settings.outlier_ejection_ms,
                    "worker ejected as an outlier: its requests fail too often"),
                (_, WorkerState::Spared) => tracing::warn!(%worker,
                    max_ejected_percent = self.settings.outlier_max_ejected_percent,
                    "worker's requests fail too often, but the ejection cap keeps it in service"),
            }
            self.router.set_healthy(&worker, state.routable());
            self.metrics.worker_health(&worker, state.routable());
            for s in WorkerState::ALL {
                self.states
                    .get_or_create(&StateLabels {
                        worker: worker.clone(),
                        state: s.as_str(),
                    })
                    .set(i64::from(s == state));
            }
        }
    }
}

/// What probing needs: the workers' health record, the worker client, the probe timings.
#[derive(Debug, Clone)]
pub struct Prober {
    /// Told each probe's outcome.
    pub health: Arc<Health>,
    /// The worker client.
    pub upstream: Upstream,
    /// Time between two rounds.
    pub interval: Duration,
    /// Timeout of one probe.
    pub timeout: Duration,
}

impl Prober {
    /// Probes every worker every `interval`, forever. Call [`Prober::probe_all`] once before
    /// serving so that `/readyz` and routing reflect reality from the first request on.
    /// While a worker has never passed a probe, rounds come every [`STARTING_PROBE_INTERVAL`].
    pub async fn run(self) {
        loop {
            let wait = if self.health.any_starting() {
                self.interval.min(STARTING_PROBE_INTERVAL)
            } else {
                self.interval
            };
            tokio::time::sleep(wait).await;
            self.probe_all().await;
        }
    }

    /// Forgets the workers that left, probes every worker once, concurrently (bounded by the probe
    /// timeout), then ends the outlier ejections that are over.
    pub async fn probe_all(&self) {
        let workers = self.health.router.workers();
        self.health.forget_unlisted(&workers);
        let probes = workers.iter().map(|w| self.probe_one(&w.url));
        futures::future::join_all(probes).await;
        self.health.expire();
    }

    async fn probe_one(&self, worker: &str) {
        let result = self.upstream.probe(worker, "/health", self.timeout).await;
        let healthy = matches!(result, Ok(status) if status.is_success());
        match &result {
            Ok(status) if !healthy => tracing::debug!(%worker, %status, "probe failed"),
            Err(error) => tracing::debug!(%worker, %error, "probe failed"),
            Ok(_) => {}
        }
        self.health.probe(worker, healthy);
    }
}

#[cfg(test)]
mod tests;
