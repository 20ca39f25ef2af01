//! OpenAI wire types: the requests the gateway accepts and forwards, and the parts of vLLM's responses it
//! reads (usage, finish reasons, stream chunks) for accounting and for the Anthropic translation.
//!
//! Requests keep every field the gateway does not interpret in `extra` ([`RawFields`]: each as its
//! JSON text, not a tree), so vLLM's extensions (`top_k`, `ignore_eos`, ...) pass through untouched.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::errors::GatewayError;

pub mod passthrough;

/// `stream_options` of a chat or completion request.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct StreamOptions {
    /// Send a final chunk with `usage`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_usage: Option<bool>,
    /// Every other option, passed through.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The members of a request the gateway does not interpret, each kept as its JSON text: passed to
/// the worker as sent and read only where the gateway needs one (a limit, `n`, a provider's
/// translation), so a large unknown member costs its bytes, never a tree of small values.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(transparent)]
pub struct RawFields(BTreeMap<String, Box<RawValue>>);

impl RawFields {
    /// Member `name`, read as JSON.
    pub fn get(&self, name: &str) -> Option<Value> {
        serde_json::from_str(self.0.get(name)?.get()).ok()
    }

    /// Member `name` as an unsigned integer.
    pub fn u64(&self, name: &str) -> Option<u64> {
        self.get(name)?.as_u64()
    }

    /// Whether member `name` is present.
    pub fn contains_key(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    /// Sets member `name` to `value`.
    pub fn insert(&mut self, name: &str, value: &impl Serialize) {
        if let Ok(raw) = serde_json::value::to_raw_value(value) {
            self.0.insert(name.to_string(), raw);
        }
    }
}

impl From<Map<String, Value>> for RawFields {
    fn from(map: Map<String, Value>) -> Self {
        let mut fields = RawFields::default();
        for (name, value) in &map {
            fields.insert(name, value);
        }
        fields
    }
}

/// A request body's members, each as its JSON text: the known ones are taken out typed, the rest
/// stay [`RawFields`].
struct Members(BTreeMap<String, Box<RawValue>>);

impl Members {
    fn read<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        BTreeMap::<String, Box<RawValue>>::deserialize(deserializer).map(Members)
    }

    /// Member `name` read as `T`, when present.
    fn take<T: DeserializeOwned, E: serde::de::Error>(
        &mut self,
        name: &str,
    ) -> Result<Option<T>, E> {
        match self.0.remove(name) {
            None => Ok(None),
            Some(raw) => serde_json::from_str(raw.get())
                .map(Some)
                .map_err(|e| E::custom(format!("{name}: {e}"))),
        }
    }

    /// Member `name`, which must be present.
    fn required<T: DeserializeOwned, E: serde::de::Error>(
        &mut self,
        name: &'static str,
    ) -> Result<T, E> {
        self.take(name)?.ok_or_else(|| E::missing_field(name))
    }

    fn rest(self) -> RawFields {
        RawFields(self.0)
    }
}

/// `POST /v1/chat/completions` request body.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionRequest {
    /// Served model name.
    pub model: String,
    /// The conversation (kept as JSON: the router tokenizes it with the model's chat template).
    pub messages: Value,
    /// Stream the answer as SSE.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Every other field, passed through.
    #[serde(flatten)]
    pub extra: RawFields,
}

impl<'de> Deserialize<'de> for ChatCompletionRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut m = Members::read(deserializer)?;
        Ok(ChatCompletionRequest {
            model: m.required("model")?,
            messages: m.required("messages")?,
            stream: m.take::<Option<bool>, _>("stream")?.flatten(),
            stream_options: m
                .take::<Option<StreamOptions>, _>("stream_options")?
                .flatten(),
            extra: m.rest(),
        })
    }
}

