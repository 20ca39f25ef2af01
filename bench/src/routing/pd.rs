//! Prefill/decode disaggregation in the routing benchmark (`routing-bench --pd`): Kinference's P/D
//! gateway against vllm-router's and smg's P/D modes on the same simulated pairs, with Kinference
//! aggregated (the same workers, each taking whole requests) as the baseline where splitting does not
//! pay.
//!
//! - The fleet: `prefill` workers started as vLLM `kv_producer`s and `decode` workers as
//!   `kv_consumer`s (`vllm-sim --kv-role`, [`PdFleet`]); every router gets the same workers, each run
//!   starts from cold caches.
//! - [`PdWorkload`]: unique prompts, long with a short answer (where a split pays: a decode worker
//!   streams without long prefills between its steps) or short with a long answer (where it does not:
//!   there is little to prefill and a decode worker should just run it).
//! - [`PdRouter`]: the rows; [`peer_plan`] is each peer's P/D command line (pure, unit-tested).
//! - [`summarize`]: TTFT median and p90, time per output token (TPOT), goodput within both SLOs
//!   (DistServe's definition: TTFT and TPOT met) and the KV pulls of the decode workers, which tell a
//!   real split from a prompt computed twice.
//! - [`run_matrix`] runs every workload x concurrency with the routers side by side (their order
//!   rotating by round), and [`Report`] writes `pd.json` and `pd.md` with the ratios measured in the same
//!   run.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;
use serde_json::{Value, json};

use super::client::{LoadClient, Route};
use super::cluster::{Cluster, ClusterError, metric_sum};
use super::peers::{LaunchPlan, PeerContext, PeerRouter};
use super::stats::RequestOutcome;
use super::workload::{Workload, WorkloadKind, WorkloadShape};
use crate::harness::http::HttpClient;
use crate::stats::percentile;

#[cfg(test)]
mod tests;

/// The two P/D workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PdWorkload {
    /// ~2,500-token unique prompts, 24 output tokens.
    LongPromptShortAnswer,
    /// ~150-token unique prompts, 256 output tokens.
    ShortPromptLongAnswer,
}

impl PdWorkload {
    /// Both, in report order.
    pub const ALL: [PdWorkload; 2] = [Self::LongPromptShortAnswer, Self::ShortPromptLongAnswer];

    /// The name on the command line and in the results.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::LongPromptShortAnswer => "long-prompt-short-answer",
            Self::ShortPromptLongAnswer => "short-prompt-long-answer",
        }
    }

    /// Prompt and answer sizes (the `unique` generator: nothing shared between prompts, so that no
    /// router gains from a cache and the split is all that differs).
    pub fn shape(self) -> WorkloadShape {
        let (prefix_words, question_words, max_tokens) = match self {
            // About 0.8 s of prefill each on the calibrated worker; 16 running on one decode worker
            // hold ~40k tokens of its 65k-token cache.
            Self::LongPromptShortAnswer => (2000, (0, 1000), 24),
            // Under Kinference's default 512-token split threshold: run whole.
            Self::ShortPromptLongAnswer => (100, (0, 100), 256),
        };
        WorkloadShape {
            prefix_words,
            question_words,
            max_tokens,
            ..WorkloadShape::default()
        }
    }

    /// The service-level objectives of goodput, simulated seconds: (TTFT, TPOT). TTFT as the routing
    /// benchmark's 8 s for long prompts, 2 s for short ones (nothing to prefill); TPOT 100 ms, about
    /// three times the calibrated worker's 31 ms step at batch 1 (what a reader still reads as fluent).
    pub fn slo_s(self) -> (f64, f64) {
        match self {
            Self::LongPromptShortAnswer => (8.0, 0.1),
            Self::ShortPromptLongAnswer => (2.0, 0.1),
        }
    }

    /// Whether splitting is expected to pay on this workload (the aggregated baseline's target is
    /// judged where it is not).
    pub fn split_pays(self) -> bool {
        self == Self::LongPromptShortAnswer
    }
}

impl std::str::FromStr for PdWorkload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|w| w.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown P/D workload {s:?} (expected {})",
                    Self::ALL.map(Self::as_str).join(" or ")
                )
            })
    }
}

/// The rows of the P/D benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PdRouter {
    /// The Kinference gateway, workers with their roles: it splits what pays and runs the rest whole
    /// on a decode worker.
    KinferencePd,
    /// The Kinference gateway, the same workers without roles: every request whole on any worker.
    KinferenceAggregated,
    /// vllm-router `--vllm-pd-disaggregation` (NIXL's two-step protocol).
    VllmRouterPd,
    /// smg `--pd-disaggregation`.
    SmgPd,
}

