//! Anthropic Messages API (`POST /v1/messages`): request validation, translation to the worker's OpenAI
//! chat API, and translation of the answer back, both whole and as the SSE event sequence
//! `message_start`, `content_block_start`, `ping`, `content_block_delta`..., `content_block_stop`,
//! `message_delta`, `message_stop`.
//!
//! Usage follows Anthropic's meaning: `input_tokens` counts the prompt tokens *not* read from the cache,
//! `cache_read_input_tokens` those that were, so their sum is the worker's `prompt_tokens`.

use bytes::{BufMut, BytesMut};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::openai::{
    ChatCompletionRequest, ChatCompletionResponse, StreamChunk, StreamOptions, Usage,
};
use crate::errors::GatewayError;

/// `POST /v1/messages` request body.
#[derive(Debug, Clone, Deserialize)]
pub struct MessagesRequest {
    /// Served model name.
    pub model: String,
    /// Required by the API; checked in [`MessagesRequest::validate`] for a clear message.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// The conversation.
    pub messages: Vec<InputMessage>,
    /// System prompt: a string or text blocks.
    #[serde(default)]
    pub system: Option<Content>,
    /// Strings that end generation.
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    /// Sampling temperature.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus sampling.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Top-k sampling (vLLM supports it as an extension).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Stream the answer as SSE.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Tool use is not supported by this gateway; present only to reject it clearly.
    #[serde(default)]
    pub tools: Option<Value>,
    /// Extended thinking is not supported; present only to reject it clearly.
    #[serde(default)]
    pub thinking: Option<Value>,
}

/// Who speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The human.
    User,
    /// The model.
    Assistant,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// One turn of the conversation.
#[derive(Debug, Clone, Deserialize)]
pub struct InputMessage {
    /// Speaker.
    pub role: Role,
    /// Text or content blocks.
    pub content: Content,
}

/// A string or a list of content blocks.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content blocks (only `text` is supported).
    Blocks(Vec<ContentBlock>),
}

/// A content block as sent by a client; every type is accepted by the parser so that unsupported ones
/// can be rejected with a message that names them.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentBlock {
    /// `text`, `image`, `tool_use`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` block.
    #[serde(default)]
    pub text: Option<String>,
}

impl Content {
    /// The text, with text blocks joined by newlines (as vLLM joins text parts).
    fn to_text(&self, param: &'static str) -> Result<String, GatewayError> {
        match self {
            Content::Text(s) => Ok(s.clone()),
            Content::Blocks(blocks) => {
                let mut out = String::new();
                for (i, block) in blocks.iter().enumerate() {
                    let text = match (block.kind.as_str(), &block.text) {
                        ("text", Some(text)) => text,
                        ("text", None) => {
                            return Err(GatewayError::invalid(
                                param,
                                format!("{param}: content block {i} of type `text` has no `text`"),
                            ));
                        }
                        (other, _) => {
                            return Err(GatewayError::invalid(
                                param,
                                format!(
                                    "{param}: content block type `{other}` is not supported by this gateway; only `text` blocks are"
                                ),
                            ));
                        }
                    };
                    if i > 0 {
                        out.push('\n');
                    }
                    out.push_str(text);
                }
                Ok(out)
            }
        }
    }
}

impl MessagesRequest {
    /// Checks the request and translates it to the worker's OpenAI chat request. Streams always ask for
    /// the final usage chunk.
    pub fn to_chat_request(&self) -> Result<ChatCompletionRequest, GatewayError> {
        if self.model.is_empty() {
            return Err(GatewayError::invalid("model", "model: must not be empty"));
        }
        let max_tokens = match self.max_tokens {
            Some(n) if n >= 1 => n,
            Some(_) => {
                return Err(GatewayError::invalid(
                    "max_tokens",
                    "max_tokens: must be at least 1",
                ));
            }
            None => {
                return Err(GatewayError::invalid(
                    "max_tokens",
                    "max_tokens: Field required",
                ));
            }
        };
        if self.messages.is_empty() {
            return Err(GatewayError::invalid(
                "messages",
                "messages: at least one message is required",
            ));
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_null()) {
            return Err(GatewayError::invalid(
                "tools",
                "tools: tool use is not supported by this gateway",
            ));
        }
        if self.thinking.as_ref().is_some_and(|t| !t.is_null()) {
            return Err(GatewayError::invalid(
                "thinking",
                "thinking: extended thinking is not supported by this gateway",
            ));
        }

        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = &self.system {
            messages.push(json!({"role": "system", "content": system.to_text("system")?}));
        }
        for message in &self.messages {
            messages.push(json!({
                "role": message.role.as_str(),
                "content": message.content.to_text("messages")?,
            }));
        }

        let mut extra = Map::new();
        extra.insert("max_tokens".into(), max_tokens.into());
        if let Some(stop) = &self.stop_sequences {
            extra.insert("stop".into(), json!(stop));
        }
        if let Some(t) = self.temperature {
            extra.insert("temperature".into(), json!(t));
        }
        if let Some(p) = self.top_p {
            extra.insert("top_p".into(), json!(p));
        }
        if let Some(k) = self.top_k {
            extra.insert("top_k".into(), json!(k));
        }
        let stream = self.stream.unwrap_or(false);
        Ok(ChatCompletionRequest {
            model: self.model.clone(),
            messages: Value::Array(messages),
            stream: Some(stream),
            stream_options: stream.then(|| StreamOptions {
                include_usage: Some(true),
                extra: Map::new(),
            }),
            extra,
        })
    }
}