/// `POST /v1/completions` request body.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionRequest {
    /// Served model name.
    pub model: String,
    /// A string, a list of strings, a list of token ids or a list of lists.
    pub prompt: Value,
    /// Stream the answer as SSE.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Every other field, passed through.
    #[serde(flatten)]
    pub extra: RawFields,
}

impl<'de> Deserialize<'de> for CompletionRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut m = Members::read(deserializer)?;
        Ok(CompletionRequest {
            model: m.required("model")?,
            prompt: m.required("prompt")?,
            stream: m.take::<Option<bool>, _>("stream")?.flatten(),
            stream_options: m
                .take::<Option<StreamOptions>, _>("stream_options")?
                .flatten(),
            extra: m.rest(),
        })
    }
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

/// `usage` of a response or of the final stream chunk.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Generated tokens.
    #[serde(default)]
    pub completion_tokens: u64,
    /// Sum of both.
    #[serde(default)]
    pub total_tokens: u64,
    /// Cache details (vLLM fills it with `--enable-prompt-tokens-details`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    /// Cached prompt tokens, when the worker reported them.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.prompt_tokens_details.and_then(|d| d.cached_tokens)
    }
}

/// The message of a non-streaming chat choice (and, as [`ChunkDelta`], a streamed one's `delta`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChoiceMessage {
    /// Generated text.
    #[serde(default)]
    pub content: Option<String>,
    /// Tool calls (vLLM's tool parsers fill them; an empty list when there are none).
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// Reasoning, from vLLM's reasoning parsers (older versions).
    #[serde(default)]
    pub reasoning_content: Option<String>,
    /// Reasoning (newer versions; some send both fields).
    #[serde(default)]
    pub reasoning: Option<String>,
}

impl ChoiceMessage {
    /// The reasoning text, under either name.
    pub fn reasoning(&self) -> Option<&str> {
        self.reasoning
            .as_deref()
            .or(self.reasoning_content.as_deref())
    }
}

/// A tool call, whole (`message.tool_calls`) or in pieces (`delta.tool_calls`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ToolCall {
    /// Position among the calls of one message (streams only).
    #[serde(default)]
    pub index: Option<u32>,
    /// The call's id (in a stream: on the call's first piece).
    #[serde(default)]
    pub id: Option<String>,
    /// The function and its arguments.
    #[serde(default)]
    pub function: Option<FunctionCall>,
}

/// The function of a [`ToolCall`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct FunctionCall {
    /// The tool's name (in a stream: on the call's first piece).
    #[serde(default)]
    pub name: Option<String>,
    /// The arguments as JSON text (in a stream: the next piece of it).
    #[serde(default)]
    pub arguments: Option<String>,
}

/// A choice of a non-streaming chat completion.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatChoice {
    /// The assistant message.
    #[serde(default)]
    pub message: ChoiceMessage,
    /// `stop`, `length`, ...
    #[serde(default)]
    pub finish_reason: Option<String>,
    /// vLLM: the stop string (or token id) that ended generation.
    #[serde(default)]
    pub stop_reason: Option<Value>,
}

/// A non-streaming chat completion, as far as the gateway reads it.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionResponse {
    /// Response id.
    #[serde(default)]
    pub id: String,
    /// Choices (the gateway uses the first).
    #[serde(default)]
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    #[serde(default)]
    pub usage: Option<Usage>,
}

/// Only the usage of any response body (chat or completion), for accounting without a full parse.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct UsageOnly {
    /// Token counts.
    #[serde(default)]
    pub usage: Option<Usage>,
}

/// `delta` of a streamed chat choice: the fields of a whole message, each holding only what is new
/// in this chunk (text, pieces of tool calls, reasoning).
pub type ChunkDelta = ChoiceMessage;

/// A choice of a stream chunk (chat: `delta`; completions: `text`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChunkChoice {
    /// Chat: the new text.
    #[serde(default)]
    pub delta: Option<ChunkDelta>,
    /// Completions: the new text.
    #[serde(default)]
    pub text: Option<String>,
    /// Set on the choice's last chunk.
    #[serde(default)]
    pub finish_reason: Option<String>,
    /// vLLM: the stop string (or token id) that ended generation.
    #[serde(default)]
    pub stop_reason: Option<Value>,
}

