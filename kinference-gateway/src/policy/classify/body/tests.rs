use base64::Engine as _;
use serde_json::json;

use super::extract;
use crate::policy::classify::pii::{PiiKind, scan};

fn kinds(body: &serde_json::Value) -> Vec<PiiKind> {
    let mut kinds: Vec<PiiKind> = scan(&extract(body).text)
        .into_iter()
        .map(|m| m.kind)
        .collect();
    kinds.dedup();
    kinds
}

fn b64(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

#[test]
fn fields_no_list_names_are_read() {
    // Each of these reaches a provider; none was scanned by the old list of prompt fields.
    let cases = [
        json!({"tools": [{"type": "function", "function": {"name": "f",
            "description": "escalate to jane@example.com", "parameters": {}}}]}),
        json!({"tools": [{"name": "f", "input_schema": {"type": "object",
            "properties": {"to": {"default": "jane@example.com"}}}}]}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
            "schema": {"description": "jane@example.com"}}}}),
        json!({"prediction": {"type": "content", "content": "jane@example.com"}}),
        json!({"user": "jane@example.com"}),
        json!({"suffix": "jane@example.com"}),
        json!({"metadata": {"user_id": "jane@example.com"}}),
        json!({"a_field_added_next_year": {"deep": ["jane@example.com"]}}),
        json!({"messages": [{"role": "user", "content": [{"type": "tool_result",
            "tool_use_id": "t1", "content": [{"type": "text", "text": "jane@example.com"}]}]}]}),
        json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
            "name": "send", "input": {"to": "jane@example.com"}}]}]}),
        json!({"messages": [{"role": "tool", "tool_call_id": "c1", "content": "jane@example.com"}]}),
        // A key is sent too.
        json!({"metadata": {"jane@example.com": true}}),
    ];
    for body in cases {
        assert_eq!(kinds(&body), [PiiKind::Email], "missed in {body}");
    }
}

#[test]
fn numbers_are_read_and_neighbouring_values_never_join() {
    assert_eq!(
        kinds(&json!({"metadata": {"card": 4111111111111111u64}})),
        [PiiKind::PaymentCard]
    );
    // 151, 643, 1516 on three lines would read as a North-American phone number.
    assert!(kinds(&json!({"stop_token_ids": [151, 643, 1516], "max_tokens": 256})).is_empty());
}

#[test]
fn escaped_json_in_strings_is_read_decoded() {
    let arguments = r#"{"to": "jane\u0040example.com"}"#;
    let body = json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
        "function": {"name": "send", "arguments": arguments}}]}]});
    assert_eq!(kinds(&body), [PiiKind::Email]);
}

#[test]
fn text_data_urls_and_base64_sources_are_decoded() {
    let cases = [
        json!({"messages": [{"role": "user", "content": [{"type": "file", "file": {
            "file_data": format!("data:text/plain;base64,{}", b64("mail jane@example.com"))}}]}]}),
        json!({"messages": [{"role": "user", "content": "data:,mail%20jane%40example.com"}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "document", "source": {
            "type": "base64", "media_type": "text/plain", "data": b64("jane@example.com")}}]}]}),
        json!({"messages": [{"role": "user", "content":
            format!("DATA:application/json;base64,{}", b64(r#"{"to":"jane@example.com"}"#))}]}),
    ];
    for body in cases {
        let content = extract(&body);
        assert!(content.binary.is_empty(), "{body}: {:?}", content.binary);
        assert_eq!(kinds(&body), [PiiKind::Email], "missed in {body}");
    }
}

#[test]
fn binary_content_is_reported_not_skipped() {
    let png = format!("data:image/png;base64,{}", b64("\u{89}PNG"));
    let body = json!({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png}},
        {"type": "input_audio", "input_audio": {"data": b64("RIFF"), "format": "wav"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/4AAQ"}},
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}},
        // Declared as text, but not UTF-8: unreadable all the same.
        {"type": "text", "text": format!("data:text/plain;base64,{}", "//79")},
    ]}]});
    assert_eq!(
        extract(&body).binary,
        [
            "image/png",
            "audio/wav",
            "image/jpeg",
            "application/pdf",
            "text/plain"
        ]
    );
}

#[test]
fn token_id_prompts_are_set_apart() {
    let single = extract(&json!({"model": "m", "prompt": [1, 2, 3]}));
    assert_eq!(single.token_prompts, [vec![1, 2, 3]]);
    let batch = extract(&json!({"prompt": [[1, 2], [3]]}));
    assert_eq!(batch.token_prompts, [vec![1, 2], vec![3]]);
    // Text prompts, mixed arrays and out-of-range numbers are read as text.
    for prompt in [
        json!("call jane@example.com"),
        json!(["a", "call jane@example.com"]),
    ] {
        let content = extract(&json!({ "prompt": prompt }));
        assert!(content.token_prompts.is_empty());
        assert_eq!(scan(&content.text).len(), 1, "{prompt}");
    }
    assert!(
        extract(&json!({"prompt": [1, -2]}))
            .token_prompts
            .is_empty()
    );
}

#[test]
fn text_that_only_starts_like_a_data_url_is_read() {
    assert_eq!(
        kinds(&json!({"messages": [{"role": "user", "content": "data: jane@example.com"}]})),
        [PiiKind::Email]
    );
}
