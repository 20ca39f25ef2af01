//! The figures of one run: median and p90 TTFT, median end-to-end latency, goodput within the TTFT SLO.
//!
//! Measurements are taken in wall-clock time against workers that run `time_scale` times faster (or
//! slower) than the hardware they simulate; every figure here is converted back to simulated time by
//! dividing by the time scale, so results read like the published ones.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use crate::stats::percentile;

#[cfg(test)]
mod tests;

/// What the client measured for one request (wall-clock times).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RequestOutcome {
    /// Session and turn of the request in the sequence.
    pub session: usize,
    /// Turn within the session.
    pub turn: usize,
    /// When the request was sent, from the start of the run.
    pub sent_at: Duration,
    /// Time to the first non-empty content chunk; `None` when the request failed before it.
    pub ttft: Option<Duration>,
    /// Time to the end of the stream; `None` when the request failed.
    pub e2e: Option<Duration>,
    /// The worker that served it (gateway header `x-kinference-worker`, or the oracle's pick).
    pub worker: Option<String>,
    /// Prompt tokens reported in the usage chunk.
    pub prompt_tokens: Option<u64>,
    /// Cached prompt tokens reported in the usage chunk.
    pub cached_tokens: Option<u64>,
    /// Completion tokens reported in the usage chunk.
    pub completion_tokens: Option<u64>,
    /// The router's explanation (gateway `x-kinference-decision`, or the oracle's estimates).
    pub decision: Option<String>,
    /// Why the request failed.
    pub error: Option<String>,
}

impl RequestOutcome {
    /// Whether the request completed (status 200 and a full stream).
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.e2e.is_some()
    }
}

/// The summary of one run, in simulated seconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunSummary {
    /// Requests sent.
    pub n: usize,
    /// Requests that failed.
    pub errors: usize,
    /// Median TTFT of the successful requests.
    pub median_ttft_s: f64,
    /// 90th percentile TTFT of the successful requests.
    pub p90_ttft_s: f64,
    /// Median end-to-end latency of the successful requests.
    pub median_e2e_s: f64,
    /// Successful requests with TTFT within the SLO, per simulated minute of the run.
    pub goodput_rpm: f64,
    /// Successful requests per simulated minute.
    pub throughput_rpm: f64,
    /// Share of successful requests whose TTFT met the SLO.
    pub slo_met_share: f64,
    /// The TTFT SLO used for goodput.
    pub ttft_slo_s: f64,
    /// Simulated duration of the run: from the first request sent to the last one finished.
    pub duration_s: f64,
    /// Cached prompt tokens / prompt tokens, from the usage the workers reported.
    pub cached_token_share: f64,
    /// Mean prompt tokens of the successful requests (from their usage).
    pub mean_prompt_tokens: f64,
    /// Requests per worker.
    pub per_worker: BTreeMap<String, usize>,
}

fn sorted_secs(values: impl Iterator<Item = Duration>, time_scale: f64) -> Vec<f64> {
    let mut v: Vec<f64> = values.map(|d| d.as_secs_f64() / time_scale).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// Summarizes a run of `outcomes` that took `wall` (wall-clock) against workers at `time_scale`.
pub fn summarize(
    outcomes: &[RequestOutcome],
    wall: Duration,
    time_scale: f64,
    ttft_slo_s: f64,
) -> RunSummary {
    let ok: Vec<&RequestOutcome> = outcomes.iter().filter(|o| o.ok()).collect();
    let ttfts = sorted_secs(ok.iter().filter_map(|o| o.ttft), time_scale);
    let e2es = sorted_secs(ok.iter().filter_map(|o| o.e2e), time_scale);
    let met = ttfts.iter().filter(|t| **t <= ttft_slo_s).count();
    let duration_s = wall.as_secs_f64() / time_scale;
    let per_minute = |count: usize| {
        if duration_s > 0.0 {
            count as f64 * 60.0 / duration_s
        } else {
            0.0
        }
    };
    let prompt: u64 = ok.iter().filter_map(|o| o.prompt_tokens).sum();
    let cached: u64 = ok.iter().filter_map(|o| o.cached_tokens).sum();
    let mut per_worker = BTreeMap::new();
    for o in outcomes {
        if let Some(w) = &o.worker {
            *per_worker.entry(w.clone()).or_insert(0) += 1;
        }
    }
    RunSummary {
        n: outcomes.len(),
        errors: outcomes.len() - ok.len(),
        median_ttft_s: percentile(&ttfts, 50.0),
        p90_ttft_s: percentile(&ttfts, 90.0),
        median_e2e_s: percentile(&e2es, 50.0),
        goodput_rpm: per_minute(met),
        throughput_rpm: per_minute(ok.len()),
        slo_met_share: if ok.is_empty() {
            0.0
        } else {
            met as f64 / ok.len() as f64
        },
        ttft_slo_s,
        duration_s,
        cached_token_share: if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        },
        mean_prompt_tokens: if ok.is_empty() {
            0.0
        } else {
            prompt as f64 / ok.len() as f64
        },
        per_worker,
    }
}

/// Geometric mean of positive finite values (`NaN` when there are none).
pub fn geometric_mean(values: impl IntoIterator<Item = f64>) -> f64 {
    let (sum, n) = values
        .into_iter()
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((0.0, 0usize), |(s, n), v| (s + v.ln(), n + 1));
    if n == 0 {
        f64::NAN
    } else {
        (sum / n as f64).exp()
    }
}
