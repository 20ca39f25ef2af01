use std::time::Duration;

use super::*;
use crate::routing::experiment::RequestCount;
use crate::routing::workload::WorkloadShape;

fn record(
    workload: WorkloadKind,
    policy: Policy,
    concurrency: usize,
    ttft: f64,
    goodput: f64,
) -> RunRecord {
    RunRecord {
        workload,
        policy,
        concurrency,
        summary: RunSummary {
            n: 10,
            errors: 0,
            median_ttft_s: ttft,
            p90_ttft_s: ttft * 2.0,
            median_e2e_s: ttft + 3.0,
            goodput_rpm: goodput,
            ttft_slo_s: workload.ttft_slo_s(),
            ..RunSummary::default()
        },
        cache_hit_share: Some(0.5),
        wall_s: 1.0,
        unavailable: None,
        outcomes: vec![],
    }
}

fn config() -> ExperimentConfig {
    ExperimentConfig {
        workloads: WorkloadKind::ALL.to_vec(),
        concurrency: vec![1, 8],
        policies: Policy::ALL.to_vec(),
        requests: RequestCount::Fixed(10),
        warmup: None,
        seed: 1,
        time_scale: 0.05,
        shape: WorkloadShape::default(),
        settle: Duration::ZERO,
    }
}

fn records() -> Vec<RunRecord> {
    use Policy::*;
    use WorkloadKind::*;
    let mut r = Vec::new();
    for c in [1, 8] {
        // shared-prefix: random 25x slower at c=1, 18x at c=8 -> geometric mean sqrt(450) ~ 21.2x.
        r.push(record(
            SharedPrefix,
            Random,
            c,
            if c == 1 { 5.0 } else { 9.0 },
            if c == 1 { 5.0 } else { 10.0 },
        ));
        r.push(record(
            SharedPrefix,
            Kinference,
            c,
            if c == 1 { 0.2 } else { 0.5 },
            if c == 1 { 20.0 } else { 80.0 },
        ));
        r.push(record(
            SharedPrefix,
            Oracle,
            c,
            if c == 1 { 0.2 } else { 0.45 },
            80.0,
        ));
        r.push(record(Unique, LeastOutstanding, c, 4.0, 10.0));
        r.push(record(Unique, Kinference, c, 4.4, 10.0));
        r.push(record(Unique, Oracle, c, 4.2, 10.0));
        r.push(record(MultiTurn, Random, c, 3.0, 10.0));
        r.push(record(
            MultiTurn,
            Kinference,
            c,
            0.5,
            if c == 1 { 20.0 } else { 34.0 },
        ));
        r.push(record(MultiTurn, Oracle, c, 0.5, 35.0));
    }
    r
}

fn target<'a>(targets: &'a [Target], prefix: &str) -> &'a Target {
    targets
        .iter()
        .find(|t| t.name.starts_with(prefix))
        .unwrap_or_else(|| panic!("no target {prefix}"))
}

#[test]
fn targets_are_computed_from_the_runs() {
    let config = config();
    let records = records();
    let report = Report {
        command: "routing-bench".into(),
        setup: json!({}),
        config: &config,
        records: &records,
    };
    let targets = report.targets();
    assert_eq!(targets.len(), 7);
    let ttft = target(&targets, "shared-prefix: median TTFT, random / kinference");
    assert!(
        (ttft.measured - 450f64.sqrt()).abs() < 1e-9,
        "{}",
        ttft.measured
    );
    assert!(ttft.met);
    let goodput = target(&targets, "shared-prefix: peak goodput");
    assert!((goodput.measured - 8.0).abs() < 1e-9);
    assert!(goodput.met);
    let mt = target(&targets, "multi-turn: peak goodput");
    assert!((mt.measured - 3.4).abs() < 1e-9);
    assert!(!mt.met);
    let unique = target(&targets, "unique: median TTFT, kinference / least");
    assert!((unique.measured - 1.1).abs() < 1e-9);
    assert!(!unique.met);
    let oracle = target(&targets, "shared-prefix: median TTFT, kinference / oracle");
    assert!(oracle.met, "{}", oracle.measured);
    let oracle_unique = target(&targets, "unique: median TTFT, kinference / oracle");
    assert!((oracle_unique.measured - 4.4 / 4.2).abs() < 1e-9);
}

