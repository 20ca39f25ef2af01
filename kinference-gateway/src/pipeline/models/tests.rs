use super::cards_of;
use crate::api::openai::ModelKind;
use crate::policy::engine::tests::{RESOURCES, set_from};

#[test]
fn without_policies_the_configured_and_workers_models_are_listed_once() {
    let cards = cards_of(
        &["a".to_string()],
        &["a".to_string(), "b".to_string()],
        None,
    );
    let ids: Vec<&str> = cards.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["a", "b"]);
    assert!(
        cards
            .iter()
            .all(|c| c.kind == ModelKind::Model && c.owned_by == "kinference")
    );
}

#[test]
fn models_aliases_and_classes_with_their_owners() {
    let set = set_from(&[RESOURCES]);
    let cards = cards_of(&[], &[], Some(&set));
    let card = |id: &str| {
        cards
            .iter()
            .find(|c| c.id == id)
            .unwrap_or_else(|| panic!("{id} listed"))
    };
    assert_eq!(card("org/small").kind, ModelKind::Model);
    assert_eq!(card("s").kind, ModelKind::Alias);
    assert_eq!(card("s").root.as_deref(), Some("org/small"));
    let coding = card("coding");
    assert_eq!(coding.kind, ModelKind::Class);
    assert_eq!(coding.owned_by, "kinference");
    assert_eq!(coding.members, ["org/large", "provider/cloud/cloud-big"]);
    // Only a provider serves `frontier`: it owns the class.
    assert_eq!(card("frontier").owned_by, "cloud");
}