impl PdRouter {
    /// Every row, in report order.
    pub const ALL: [PdRouter; 4] = [
        Self::KinferencePd,
        Self::KinferenceAggregated,
        Self::VllmRouterPd,
        Self::SmgPd,
    ];

    /// The row name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::KinferencePd => "kinference-pd",
            Self::KinferenceAggregated => "kinference-aggregated",
            Self::VllmRouterPd => "vllm-router-pd",
            Self::SmgPd => "smg-pd",
        }
    }

    /// The gateway mode of a Kinference row (`-aggregated`: the roles left out, see
    /// [`super::cluster::AGGREGATED_SUFFIX`]).
    pub fn gateway_mode(self) -> Option<&'static str> {
        match self {
            Self::KinferencePd => Some("kinference"),
            Self::KinferenceAggregated => Some("kinference-aggregated"),
            _ => None,
        }
    }

    /// The package of a peer row.
    pub fn peer(self) -> Option<PeerRouter> {
        match self {
            Self::VllmRouterPd => Some(PeerRouter::VllmRouter),
            Self::SmgPd => Some(PeerRouter::Smg),
            _ => None,
        }
    }
}

/// How many workers of each role; prefill workers first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PdFleet {
    /// `kv_producer` workers (gateway role `prefill`).
    pub prefill: usize,
    /// `kv_consumer` workers (gateway role `decode`).
    pub decode: usize,
}

impl PdFleet {
    /// Workers in all.
    pub fn workers(&self) -> usize {
        self.prefill + self.decode
    }

    /// Each worker's extra `vllm-sim` arguments: its KV connector's role.
    pub fn worker_args(&self) -> Vec<Vec<String>> {
        self.roles()
            .map(|(kv_role, _)| vec!["--kv-role".to_string(), kv_role.to_string()])
            .collect()
    }

    /// Each worker's gateway role.
    pub fn gateway_roles(&self) -> Vec<String> {
        self.roles().map(|(_, role)| role.to_string()).collect()
    }

    fn roles(&self) -> impl Iterator<Item = (&'static str, &'static str)> {
        std::iter::repeat_n(("kv_producer", "prefill"), self.prefill)
            .chain(std::iter::repeat_n(("kv_consumer", "decode"), self.decode))
    }

    /// Splits worker URLs (in fleet order) into (prefill, decode).
    pub fn split<'a>(&self, urls: &'a [String]) -> (&'a [String], &'a [String]) {
        urls.split_at(self.prefill.min(urls.len()))
    }
}

/// A peer's P/D launch plan: the prefill and decode lists in its own flags, round-robin on both sides
/// (neither peer has a load signal from these workers that its other policies would use; both
/// default to cache_aware, which on unique prompts is load-only with extra work per request).
pub fn peer_plan(
    router: PeerRouter,
    ctx: &PeerContext,
    prefill: &[String],
    decode: &[String],
    policy: &str,
) -> Option<LaunchPlan> {
    let mut args: Vec<String> = vec![];
    let (program, log_level) = match router {
        PeerRouter::VllmRouter => {
            // NIXL (the default connector): the prefill request asks `do_remote_decode`, the decode
            // request carries the returned `kv_transfer_params`.
            args.push("--vllm-pd-disaggregation".into());
            for url in prefill {
                args.extend(["--prefill".into(), url.clone()]);
            }
            ("vllm-router", "warning")
        }
        PeerRouter::Smg => {
            args.extend(["launch".into(), "--pd-disaggregation".into()]);
            // The prefill worker's HTTP port as its bootstrap port: what vllm-sim answers rooms on
            // (smg only sends rooms to workers it takes for SGLang; see the module docs of
            // `crate::sim::kv_transfer`).
            for url in prefill {
                let port = url.rsplit(':').next().unwrap_or_default().to_string();
                args.extend(["--prefill".into(), url.clone(), port]);
            }
            ("smg", "warn")
        }
        PeerRouter::SglangRouter | PeerRouter::Litellm => return None,
    };
    for url in decode {
        args.extend(["--decode".into(), url.clone()]);
    }
    args.extend([
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        ctx.port.to_string(),
        "--policy".into(),
        policy.into(),
        "--prometheus-host".into(),
        "127.0.0.1".into(),
        "--prometheus-port".into(),
        ctx.metrics_port.to_string(),
        "--log-level".into(),
        log_level.into(),
    ]);
    Some(LaunchPlan {
        program,
        args,
        env: vec![],
        files: vec![],
        api_key: None,
    })
}

