//! Protocol translation for providers, with the OpenAI chat API as the pivot: requests go out in the
//! provider's protocol, answers come back as OpenAI chat completions (whole) or chunks (streams),
//! which the pipeline's existing translators then turn into the client's protocol. An OpenAI client
//! bursting to an Anthropic provider thus gets OpenAI answers, and an Anthropic client gets Anthropic
//! ones whichever provider served it.

use serde_json::{Map, Value, json};

use crate::api::openai::ChatCompletionRequest;

/// `anthropic-version` header sent to Anthropic providers.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";
/// `max_tokens` for an Anthropic provider when the client gave none (the API requires one).
pub const DEFAULT_MAX_TOKENS: u64 = 4096;

/// Why a request cannot be expressed in a provider's protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Untranslatable(pub String);

/// The text of an OpenAI message `content`: a string, or the `text` parts of a part list.
fn content_text(content: &Value) -> Result<String, Untranslatable> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut out = Vec::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => out.push(t.as_str()),
                    (kind, _) => {
                        return Err(Untranslatable(format!(
                            "content part of type {:?} cannot be sent to an Anthropic provider",
                            kind.unwrap_or("?")
                        )));
                    }
                }
            }
            Ok(out.join("\n"))
        }
        other => Err(Untranslatable(format!(
            "message content {other} is neither text nor parts"
        ))),
    }
}

/// An OpenAI chat request as an Anthropic Messages request for `model`.
pub fn anthropic_request(
    chat: &ChatCompletionRequest,
    model: &str,
    stream: bool,
) -> Result<Value, Untranslatable> {
    let messages = chat
        .messages
        .as_array()
        .ok_or_else(|| Untranslatable("`messages` is not an array".into()))?;
    let mut system = Vec::new();
    let mut turns = Vec::new();
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let text = content_text(m.get("content").unwrap_or(&Value::Null))?;
        match role {
            "system" | "developer" => system.push(text),
            "user" | "assistant" => turns.push(json!({"role": role, "content": text})),
            other => {
                return Err(Untranslatable(format!(
                    "messages with role {other:?} cannot be sent to an Anthropic provider"
                )));
            }
        }
    }
    let extra = &chat.extra;
    let max_tokens = extra
        .get("max_tokens")
        .or_else(|| extra.get("max_completion_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    let mut body = Map::new();
    body.insert("model".into(), model.into());
    body.insert("max_tokens".into(), max_tokens.into());
    if !system.is_empty() {
        body.insert("system".into(), system.join("\n").into());
    }
    body.insert("messages".into(), Value::Array(turns));
    for key in ["temperature", "top_p", "top_k"] {
        if let Some(v) = extra.get(key).filter(|v| !v.is_null()) {
            body.insert(key.into(), v.clone());
        }
    }
    match extra.get("stop") {
        Some(Value::String(s)) => {
            body.insert("stop_sequences".into(), json!([s]));
        }
        Some(Value::Array(a)) if !a.is_empty() => {
            body.insert("stop_sequences".into(), Value::Array(a.clone()));
        }
        _ => {}
    }
    if stream {
        body.insert("stream".into(), true.into());
    }
    Ok(Value::Object(body))
}

/// Anthropic's `stop_reason` as OpenAI's `finish_reason`.
pub fn finish_reason(stop_reason: Option<&str>) -> &'static str {
    match stop_reason {
        Some("max_tokens") => "length",
        Some("tool_use") => "tool_calls",
        Some("refusal") => "content_filter",
        _ => "stop",
    }
}

/// Anthropic usage (`input_tokens` uncached, `cache_read_input_tokens` cached) as OpenAI usage.
fn openai_usage(input: u64, cache_read: u64, cache_creation: u64, output: u64) -> Value {
    let prompt = input + cache_read + cache_creation;
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": cache_read},
    })
}

