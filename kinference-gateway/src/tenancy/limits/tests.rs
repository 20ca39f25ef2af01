use kinference_crds::RateLimits;

use super::*;

fn limits(rpm: u64, itpm: u64, otpm: u64) -> RateLimits {
    RateLimits {
        input_tokens_per_minute: Some(itpm),
        output_tokens_per_minute: Some(otpm),
        requests_per_minute: Some(rpm),
    }
}

fn demand(input: f64, output: f64) -> Demand {
    Demand {
        requests: 1.0,
        input,
        output,
    }
}

/// Tenant `a`'s takes on model `m` with a one-second burst: each bucket holds one second of its rate.
fn takes_1s_burst(limits: &RateLimits, demand: Demand) -> Vec<Take> {
    let settings = TenantSettings {
        burst_seconds: Some(1.0),
        ..TenantSettings::default()
    };
    takes("a", Some(limits), &settings, "m", demand)
}

#[test]
fn takes_cover_tenant_wide_and_per_model_limits() {
    let mut settings = TenantSettings::default();
    settings.models.insert(
        "m".into(),
        ModelLimits {
            requests_per_minute: Some(10),
            ..ModelLimits::default()
        },
    );
    let t = takes(
        "acme",
        Some(&limits(60, 600, 120)),
        &settings,
        "m",
        demand(5.0, 7.0),
    );
    assert_eq!(t.len(), 4);
    assert_eq!(t[0].key, "kinf:rl:{acme}:*:requests");
    assert_eq!(t[1].amount, 5.0);
    assert_eq!(t[2].amount, 7.0);
    assert_eq!(t[3].key, "kinf:rl:{acme}:m:requests");
    assert!(t[3].per_model);
    // Another model only gets the tenant-wide buckets.
    assert_eq!(
        takes(
            "acme",
            Some(&limits(60, 600, 120)),
            &settings,
            "other",
            demand(1.0, 1.0)
        )
        .len(),
        3
    );
    assert!(
        takes(
            "acme",
            None,
            &TenantSettings::default(),
            "m",
            demand(1.0, 1.0)
        )
        .is_empty()
    );
}

#[test]
fn admission_is_all_or_nothing() {
    let buckets = LocalBuckets::default();
    // 600 rpm (10/s, capacity 10), 600 input tokens per minute (10/s, capacity 10), 6000 output.
    let t = takes_1s_burst(&limits(600, 600, 6000), demand(8.0, 1.0));
    assert!(matches!(
        buckets.admit_at(&t, 0.0),
        LimitVerdict::Admitted(_)
    ));
    // The input bucket has 2 left: refused, and the request bucket was not debited either.
    match buckets.admit_at(&t, 0.0) {
        LimitVerdict::Limited {
            retry_after_s,
            refused,
            levels,
        } => {
            assert_eq!(t[refused].dim, Dim::InputTokens);
            assert!((retry_after_s - 0.6).abs() < 1e-9, "{retry_after_s}");
            assert_eq!(levels[0].remaining, 9.0);
        }
        other => panic!("{other:?}"),
    }
    match buckets.admit_at(&t, 0.6) {
        LimitVerdict::Admitted(levels) => {
            assert_eq!(levels[0].remaining, 9.0);
            assert!(levels[1].remaining.abs() < 1e-9);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_admitted_rate_converges_to_the_limit_under_overload() {
    // 600 requests per minute = 10/s, burst 1 s; clients try every millisecond for 100 s.
    let buckets = LocalBuckets::default();
    let t = takes_1s_burst(
        &RateLimits {
            requests_per_minute: Some(600),
            ..RateLimits::default()
        },
        demand(0.0, 0.0),
    );
    let mut admitted = 0u32;
    for ms in 0..100_000u32 {
        if matches!(
            buckets.admit_at(&t, f64::from(ms) / 1000.0),
            LimitVerdict::Admitted(_)
        ) {
            admitted += 1;
        }
    }
    // capacity + rate x time = 10 + 1000 (the last refill at 99.999 s is not quite complete).
    assert!((1008..=1010).contains(&admitted), "{admitted}");
}

#[test]
fn reconciliation_refunds_and_charges_debt() {
    let buckets = LocalBuckets::default();
    let lim = limits(6000, 6000, 600); // output: 10/s, capacity 10
    let reserve = takes_1s_burst(&lim, demand(0.0, 10.0));
    assert!(matches!(
        buckets.admit_at(&reserve, 0.0),
        LimitVerdict::Admitted(_)
    ));
    // Only 4 of the 10 reserved were generated: 6 come back.
    let mut refund = takes_1s_burst(&lim, Demand::default());
    refund[2].amount = -6.0;
    buckets.adjust_at(&refund, 0.0);
    let next = takes_1s_burst(&lim, demand(0.0, 6.0));
    assert!(matches!(
        buckets.admit_at(&next, 0.0),
        LimitVerdict::Admitted(_)
    ));
    // A stream that ran 20 past its reservation leaves the bucket in debt for 2 s.
    let mut debt = takes_1s_burst(&lim, Demand::default());
    debt[2].amount = 20.0;
    buckets.adjust_at(&debt, 0.0);
    let one = takes_1s_burst(&lim, demand(0.0, 1.0));
    assert!(matches!(
        buckets.admit_at(&one, 2.0),
        LimitVerdict::Limited { .. }
    ));
    assert!(matches!(
        buckets.admit_at(&one, 2.11),
        LimitVerdict::Admitted(_)
    ));
}

#[test]
fn oversized_demands_are_clamped_to_the_capacity() {
    let buckets = LocalBuckets::default();
    let t = takes_1s_burst(&limits(60, 60, 60), demand(1e6, 0.0));
    assert!(matches!(
        buckets.admit_at(&t, 0.0),
        LimitVerdict::Admitted(_)
    ));
}
