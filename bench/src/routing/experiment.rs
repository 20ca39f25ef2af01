//! The experiment matrix: every workload x concurrency x policy, on the same request sequence, each run
//! starting from cold caches.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::client::{LoadClient, Route, RunExtras};
use super::cluster::{Cluster, ClusterError};
use super::fleet::{FleetChange, FleetPlan};
use super::oracle::Oracle;
use super::policy::Policy;
use super::stats::{RequestOutcome, RunSummary, summarize};
use super::workload::{Workload, WorkloadKind, WorkloadShape};

#[cfg(test)]
mod tests;

/// How many requests a run sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RequestCount {
    /// The same number at every concurrency.
    Fixed(usize),
    /// `max(min, per_user x concurrency)`: enough requests per virtual user that the run is not only
    /// the initial burst.
    Scaled {
        /// Lower bound.
        min: usize,
        /// Requests per virtual user.
        per_user: usize,
    },
}

impl RequestCount {
    /// Requests for a run at `concurrency`.
    pub fn for_concurrency(self, concurrency: usize) -> usize {
        match self {
            Self::Fixed(n) => n,
            Self::Scaled { min, per_user } => min.max(per_user * concurrency),
        }
    }
}

/// What to run.
#[derive(Debug, Clone, Serialize)]
pub struct ExperimentConfig {
    /// Workloads, in order.
    pub workloads: Vec<WorkloadKind>,
    /// Concurrency levels (virtual users), in order.
    pub concurrency: Vec<usize>,
    /// Policies, in order.
    pub policies: Vec<Policy>,
    /// Requests per run.
    pub requests: RequestCount,
    /// Requests sent before each measured run, through the same policy, not measured (`None`: twice
    /// the number of shared prefixes for shared-prefix, none otherwise).
    pub warmup: Option<usize>,
    /// Seed of the request sequences.
    pub seed: u64,
    /// Simulator time scale (wall = simulated x scale).
    pub time_scale: f64,
    /// Prompt sizes.
    pub shape: WorkloadShape,
    /// Wall-clock pause after a cache reset (lets `AllBlocksCleared` reach the gateways).
    #[serde(skip)]
    pub settle: Duration,
}

impl ExperimentConfig {
    /// Warm-up requests before a measured run of `kind`.
    ///
    /// A run starts from empty caches; without a warm-up, the first request for each shared prefix is a
    /// compulsory miss under every policy and short runs would measure start-up, not routing. Two
    /// requests per prefix bring the caches to their steady state (multi-turn conversations and unique
    /// prompts have no state to build up across sessions).
    pub fn warmup_for(&self, kind: WorkloadKind) -> usize {
        self.warmup.unwrap_or(match kind {
            WorkloadKind::SharedPrefix
            | WorkloadKind::Heterogeneous
            | WorkloadKind::Restart
            | WorkloadKind::Bursty => 2 * self.shape.shared_prefixes,
            WorkloadKind::Unique | WorkloadKind::MultiTurn => 0,
        })
    }

    /// Conversations per virtual user in a scaled multi-turn run.
    pub const MULTI_TURN_SESSIONS_PER_USER: usize = 2;

    /// Requests in a measured run of `kind` at `concurrency`.
    ///
    /// A multi-turn run scales by whole conversations: a virtual user sends a session's turns one after
    /// another, so a run of fewer than `concurrency` sessions leaves users idle and measures a lower
    /// concurrency than it names (96 requests are 16 conversations of 6 turns). With the scaled count it
    /// holds at least [`Self::MULTI_TURN_SESSIONS_PER_USER`] sessions per user.
    pub fn requests_for(&self, kind: WorkloadKind, concurrency: usize) -> usize {
        let n = self.requests.for_concurrency(concurrency);
        match (kind, self.requests) {
            (WorkloadKind::MultiTurn, RequestCount::Scaled { .. }) => {
                n.max(Self::MULTI_TURN_SESSIONS_PER_USER * concurrency * self.shape.mean_turns())
            }
            _ => n,
        }
    }

    /// The warm-up phase and the measured sequence of a run at `concurrency`. A bursty run's measured
    /// sessions arrive in bursts of `concurrency` ([`Workload::schedule_bursts`]); its warm-up does not.
    pub fn sequences(&self, kind: WorkloadKind, concurrency: usize) -> (Workload, Workload) {
        let warmup = self.warmup_for(kind);
        let n = self.requests_for(kind, concurrency);
        let (warmup, mut measured) =
            Workload::generate(kind, &self.shape, self.seed, warmup + n).split_at_requests(warmup);
        if kind == WorkloadKind::Bursty {
            measured.schedule_bursts(&self.shape, concurrency, self.seed);
        }
        (warmup, measured)
    }