fn u(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or(0)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A whole Anthropic message as an OpenAI chat completion.
pub fn chat_from_anthropic(message: &Value) -> Value {
    let text: String = message
        .get("content")
        .and_then(Value::as_array)
        .map(|blocks| {
            blocks
                .iter()
                .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect()
        })
        .unwrap_or_default();
    let usage = message.get("usage").cloned().unwrap_or(Value::Null);
    let id = message.get("id").and_then(Value::as_str).unwrap_or("msg");
    json!({
        "id": format!("chatcmpl-{}", id.trim_start_matches("msg_")),
        "object": "chat.completion",
        "created": unix_now(),
        "model": message.get("model").cloned().unwrap_or(Value::Null),
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason(message.get("stop_reason").and_then(Value::as_str)),
            "stop_reason": message.get("stop_sequence").cloned().unwrap_or(Value::Null),
            "logprobs": null,
        }],
        "usage": openai_usage(
            u(&usage, "input_tokens"),
            u(&usage, "cache_read_input_tokens"),
            u(&usage, "cache_creation_input_tokens"),
            u(&usage, "output_tokens"),
        ),
    })
}

/// What one Anthropic stream event turned into.
#[derive(Debug, Default, PartialEq)]
pub struct Step {
    /// OpenAI chat completion chunks to emit, in order.
    pub chunks: Vec<Value>,
    /// The stream is complete (`message_stop`).
    pub done: bool,
    /// The provider reported an error in the stream.
    pub error: Option<String>,
}

/// Turns an Anthropic Messages event stream into OpenAI chat completion chunks, one event at a time.
#[derive(Debug)]
pub struct AnthropicStream {
    id: String,
    model: Value,
    created: u64,
    input: (u64, u64, u64),
    output: u64,
    stop_sequence: Value,
}

impl Default for AnthropicStream {
    fn default() -> Self {
        Self::new()
    }
}

impl AnthropicStream {
    /// A converter for one response.
    pub fn new() -> Self {
        AnthropicStream {
            id: "chatcmpl-anthropic".into(),
            model: Value::Null,
            created: unix_now(),
            input: (0, 0, 0),
            output: 0,
            stop_sequence: Value::Null,
        }
    }

    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": 0,
                "delta": delta,
                "finish_reason": finish,
                "stop_reason": if finish.is_some() { self.stop_sequence.clone() } else { Value::Null },
                "logprobs": null,
            }],
        })
    }

    /// Converts one event's `data` (its JSON carries the event type).
    pub fn event(&mut self, data: &[u8]) -> Step {
        let mut step = Step::default();
        let Ok(event) = serde_json::from_slice::<Value>(data) else {
            return step;
        };
        match event.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                let message = event.get("message").cloned().unwrap_or(Value::Null);
                if let Some(id) = message.get("id").and_then(Value::as_str) {
                    self.id = format!("chatcmpl-{}", id.trim_start_matches("msg_"));
                }
                self.model = message.get("model").cloned().unwrap_or(Value::Null);
                let usage = message.get("usage").cloned().unwrap_or(Value::Null);
                self.input = (
                    u(&usage, "input_tokens"),
                    u(&usage, "cache_read_input_tokens"),
                    u(&usage, "cache_creation_input_tokens"),
                );
                self.output = u(&usage, "output_tokens");
                step.chunks
                    .push(self.chunk(json!({"role": "assistant", "content": ""}), None));
            }
            Some("content_block_delta") => {
                let delta = event.get("delta").cloned().unwrap_or(Value::Null);
                if delta.get("type").and_then(Value::as_str) == Some("text_delta")
                    && let Some(text) = delta.get("text").and_then(Value::as_str)
                {
                    step.chunks.push(self.chunk(json!({"content": text}), None));
                }
            }
            Some("message_delta") => {
                let delta = event.get("delta").cloned().unwrap_or(Value::Null);
                if let Some(usage) = event.get("usage") {
                    self.output = u(usage, "output_tokens").max(self.output);
                }
                self.stop_sequence = delta.get("stop_sequence").cloned().unwrap_or(Value::Null);
                if let Some(reason) = delta.get("stop_reason").and_then(Value::as_str) {
                    step.chunks
                        .push(self.chunk(json!({}), Some(finish_reason(Some(reason)))));
                }
            }
            Some("message_stop") => {
                let (input, read, created) = self.input;
                step.chunks.push(json!({
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": openai_usage(input, read, created, self.output),
                }));
                step.done = true;
            }
            Some("error") => {
                step.error = Some(
                    event
                        .pointer("/error/message")
                        .and_then(Value::as_str)
                        .unwrap_or("error event in the provider's stream")
                        .to_string(),
                );
            }
            _ => {} // ping, content_block_start, content_block_stop
        }
        step
    }
}
