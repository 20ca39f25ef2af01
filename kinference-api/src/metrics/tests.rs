use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::*;

type Labelled = Family<Vec<(String, String)>, Counter>;

#[test]
fn an_empty_family_is_described_only_when_wrapped() {
    let mut registry = Registry::default();
    registry.register("bare", "A bare family", Labelled::default());
    let described = Labelled::default();
    registry.register(
        "described",
        "A described family",
        Described(described.clone()),
    );
    let mut text = String::new();
    encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("# HELP described A described family"),
        "{text}"
    );
    assert!(text.contains("# TYPE described counter"), "{text}");
    assert!(!text.contains("bare"), "{text}");

    described
        .get_or_create(&vec![("worker".to_string(), "w1".to_string())])
        .inc();
    let mut text = String::new();
    encode(&mut text, &registry).unwrap();
    assert!(text.contains("described_total{worker=\"w1\"} 1"), "{text}");
}