impl ChunkChoice {
    /// The text this chunk adds, if any.
    pub fn text(&self) -> Option<&str> {
        self.delta
            .as_ref()
            .and_then(|d| d.content.as_deref())
            .or(self.text.as_deref())
    }
}

/// One SSE chunk of a streamed chat or completion response, as far as the gateway reads it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamChunk {
    /// Choices (empty on the final usage chunk).
    #[serde(default)]
    pub choices: Vec<ChunkChoice>,
    /// Present on the final chunk with `include_usage` (and on every chunk with continuous stats).
    #[serde(default)]
    pub usage: Option<Usage>,
    /// vLLM reports errors inside a stream this way.
    #[serde(default)]
    pub error: Option<Value>,
}

impl StreamChunk {
    /// Whether this chunk carries generated output: text, reasoning or a piece of a tool call.
    pub fn has_text(&self) -> bool {
        self.choices.iter().any(|c| {
            c.text().is_some_and(|t| !t.is_empty())
                || c.delta.as_ref().is_some_and(|d| {
                    d.reasoning().is_some_and(|r| !r.is_empty())
                        || d.tool_calls.as_ref().is_some_and(|t| !t.is_empty())
                })
        })
    }
}

/// An error body from a worker: vLLM answers `{"error": {"message": ..}}` (newer) or
/// `{"object": "error", "message": ..}` (older).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct UpstreamErrorBody {
    /// Newer shape.
    #[serde(default)]
    pub error: Option<UpstreamErrorDetail>,
    /// Older shape.
    #[serde(default)]
    pub message: Option<String>,
}

/// The inner error object of [`UpstreamErrorBody`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct UpstreamErrorDetail {
    /// Human-readable message.
    #[serde(default)]
    pub message: Option<String>,
}

impl UpstreamErrorBody {
    /// The worker's message, or the raw body when it is not in a known shape.
    pub fn message_from(body: &[u8]) -> String {
        match serde_json::from_slice::<UpstreamErrorBody>(body) {
            Ok(parsed) => parsed
                .error
                .and_then(|e| e.message)
                .or(parsed.message)
                .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned()),
            Err(_) => String::from_utf8_lossy(body).into_owned(),
        }
    }
}

/// Parses a JSON request body, mapping syntax and shape errors to a 400.
pub fn parse_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, GatewayError> {
    serde_json::from_slice(body).map_err(|e| GatewayError::MalformedJson(e.to_string()))
}

/// Asks the worker for a final usage chunk on streams, whatever the client asked, so that every
/// request is accounted. Returns whether the client itself asked for it (then the chunk is passed on).
pub fn force_include_usage(stream_options: &mut Option<StreamOptions>) -> bool {
    let options = stream_options.get_or_insert_with(StreamOptions::default);
    let client_asked = options.include_usage == Some(true);
    options.include_usage = Some(true);
    client_asked
}

/// `body` (a JSON object without `stream_options`) with `"stream_options":{"include_usage":true}` as
/// its first member; `None` when the body does not start with `{`.
pub fn splice_include_usage(body: &[u8]) -> Option<bytes::Bytes> {
    const MEMBER: &[u8] = br#""stream_options":{"include_usage":true}"#;
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    let rest = &body[open + 1..];
    let empty = rest.iter().all(|b| b.is_ascii_whitespace() || *b == b'}');
    let mut out = Vec::with_capacity(body.len() + MEMBER.len() + 2);
    out.push(b'{');
    out.extend_from_slice(MEMBER);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Some(out.into())
}

