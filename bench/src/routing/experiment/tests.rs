use super::*;

#[test]
fn policy_names_round_trip_and_the_oracle_has_no_gateway() {
    for p in Policy::ALL {
        assert_eq!(p.as_str().parse::<Policy>().ok(), Some(p));
    }
    assert_eq!(Policy::Oracle.gateway_mode(), None);
    assert_eq!(Policy::PrefixHash.gateway_mode(), Some("prefix-hash"));
    assert!("fastest".parse::<Policy>().is_err());
}

#[test]
fn scaled_request_counts_grow_with_concurrency_above_a_floor() {
    let count = RequestCount::Scaled {
        min: 40,
        per_user: 4,
    };
    assert_eq!(count.for_concurrency(1), 40);
    assert_eq!(count.for_concurrency(32), 128);
    assert_eq!(RequestCount::Fixed(7).for_concurrency(32), 7);
}