#[test]
fn json_has_every_figure_per_workload_policy_and_concurrency() {
    let config = config();
    let records = records();
    let report = Report {
        command: "routing-bench --quick".into(),
        setup: json!({"workers": 3}),
        config: &config,
        records: &records,
    };
    let v = report.to_json();
    assert_eq!(v["command"], "routing-bench --quick");
    let run = &v["results"]["shared-prefix"]["kinference"]["8"];
    assert_eq!(run["median_ttft_s"], 0.5);
    assert_eq!(run["p90_ttft_s"], 1.0);
    assert_eq!(run["median_e2e_s"], 3.5);
    assert_eq!(run["goodput_rpm"], 80.0);
    assert_eq!(run["n"], 10);
    assert_eq!(run["errors"], 0);
    assert!(v["targets"].as_array().is_some_and(|t| t.len() == 7));
}

#[test]
fn markdown_starts_with_the_command_and_has_a_table_per_figure() {
    let config = config();
    let records = records();
    let report = Report {
        command: "cargo run --release -p kinference-bench --bin routing-bench".into(),
        setup: json!({}),
        config: &config,
        records: &records,
    };
    let md = report.to_markdown();
    let command_at = md.find("cargo run --release").unwrap_or(usize::MAX);
    let targets_at = md.find("## Targets").unwrap_or(0);
    assert!(command_at < targets_at);
    assert!(md.contains("| kinference | 0.20 | 0.50 |"), "{md}");
    assert_eq!(md.matches("### median TTFT (s)").count(), 3);
    assert!(md.contains("| **no** |"));
}

#[test]
fn the_plot_is_an_svg_with_one_panel_per_workload() {
    let records = records();
    let dir = std::env::temp_dir().join(format!("kinference-plot-test-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join("routing.svg");
    assert!(write_svg(&path, &records).is_ok());
    let svg = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(100)]);
    for w in ["shared-prefix", "unique", "multi-turn"] {
        assert!(svg.contains(w), "{w}");
    }
    assert!(svg.contains("kinference") && svg.contains("oracle"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn peers_get_rows_targets_and_n_a_when_they_cannot_run() {
    use Policy::*;
    use WorkloadKind::*;
    let mut records = records();
    for c in [1, 8] {
        // Kinference: 0.2 / 0.5 s median, p90 twice that, goodput 20 / 80. One peer faster at c=8.
        records.push(record(
            SharedPrefix,
            SmgPrefixHash,
            c,
            if c == 1 { 0.3 } else { 0.4 },
            if c == 1 { 10.0 } else { 90.0 },
        ));
        records.push(record(Unique, SmgPrefixHash, c, 4.3, 10.0));
        let mut missing = record(SharedPrefix, LitellmLeastBusy, c, 0.0, 0.0);
        missing.summary = RunSummary::default();
        missing.unavailable = Some("install failed: no network".into());
        records.push(missing);
    }
    let config = config();
    let report = Report {
        command: "routing-bench --peers smg,litellm".into(),
        setup: json!({}),
        config: &config,
        records: &records,
    };
    let targets = report.targets();
    let median = target(
        &targets,
        "shared-prefix: median TTFT, kinference / best peer",
    );
    // c=8: 0.5 / 0.4 = 1.25 (worst level), not met.
    assert!((median.measured - 1.25).abs() < 1e-9, "{median:?}");
    assert!(!median.met);
    assert!(median.detail.contains("smg-prefix-hash"));
    let goodput = target(&targets, "shared-prefix: goodput, best peer / kinference");
    assert!((goodput.measured - 90.0 / 80.0).abs() < 1e-9);
    // Unique: within 5% (4.4 / 4.3 = 1.023).
    let unique = target(&targets, "unique: median TTFT, kinference / best peer");
    assert!(unique.met, "{unique:?}");
    // The peer that could not run: n/a cells and its reason, not dropped; not counted as best.
    let md = report.to_markdown();
    assert!(md.contains("| litellm-least-busy | n/a | n/a |"), "{md}");
    assert!(md.contains("install failed: no network"));
    let json = report.to_json();
    assert_eq!(
        json["results"]["shared-prefix"]["litellm-least-busy"]["8"]["unavailable"],
        "install failed: no network"
    );
}
