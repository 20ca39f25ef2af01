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
fn peers_parse_have_no_gateway_and_serialize_by_name() {
    for p in Policy::PEERS {
        assert_eq!(p.as_str().parse::<Policy>().ok(), Some(p));
        assert!(p.is_peer());
        assert_eq!(p.gateway_mode(), None);
        assert_eq!(
            serde_json::to_value(p).expect("json"),
            serde_json::json!(p.as_str())
        );
    }
    assert!(!Policy::Kinference.is_peer());
    // Report order: baselines, peers, Kinference, the oracle.
    assert!(Policy::PrefixHash < Policy::VllmRouterKvAware);
    assert!(Policy::LitellmLeastBusy < Policy::Kinference);
}
