use serde_json::json;

use super::*;
use crate::api::openai::StreamChunk;

/// Stream events as workers send them, and odd ones.
fn events() -> Vec<String> {
    let mut events: Vec<String> = [
        json!({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        json!({"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": null}]}),
        json!({"choices": [{"index": 0, "delta": {"content": "a \"quoted\"\nline"}}]}),
        json!({"choices": [{"index": 0, "delta": {"content": ""}, "text": "ignored"}]}),
        json!({"choices": [{"index": 0, "delta": {}, "text": "completion text"}]}),
        json!({"choices": [{"index": 0, "text": ""}]}),
        json!({"choices": [{"delta": {"reasoning_content": "think"}}]}),
        json!({"choices": [{"delta": {"reasoning": "", "reasoning_content": "hidden"}}]}),
        json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\""}}]}}]}),
        json!({"choices": [{"delta": {"tool_calls": []}}]}),
        json!({"choices": [{"delta": {"content": null}, "finish_reason": "stop", "stop_reason": 151645}]}),
        json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 8, "total_tokens": 17,
            "prompt_tokens_details": {"cached_tokens": 4}}}),
        json!({"choices": [{"delta": {"content": "x"}}], "usage": {"prompt_tokens": 1}}),
        json!({"error": {"message": "boom", "code": 500}}),
        json!({"error": null, "choices": []}),
        // Refused by both: wrong types.
        json!({"choices": [{"delta": {"content": 5}}]}),
        json!({"choices": [{"finish_reason": 1}]}),
        json!({"choices": [{"delta": {"tool_calls": [{"index": "zero"}]}}]}),
        json!({"choices": {}}),
        json!({"usage": "none"}),
    ]
    .iter()
    .map(|v| v.to_string())
    .collect();
    events.push("not json".into());
    events.push("[1, 2]".into());
    events
}

#[test]
fn a_glance_reads_what_a_full_parse_reads_and_refuses_what_it_refuses() {
    let mut refused = 0;
    for event in events() {
        let full = serde_json::from_str::<StreamChunk>(&event);
        let glance = serde_json::from_str::<ChunkGlance>(&event);
        match (full, glance) {
            (Ok(full), Ok(glance)) => {
                assert_eq!(glance.has_text(), full.has_text(), "{event}");
                assert_eq!(glance.usage, full.usage, "{event}");
                assert_eq!(glance.error, full.error, "{event}");
                assert_eq!(
                    glance.usage_only(),
                    full.choices.is_empty() && full.usage.is_some(),
                    "{event}"
                );
            }
            (Err(_), Err(_)) => refused += 1,
            (full, glance) => panic!("{event}: full parse {full:?}, glance {glance:?}"),
        }
    }
    assert_eq!(refused, 7, "the odd events are refused by both");
}

#[test]
fn plain_text_is_borrowed_from_the_event() {
    let event = r#"{"choices":[{"delta":{"content":"Hello"}}]}"#;
    let glance: ChunkGlance = serde_json::from_str(event).unwrap();
    let content = glance.choices[0].delta.as_ref().unwrap().content.as_ref();
    assert!(matches!(content, Some(Text(Cow::Borrowed("Hello")))));
    // With an escape the text is unescaped into its own string.
    let event = r#"{"choices":[{"delta":{"content":"a\nb"}}]}"#;
    let glance: ChunkGlance = serde_json::from_str(event).unwrap();
    let content = glance.choices[0].delta.as_ref().unwrap().content.as_ref();
    assert!(matches!(content, Some(Text(Cow::Owned(s))) if s == "a\nb"));
}