    /// Virtual users of a run at `concurrency`: as many, except for bursty runs, whose concurrency is
    /// the burst size and whose users only carry the arrivals: four bursts' worth, so that a burst is
    /// sent on time unless four are still unanswered (and then the wait counts in its TTFT).
    pub fn users_for(&self, kind: WorkloadKind, concurrency: usize) -> usize {
        match kind {
            WorkloadKind::Bursty => 4 * concurrency.max(1),
            _ => concurrency,
        }
    }

    /// The mixed fleet `kind` runs on (`None`: the cluster's identical workers).
    pub fn fleet_for(&self, kind: WorkloadKind) -> Option<FleetPlan> {
        FleetPlan::for_workload(kind)
    }

    /// Number of runs in the matrix.
    pub fn runs(&self) -> usize {
        self.workloads.len() * self.concurrency.len() * self.policies.len()
    }
}

/// One run's results.
#[derive(Debug, Clone, Serialize)]
pub struct RunRecord {
    /// Workload.
    pub workload: WorkloadKind,
    /// Policy.
    pub policy: Policy,
    /// Virtual users.
    pub concurrency: usize,
    /// The figures (simulated time).
    pub summary: RunSummary,
    /// `vllm:prefix_cache_hits_total / queries_total` over the run, all workers.
    pub cache_hit_share: Option<f64>,
    /// Wall-clock seconds the run took.
    pub wall_s: f64,
    /// Why the policy could not run this workload (a peer that failed to install or start); the
    /// summary is then empty.
    pub unavailable: Option<String>,
    /// Every request's measurements (for decision logs; not in the JSON summary).
    #[serde(skip)]
    pub outcomes: Vec<RequestOutcome>,
}

/// Where the matrix stands, for progress lines.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Runs finished, including this one.
    pub done: usize,
    /// Runs in all.
    pub total: usize,
    /// Wall-clock time since the experiment started.
    pub elapsed: Duration,
    /// Estimated time left.
    pub eta: Duration,
}

/// Errors that stop the experiment.
#[derive(Debug, thiserror::Error)]
pub enum ExperimentError {
    /// A policy has no gateway in the cluster.
    #[error("no gateway runs routing mode {0}")]
    NoGateway(String),
    /// A peer policy was asked for but none was registered ([`Cluster::set_peer`]).
    #[error("peer {0} was not set up")]
    NoPeer(String),
    /// The cluster failed.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

/// Runs one workload at one concurrency through one policy, from cold caches: the warm-up phase (not
/// measured), then the measured sequence.
#[allow(clippy::too_many_arguments)]
pub async fn run_one(
    cluster: &Cluster,
    client: &LoadClient,
    oracle: &Arc<Oracle>,
    warmup: &Workload,
    workload: &Workload,
    policy: Policy,
    concurrency: usize,
    config: &ExperimentConfig,
) -> Result<RunRecord, ExperimentError> {
    let route = match policy.gateway_mode() {
        None if policy.is_peer() => match cluster.peer(policy) {
            None => return Err(ExperimentError::NoPeer(policy.to_string())),
            Some(Err(reason)) => {
                return Ok(RunRecord {
                    workload: workload.kind,
                    policy,
                    concurrency,
                    summary: RunSummary::default(),
                    cache_hit_share: None,
                    wall_s: 0.0,
                    unavailable: Some(reason.clone()),
                    outcomes: Vec::new(),
                });
            }
            Some(Ok(route)) => route.clone(),
        },
        None => Route::Oracle(Arc::clone(oracle)),
        Some(mode) => Route::Endpoint(
            cluster
                .gateway(mode)
                .ok_or_else(|| ExperimentError::NoGateway(mode.to_string()))?
                .url
                .clone(),
        ),
    };
    run_on(
        cluster,
        client,
        &route,
        warmup,
        workload,
        policy,
        concurrency,
        config,
    )
    .await
}

/// [`run_one`] through a given `route` (recorded as `policy`): e.g. several replicas of one gateway
/// mode behind a random front ([`Route::Front`]).
#[allow(clippy::too_many_arguments)]
pub async fn run_on(
    cluster: &Cluster,
    client: &LoadClient,
    route: &Route,
    warmup: &Workload,
    workload: &Workload,
    policy: Policy,
    concurrency: usize,
    config: &ExperimentConfig,
) -> Result<RunRecord, ExperimentError> {
    // A mixed fleet starts every run at its initial speeds (the previous run's event slowed a worker).
    let fleet = config.fleet_for(workload.kind);
    for (i, w) in fleet.iter().flat_map(|f| f.workers.iter().enumerate()) {
        cluster.set_slowdown(i, w.slowdown).await?;
    }
    cluster.reset_caches(config.settle).await?;
    if !warmup.is_empty() {
        client.run(route, warmup, concurrency).await;
    }
    let before = cluster.cache_counters().await.ok();
    let fleet_event = fleet.as_ref().and_then(|f| f.event);
    // A restarted worker's counters start over: the workers' own hit share would mix two runs.
    let restarts = matches!(
        fleet_event.map(|e| e.change),
        Some(FleetChange::Restart { .. })
    );
    let event = fleet_event.map(|e| {
        let time_scale = config.time_scale;
        let change: futures::future::BoxFuture<'_, ()> = Box::pin(async move {
            let done = match e.change {
                FleetChange::Slowdown(factor) => cluster.set_slowdown(e.worker, factor).await,
                FleetChange::Restart { down_s } => {
                    let down = Duration::from_secs_f64(down_s * time_scale);
                    cluster.restart_worker(e.worker, down).await
                }
            };
            if let Err(err) = done {
                tracing::warn!(worker = e.worker, change = ?e.change, error = %err, "mid-run fleet event failed");
            }
        });
        (e.at_session(workload.sessions.len()), change)
    });
    let extras = RunExtras {
        time_scale: config.time_scale,
        event,
    };
    let users = config.users_for(workload.kind, concurrency);
    let result = client.run_with(route, workload, users, extras).await;
    let after = cluster.cache_counters().await.ok();
    let summary = summarize(
        &result.outcomes,
        result.wall,
        config.time_scale,
        workload.kind.ttft_slo_s(),
    );
    Ok(RunRecord {
        workload: workload.kind,
        policy,
        concurrency,
        summary,
        cache_hit_share: before
            .zip(after)
            .filter(|_| !restarts)
            .map(|(b, a)| a.hit_share_since(&b)),
        wall_s: result.wall.as_secs_f64(),
        unavailable: None,
        outcomes: result.outcomes,
    })
}

