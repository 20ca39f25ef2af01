use serde_json::json;

use super::{from_body, from_header};

#[test]
fn header_tags_are_split_and_lowercased() {
    let tags = from_header("Confidential, team:legal  batch");
    assert_eq!(
        tags.into_iter().collect::<Vec<_>>(),
        ["batch", "confidential", "team:legal"]
    );
}

#[test]
fn invalid_tags_are_dropped() {
    let tags = from_header("ok, bad tag!, <script>, ");
    assert_eq!(tags.into_iter().collect::<Vec<_>>(), ["bad", "ok"]);
    assert_eq!(from_header(&"x,".repeat(100)).len(), 1);
}

#[test]
fn body_metadata_tags_as_string_or_array() {
    assert!(from_body(&json!({"metadata": {"tags": "pii,internal"}})).contains("internal"));
    assert!(from_body(&json!({"metadata": {"tags": ["Coding"]}})).contains("coding"));
    assert!(from_body(&json!({"metadata": {"user_id": "u"}})).is_empty());
}
