//! The scale benchmark's results: one row per fleet size and policy (medians over the runs), written as
//! a markdown table and a plain SVG line plot (`scale.svg`, drawn here without a plotting library).

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

#[cfg(test)]
mod tests;

/// Medians over the runs of one policy on one fleet.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Row {
    /// Simulated workers.
    pub workers: usize,
    /// Simulated nodes, one agent each.
    pub agents: usize,
    /// `random`, `kinference` or `oracle`.
    pub policy: String,
    /// Runs the medians are taken over.
    pub runs: usize,
    /// Requests per run.
    pub requests: usize,
    /// Failed requests, summed over the runs.
    pub errors: usize,
    /// The gateway's decision stage, p50 and p99 (us), estimated from its histogram.
    pub decision_p50_us: Option<f64>,
    /// See [`Row::decision_p50_us`].
    pub decision_p99_us: Option<f64>,
    /// The histogram bucket that holds the p99, in us: how coarse that estimate is.
    pub decision_p99_bucket_us: Option<(f64, f64)>,
    /// Mean decision time (us), exact (histogram sum / count).
    pub decision_mean_us: Option<f64>,
    /// Gateway CPU (user + system) per request, ms.
    pub gateway_cpu_ms_per_request: Option<f64>,
    /// Summary bytes the agents sent the gateway per second of the run.
    pub agent_bytes_per_s: Option<f64>,
    /// Gateway resident memory after the run, MiB.
    pub gateway_rss_mib: Option<f64>,
    /// Gateway resident memory once the fleet is up, before any request, MiB.
    pub gateway_idle_rss_mib: Option<f64>,
    /// Idle gateway memory per worker added since the smallest fleet, KiB: what a worker costs the
    /// gateway before it caches anything.
    pub idle_rss_kib_per_added_worker: Option<f64>,
    /// Gateway RSS growth from idle to the end of the run, per (block, worker) pair indexed, bytes.
    pub rss_bytes_per_cached_block: Option<f64>,
    /// The gateway's own index estimate per (block, worker) pair, bytes.
    pub index_bytes_per_cached_block: Option<f64>,
    /// (block, worker) pairs in the gateway's index at the end of the run.
    pub cached_blocks: Option<f64>,
    /// The workers' own prefix-cache hit rate over the run.
    pub hit_rate: Option<f64>,
    /// Time to first token, simulated seconds.
    pub ttft_p50_s: f64,
    /// See [`Row::ttft_p50_s`].
    pub ttft_p90_s: f64,
}

fn cell(v: Option<f64>, digits: usize) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.digits$}"),
        _ => "-".into(),
    }
}

/// The results table, one line per row.
pub fn table(rows: &[Row]) -> String {
    let mut md = String::from(
        "| workers | agents | policy | runs x req | decision p50 / p99 (us) | p99 bucket (us) | decision mean (us) | gateway CPU ms/req | agent->gateway KB/s | gateway RSS MiB (idle) | idle KiB/added worker | RSS B/cached block | index B/block | cached blocks | hit rate | TTFT p50 / p90 (s) | errors |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let rss = format!(
            "{} ({})",
            cell(r.gateway_rss_mib, 1),
            cell(r.gateway_idle_rss_mib, 1)
        );
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} x {} | {} / {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} / {:.2} | {} |",
            r.workers,
            r.agents,
            r.policy,
            r.runs,
            r.requests,
            cell(r.decision_p50_us, 1),
            cell(r.decision_p99_us, 1),
            r.decision_p99_bucket_us
                .map_or("-".into(), |(lo, hi)| format!("({lo:.0}, {hi:.0}]")),
            cell(r.decision_mean_us, 1),
            cell(r.gateway_cpu_ms_per_request, 2),
            cell(r.agent_bytes_per_s.map(|b| b / 1024.0), 1),
            rss,
            cell(r.idle_rss_kib_per_added_worker, 0),
            cell(r.rss_bytes_per_cached_block, 0),
            cell(r.index_bytes_per_cached_block, 0),
            cell(r.cached_blocks, 0),
            r.hit_rate
                .map_or("-".into(), |h| format!("{:.1}%", 100.0 * h)),
            r.ttft_p50_s,
            r.ttft_p90_s,
            r.errors,
        );
    }
    md
}