/// The figures of one run, in simulated seconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PdSummary {
    /// Requests sent.
    pub n: usize,
    /// Requests that failed.
    pub errors: usize,
    /// Median TTFT.
    pub median_ttft_s: f64,
    /// 90th percentile TTFT.
    pub p90_ttft_s: f64,
    /// Median time per output token: (end - first token) / (output tokens - 1), per request.
    pub median_tpot_s: f64,
    /// 90th percentile of the same.
    pub p90_tpot_s: f64,
    /// Requests that met both SLOs, per simulated minute.
    pub goodput_rpm: f64,
    /// Successful requests per simulated minute.
    pub throughput_rpm: f64,
    /// Share of the successful requests that met both SLOs.
    pub slo_met_share: f64,
    /// (TTFT, TPOT) SLOs.
    pub slo_s: (f64, f64),
    /// KV caches the decode workers pulled during the run, per request sent.
    pub kv_pulls_per_request: f64,
    /// Simulated duration: first request sent to last finished.
    pub duration_s: f64,
}

/// Time per output token of one request, wall clock: `None` without a first token or with one token.
/// Output tokens come from the usage chunk, else `max_tokens` (the simulator always generates that
/// many; a router may drop the usage chunk).
pub fn tpot(outcome: &RequestOutcome, max_tokens: u32) -> Option<Duration> {
    let (ttft, e2e) = (outcome.ttft?, outcome.e2e?);
    let tokens = outcome
        .completion_tokens
        .unwrap_or(u64::from(max_tokens))
        .checked_sub(1)
        .filter(|n| *n > 0)?;
    Some(e2e.saturating_sub(ttft) / u32::try_from(tokens).ok()?)
}

/// Summarizes one run.
pub fn summarize(
    outcomes: &[RequestOutcome],
    wall: Duration,
    time_scale: f64,
    workload: PdWorkload,
    kv_pulls: f64,
) -> PdSummary {
    let max_tokens = workload.shape().max_tokens;
    let (ttft_slo, tpot_slo) = workload.slo_s();
    let sim = |d: Duration| d.as_secs_f64() / time_scale;
    let ok: Vec<&RequestOutcome> = outcomes.iter().filter(|o| o.ok()).collect();
    let sorted = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v
    };
    let ttfts = sorted(ok.iter().filter_map(|o| o.ttft).map(sim).collect());
    let tpots = sorted(
        ok.iter()
            .filter_map(|o| tpot(o, max_tokens))
            .map(sim)
            .collect(),
    );
    let met = ok
        .iter()
        .filter(|o| {
            o.ttft.is_some_and(|t| sim(t) <= ttft_slo)
                && tpot(o, max_tokens).is_none_or(|t| sim(t) <= tpot_slo)
        })
        .count();
    let duration_s = sim(wall);
    let per_minute = |n: usize| {
        if duration_s > 0.0 {
            n as f64 * 60.0 / duration_s
        } else {
            0.0
        }
    };
    PdSummary {
        n: outcomes.len(),
        errors: outcomes.len() - ok.len(),
        median_ttft_s: percentile(&ttfts, 50.0),
        p90_ttft_s: percentile(&ttfts, 90.0),
        median_tpot_s: percentile(&tpots, 50.0),
        p90_tpot_s: percentile(&tpots, 90.0),
        goodput_rpm: per_minute(met),
        throughput_rpm: per_minute(ok.len()),
        slo_met_share: if ok.is_empty() {
            0.0
        } else {
            met as f64 / ok.len() as f64
        },
        slo_s: (ttft_slo, tpot_slo),
        kv_pulls_per_request: if outcomes.is_empty() {
            0.0
        } else {
            kv_pulls / outcomes.len() as f64
        },
        duration_s,
    }
}

/// One run: a router on a workload at a concurrency, in a round.
#[derive(Debug, Clone, Serialize)]
pub struct PdRecord {
    /// The workload.
    pub workload: PdWorkload,
    /// Virtual users.
    pub concurrency: usize,
    /// The row.
    pub router: PdRouter,
    /// Round, from 0.
    pub round: usize,
    /// Its figures; `None` when the router could not run.
    pub summary: Option<PdSummary>,
    /// Why it could not run.
    pub unavailable: Option<String>,
    /// The first decision header of a split request (Kinference rows asked with `x-kinference-debug`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split_decision: Option<String>,
    /// Wall seconds the run took.
    pub wall_s: f64,
}

