//! Tags supplied by the client: the `x-kinference-tags` header and `metadata.tags` in the body.
//!
//! Tags only ever add constraints or routing hints; a client cannot remove a tag a classifier set
//! (so it cannot un-mark PII). Tags are lowercased; anything outside `[a-z0-9:._/-]`, longer than
//! 64 characters, or beyond the 32nd tag is dropped.

use std::collections::BTreeSet;

use serde_json::Value;

#[cfg(test)]
mod tests;

/// Header carrying comma-separated tags.
pub const TAGS_HEADER: &str = "x-kinference-tags";
const MAX_TAGS: usize = 32;
const MAX_TAG_LEN: usize = 64;

/// Tags from the header value (comma or whitespace separated).
pub fn from_header(value: &str) -> BTreeSet<String> {
    parse_list(value)
}

/// Tags from the body's `metadata.tags` (a comma-separated string, as OpenAI metadata values are
/// strings, or an array of strings).
pub fn from_body(body: &Value) -> BTreeSet<String> {
    match body.get("metadata").and_then(|m| m.get("tags")) {
        Some(Value::String(s)) => parse_list(s),
        Some(Value::Array(items)) => parse_list(
            &items
                .iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join(","),
        ),
        _ => BTreeSet::new(),
    }
}

fn parse_list(value: &str) -> BTreeSet<String> {
    value
        .split(|c: char| c == ',' || c.is_whitespace())
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| {
            !t.is_empty()
                && t.len() <= MAX_TAG_LEN
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b":._/-".contains(&b))
        })
        .take(MAX_TAGS)
        .collect()
}