impl ChatCompletionRequest {
    /// Checks the fields the gateway relies on.
    pub fn validate(&self) -> Result<(), GatewayError> {
        validate_model(&self.model)?;
        match self.messages.as_array() {
            Some(m) if !m.is_empty() => Ok(()),
            _ => Err(GatewayError::invalid(
                "messages",
                "`messages` must be a non-empty array",
            )),
        }
    }
}

impl CompletionRequest {
    /// Checks the fields the gateway relies on.
    pub fn validate(&self) -> Result<(), GatewayError> {
        validate_model(&self.model)?;
        match &self.prompt {
            Value::String(_) => Ok(()),
            Value::Array(items) if !items.is_empty() => Ok(()),
            _ => Err(GatewayError::invalid(
                "prompt",
                "`prompt` must be a string or a non-empty array",
            )),
        }
    }

    /// The prompt as the router reads it: the prompt string, or the first of a list; token ids
    /// (`[1, 2, 3]`, or the first list of `[[1, 2], [3]]`) as they are.
    pub fn routing_prompt(&self) -> crate::routing::Prompt<'_> {
        match &self.prompt {
            Value::Array(items) if items.first().is_some_and(Value::is_number) => {
                crate::routing::Prompt::Ids(items)
            }
            Value::Array(items) => match items.first() {
                Some(Value::Array(first)) => crate::routing::Prompt::Ids(first),
                _ => crate::routing::Prompt::Text(self.prompt_text()),
            },
            _ => crate::routing::Prompt::Text(self.prompt_text()),
        }
    }

    /// The text of the prompt: the prompt string, or the first string of a list ("" for token
    /// ids).
    pub fn prompt_text(&self) -> &str {
        match &self.prompt {
            Value::String(s) => s,
            Value::Array(items) => items.first().and_then(Value::as_str).unwrap_or(""),
            _ => "",
        }
    }
}

fn validate_model(model: &str) -> Result<(), GatewayError> {
    if model.is_empty() {
        return Err(GatewayError::invalid("model", "`model` must not be empty"));
    }
    Ok(())
}

/// What a `/v1/models` entry names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    /// A served model name (what workers serve).
    Model,
    /// Another name of a served model (`root` is the served name).
    Alias,
    /// A model class: a request for it is served by any member.
    Class,
    /// A LoRA adapter some workers have loaded (`root` is the model it adapts).
    Adapter,
}

impl ModelKind {
    fn as_str(self) -> &'static str {
        match self {
            ModelKind::Model => "model",
            ModelKind::Alias => "alias",
            ModelKind::Class => "class",
            ModelKind::Adapter => "adapter",
        }
    }
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelCard {
    /// The name clients put in `model`.
    pub id: String,
    /// Who serves it: `kinference` for the gateway's workers, a provider's name for a class only
    /// providers serve.
    pub owned_by: String,
    /// What the name is.
    pub kind: ModelKind,
    /// The served model behind an alias or adapter (a model is its own root; a class has none).
    pub root: Option<String>,
    /// A class's members (served names, `provider/<name>` for providers' models).
    pub members: Vec<String>,
}

/// The `GET /v1/models` response: OpenAI's list, each entry with `owned_by`, `root` and `parent`
/// as vLLM writes them, plus `kind` (and a class's `members`).
pub fn models_response(cards: &[ModelCard]) -> Value {
    let data: Vec<Value> = cards
        .iter()
        .map(|c| {
            let mut v = serde_json::json!({
                "id": c.id,
                "object": "model",
                "created": 0,
                "owned_by": c.owned_by,
                "root": c.root,
                "parent": match c.kind {
                    ModelKind::Alias | ModelKind::Adapter => c.root.clone(),
                    ModelKind::Model | ModelKind::Class => None,
                },
                "kind": c.kind.as_str(),
            });
            if c.kind == ModelKind::Class {
                v["members"] = serde_json::json!(c.members);
            }
            v
        })
        .collect();
    serde_json::json!({"object": "list", "data": data})
}

#[cfg(test)]
mod tests;