/// What the matrix runs.
#[derive(Debug, Clone, Serialize)]
pub struct PdConfig {
    /// Workloads.
    pub workloads: Vec<PdWorkload>,
    /// Concurrency levels.
    pub concurrency: Vec<usize>,
    /// Rows.
    pub routers: Vec<PdRouter>,
    /// Requests per run: max(`min_requests`, `per_user` x concurrency).
    pub min_requests: usize,
    /// See `min_requests`.
    pub requests_per_user: usize,
    /// Rounds of the whole matrix (the routers' order rotates by one each round).
    pub rounds: usize,
    /// Seed of the prompts (the same prompts for every router in a round; round `r` uses seed + r).
    pub seed: u64,
    /// Simulator time scale.
    pub time_scale: f64,
}

impl PdConfig {
    /// Requests of one run at `concurrency`.
    pub fn requests_for(&self, concurrency: usize) -> usize {
        self.min_requests.max(self.requests_per_user * concurrency)
    }
}

/// Where each row sends its requests, or why it cannot run.
pub type Routes = BTreeMap<PdRouter, Result<Route, String>>;

/// Sum of the decode workers' `kinference_sim_kv_pulls_total`.
async fn kv_pulls(http: &HttpClient, workers: &[String]) -> f64 {
    let mut total = 0.0;
    for w in workers {
        if let Ok(text) = http.get_text(&format!("{w}/metrics")).await {
            total += metric_sum(&text, "kinference_sim_kv_pulls_total");
        }
    }
    total
}

/// Runs every round x workload x concurrency x router, calling `done` after each run.
pub async fn run_matrix(
    cluster: &mut Cluster,
    client: &LoadClient,
    http: &HttpClient,
    routes: &Routes,
    config: &PdConfig,
    mut done: impl FnMut(&PdRecord),
) -> Result<Vec<PdRecord>, ClusterError> {
    let mut records = Vec::new();
    for round in 0..config.rounds.max(1) {
        for &workload in &config.workloads {
            for &concurrency in &config.concurrency {
                let sequence = Workload::generate(
                    WorkloadKind::Unique,
                    &workload.shape(),
                    config.seed + round as u64,
                    config.requests_for(concurrency),
                );
                let mut order = config.routers.clone();
                let turn = round % order.len().max(1);
                order.rotate_left(turn);
                for router in order {
                    let started = std::time::Instant::now();
                    let mut record = PdRecord {
                        workload,
                        concurrency,
                        router,
                        round,
                        summary: None,
                        unavailable: None,
                        split_decision: None,
                        wall_s: 0.0,
                    };
                    match routes.get(&router) {
                        Some(Ok(route)) => {
                            cluster.check_alive()?;
                            cluster.reset_caches(Duration::from_millis(300)).await?;
                            let before = kv_pulls(http, cluster.workers()).await;
                            let result = client.run(route, &sequence, concurrency).await;
                            let pulls = kv_pulls(http, cluster.workers()).await - before;
                            record.split_decision = result
                                .outcomes
                                .iter()
                                .filter_map(|o| o.decision.as_deref())
                                .find(|d| d.contains("pd=split"))
                                .map(str::to_string);
                            record.summary = Some(summarize(
                                &result.outcomes,
                                result.wall,
                                config.time_scale,
                                workload,
                                pulls,
                            ));
                        }
                        Some(Err(why)) => record.unavailable = Some(why.clone()),
                        None => record.unavailable = Some("not started".into()),
                    }
                    record.wall_s = started.elapsed().as_secs_f64();
                    done(&record);
                    records.push(record);
                }
            }
        }
    }
    Ok(records)
}

/// Median of the non-NaN values (NaN when none).
fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| !x.is_nan());
    v.sort_by(f64::total_cmp);
    percentile(&v, 50.0)
}

/// One row of the report: a router's medians over rounds on one workload and concurrency.
#[derive(Debug, Clone, Serialize)]
pub struct PdRow {
    /// The workload.
    pub workload: PdWorkload,
    /// Virtual users.
    pub concurrency: usize,
    /// The router.
    pub router: PdRouter,
    /// Rounds measured.
    pub rounds: usize,
    /// Medians over rounds of each figure (`None`: could not run).
    pub median: Option<PdSummary>,
    /// Median over rounds of Kinference P/D's goodput / this row's, each pair from the same round.
    pub kinference_goodput_ratio: Option<f64>,
    /// Why it could not run.
    pub unavailable: Option<String>,
}

