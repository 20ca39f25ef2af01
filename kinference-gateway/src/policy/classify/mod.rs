//! Facts about a request, from its text and headers: PII, prompt complexity, tags.
//!
//! [`classify_request`] is what the gateway pipeline calls on the parsed body (OpenAI chat or
//! completion, or Anthropic messages): it scans all message text, never only the last message.

pub mod complexity;
pub mod external;
pub mod pii;
pub mod tags;

use std::collections::BTreeSet;

use serde::Serialize;
use serde_json::Value;

use super::engine::{PII_TAG, RequestFacts};

#[cfg(test)]
mod tests;

/// What the built-in classifiers found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Classification {
    /// All tags: `pii` and `pii:<kind>` from the detectors, plus the client's tags.
    pub tags: BTreeSet<String>,
    /// PII matches (kinds and positions in the extracted text, never the text).
    pub pii: Vec<pii::PiiMatch>,
    /// The complexity assessment.
    pub complexity: complexity::ComplexityAssessment,
}

/// Classifies a request body, with the value of the `x-kinference-tags` header if present.
pub fn classify_request(body: &Value, tags_header: Option<&str>) -> Classification {
    let (text, turns) = request_text(body);
    let pii = pii::scan(&text);
    let mut tags = tags::from_body(body);
    if let Some(h) = tags_header {
        tags.extend(tags::from_header(h));
    }
    if !pii.is_empty() {
        tags.insert(PII_TAG.to_string());
        tags.extend(pii.iter().map(|m| m.kind.tag().to_string()));
    }
    Classification {
        tags,
        pii,
        complexity: complexity::assess(&text, turns),
    }
}

/// The engine's facts for a request body: what the gateway pipeline calls before
/// [`super::engine::evaluate`]. `tenant` is the authenticated tenant, `tags_header` the
/// `x-kinference-tags` value, `prompt_tokens` the router's count when it has one (else about four
/// characters per token). `None` when the body has no `model`.
pub fn request_facts(
    body: &Value,
    tenant: Option<&str>,
    tags_header: Option<&str>,
    prompt_tokens: Option<u64>,
) -> Option<(RequestFacts, Classification)> {
    let model = body.get("model")?.as_str()?.to_string();
    let classification = classify_request(body, tags_header);
    let prompt_tokens =
        prompt_tokens.or_else(|| Some((request_text(body).0.len() as u64).div_ceil(4)));
    let max_output_tokens = body
        .get("max_tokens")
        .or_else(|| body.get("max_completion_tokens"))
        .and_then(Value::as_u64);
    let facts = RequestFacts {
        tenant: tenant.map(str::to_string),
        model,
        tags: classification.tags.clone(),
        complexity: Some(classification.complexity.level),
        prompt_tokens,
        max_output_tokens,
    };
    Some((facts, classification))
}

/// All prompt text of a request, one part per line, and its number of turns. Covers OpenAI chat
/// `messages` (string or part arrays, tool calls), completion `prompt` (string or array),
/// Anthropic `system` and `messages` (blocks), and Responses-style `input`. Inline data URLs
/// (images) are skipped.
pub fn request_text(body: &Value) -> (String, usize) {
    let mut parts = Vec::new();
    for key in ["system", "messages", "prompt", "input", "instructions"] {
        if let Some(v) = body.get(key) {
            collect_strings(v, &mut parts);
        }
    }
    let turns = match body.get("messages") {
        Some(Value::Array(m)) => m.len(),
        _ => 1,
    };
    (parts.join("\n"), turns)
}

fn collect_strings<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::String(s) if !s.starts_with("data:") => out.push(s),
        Value::Array(items) => items.iter().for_each(|i| collect_strings(i, out)),
        Value::Object(map) => {
            for (k, v) in map {
                // Structural fields, not text.
                if !matches!(
                    k.as_str(),
                    "role" | "type" | "id" | "tool_call_id" | "cache_control"
                ) {
                    collect_strings(v, out);
                }
            }
        }
        _ => {}
    }
}