/// Runs the whole matrix: for each workload and concurrency, every policy on the same sequence.
/// `on_run` is called after each run (progress lines, incremental writes).
pub async fn run_matrix(
    cluster: &mut Cluster,
    client: &LoadClient,
    oracle: &Arc<Oracle>,
    config: &ExperimentConfig,
    mut on_run: impl FnMut(&Progress, &RunRecord),
) -> Result<Vec<RunRecord>, ExperimentError> {
    let start = Instant::now();
    let total = config.runs();
    let mut records = Vec::with_capacity(total);
    for &kind in &config.workloads {
        for &concurrency in &config.concurrency {
            let (warmup, workload) = config.sequences(kind, concurrency);
            for &policy in &config.policies {
                cluster.check_alive()?;
                let record = run_one(
                    cluster,
                    client,
                    oracle,
                    &warmup,
                    &workload,
                    policy,
                    concurrency,
                    config,
                )
                .await?;
                records.push(record);
                let elapsed = start.elapsed();
                let done = records.len();
                let eta = estimate_left(&records, config, elapsed);
                on_run(
                    &Progress {
                        done,
                        total,
                        elapsed,
                        eta,
                    },
                    &records[done - 1],
                );
            }
        }
    }
    Ok(records)
}

/// Time left, from the runs so far: a run's wall time grows with its request count, so the estimate
/// scales the measured seconds per request to the requests still to send.
fn estimate_left(records: &[RunRecord], config: &ExperimentConfig, elapsed: Duration) -> Duration {
    let sent: usize = records.iter().map(|r| r.summary.n).sum();
    let planned: usize = config
        .workloads
        .iter()
        .flat_map(|&w| config.concurrency.iter().map(move |&c| (w, c)))
        .map(|(w, c)| config.requests_for(w, c) * config.policies.len())
        .sum::<usize>()
        + config
            .workloads
            .iter()
            .map(|&w| config.warmup_for(w) * config.concurrency.len() * config.policies.len())
            .sum::<usize>();
    let sent = sent
        + records
            .iter()
            .map(|r| config.warmup_for(r.workload))
            .sum::<usize>();
    if sent == 0 {
        return Duration::ZERO;
    }
    let per_request = elapsed.as_secs_f64() / sent as f64;
    Duration::from_secs_f64(per_request * planned.saturating_sub(sent) as f64)
}
