use serde_json::json;

use super::{classify_request, request_text};

#[test]
fn pii_in_an_earlier_message_is_found() {
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "my email is jane@example.com"},
        {"role": "assistant", "content": "noted"},
        {"role": "user", "content": "now summarise our chat"}
    ]});
    let c = classify_request(&body, None);
    assert!(
        c.tags.contains("pii") && c.tags.contains("pii:email"),
        "{:?}",
        c.tags
    );
}

#[test]
fn content_parts_tool_calls_and_anthropic_system_are_scanned() {
    let openai = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "card 4111 1111 1111 1111"}]}]});
    assert!(
        classify_request(&openai, None)
            .tags
            .contains("pii:payment_card")
    );
    let tool = json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "lookup", "arguments": "{\"ssn\": \"123-45-6789\"}"}}]}]});
    assert!(classify_request(&tool, None).tags.contains("pii:us_ssn"));
    let anthropic = json!({"system": [{"type": "text", "text": "Customer IBAN DE89370400440532013000"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]});
    assert!(classify_request(&anthropic, None).tags.contains("pii:iban"));
    let completion = json!({"prompt": ["a", "call +44 20 7946 0958"]});
    assert!(
        classify_request(&completion, None)
            .tags
            .contains("pii:phone")
    );
}

#[test]
fn header_and_metadata_tags_are_merged_and_cannot_remove_pii() {
    let body = json!({"messages": [{"role": "user", "content": "reach me at a@example.org"}],
        "metadata": {"tags": "internal"}});
    let c = classify_request(&body, Some("batch"));
    for t in ["pii", "internal", "batch"] {
        assert!(c.tags.contains(t), "{t} missing from {:?}", c.tags);
    }
}

#[test]
fn images_fail_closed_and_turns_counted() {
    let body = json!({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,GB82WEST12345698765432"}}]},
        {"role": "user", "content": "what is this?"}]});
    let (text, turns) = request_text(&body);
    assert_eq!(turns, 2);
    assert!(!text.contains("base64"));
    let c = classify_request(&body, None);
    // Nothing was detected, but an image cannot be read: the request is kept local.
    assert!(c.pii.is_empty());
    assert_eq!(c.unreadable, ["image/png"]);
    assert!(
        c.tags.contains("pii") && c.tags.contains("unreadable"),
        "{:?}",
        c.tags
    );
}

#[test]
fn token_id_prompts_are_scanned_when_decoded_and_fail_closed_otherwise() {
    let body = json!({"model": "m", "prompt": [7, 8, 9]});
    let undecoded = classify_request(&body, None);
    assert_eq!(undecoded.unreadable, ["token_ids"]);
    assert!(undecoded.tags.contains("pii"));
    let decode = |ids: &[u32]| (ids == [7, 8, 9]).then(|| "mail jane@example.com".to_string());
    let decoded = super::classify_request_with(&body, None, &decode);
    assert!(decoded.unreadable.is_empty());
    assert!(decoded.tags.contains("pii:email"), "{:?}", decoded.tags);
    let harmless = |_: &[u32]| Some("hello there".to_string());
    let clean = super::classify_request_with(&body, None, &harmless);
    assert!(!clean.tags.contains("pii"), "{:?}", clean.tags);
}

#[test]
fn request_facts_carry_model_tenant_tags_and_token_counts() {
    let body = json!({"model": "qwen-large", "max_tokens": 64,
        "messages": [{"role": "user", "content": "card 4111 1111 1111 1111"}]});
    let (facts, c) = super::request_facts(&body, Some("acme"), Some("batch"), None).expect("facts");
    assert_eq!(facts.model, "qwen-large");
    assert_eq!(facts.tenant.as_deref(), Some("acme"));
    assert!(facts.tags.contains("pii:payment_card") && facts.tags.contains("batch"));
    assert_eq!(facts.max_output_tokens, Some(64));
    assert_eq!(facts.prompt_tokens, Some(6));
    assert_eq!(c.pii.len(), 1);
    assert!(super::request_facts(&json!({"messages": []}), None, None, None).is_none());
}

#[tokio::test]
async fn unreadable_content_is_counted_once_per_request_and_kind() {
    let classifier = super::Classifier::default();
    let png = "data:image/png;base64,iVBORw0KGgo=";
    let body = json!({"model": "m", "prompt": [1, 2], "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png}},
        {"type": "image_url", "image_url": {"url": png}}]}]});
    let (facts, c) = classifier
        .facts(&body, None, None, &|_| None)
        .await
        .expect("facts");
    assert_eq!(c.unreadable, ["image/png", "image/png", "token_ids"]);
    assert!(facts.tags.contains("pii") && facts.tags.contains("unreadable"));
    let mut registry = prometheus_client::registry::Registry::default();
    classifier.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    assert!(
        text.contains("classifier_unreadable_requests_total{content=\"binary\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("classifier_unreadable_requests_total{content=\"token_ids\"} 1"),
        "{text}"
    );
}
