//! `routing-bench --replicas`: how routing quality changes as one gateway becomes several replicas.
//!
//! The same workers, the same request sequence, the `kinference` gateway run as 1, 2 or 4 replicas
//! behind a random front ([`super::client::Route::Front`]: each request to a replica drawn from the
//! seed, its session and its turn, as a Kubernetes Service spreads connections, with no affinity).
//! Each row is one run; the report puts every N beside N = 1 of the same workload, concurrency and
//! seed, as ratios.

use std::path::Path;

use serde::Serialize;

use super::stats::RunSummary;
use super::workload::WorkloadKind;

/// One run: a workload at a concurrency through N replicas.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaRecord {
    /// Workload.
    pub workload: WorkloadKind,
    /// Virtual users (bursty: the burst size).
    pub concurrency: usize,
    /// Gateway replicas behind the front.
    pub replicas: usize,
    /// Seed of the sequence and of the front's draws.
    pub seed: u64,
    /// Whether the replicas told each other what they dispatched.
    pub share_dispatches: bool,
    /// The figures (simulated time).
    pub summary: RunSummary,
    /// `vllm:prefix_cache_hits_total / queries_total` over the run, all workers.
    pub cache_hit_share: Option<f64>,
    /// Wall-clock seconds the run took.
    pub wall_s: f64,
}

/// The rows of one `--replicas` command, with how they were made.
#[derive(Debug, Serialize)]
pub struct ReplicaReport<'a> {
    /// The command that reproduces it.
    pub command: String,
    /// Machine, fleet, build.
    pub setup: serde_json::Value,
    /// Every run so far.
    pub records: &'a [ReplicaRecord],
}

impl ReplicaReport<'_> {
    /// Writes `replicas-{label}.json` and `replicas-{label}.md` into `dir`.
    pub fn write_all(&self, dir: &Path, label: &str) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let json = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(dir.join(format!("replicas-{label}.json")), json + "\n")?;
        std::fs::write(dir.join(format!("replicas-{label}.md")), self.markdown())
    }

    /// The table: one row per run, its ratios to N = 1 of the same workload, concurrency and seed.
    pub fn markdown(&self) -> String {
        let mut md = format!(
            "# Gateway replicas behind a random front\n\n```sh\n{}\n```\n\nSetup: `{}`\n\n\
             Simulated seconds. hit = the workers' prefix-cache hit share over the run; goodput = \
             requests within the TTFT SLO per simulated minute; x1 = ratio to one replica (same \
             workload, concurrency, seed).\n\n\
             | workload | c | seed | N | shared | n | err | hit | TTFT p50 (s) | TTFT p90 (s) | goodput (/min) | hit x1 | p90 x1 | goodput x1 |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
            self.command, self.setup
        );
        for r in self.records {
            let one = self.records.iter().find(|o| {
                o.replicas == 1
                    && o.workload == r.workload
                    && o.concurrency == r.concurrency
                    && o.seed == r.seed
            });
            let ratio = |a: f64, b: f64| {
                if b > 0.0 {
                    format!("{:.2}", a / b)
                } else {
                    "-".to_string()
                }
            };
            let hit = r.cache_hit_share.unwrap_or(f64::NAN);
            let s = &r.summary;
            let (hit_x1, p90_x1, goodput_x1) = match one {
                Some(o) => (
                    ratio(hit, o.cache_hit_share.unwrap_or(f64::NAN)),
                    ratio(s.p90_ttft_s, o.summary.p90_ttft_s),
                    ratio(s.goodput_rpm, o.summary.goodput_rpm),
                ),
                None => ("-".into(), "-".into(), "-".into()),
            };
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {:.1}% | {:.2} | {:.2} | {:.1} | {hit_x1} | {p90_x1} | {goodput_x1} |\n",
                r.workload.as_str(),
                r.concurrency,
                r.seed,
                r.replicas,
                if r.share_dispatches { "yes" } else { "no" },
                s.n,
                s.errors,
                100.0 * hit,
                s.median_ttft_s,
                s.p90_ttft_s,
                s.goodput_rpm,
            ));
        }
        md
    }
}
