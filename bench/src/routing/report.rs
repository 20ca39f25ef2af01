//! The benchmark's results: `routing.json`, `routing.md` (tables and the issue's targets) and
//! `routing.svg` (median TTFT against concurrency, one panel per workload).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;
use serde_json::{Value, json};

use super::experiment::{ExperimentConfig, RunRecord};
use super::policy::Policy;
use super::stats::{RunSummary, geometric_mean};
use super::workload::WorkloadKind;

mod plot;
#[cfg(test)]
mod tests;

pub use plot::write_svg;

/// Errors writing the results.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file could not be written.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The plot could not be drawn.
    #[error("drawing {path}: {message}")]
    Plot {
        /// The file.
        path: String,
        /// Why.
        message: String,
    },
}

/// One of the issue's targets, checked on the measured runs.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    /// What is compared.
    pub name: String,
    /// The measured value.
    pub measured: f64,
    /// The bound, e.g. `>= 20`.
    pub required: String,
    /// Whether it is met.
    pub met: bool,
    /// The per-concurrency values behind it.
    pub detail: String,
}

/// The results of an experiment, ready to be written.
pub struct Report<'a> {
    /// The exact command that produced them.
    pub command: String,
    /// Cluster and tool settings for the record (time scale, preset, workers, build...).
    pub setup: Value,
    /// The matrix that was run.
    pub config: &'a ExperimentConfig,
    /// The runs.
    pub records: &'a [RunRecord],
}

fn run_json(r: &RunRecord) -> Value {
    let s = &r.summary;
    json!({
        "median_ttft_s": s.median_ttft_s,
        "p90_ttft_s": s.p90_ttft_s,
        "median_e2e_s": s.median_e2e_s,
        "goodput_rpm": s.goodput_rpm,
        "throughput_rpm": s.throughput_rpm,
        "slo_met_share": s.slo_met_share,
        "ttft_slo_s": s.ttft_slo_s,
        "n": s.n,
        "errors": s.errors,
        "duration_s": s.duration_s,
        "cached_token_share": s.cached_token_share,
        "mean_prompt_tokens": s.mean_prompt_tokens,
        "cache_hit_share": r.cache_hit_share,
        "per_worker": s.per_worker,
        "wall_s": r.wall_s,
        "unavailable": r.unavailable,
    })
}