/// A target of issue 36, judged on the rows.
#[derive(Debug, Clone, Serialize)]
pub struct PdTarget {
    /// What is required.
    pub name: String,
    /// The measured ratio.
    pub measured: f64,
    /// The ratio required (at least).
    pub required: f64,
    /// Whether it was met.
    pub met: bool,
}

/// The rows of `records`: medians over rounds, ratios paired by round.
pub fn rows(records: &[PdRecord]) -> Vec<PdRow> {
    let mut keys: Vec<(PdWorkload, usize, PdRouter)> = records
        .iter()
        .map(|r| (r.workload, r.concurrency, r.router))
        .collect();
    keys.sort();
    keys.dedup();
    let goodput = |w: PdWorkload, c: usize, router: PdRouter, round: usize| {
        records
            .iter()
            .find(|r| {
                r.workload == w && r.concurrency == c && r.router == router && r.round == round
            })
            .and_then(|r| r.summary.as_ref())
            .map(|s| s.goodput_rpm)
    };
    keys.into_iter()
        .map(|(workload, concurrency, router)| {
            let runs: Vec<&PdRecord> = records
                .iter()
                .filter(|r| {
                    r.workload == workload && r.concurrency == concurrency && r.router == router
                })
                .collect();
            let sums: Vec<&PdSummary> = runs.iter().filter_map(|r| r.summary.as_ref()).collect();
            let m = |f: fn(&PdSummary) -> f64| median(sums.iter().map(|s| f(s)).collect());
            let median_summary = (!sums.is_empty()).then(|| PdSummary {
                n: sums.iter().map(|s| s.n).sum(),
                errors: sums.iter().map(|s| s.errors).sum(),
                median_ttft_s: m(|s| s.median_ttft_s),
                p90_ttft_s: m(|s| s.p90_ttft_s),
                median_tpot_s: m(|s| s.median_tpot_s),
                p90_tpot_s: m(|s| s.p90_tpot_s),
                goodput_rpm: m(|s| s.goodput_rpm),
                throughput_rpm: m(|s| s.throughput_rpm),
                slo_met_share: m(|s| s.slo_met_share),
                slo_s: sums[0].slo_s,
                kv_pulls_per_request: m(|s| s.kv_pulls_per_request),
                duration_s: m(|s| s.duration_s),
            });
            let ratios: Vec<f64> = runs
                .iter()
                .filter_map(|r| {
                    let ours = goodput(workload, concurrency, PdRouter::KinferencePd, r.round)?;
                    let theirs = r.summary.as_ref()?.goodput_rpm;
                    Some(if theirs > 0.0 {
                        ours / theirs
                    } else if ours > 0.0 {
                        f64::INFINITY
                    } else {
                        f64::NAN
                    })
                })
                .collect();
            PdRow {
                workload,
                concurrency,
                router,
                rounds: sums.len(),
                median: median_summary,
                kinference_goodput_ratio: (!ratios.is_empty())
                    .then(|| median(ratios))
                    .filter(|r| !r.is_nan()),
                unavailable: runs.iter().find_map(|r| r.unavailable.clone()),
            }
        })
        .collect()
}

/// Issue 36's targets: ahead of every peer on goodput at the highest concurrency (every workload), and
/// no worse than aggregated serving (within `tolerance`) where splitting does not pay.
pub fn targets(rows: &[PdRow], tolerance: f64) -> Vec<PdTarget> {
    let top = rows.iter().map(|r| r.concurrency).max().unwrap_or(0);
    let mut out = Vec::new();
    for row in rows {
        let Some(ratio) = row.kinference_goodput_ratio else {
            continue;
        };
        if row.router.peer().is_some() && row.concurrency == top {
            out.push(PdTarget {
                name: format!(
                    "goodput kinference-pd / {} ({}, c={})",
                    row.router.as_str(),
                    row.workload.as_str(),
                    row.concurrency
                ),
                measured: ratio,
                required: 1.0,
                met: ratio > 1.0,
            });
        }
        if row.router == PdRouter::KinferenceAggregated && !row.workload.split_pays() {
            out.push(PdTarget {
                name: format!(
                    "goodput kinference-pd / kinference-aggregated ({}, c={})",
                    row.workload.as_str(),
                    row.concurrency
                ),
                measured: ratio,
                required: 1.0 - tolerance,
                met: ratio >= 1.0 - tolerance,
            });
        }
    }
    out
}