/// One line of a panel: a name, a colour and its points.
struct Series {
    name: String,
    color: &'static str,
    dashed: bool,
    points: Vec<(f64, f64)>,
}

const POLICY_COLORS: [(&str, &str); 3] = [
    ("random", "#d62728"),
    ("kinference", "#1f77b4"),
    ("oracle", "#2ca02c"),
];

fn color_of(policy: &str) -> &'static str {
    POLICY_COLORS
        .iter()
        .find(|(p, _)| *p == policy)
        .map_or("#7f7f7f", |(_, c)| c)
}

/// Points `(workers, f(row))` of `policy`, in fleet order.
fn points(rows: &[Row], policy: &str, f: impl Fn(&Row) -> Option<f64>) -> Vec<(f64, f64)> {
    rows.iter()
        .filter(|r| r.policy == policy)
        .filter_map(|r| Some((r.workers as f64, f(r).filter(|v| v.is_finite())?)))
        .collect()
}

fn per_policy(rows: &[Row], f: impl Fn(&Row) -> Option<f64> + Copy) -> Vec<Series> {
    let mut policies: Vec<&str> = rows.iter().map(|r| r.policy.as_str()).collect();
    policies.dedup();
    policies.sort();
    policies.dedup();
    policies
        .into_iter()
        .map(|p| Series {
            name: p.to_string(),
            color: color_of(p),
            dashed: false,
            points: points(rows, p, f),
        })
        .filter(|s| !s.points.is_empty())
        .collect()
}

const PANEL_W: f64 = 460.0;
const PANEL_H: f64 = 300.0;

/// The scale curve as an SVG document: decision time, gateway CPU per request, agent -> gateway
/// bytes and the workers' hit rate against the fleet size, one panel each.
pub fn svg(rows: &[Row]) -> String {
    let decision = vec![
        Series {
            name: "kinference p99".into(),
            color: "#1f77b4",
            dashed: false,
            points: points(rows, "kinference", |r| r.decision_p99_us),
        },
        Series {
            name: "kinference p50".into(),
            color: "#1f77b4",
            dashed: true,
            points: points(rows, "kinference", |r| r.decision_p50_us),
        },
        Series {
            name: "target p99 50 us".into(),
            color: "#999999",
            dashed: true,
            points: {
                let xs: Vec<f64> = rows.iter().map(|r| r.workers as f64).collect();
                let max = xs.iter().copied().fold(0.0, f64::max);
                vec![(0.0, 50.0), (max, 50.0)]
            },
        },
    ];
    let panels = [
        // Logarithmic: a preempted decision's p99 is milliseconds, its p50 tens of microseconds.
        (
            "Routing decision (us, log scale), gateway histogram",
            decision,
        ),
        (
            "Gateway CPU per request (ms)",
            per_policy(rows, |r| r.gateway_cpu_ms_per_request),
        ),
        (
            "Agent -> gateway summary stream (KB/s)",
            per_policy(rows, |r| r.agent_bytes_per_s.map(|b| b / 1024.0)),
        ),
        (
            "Workers' prefix-cache hit rate (%)",
            per_policy(rows, |r| r.hit_rate.map(|h| 100.0 * h)),
        ),
    ];
    let (w, h) = (2.0 * PANEL_W, 2.0 * PANEL_H);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (i, (title, series)) in panels.iter().enumerate() {
        let x0 = (i % 2) as f64 * PANEL_W;
        let y0 = (i / 2) as f64 * PANEL_H;
        panel(&mut out, x0, y0, title, series, i == 0);
    }
    out.push_str("</svg>\n");
    out
}

