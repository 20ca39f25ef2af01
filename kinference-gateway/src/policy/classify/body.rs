//! Everything in a request body that a worker or a provider would receive, as text for the PII
//! scan.
//!
//! The whole JSON body is walked (object keys, strings, numbers), never a list of known fields: a
//! field added to either protocol later (OpenAI or Anthropic, tools, `response_format`,
//! `prediction`, `metadata`, ...) is covered without a change here. What cannot be read as text is
//! reported instead of skipped, so that the caller can fail closed:
//! - completion prompts given as token ids ([`BodyText::token_prompts`]): the policy stage decodes
//!   them with the model's tokenizer when it has one;
//! - binary content ([`BodyText::binary`]): images, audio, PDFs, whether as `data:` URLs, Anthropic
//!   base64 sources or OpenAI `input_audio`. Text `data:` URLs and text base64 sources are decoded
//!   and scanned like any other text.
//!
//! Strings that hold JSON with escapes (tool call `arguments`, tool results) are also walked
//! decoded, so `jane\u0040example.com` is seen as the provider's parser will see it.

use base64::Engine as _;
use serde_json::Value;

#[cfg(test)]
mod tests;

/// Top-level members that may hold token ids a worker turns into text: a completion's or
/// tokenizer's `prompt`, an embedding's `input`, `/detokenize`'s `tokens`.
const TOKEN_ID_KEYS: [&str; 3] = ["prompt", "input", "tokens"];

/// How deep JSON inside strings (inside strings ...) is decoded: enough for tool arguments that
/// quote a tool result, without letting a crafted body recurse without bound.
const MAX_EMBEDDED_JSON_DEPTH: u8 = 3;

/// The readable text of a body and what could not be read.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BodyText {
    /// Every key, string and number, separated by blank lines (no detector pattern spans a blank
    /// line, so two neighbouring values never make up a match that neither holds).
    pub text: String,
    /// Completion prompts given as token ids (`prompt: [1, 2]` or `prompt: [[1, 2], [3]]`).
    pub token_prompts: Vec<Vec<u32>>,
    /// Media types of content that is not text (`image/png`, `audio/wav`, `application/pdf`).
    pub binary: Vec<String>,
}

/// Walks the whole body; see the module documentation.
pub fn extract(body: &Value) -> BodyText {
    let mut out = BodyText::default();
    match body {
        Value::Object(map) => {
            for (key, value) in map {
                out.push(key);
                if TOKEN_ID_KEYS.contains(&key.as_str())
                    && let Some(prompts) = token_prompts(value)
                {
                    out.token_prompts.extend(prompts);
                    continue;
                }
                walk(value, &mut out, 0);
            }
        }
        other => walk(other, &mut out, 0),
    }
    out
}

impl BodyText {
    fn push(&mut self, text: &str) {
        if !self.text.is_empty() {
            self.text.push_str("\n\n");
        }
        self.text.push_str(text);
    }
}

fn walk(value: &Value, out: &mut BodyText, depth: u8) {
    match value {
        Value::String(s) => string(s, out, depth),
        Value::Number(n) => out.push(&n.to_string()),
        Value::Array(items) => items.iter().for_each(|v| walk(v, out, depth)),
        Value::Object(map) => {
            if let Some(media_type) = base64_source(map) {
                // An Anthropic `{"type": "base64", "media_type": ..., "data": ...}` source.
                let data = map.get("data").and_then(Value::as_str).unwrap_or("");
                readable(media_type, decode_base64(data), out);
                return;
            }
            for (key, value) in map {
                out.push(key);
                if key == "input_audio" {
                    // OpenAI audio input: `{"data": <base64>, "format": "wav"}`.
                    let format = value.get("format").and_then(Value::as_str).unwrap_or("");
                    out.binary.push(format!("audio/{format}"));
                    continue;
                }
                walk(value, out, depth);
            }
        }
        Value::Bool(_) | Value::Null => {}
    }
}

fn string(s: &str, out: &mut BodyText, depth: u8) {
    if let Some(url) = strip_prefix_ignore_case(s, "data:") {
        data_url(url, out);
        return;
    }
    out.push(s);
    // JSON in a string (tool arguments, tool results): the escapes hide text from the scan above.
    let trimmed = s.trim_start();
    if depth < MAX_EMBEDDED_JSON_DEPTH
        && (trimmed.starts_with('{') || trimmed.starts_with('['))
        && s.contains('\\')
        && let Ok(inner) = serde_json::from_str::<Value>(s)
    {
        walk(&inner, out, depth + 1);
    }
}

/// `data:[<media type>][;base64],<data>` (RFC 2397), without the `data:`.
fn data_url(url: &str, out: &mut BodyText) {
    let Some((meta, data)) = url.split_once(',') else {
        // Not a data URL after all: plain text that starts with "data:".
        out.push(url);
        return;
    };
    let mut params = meta.split(';');
    let media_type = params.next().unwrap_or("").trim();
    // RFC 2397: an empty media type means text/plain.
    let media_type = if media_type.is_empty() {
        "text/plain"
    } else {
        media_type
    };
    let bytes = if params.any(|p| p.trim().eq_ignore_ascii_case("base64")) {
        decode_base64(data)
    } else {
        Some(percent_encoding::percent_decode_str(data).collect())
    };
    readable(media_type, bytes, out);
}

/// Text content joins the scanned text; anything else (or text that does not decode) is binary.
fn readable(media_type: &str, bytes: Option<Vec<u8>>, out: &mut BodyText) {
    let media_type = media_type.to_ascii_lowercase();
    if is_text(&media_type)
        && let Some(bytes) = bytes
        && let Ok(text) = String::from_utf8(bytes)
    {
        out.push(&text);
    } else {
        out.binary.push(media_type);
    }
}

fn is_text(media_type: &str) -> bool {
    media_type.starts_with("text/")
        || media_type.ends_with("+json")
        || media_type.ends_with("+xml")
        || matches!(
            media_type,
            "application/json"
                | "application/xml"
                | "application/javascript"
                | "application/x-www-form-urlencoded"
                | "application/yaml"
                | "application/x-yaml"
        )
}

fn base64_source(map: &serde_json::Map<String, Value>) -> Option<&str> {
    (map.get("type").and_then(Value::as_str) == Some("base64"))
        .then(|| map.get("media_type").and_then(Value::as_str))
        .flatten()
}

fn decode_base64(data: &str) -> Option<Vec<u8>> {
    let compact: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    base64::engine::general_purpose::STANDARD
        .decode(compact.as_bytes())
        .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(compact.as_bytes()))
        .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(compact.as_bytes()))
        .ok()
}

/// `prompt` as token ids: a non-empty array of integers, or an array of such arrays.
fn token_prompts(prompt: &Value) -> Option<Vec<Vec<u32>>> {
    let Value::Array(items) = prompt else {
        return None;
    };
    if items.is_empty() {
        return None;
    }
    if let Some(ids) = ids(items) {
        return Some(vec![ids]);
    }
    items
        .iter()
        .map(|item| match item {
            Value::Array(inner) if !inner.is_empty() => ids(inner),
            _ => None,
        })
        .collect()
}

fn ids(items: &[Value]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}