/// `usage` of an Anthropic message.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct MessageUsage {
    /// Prompt tokens not read from the cache.
    pub input_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Prompt tokens read from the prefix cache.
    pub cache_read_input_tokens: u64,
    /// Always 0: vLLM's cache is automatic.
    pub cache_creation_input_tokens: u64,
}

impl From<Usage> for MessageUsage {
    fn from(u: Usage) -> Self {
        let cached = u.cached_tokens().unwrap_or(0).min(u.prompt_tokens);
        MessageUsage {
            input_tokens: u.prompt_tokens - cached,
            output_tokens: u.completion_tokens,
            cache_read_input_tokens: cached,
            cache_creation_input_tokens: 0,
        }
    }
}

/// Maps OpenAI's `finish_reason` (and vLLM's `stop_reason`, the matched stop string) to Anthropic's
/// `stop_reason` and `stop_sequence`.
pub fn stop_reason(
    finish_reason: Option<&str>,
    matched: Option<&Value>,
) -> (&'static str, Option<String>) {
    match finish_reason {
        Some("length") => ("max_tokens", None),
        Some("stop") => match matched.and_then(Value::as_str) {
            Some(seq) => ("stop_sequence", Some(seq.to_string())),
            None => ("end_turn", None),
        },
        Some("tool_calls") => ("tool_use", None),
        _ => ("end_turn", None),
    }
}

/// A new message id in Anthropic's style, derived from the worker's response id.
pub fn message_id(upstream_id: &str) -> String {
    let tail = upstream_id
        .rsplit(['-', '_'])
        .next()
        .filter(|t| !t.is_empty())
        .unwrap_or(upstream_id);
    format!("msg_{tail}")
}

/// Translates a non-streaming chat completion into an Anthropic message.
pub fn message_from_chat(response: &ChatCompletionResponse, model: &str) -> Value {
    let choice = response.choices.first();
    let text = choice
        .and_then(|c| c.message.content.clone())
        .unwrap_or_default();
    let (reason, sequence) = stop_reason(
        choice.and_then(|c| c.finish_reason.as_deref()),
        choice.and_then(|c| c.stop_reason.as_ref()),
    );
    let usage = MessageUsage::from(response.usage.unwrap_or_default());
    json!({
        "id": message_id(&response.id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
    })
}

fn put_event(out: &mut BytesMut, name: &str, data: &Value) {
    out.put_slice(b"event: ");
    out.put_slice(name.as_bytes());
    out.put_slice(b"\ndata: ");
    // Serializing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer((&mut *out).writer(), data);
    out.put_slice(b"\n\n");
}

/// Turns the worker's OpenAI chat stream into Anthropic's event sequence, one upstream chunk at a time.
#[derive(Debug)]
pub struct StreamTranslator {
    model: String,
    id: String,
    started: bool,
    finish_reason: Option<String>,
    matched_stop: Option<Value>,
    usage: Option<Usage>,
    output_chunks: u64,
}

impl StreamTranslator {
    /// A translator for one response; `id` is the message id to report.
    pub fn new(model: &str, id: String) -> Self {
        StreamTranslator {
            model: model.to_string(),
            id,
            started: false,
            finish_reason: None,
            matched_stop: None,
            usage: None,
            output_chunks: 0,
        }
    }

    /// The opening events (`message_start`, `content_block_start`, `ping`), sent as soon as the worker
    /// accepted the request. `input_tokens` is the gateway's own estimate; `message_delta` corrects it.
    pub fn start(&mut self, out: &mut BytesMut, input_tokens: u64) {
        if self.started {
            return;
        }
        self.started = true;
        put_event(
            out,
            "message_start",
            &json!({"type": "message_start", "message": {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": {"input_tokens": input_tokens, "output_tokens": 0,
                          "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
            }}),
        );
        put_event(
            out,
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}),
        );
        put_event(out, "ping", &json!({"type": "ping"}));
    }

    /// Translates one upstream chunk.
    pub fn chunk(&mut self, out: &mut BytesMut, chunk: &StreamChunk) {
        self.start(out, 0);
        for choice in &chunk.choices {
            if let Some(text) = choice.text().filter(|t| !t.is_empty()) {
                self.output_chunks += 1;
                put_event(
                    out,
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": 0,
                            "delta": {"type": "text_delta", "text": text}}),
                );
            }
            if let Some(reason) = &choice.finish_reason {
                self.finish_reason = Some(reason.clone());
                self.matched_stop = choice.stop_reason.clone();
            }
        }
        if let Some(usage) = chunk.usage {
            self.usage = Some(usage);
        }
    }

    /// Whether the worker said why generation ended (a stream without it was cut short).
    pub fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }

    /// The closing events (`content_block_stop`, `message_delta`, `message_stop`).
    pub fn finish(&mut self, out: &mut BytesMut) {
        self.start(out, 0);
        put_event(
            out,
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": 0}),
        );
        let (reason, sequence) =
            stop_reason(self.finish_reason.as_deref(), self.matched_stop.as_ref());
        let usage = match self.usage {
            Some(u) => MessageUsage::from(u),
            None => MessageUsage {
                output_tokens: self.output_chunks,
                ..MessageUsage::default()
            },
        };
        put_event(
            out,
            "message_delta",
            &json!({"type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage}),
        );
        put_event(out, "message_stop", &json!({"type": "message_stop"}));
    }
}

#[cfg(test)]
mod tests;