impl Report<'_> {
    fn find(
        &self,
        workload: WorkloadKind,
        policy: Policy,
        concurrency: usize,
    ) -> Option<&RunSummary> {
        self.record(workload, policy, concurrency)
            .filter(|r| r.unavailable.is_none())
            .map(|r| &r.summary)
    }

    fn record(
        &self,
        workload: WorkloadKind,
        policy: Policy,
        concurrency: usize,
    ) -> Option<&RunRecord> {
        self.records
            .iter()
            .find(|r| r.workload == workload && r.policy == policy && r.concurrency == concurrency)
    }

    fn workloads(&self) -> Vec<WorkloadKind> {
        let mut w: Vec<_> = self.records.iter().map(|r| r.workload).collect();
        w.sort();
        w.dedup();
        w
    }

    fn policies(&self) -> Vec<Policy> {
        let mut p: Vec<_> = self.records.iter().map(|r| r.policy).collect();
        p.sort();
        p.dedup();
        p
    }

    fn levels(&self) -> Vec<usize> {
        let mut c: Vec<_> = self.records.iter().map(|r| r.concurrency).collect();
        c.sort_unstable();
        c.dedup();
        c
    }

    /// `results[workload][policy][concurrency]` plus the command, the setup and the targets.
    pub fn to_json(&self) -> Value {
        let mut results: BTreeMap<String, BTreeMap<String, BTreeMap<String, Value>>> =
            BTreeMap::new();
        for r in self.records {
            results
                .entry(r.workload.to_string())
                .or_default()
                .entry(r.policy.to_string())
                .or_default()
                .insert(r.concurrency.to_string(), run_json(r));
        }
        json!({
            "command": self.command,
            "setup": self.setup,
            "experiment": self.config,
            "times": "simulated seconds (wall-clock / time scale)",
            "results": results,
            "targets": self.targets(),
        })
    }

    /// Per concurrency level: `metric(a) / metric(b)`.
    fn ratios(
        &self,
        workload: WorkloadKind,
        a: Policy,
        b: Policy,
        metric: fn(&RunSummary) -> f64,
    ) -> Vec<(usize, f64)> {
        self.levels()
            .into_iter()
            .filter_map(|c| {
                let (x, y) = (self.find(workload, a, c)?, self.find(workload, b, c)?);
                Some((c, metric(x) / metric(y)))
            })
            .collect()
    }

    fn peak(
        &self,
        workload: WorkloadKind,
        policy: Policy,
        metric: fn(&RunSummary) -> f64,
    ) -> Option<(usize, f64)> {
        self.levels()
            .into_iter()
            .filter_map(|c| Some((c, metric(self.find(workload, policy, c)?))))
            .max_by(|x, y| x.1.total_cmp(&y.1))
    }

    fn ratio_target(
        &self,
        name: String,
        workload: WorkloadKind,
        (a, b): (Policy, Policy),
        bound: Bound,
    ) -> Option<Target> {
        let per_level = self.ratios(workload, a, b, |s| s.median_ttft_s);
        if per_level.is_empty() {
            return None;
        }
        let measured = geometric_mean(per_level.iter().map(|(_, r)| *r));
        Some(Target {
            name,
            measured,
            required: bound.to_string(),
            met: bound.holds(measured),
            detail: per_level
                .iter()
                .map(|(c, r)| format!("c={c}: {}", fmt_ratio(*r)))
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    fn goodput_target(&self, workload: WorkloadKind, bound: Bound) -> Option<Target> {
        let (ck, k) = self.peak(workload, Policy::Kinference, |s| s.goodput_rpm)?;
        let (cr, r) = self.peak(workload, Policy::Random, |s| s.goodput_rpm)?;
        let measured = k / r;
        Some(Target {
            name: format!("{workload}: peak goodput, kinference / random"),
            measured,
            required: bound.to_string(),
            met: bound.holds(measured),
            detail: format!("kinference {k:.1} rpm at c={ck}, random {r:.1} rpm at c={cr}"),
        })
    }

    /// The issue's targets that the measured runs allow to check.
    pub fn targets(&self) -> Vec<Target> {
        use Policy::{Kinference, LeastOutstanding, Oracle, Random};
        use WorkloadKind::{MultiTurn, SharedPrefix, Unique};
        let mut targets = vec![
            self.ratio_target(
                "shared-prefix: median TTFT, random / kinference (geometric mean over concurrency)".into(),
                SharedPrefix,
                (Random, Kinference),
                Bound::AtLeast(20.0),
            ),
            self.goodput_target(SharedPrefix, Bound::AtLeast(7.4)),
            self.goodput_target(MultiTurn, Bound::AtLeast(3.5)),
            self.ratio_target(
                "unique: median TTFT, kinference / least-outstanding (geometric mean over concurrency)".into(),
                Unique,
                (Kinference, LeastOutstanding),
                Bound::AtMost(1.05),
            ),
        ];
        for w in WorkloadKind::ALL {
            targets.push(self.ratio_target(
                format!("{w}: median TTFT, kinference / oracle (geometric mean over concurrency)"),
                w,
                (Kinference, Oracle),
                Bound::AtMost(1.10),
            ));
        }
        let mut targets: Vec<Target> = targets.into_iter().flatten().collect();
        targets.extend(self.peer_targets());
        targets
    }

    fn peers(&self) -> Vec<Policy> {
        self.policies()
            .into_iter()
            .filter(|p| p.is_peer())
            .collect()
    }

    /// Issue 6: Kinference against every peer that ran, per workload and concurrency. Shared-prefix and
    /// multi-turn: the lowest median and p90 TTFT and the highest goodput of all routers; unique:
    /// median TTFT within 5% of the best router's.
    fn peer_targets(&self) -> Vec<Target> {
        let peers = self.peers();
        if peers.is_empty() {
            return Vec::new();
        }
        type Metric = (&'static str, fn(&RunSummary) -> f64, bool);
        let metrics: [Metric; 3] = [
            ("median TTFT", |s| s.median_ttft_s, false),
            ("p90 TTFT", |s| s.p90_ttft_s, false),
            ("goodput", |s| s.goodput_rpm, true),
        ];
        let mut out = Vec::new();
        for w in self.workloads() {
            let unique = w == WorkloadKind::Unique;
            for (name, metric, higher_better) in metrics {
                if unique && name != "median TTFT" {
                    continue;
                }
                // Per level: kinference / best peer (for goodput: best peer / kinference), so that
                // <= 1 always means Kinference is at least as good.
                let mut worst: Option<(usize, f64, Policy)> = None;
                let mut detail = Vec::new();
                for c in self.levels() {
                    let Some(k) = self.find(w, Policy::Kinference, c) else {
                        continue;
                    };
                    let best = peers
                        .iter()
                        .filter_map(|&p| Some((p, metric(self.find(w, p, c)?))))
                        .filter(|(_, v)| v.is_finite())
                        .min_by(|a, b| {
                            if higher_better {
                                b.1.total_cmp(&a.1)
                            } else {
                                a.1.total_cmp(&b.1)
                            }
                        });
                    let Some((peer, v)) = best else { continue };
                    let ratio = if higher_better {
                        v / metric(k)
                    } else {
                        metric(k) / v
                    };
                    detail.push(format!("c={c}: {} vs {peer}", fmt_ratio(ratio)));
                    if worst.is_none_or(|(_, r, _)| ratio > r || r.is_nan()) {
                        worst = Some((c, ratio, peer));
                    }
                }
                let Some((_, measured, _)) = worst else {
                    continue;
                };
                let bound = Bound::AtMost(if unique { 1.05 } else { 1.0 });
                let what = if higher_better {
                    "best peer / kinference"
                } else {
                    "kinference / best peer"
                };
                out.push(Target {
                    name: format!("{w}: {name}, {what} (worst concurrency)"),
                    measured,
                    required: bound.to_string(),
                    met: bound.holds(measured),
                    detail: detail.join(", "),
                });
            }
        }
        out
    }

    /// The markdown report: command, setup, targets, then per workload one table per figure.
    pub fn to_markdown(&self) -> String {
        let mut md = String::new();
        let _ = writeln!(
            md,
            "# Routing benchmark: Kinference vs. baselines on simulated vLLM workers\n"
        );
        let _ = writeln!(md, "Command:\n\n```\n{}\n```\n", self.command);
        let _ = writeln!(
            md,
            "Setup:\n\n```json\n{}\n```\n",
            serde_json::to_string_pretty(&self.setup).unwrap_or_default()
        );
        let _ = writeln!(
            md,
            "All times are simulated seconds (wall-clock / time scale {}). Goodput = requests per simulated \
             minute whose TTFT met the SLO (8 s shared-prefix and unique, 4 s multi-turn). Every policy ran \
             the same request sequence (seed {}). Each run starts from empty caches (`POST \
             /reset_prefix_cache` on every worker); shared-prefix runs then send {} unmeasured warm-up \
             requests through the same policy (the first request for each shared prompt is a miss under \
             any policy), multi-turn {} and unique {}.\n\nWorkload shape: `{}`\n",
            self.config.time_scale,
            self.config.seed,
            self.config.warmup_for(WorkloadKind::SharedPrefix),
            self.config.warmup_for(WorkloadKind::MultiTurn),
            self.config.warmup_for(WorkloadKind::Unique),
            serde_json::to_string(&self.config.shape).unwrap_or_default()
        );
        let _ = writeln!(
            md,
            "## Targets (issue 3{})\n",
            if self.peers().is_empty() {
                ""
            } else {
                "; issue 6: against the peer routers"
            }
        );
        let _ = writeln!(
            md,
            "| target | measured | required | met | detail |\n|---|---|---|---|---|"
        );
        for t in self.targets() {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} |",
                t.name,
                fmt_ratio(t.measured),
                t.required,
                if t.met { "yes" } else { "**no**" },
                t.detail
            );
        }
        let unavailable: BTreeMap<Policy, &str> = self
            .records
            .iter()
            .filter_map(|r| Some((r.policy, r.unavailable.as_deref()?)))
            .collect();
        if !unavailable.is_empty() {
            let _ = writeln!(
                md,
                "\n## Routers that could not run\n\nTheir rows say `n/a`.\n\n| router / policy | why |\n|---|---|"
            );
            for (p, why) in &unavailable {
                let why = why.lines().next().unwrap_or_default().replace('|', "\\|");
                let _ = writeln!(md, "| {p} | {why} |");
            }
        }
        let levels = self.levels();
        let policies = self.policies();
        type Column = (&'static str, fn(&RunSummary) -> String);
        let figures: [Column; 7] = [
            ("median TTFT (s)", |s| fmt_secs(s.median_ttft_s)),
            ("p90 TTFT (s)", |s| fmt_secs(s.p90_ttft_s)),
            ("median end-to-end latency (s)", |s| {
                fmt_secs(s.median_e2e_s)
            }),
            ("goodput (requests/min within the TTFT SLO)", |s| {
                format!("{:.1}", s.goodput_rpm)
            }),
            ("cached share of prompt tokens", |s| {
                format!("{:.0}%", 100.0 * s.cached_token_share)
            }),
            ("mean prompt tokens", |s| {
                format!("{:.0}", s.mean_prompt_tokens)
            }),
            ("requests / errors", |s| format!("{} / {}", s.n, s.errors)),
        ];
        for w in self.workloads() {
            let _ = writeln!(md, "\n## {w} (TTFT SLO {} s)\n", w.ttft_slo_s());
            for (title, cell) in &figures {
                let _ = writeln!(md, "### {title}\n");
                let header: Vec<String> = levels.iter().map(|c| format!("c={c}")).collect();
                let _ = writeln!(md, "| policy | {} |", header.join(" | "));
                let _ = writeln!(md, "|---|{}", "---|".repeat(levels.len()));
                for &p in &policies {
                    let cells: Vec<String> = levels
                        .iter()
                        .map(|&c| match self.record(w, p, c) {
                            Some(r) if r.unavailable.is_some() => "n/a".into(),
                            Some(r) => cell(&r.summary),
                            None => "-".into(),
                        })
                        .collect();
                    let _ = writeln!(md, "| {p} | {} |", cells.join(" | "));
                }
                md.push('\n');
            }
        }
        md
    }

    /// Writes `routing.json`, `routing.md` and `routing.svg` into `dir`.
    pub fn write_all(&self, dir: &Path) -> Result<(), ReportError> {
        std::fs::create_dir_all(dir).map_err(|source| ReportError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        let write = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|source| ReportError::Io {
                path: path.display().to_string(),
                source,
            })
        };
        write(
            "routing.json",
            serde_json::to_string_pretty(&self.to_json()).unwrap_or_default() + "\n",
        )?;
        write("routing.md", self.to_markdown())?;
        write_svg(&dir.join("routing.svg"), self.records)
    }
}

#[derive(Debug, Clone, Copy)]
enum Bound {
    AtLeast(f64),
    AtMost(f64),
}

impl Bound {
    fn holds(self, v: f64) -> bool {
        match self {
            Self::AtLeast(b) => v >= b,
            Self::AtMost(b) => v <= b,
        }
    }
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::AtLeast(b) => write!(f, ">= {b}"),
            Self::AtMost(b) => write!(f, "<= {b}"),
        }
    }
}

fn fmt_ratio(r: f64) -> String {
    if r.is_nan() {
        "n/a".into()
    } else if r.is_infinite() {
        "inf".into()
    } else if r >= 10.0 {
        format!("{r:.1}x")
    } else {
        format!("{r:.3}x")
    }
}

fn fmt_secs(s: f64) -> String {
    if s.is_nan() {
        "-".into()
    } else if s < 10.0 {
        format!("{s:.2}")
    } else {
        format!("{s:.1}")
    }
}
