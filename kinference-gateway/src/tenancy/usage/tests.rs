use kinference_crds::TokenPrices;

use super::*;

fn record(
    id: &str,
    tenant: &str,
    ts_ms: u64,
    uncached: u64,
    cached: u64,
    output: u64,
) -> UsageRecord {
    UsageRecord {
        id: id.into(),
        request_id: String::new(),
        ts_ms,
        tenant: tenant.into(),
        model: "m".into(),
        pool: "p".into(),
        provider: String::new(),
        status: 200,
        requests: 1,
        input_uncached: uncached,
        input_cached: cached,
        output,
        cost: 0.0,
        estimated: false,
        prefill_pool: String::new(),
    }
}

#[test]
fn cached_and_uncached_tokens_are_priced_separately() {
    let prices = TokenPrices {
        cached_input_per_million: 0.1,
        uncached_input_per_million: 1.0,
        output_per_million: 2.0,
        currency: None,
    };
    let c = cost(Some(&prices), 1_000_000, 2_000_000, 500_000);
    assert!((c - (1.0 + 0.2 + 1.0)).abs() < 1e-12, "{c}");
    assert_eq!(cost(None, 1, 1, 1), 0.0);
}

#[test]
fn aggregates_answer_time_ranges_per_tenant() {
    let mut agg = Aggregates::default();
    agg.add(&record("1", "a", 60_000, 10, 5, 3));
    agg.add(&record("2", "a", 120_500, 1, 0, 1));
    agg.add(&record("3", "b", 120_500, 100, 0, 0));
    let all = agg.query(None, 0, 10 * 60_000);
    assert_eq!(all.len(), 2);
    let a = agg.query(Some("a"), 0, 10 * 60_000);
    let t = a.values().next().unwrap();
    assert_eq!(
        (
            t.requests,
            t.input_uncached_tokens,
            t.input_cached_tokens,
            t.output_tokens
        ),
        (2, 11, 5, 4)
    );
    // Only the first minute.
    let first = agg.query(Some("a"), 60_000, 120_000);
    assert_eq!(first.values().next().unwrap().requests, 1);
    let json = report(&all, 0, 600_000, "journal");
    assert_eq!(json["total"]["requests"], 3);
    assert_eq!(json["total"]["input_uncached_tokens"], 111);
}

#[test]
fn group_fields_round_trip() {
    let r = record("x", "acme", 0, 0, 0, 0);
    let g = Group::from_field(&r.group_field()).unwrap();
    assert_eq!(
        (
            g.tenant.as_str(),
            g.model.as_str(),
            g.pool.as_str(),
            g.provider.as_str()
        ),
        ("acme", "m", "p", "")
    );
}

#[test]
fn aggregates_stay_bounded_in_time_and_groups_and_keep_every_total() {
    let hour = 3_600_000;
    // Three days of a request every minute, two hours of history kept past the last day.
    let mut agg = Aggregates::new(26 * hour);
    let minutes = 3 * 24 * 60;
    for m in 0..minutes {
        agg.add(&record(&m.to_string(), "a", m * 60_000, 1, 0, 0));
    }
    assert!(agg.buckets() <= 24 * 60 + 26, "{} buckets", agg.buckets());
    // The last 26 hours are all there, summed to the hour before the last day.
    let kept = agg.query(None, (minutes * 60_000) - 26 * hour, minutes * 60_000);
    assert_eq!(kept.values().map(|t| t.requests).sum::<u64>(), 26 * 60);

    // Past MAX_GROUPS distinct groups, new ones are summed under `other`; nothing is lost.
    let mut agg = Aggregates::default();
    for i in 0..MAX_GROUPS + 5 {
        agg.add(&record(&i.to_string(), &format!("t{i}"), 0, 1, 0, 0));
    }
    let all = agg.query(None, 0, 60_000);
    assert_eq!(all.len(), MAX_GROUPS + 1);
    assert_eq!(all[&Group::other()].requests, 5);
    assert_eq!(
        all.values().map(|t| t.requests).sum::<u64>(),
        MAX_GROUPS as u64 + 5
    );
}
