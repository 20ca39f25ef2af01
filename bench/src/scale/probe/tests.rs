use super::*;

const EXPOSITION: &str = r#"# HELP kinference_routing_stage_seconds Time spent routing a request.
# TYPE kinference_routing_stage_seconds histogram
kinference_routing_stage_seconds_sum{mode="kinference",stage="decide"} 0.004
kinference_routing_stage_seconds_count{mode="kinference",stage="decide"} 100
kinference_routing_stage_seconds_bucket{le="1e-5",mode="kinference",stage="decide"} 0
kinference_routing_stage_seconds_bucket{le="2e-5",mode="kinference",stage="decide"} 40
kinference_routing_stage_seconds_bucket{le="4e-5",mode="kinference",stage="decide"} 90
kinference_routing_stage_seconds_bucket{le="8e-5",mode="kinference",stage="decide"} 100
kinference_routing_stage_seconds_bucket{le="+Inf",mode="kinference",stage="decide"} 100
kinference_routing_stage_seconds_sum{mode="kinference",stage="tokenize"} 1.5
kinference_routing_stage_seconds_count{mode="kinference",stage="tokenize"} 100
kinference_routing_stage_seconds_bucket{le="+Inf",mode="kinference",stage="tokenize"} 100
"#;

fn decide() -> Histogram {
    Histogram::parse(
        EXPOSITION,
        "kinference_routing_stage_seconds",
        &[("mode", "kinference"), ("stage", "decide")],
    )
    .expect("the decide series")
}

#[test]
fn a_histogram_series_is_picked_by_its_labels() {
    let h = decide();
    assert_eq!(h.buckets.len(), 5);
    assert_eq!(h.count, 100.0);
    assert!((h.mean() - 40e-6).abs() < 1e-12);
    assert!(
        Histogram::parse(
            EXPOSITION,
            "kinference_routing_stage_seconds",
            &[("stage", "x")]
        )
        .is_none()
    );
}

#[test]
fn quantiles_interpolate_within_their_bucket_as_prometheus_does() {
    let h = decide();
    // Rank 50 of 100: 10 of the 50 in (20, 40] us.
    assert!(
        (h.quantile(0.5) - 24e-6).abs() < 1e-12,
        "{}",
        h.quantile(0.5)
    );
    // Rank 99: 9 of the 10 in (40, 80] us.
    assert!(
        (h.quantile(0.99) - 76e-6).abs() < 1e-12,
        "{}",
        h.quantile(0.99)
    );
    assert_eq!(h.bucket_of(0.99), Some((40e-6, 80e-6)));
}

#[test]
fn since_subtracts_an_earlier_snapshot() {
    let h = decide();
    let none = h.since(&h);
    assert_eq!(none.count, 0.0);
    assert!(none.quantile(0.5).is_nan());
    let mut later = h.clone();
    later.buckets[4].1 += 5.0; // five slow decisions past the last bound
    later.count += 5.0;
    let delta = later.since(&h);
    assert_eq!(
        delta.quantile(0.99),
        80e-6,
        "the overflow bucket reports its lower bound"
    );
}

#[test]
fn proc_files_give_cpu_seconds_and_rss() {
    let stat =
        "4242 (kinference (gw)) S 1 4242 4242 0 -1 4194560 2000 0 0 0 250 50 0 0 20 0 9 0 100 0 0";
    assert_eq!(cpu_seconds(stat), Some(3.0));
    assert_eq!(
        rss_bytes("Name:\tx\nVmRSS:\t  2048 kB\n"),
        Some(2 * 1024 * 1024)
    );
    let me = sample(std::process::id()).expect("this process");
    assert!(me.rss_bytes > 0);
}
