//! `routing.svg`: median TTFT against concurrency, one line per policy, one panel per workload (both
//! axes logarithmic: the policies differ by orders of magnitude).

use std::path::Path;

use plotters::prelude::*;

use super::ReportError;
use crate::routing::experiment::RunRecord;
use crate::routing::policy::Policy;
use crate::routing::workload::WorkloadKind;

const PANEL_WIDTH: u32 = 560;
const HEIGHT: u32 = 480;

/// Draws the plot of `records` into `path`.
pub fn write_svg(path: &Path, records: &[RunRecord]) -> Result<(), ReportError> {
    draw(path, records).map_err(|message| ReportError::Plot {
        path: path.display().to_string(),
        message,
    })
}

fn policy_color(policy: Policy) -> RGBColor {
    match policy {
        Policy::Random => RGBColor(214, 39, 40),
        Policy::RoundRobin => RGBColor(255, 127, 14),
        Policy::LeastOutstanding => RGBColor(148, 103, 189),
        Policy::PrefixHash => RGBColor(140, 86, 75),
        Policy::VllmRouterKvAware => RGBColor(23, 190, 207),
        Policy::VllmRouterCacheAware => RGBColor(158, 218, 229),
        Policy::SmgCacheAware => RGBColor(188, 189, 34),
        Policy::SmgPrefixHash => RGBColor(219, 219, 141),
        Policy::SglangRouterCacheAware => RGBColor(227, 119, 194),
        Policy::LitellmLeastBusy => RGBColor(127, 127, 127),
        Policy::Kinference => RGBColor(31, 119, 180),
        Policy::Oracle => RGBColor(44, 160, 44),
    }
}

fn draw(path: &Path, records: &[RunRecord]) -> Result<(), String> {
    let mut workloads: Vec<WorkloadKind> = records.iter().map(|r| r.workload).collect();
    workloads.sort();
    workloads.dedup();
    let mut policies: Vec<Policy> = records.iter().map(|r| r.policy).collect();
    policies.sort();
    policies.dedup();
    let panels = workloads.len().max(1);
    let root = SVGBackend::new(path, (PANEL_WIDTH * panels as u32, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let areas = root.split_evenly((1, panels));
    for (area, &workload) in areas.iter().zip(&workloads) {
        let points: Vec<&RunRecord> = records
            .iter()
            .filter(|r| {
                r.workload == workload
                    && r.summary.median_ttft_s.is_finite()
                    && r.summary.median_ttft_s > 0.0
            })
            .collect();
        if points.is_empty() {
            continue;
        }
        let (cmin, cmax) = points.iter().fold((usize::MAX, 0), |(lo, hi), r| {
            (lo.min(r.concurrency), hi.max(r.concurrency))
        });
        let (ymin, ymax) = points.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), r| {
            (
                lo.min(r.summary.median_ttft_s),
                hi.max(r.summary.median_ttft_s),
            )
        });
        let x_range = (cmin as f64 / 1.25)..(cmax as f64 * 1.25);
        let y_range = (ymin / 1.5)..(ymax * 1.5);
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{workload} (TTFT SLO {} s)", workload.ttft_slo_s()),
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x_range.log_scale(), y_range.log_scale())
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("concurrency (virtual users)")
            .y_desc("median TTFT (simulated s)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.2}"))
            .draw()
            .map_err(|e| e.to_string())?;
        for &policy in &policies {
            let mut series: Vec<(f64, f64)> = points
                .iter()
                .filter(|r| r.policy == policy)
                .map(|r| (r.concurrency as f64, r.summary.median_ttft_s))
                .collect();
            if series.is_empty() {
                continue;
            }
            series.sort_by(|a, b| a.0.total_cmp(&b.0));
            let color = policy_color(policy);
            chart
                .draw_series(LineSeries::new(series, color.stroke_width(2)).point_size(3))
                .map_err(|e| e.to_string())?
                .label(policy.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.85))
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}
