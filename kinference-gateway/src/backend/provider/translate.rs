//! Protocol translation for providers, with the OpenAI chat API as the pivot: requests go out in the
//! provider's protocol, answers come back as OpenAI chat completions (whole) or chunks (streams),
//! which the pipeline's existing translators then turn into the client's protocol. An OpenAI client
//! bursting to an Anthropic provider thus gets OpenAI answers, and an Anthropic client gets Anthropic
//! ones whichever provider served it. Tools cross both ways: `tools`, `tool_choice`, `tool_calls`
//! and `tool` messages become Anthropic tools, `tool_use` and `tool_result` blocks, and the
//! provider's `tool_use` blocks (whole, or streamed as `input_json_delta`) come back as `tool_calls`.

use serde_json::{Map, Value, json};

use crate::api::openai::{ChatCompletionRequest, RawFields};

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
    let mut turns: Vec<Value> = Vec::new();
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let text = content_text(m.get("content").unwrap_or(&Value::Null))?;
        match role {
            "system" | "developer" => system.push(text),
            "user" => turns.push(json!({"role": role, "content": text})),
            "assistant" => turns.push(assistant_turn(m, text)?),
            "tool" => tool_result(m, text, &mut turns),
            other => {
                return Err(Untranslatable(format!(
                    "messages with role {other:?} cannot be sent to an Anthropic provider"
                )));
            }
        }
    }
    let extra = &chat.extra;
    let max_tokens = extra
        .u64("max_tokens")
        .or_else(|| extra.u64("max_completion_tokens"))
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
            body.insert(key.into(), v);
        }
    }
    match extra.get("stop") {
        Some(Value::String(s)) => {
            body.insert("stop_sequences".into(), json!([s]));
        }
        Some(Value::Array(a)) if !a.is_empty() => {
            body.insert("stop_sequences".into(), Value::Array(a));
        }
        _ => {}
    }
    if let Some(Value::Array(tools)) = extra.get("tools") {
        let tools = tools
            .iter()
            .map(anthropic_tool)
            .collect::<Result<Vec<_>, _>>()?;
        if !tools.is_empty() {
            body.insert("tools".into(), Value::Array(tools));
        }
    }
    if let Some(choice) = anthropic_tool_choice(extra)? {
        body.insert("tool_choice".into(), choice);
    }
    if let Some(Value::String(user)) = extra.get("user") {
        body.insert("metadata".into(), json!({"user_id": user}));
    }
    if stream {
        body.insert("stream".into(), true.into());
    }
    Ok(Value::Object(body))
}

/// An assistant message: its text, and its `tool_calls` as `tool_use` blocks.
fn assistant_turn(message: &Value, text: String) -> Result<Value, Untranslatable> {
    let calls = message.get("tool_calls").and_then(Value::as_array);
    let Some(calls) = calls.filter(|c| !c.is_empty()) else {
        return Ok(json!({"role": "assistant", "content": text}));
    };
    let mut blocks = Vec::with_capacity(calls.len() + 1);
    if !text.is_empty() {
        blocks.push(json!({"type": "text", "text": text}));
    }
    for call in calls {
        let name = call.pointer("/function/name").and_then(Value::as_str);
        let arguments = call.pointer("/function/arguments").and_then(Value::as_str);
        let input = match arguments.map(str::trim).filter(|a| !a.is_empty()) {
            None => json!({}),
            Some(a) => match serde_json::from_str::<Value>(a) {
                Ok(input @ Value::Object(_)) => input,
                _ => {
                    return Err(Untranslatable(format!(
                        "tool call arguments {a:?} are not a JSON object"
                    )));
                }
            },
        };
        blocks.push(json!({
            "type": "tool_use",
            "id": call.get("id").cloned().unwrap_or(Value::Null),
            "name": name.unwrap_or(""),
            "input": input,
        }));
    }
    Ok(json!({"role": "assistant", "content": blocks}))
}

/// A `tool` message as a `tool_result` block, joined to the user turn of the results before it
/// (Anthropic wants every result of a turn's calls in the one user turn that follows).
fn tool_result(message: &Value, text: String, turns: &mut Vec<Value>) {
    let block = json!({
        "type": "tool_result",
        "tool_use_id": message.get("tool_call_id").cloned().unwrap_or(Value::Null),
        "content": text,
    });
    let results_turn = turns.last_mut().filter(|t| {
        t["role"] == "user"
            && t["content"]
                .as_array()
                .is_some_and(|b| b.iter().all(|b| b["type"] == "tool_result"))
    });
    match results_turn.and_then(|t| t["content"].as_array_mut()) {
        Some(blocks) => blocks.push(block),
        None => turns.push(json!({"role": "user", "content": [block]})),
    }
}

/// An OpenAI function tool as an Anthropic client tool.
fn anthropic_tool(tool: &Value) -> Result<Value, Untranslatable> {
    let kind = tool
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("function");
    let function = tool.get("function").filter(|_| kind == "function");
    let Some(name) = function.and_then(|f| f.get("name")).and_then(Value::as_str) else {
        return Err(Untranslatable(format!(
            "tools of type {kind:?} without a function name cannot be sent to an Anthropic provider"
        )));
    };
    let mut out = json!({
        "name": name,
        "input_schema": function
            .and_then(|f| f.get("parameters"))
            .filter(|p| p.is_object())
            .cloned()
            .unwrap_or_else(|| json!({"type": "object"})),
    });
    if let Some(description) = function.and_then(|f| f.get("description")) {
        out["description"] = description.clone();
    }
    Ok(out)
}