/// A "nice" step for about five ticks up to `max`.
fn tick_step(max: f64) -> f64 {
    let raw = (max / 5.0).max(f64::MIN_POSITIVE);
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude)
}

fn panel(out: &mut String, x0: f64, y0: f64, title: &str, series: &[Series], log: bool) {
    let (left, right, top, bottom) = (
        x0 + 60.0,
        x0 + PANEL_W - 20.0,
        y0 + 30.0,
        y0 + PANEL_H - 45.0,
    );
    let all = series.iter().flat_map(|s| s.points.iter());
    let x_max = all.clone().map(|p| p.0).fold(0.0, f64::max).max(1.0);
    let y_max = all.map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.1;
    let (x_step, y_step) = (tick_step(x_max), tick_step(y_max));
    let x_top = (x_max / x_step).ceil() * x_step;
    let y_top = (y_max / y_step).ceil() * y_step;
    // On the log scale: whole decades from below the smallest value to above the largest.
    let y_min_positive = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .filter(|y| *y > 0.0)
        .fold(f64::INFINITY, f64::min);
    let decades = (
        y_min_positive.min(y_max).max(1e-9).log10().floor(),
        y_max
            .log10()
            .ceil()
            .max(y_min_positive.log10().floor() + 1.0),
    );
    let sx = |x: f64| left + (right - left) * x / x_top;
    let sy = |y: f64| {
        if log {
            let d = (y.max(1e-9).log10() - decades.0) / (decades.1 - decades.0);
            bottom - (bottom - top) * d.clamp(0.0, 1.0)
        } else {
            bottom - (bottom - top) * y / y_top
        }
    };
    let y_ticks: Vec<f64> = if log {
        (decades.0 as i32..=decades.1 as i32)
            .map(|e| 10f64.powi(e))
            .collect()
    } else {
        (0..)
            .map(|k| k as f64 * y_step)
            .take_while(|y| *y <= y_top + 1e-9)
            .collect()
    };
    let _ = writeln!(
        out,
        "<text x=\"{}\" y=\"{}\" font-size=\"13\" font-weight=\"bold\">{title}</text>",
        left,
        y0 + 18.0
    );
    let _ = writeln!(
        out,
        "<line x1=\"{left}\" y1=\"{bottom}\" x2=\"{right}\" y2=\"{bottom}\" stroke=\"black\"/><line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{bottom}\" stroke=\"black\"/>"
    );
    let mut x = 0.0;
    while x <= x_top + 1e-9 {
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{x}</text>",
            sx(x),
            bottom + 14.0
        );
        x += x_step;
    }
    let _ = writeln!(
        out,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">workers</text>",
        (left + right) / 2.0,
        bottom + 30.0
    );
    for y in y_ticks {
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text><line x1=\"{left}\" y1=\"{:.1}\" x2=\"{right}\" y2=\"{:.1}\" stroke=\"#eeeeee\"/>",
            left - 4.0,
            sy(y) + 4.0,
            format_tick(y),
            sy(y),
            sy(y)
        );
    }
    for (k, s) in series.iter().enumerate() {
        let path: Vec<String> = s
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let dash = if s.dashed {
            " stroke-dasharray=\"5,4\""
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{dash}/>",
            path.join(" "),
            s.color
        );
        for &(x, y) in &s.points {
            let _ = writeln!(
                out,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{}\"/>",
                sx(x),
                sy(y),
                s.color
            );
        }
        let ly = top + 4.0 + 14.0 * k as f64;
        let _ = writeln!(
            out,
            "<line x1=\"{:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{}\" stroke-width=\"2\"{dash}/><text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            right - 130.0,
            right - 110.0,
            s.color,
            right - 106.0,
            ly + 4.0,
            s.name
        );
    }
}

fn format_tick(v: f64) -> String {
    if v == v.trunc() {
        format!("{v:.0}")
    } else if v >= 0.1 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}
