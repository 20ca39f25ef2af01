use super::*;

#[test]
fn calendar_round_trips_and_month_boundaries() {
    for days in [-1000i64, 0, 59, 60, 365, 11_016, 20_000, 20_790] {
        let (y, m, d) = civil_from_days(days);
        assert_eq!(days_from_civil(y, m, d), days);
    }
    // 2026-12-03T02:30:00Z
    let t = parse_time("2026-12-03T02:30:00Z").unwrap();
    assert_eq!(rfc3339(t), "2026-12-03T02:30:00Z");
    assert_eq!(month_key(t), "2026-12");
    assert_eq!(hour_key(t), "2026120302");
    assert_eq!(rfc3339(next_month_ms(t)), "2027-01-01T00:00:00Z");
    assert_eq!(rfc3339(month_start_ms(t)), "2026-12-01T00:00:00Z");
    assert_eq!(
        parse_time("2026-12-03"),
        Some(month_start_ms(t) + 2 * 86_400_000)
    );
    assert_eq!(parse_time("1700000000"), Some(1_700_000_000_000));
    assert_eq!(parse_time("2026-13-01"), None);
    assert_eq!(parse_time("yesterday"), None);
    assert_eq!(parse_time("2026-12-0\u{e9}T01:00Z"), None);
    assert_eq!(parse_time("2026-12-03\u{e9}01:00"), None);
}

#[test]
fn spend_is_per_tenant_and_month() {
    let spend = Spend::default();
    let dec = parse_time("2026-12-31T23:59:00Z").unwrap();
    let jan = parse_time("2027-01-01T00:01:00Z").unwrap();
    spend.add("a", dec, 1.5);
    spend.add("a", dec, 1.0);
    spend.add("a", jan, 7.0);
    spend.add("b", dec, 3.0);
    assert_eq!(spend.spent("a", dec), 2.5);
    assert_eq!(spend.spent("a", jan), 7.0);
    assert_eq!(spend.spent("b", jan), 0.0);
}
