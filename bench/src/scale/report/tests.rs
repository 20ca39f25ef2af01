use super::*;

fn row(workers: usize, policy: &str, p99: f64, hit: f64) -> Row {
    Row {
        workers,
        agents: workers.div_ceil(8),
        policy: policy.into(),
        runs: 3,
        requests: 10,
        decision_p50_us: Some(p99 / 2.0),
        decision_p99_us: Some(p99),
        decision_p99_bucket_us: Some((40.0, 80.0)),
        hit_rate: Some(hit),
        ttft_p50_s: 0.1,
        ttft_p90_s: 0.2,
        ..Row::default()
    }
}

#[test]
fn the_table_has_one_line_per_row_and_dashes_for_what_was_not_measured() {
    let rows = [row(3, "kinference", 30.0, 0.9), row(24, "random", 5.0, 0.2)];
    let md = table(&rows);
    assert_eq!(md.lines().count(), 2 + rows.len());
    assert!(
        md.contains("| 3 | 1 | kinference | 3 x 10 | 15.0 / 30.0 | (40, 80] |"),
        "{md}"
    );
    assert!(md.contains("| 90.0% |"), "{md}");
    assert!(
        md.contains("| 24 | 3 | random | 3 x 10 | 2.5 / 5.0 | (40, 80] | - |"),
        "{md}"
    );
}

#[test]
fn the_plot_is_a_standalone_svg_with_a_line_per_policy() {
    let rows = [
        row(3, "kinference", 30.0, 0.9),
        row(24, "kinference", 40.0, 0.9),
        row(3, "random", 5.0, 0.3),
        row(24, "random", 6.0, 0.1),
    ];
    let doc = svg(&rows);
    assert!(doc.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert!(doc.trim_end().ends_with("</svg>"));
    // Decision: p99, p50 and the target; hit rate: kinference and random.
    assert_eq!(doc.matches("<polyline").count(), 5, "{doc}");
    assert!(doc.contains(">target p99 50 us</text>"));
}

#[test]
fn ticks_are_round_numbers() {
    assert_eq!(tick_step(96.0), 20.0);
    assert_eq!(tick_step(0.9), 0.2);
    assert_eq!(tick_step(50.0), 10.0);
}

#[test]
fn rows_read_back_from_json_draw_the_same_plot() {
    let rows = vec![
        row(3, "kinference", 30.0, 0.9),
        row(96, "kinference", 4000.0, 0.9),
    ];
    let json = serde_json::to_value(&rows).expect("serialize");
    let back: Vec<Row> = serde_json::from_value(json).expect("deserialize");
    assert_eq!(svg(&back), svg(&rows));
    // Log scale: decades from 10 us to 10 ms label the decision panel.
    assert!(svg(&rows).contains(">10000</text>"));
}