/// OpenAI's `tool_choice` and `parallel_tool_calls` as Anthropic's `tool_choice`.
fn anthropic_tool_choice(extra: &RawFields) -> Result<Option<Value>, Untranslatable> {
    let mut choice = match extra.get("tool_choice") {
        None | Some(Value::Null) => None,
        Some(Value::String(c)) if c == "auto" => Some(json!({"type": "auto"})),
        Some(Value::String(c)) if c == "required" => Some(json!({"type": "any"})),
        Some(Value::String(c)) if c == "none" => Some(json!({"type": "none"})),
        Some(c) => match c.pointer("/function/name").and_then(Value::as_str) {
            Some(name) => Some(json!({"type": "tool", "name": name})),
            None => {
                return Err(Untranslatable(format!(
                    "tool_choice {c} cannot be sent to an Anthropic provider"
                )));
            }
        },
    };
    if extra.get("parallel_tool_calls") == Some(Value::Bool(false)) {
        let choice = choice.get_or_insert_with(|| json!({"type": "auto"}));
        if choice["type"] != "none" {
            choice["disable_parallel_tool_use"] = true.into();
        }
    }
    Ok(choice)
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

/// The blocks of `message` of type `kind`.
fn blocks<'a>(message: &'a Value, kind: &'a str) -> impl Iterator<Item = &'a Value> {
    message
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(move |b| b.get("type").and_then(Value::as_str) == Some(kind))
}

/// A whole Anthropic message as an OpenAI chat completion (`tool_use` blocks as `tool_calls`,
/// `thinking` as `reasoning_content`).
pub fn chat_from_anthropic(message: &Value) -> Value {
    let text: String = blocks(message, "text")
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .collect();
    let reasoning: String = blocks(message, "thinking")
        .filter_map(|b| b.get("thinking").and_then(Value::as_str))
        .collect();
    let tool_calls: Vec<Value> = blocks(message, "tool_use")
        .map(|b| {
            json!({
                "id": b.get("id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {
                    "name": b.get("name").cloned().unwrap_or(Value::Null),
                    "arguments": b.get("input").unwrap_or(&json!({})).to_string(),
                },
            })
        })
        .collect();
    let mut reply = json!({"role": "assistant", "content": text});
    if !tool_calls.is_empty() {
        if text.is_empty() {
            reply["content"] = Value::Null;
        }
        reply["tool_calls"] = Value::Array(tool_calls);
    }
    if !reasoning.is_empty() {
        reply["reasoning_content"] = reasoning.into();
    }
    let usage = message.get("usage").cloned().unwrap_or(Value::Null);
    let id = message.get("id").and_then(Value::as_str).unwrap_or("msg");
    json!({
        "id": format!("chatcmpl-{}", id.trim_start_matches("msg_")),
        "object": "chat.completion",
        "created": unix_now(),
        "model": message.get("model").cloned().unwrap_or(Value::Null),
        "choices": [{
            "index": 0,
            "message": reply,
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
    /// The provider's block index of each `tool_use` block, in order: a call's OpenAI `index` is
    /// its position here.
    tool_blocks: Vec<u64>,
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
            tool_blocks: Vec::new(),
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
            Some("content_block_start") => {
                let block = event.get("content_block").unwrap_or(&Value::Null);
                if block.get("type").and_then(Value::as_str) == Some("tool_use") {
                    self.tool_blocks.push(u(&event, "index"));
                    let call = json!({
                        "index": self.tool_blocks.len() - 1,
                        "id": block.get("id").cloned().unwrap_or(Value::Null),
                        "type": "function",
                        "function": {"name": block.get("name").cloned().unwrap_or(Value::Null), "arguments": ""},
                    });
                    step.chunks
                        .push(self.chunk(json!({"tool_calls": [call]}), None));
                }
            }
            Some("content_block_delta") => {
                let delta = event.get("delta").cloned().unwrap_or(Value::Null);
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => {
                        if let Some(text) = delta.get("text").and_then(Value::as_str) {
                            step.chunks.push(self.chunk(json!({"content": text}), None));
                        }
                    }
                    Some("thinking_delta") => {
                        if let Some(thinking) = delta.get("thinking").and_then(Value::as_str) {
                            step.chunks
                                .push(self.chunk(json!({"reasoning_content": thinking}), None));
                        }
                    }
                    Some("input_json_delta") => {
                        let block = u(&event, "index");
                        let call = self.tool_blocks.iter().position(|b| *b == block);
                        if let (Some(call), Some(piece)) =
                            (call, delta.get("partial_json").and_then(Value::as_str))
                        {
                            let call = json!({"index": call, "function": {"arguments": piece}});
                            step.chunks
                                .push(self.chunk(json!({"tool_calls": [call]}), None));
                        }
                    }
                    _ => {}
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
            _ => {} // ping, content_block_stop
        }
        step
    }
}