/// `pd.json` and `pd.md`.
pub struct Report<'a> {
    /// The command that produced it.
    pub command: String,
    /// Fleet, machine and peer versions.
    pub setup: Value,
    /// What ran.
    pub config: &'a PdConfig,
    /// Every run.
    pub records: &'a [PdRecord],
    /// Notes per row (e.g. what a peer sends), printed under the table.
    pub notes: BTreeMap<PdRouter, String>,
}

/// Tolerance of the "no worse than aggregated" target: 5% of goodput (run-to-run noise here).
pub const AGGREGATED_TOLERANCE: f64 = 0.05;

impl Report<'_> {
    /// The JSON document.
    pub fn json(&self) -> Value {
        let rows = rows(self.records);
        json!({
            "command": self.command,
            "setup": self.setup,
            "config": self.config,
            "rows": rows,
            "targets": targets(&rows, AGGREGATED_TOLERANCE),
            "notes": self.notes.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect::<BTreeMap<_, _>>(),
            "runs": self.records,
        })
    }

    /// The markdown table.
    pub fn markdown(&self) -> String {
        let rows = rows(self.records);
        let mut md = String::new();
        let _ = writeln!(md, "```sh\n{}\n```\n", self.command);
        let _ = writeln!(
            md,
            "Simulated seconds (`l40s-27b-fp8` workers). Medians over {} round(s); ratio = Kinference P/D's goodput / the row's, paired by round. Goodput: requests meeting both SLOs per simulated minute. KV pulls: transfers the decode workers made per request (0 for a router whose split moves no KV).\n",
            self.config.rounds.max(1)
        );
        let mut current = None;
        for row in &rows {
            if current != Some((row.workload, row.concurrency)) {
                current = Some((row.workload, row.concurrency));
                let (ttft, tpot) = row.workload.slo_s();
                let _ = writeln!(
                    md,
                    "\n### {} c={} (SLO: TTFT <= {ttft} s, TPOT <= {} ms)\n\n| router | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | goodput /min | SLO met | KV pulls/req | errors | ratio |\n|---|---|---|---|---|---|---|---|---|---|",
                    row.workload.as_str(),
                    row.concurrency,
                    tpot * 1e3
                );
            }
            match &row.median {
                Some(s) => {
                    let _ = writeln!(
                        md,
                        "| {} | {:.2} s | {:.2} s | {:.0} ms | {:.0} ms | {:.1} | {:.0}% | {:.2} | {}/{} | {} |",
                        row.router.as_str(),
                        s.median_ttft_s,
                        s.p90_ttft_s,
                        s.median_tpot_s * 1e3,
                        s.p90_tpot_s * 1e3,
                        s.goodput_rpm,
                        100.0 * s.slo_met_share,
                        s.kv_pulls_per_request,
                        s.errors,
                        s.n,
                        row.kinference_goodput_ratio
                            .map_or("-".to_string(), |r| format!("{r:.2}")),
                    );
                }
                None => {
                    let _ = writeln!(
                        md,
                        "| {} | n/a: {} | | | | | | | | |",
                        row.router.as_str(),
                        row.unavailable.as_deref().unwrap_or("did not run")
                    );
                }
            }
        }
        if !self.notes.is_empty() {
            md.push_str("\nNotes:\n");
            for (router, note) in &self.notes {
                let _ = writeln!(md, "- **{}**: {note}", router.as_str());
            }
        }
        md.push_str("\nTargets:\n");
        for t in targets(&rows, AGGREGATED_TOLERANCE) {
            let _ = writeln!(
                md,
                "- [{}] {}: {:.2} (required {} {:.2})",
                if t.met { "met" } else { "NOT MET" },
                t.name,
                t.measured,
                if t.required >= 1.0 { ">" } else { ">=" },
                t.required
            );
        }
        if let Some(d) = self
            .records
            .iter()
            .find_map(|r| r.split_decision.as_deref())
        {
            let _ = writeln!(
                md,
                "\nA split request's decision header (`x-kinference-decision`, first one of the run):\n\n```\n{d}\n```"
            );
        }
        md
    }

    /// Writes `pd.json` and `pd.md` into `dir`.
    pub fn write_all(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let json = serde_json::to_string_pretty(&self.json()).unwrap_or_default();
        std::fs::write(dir.join("pd.json"), json + "\n")?;
        std::fs::write(dir.join("pd.md"), self.markdown())
    }
}
