//! The client's `POST /v1/messages` body and its translation to the worker's OpenAI chat request.
//!
//! | Anthropic | OpenAI chat (as vLLM reads it) |
//! |---|---|
//! | `system` | a leading `system` message |
//! | `text` blocks | the message's text, joined by newlines (as vLLM joins text parts) |
//! | `image` blocks (base64 or URL) | `image_url` parts (base64 as a `data:` URL) |
//! | `tool_use` blocks of an assistant turn | `tool_calls` of the assistant message |
//! | `tool_result` blocks of a user turn | `role: tool` messages, before the turn's other content (their images in it) |
//! | `thinking` blocks of earlier turns | dropped (the model's template re-renders no reasoning) |
//! | `tools` (`strict` included), `tool_choice` | `tools` (functions), `tool_choice`, `parallel_tool_calls` |
//! | `thinking` | `chat_template_kwargs.enable_thinking`; its budget as `thinking_token_budget` and `chat_template_kwargs.thinking_budget` |
//! | `stop_sequences`, `metadata.user_id` | `stop`, `user` |
//!
//! `cache_control` on any block or tool is accepted and ignored: vLLM's prefix cache is automatic.
//!
//! The thinking budget goes where vLLM and the reasoning models' templates read one: the request field
//! `thinking_token_budget` (vLLM stops the reasoning there when it runs with a reasoning parser; vLLM
//! 0.32 without `--reasoning-parser` refuses the request with 400, which reaches the client as an
//! `invalid_request_error`; a vLLM without the field ignores it) and the template variable
//! `thinking_budget` (Qwen3's template reads it; others leave it unused).

use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde_json::{Map, Value, json};

use crate::api::openai::{ChatCompletionRequest, StreamOptions};
use crate::errors::GatewayError;

/// `POST /v1/messages` (and `/v1/messages/count_tokens`) request body. Fields the gateway does not
/// know are ignored, as Anthropic's beta fields would be by a worker that cannot use them.
#[derive(Debug, Clone, Deserialize)]
pub struct MessagesRequest {
    /// Served model name.
    pub model: String,
    /// Required by `/v1/messages`; checked in [`MessagesRequest::to_chat_request`] for a clear message.
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
    /// Tools the model may call.
    #[serde(default)]
    pub tools: Option<Vec<Tool>>,
    /// Whether and which tool the model must call.
    #[serde(default)]
    pub tool_choice: Option<ToolChoice>,
    /// Extended thinking.
    #[serde(default)]
    pub thinking: Option<Thinking>,
    /// Who the request is for.
    #[serde(default)]
    pub metadata: Option<Metadata>,
    /// vLLM's prefix-cache salt (its `/v1/messages` takes one; the gateway mixes the tenant's in).
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// Who speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The human (and the results of tools).
    User,
    /// The model.
    Assistant,
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
#[derive(Debug, Clone)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content blocks.
    Blocks(Vec<ContentBlock>),
}

/// By hand rather than `untagged`, so that a bad block's error (an unknown type, a missing field)
/// reaches the client instead of "did not match any variant".
impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ContentVisitor;
        impl<'de> Visitor<'de> for ContentVisitor {
            type Value = Content;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string or a list of content blocks")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Content, E> {
                Ok(Content::Text(text.to_string()))
            }
            fn visit_string<E: de::Error>(self, text: String) -> Result<Content, E> {
                Ok(Content::Text(text))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Content, A::Error> {
                Vec::deserialize(de::value::SeqAccessDeserializer::new(seq)).map(Content::Blocks)
            }
        }
        deserializer.deserialize_any(ContentVisitor)
    }
}

/// A content block. Other types (`document`, server tool results, ...) are refused by the parser,
/// which names the type and the ones accepted.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    /// Text.
    Text {
        /// The text.
        text: String,
    },
    /// An image, for multimodal workers.
    Image {
        /// Where the image is.
        source: ImageSource,
    },
    /// A tool call the model made in an earlier turn.
    ToolUse {
        /// The call's id, echoed by the matching `tool_result`.
        id: String,
        /// The tool.
        name: String,
        /// The arguments (a JSON object).
        input: Value,
    },
    /// The result of a tool call, sent by the client.
    ToolResult {
        /// The `tool_use` this answers.
        tool_use_id: String,
        /// A string or text blocks (absent: empty).
        #[serde(default)]
        content: Option<Content>,
        /// The tool failed.
        #[serde(default)]
        is_error: Option<bool>,
    },
    /// The model's reasoning in an earlier turn.
    Thinking {
        /// The reasoning text.
        #[serde(default)]
        thinking: String,
    },
    /// Reasoning the client received encrypted.
    RedactedThinking {},
}

/// The source of an `image` block.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ImageSource {
    /// Inline data.
    Base64 {
        /// `image/png`, `image/jpeg`, ...
        media_type: String,
        /// Base64 of the image.
        data: String,
    },
    /// An image the worker fetches.
    Url {
        /// Its address.
        url: String,
    },
}

/// A tool definition. Only client tools (name, description, JSON schema) exist on a worker;
/// Anthropic's server tools (`web_search_...`, `bash_...`) are refused by name.
#[derive(Debug, Clone, Deserialize)]
pub struct Tool {
    /// `custom` or absent for client tools.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// The tool's name.
    pub name: String,
    /// What it does, for the model.
    #[serde(default)]
    pub description: Option<String>,
    /// JSON schema of its input.
    #[serde(default)]
    pub input_schema: Option<Value>,
    /// The input must follow the schema: passed on as the function's `strict`, which is what makes
    /// vLLM (0.32) constrain a forced call's arguments to the schema and not only the call's envelope.
    #[serde(default)]
    pub strict: Option<bool>,
}

/// `tool_choice`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToolChoice {
    /// The model decides.
    Auto {
        /// At most one call per turn.
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must call some tool.
    Any {
        /// At most one call per turn.
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must call this tool.
    Tool {
        /// The tool.
        name: String,
        /// At most one call per turn.
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    /// No tool calls.
    None {},
}

/// `thinking`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Thinking {
    /// Reason before answering, within a budget of tokens.
    Enabled {
        /// Tokens the reasoning may take (part of `max_tokens`).
        budget_tokens: u64,
    },
    /// Answer without reasoning.
    Disabled {},
}

/// `metadata`.
#[derive(Debug, Clone, Deserialize)]
pub struct Metadata {
    /// An opaque id of the end user.
    #[serde(default)]
    pub user_id: Option<String>,
}

/// The parts of a request a chat template renders: what the worker tokenizes, and what
/// `count_tokens` counts.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatPrompt {
    /// OpenAI chat `messages`.
    pub messages: Vec<Value>,
    /// OpenAI `tools` (functions), when the request has tools.
    pub tools: Option<Vec<Value>>,
    /// `chat_template_kwargs` (thinking on or off), when the request says.
    pub template_kwargs: Option<Value>,
}

fn invalid(param: &'static str, message: String) -> GatewayError {
    GatewayError::invalid(param, message)
}

impl MessagesRequest {
    /// Checks the request and translates it to the worker's OpenAI chat request. Streams always ask for
    /// the final usage chunk.
    pub fn to_chat_request(&self) -> Result<ChatCompletionRequest, GatewayError> {
        let max_tokens = match self.max_tokens {
            Some(n) if n >= 1 => n,
            Some(_) => {
                return Err(invalid(
                    "max_tokens",
                    "max_tokens: must be at least 1".into(),
                ));
            }
            None => return Err(invalid("max_tokens", "max_tokens: Field required".into())),
        };
        if let Some(Thinking::Enabled { budget_tokens }) = &self.thinking
            && *budget_tokens >= max_tokens
        {
            return Err(invalid(
                "thinking",
                format!(
                    "thinking.budget_tokens: must be less than max_tokens ({budget_tokens} >= {max_tokens})"
                ),
            ));
        }
        let prompt = self.chat_prompt()?;

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
        if let Some(tools) = prompt.tools {
            extra.insert("tools".into(), Value::Array(tools));
        }
        if let Some(choice) = &self.tool_choice {
            let (choice, single) = openai_tool_choice(choice);
            extra.insert("tool_choice".into(), choice);
            if single == Some(true) {
                extra.insert("parallel_tool_calls".into(), false.into());
            }
        }
        if let Some(kwargs) = prompt.template_kwargs {
            extra.insert("chat_template_kwargs".into(), kwargs);
        }
        if let Some(Thinking::Enabled { budget_tokens }) = &self.thinking {
            extra.insert("thinking_token_budget".into(), json!(budget_tokens));
        }
        if let Some(user) = self.metadata.as_ref().and_then(|m| m.user_id.as_ref()) {
            extra.insert("user".into(), json!(user));
        }
        let stream = self.stream.unwrap_or(false);
        Ok(ChatCompletionRequest {
            model: self.model.clone(),
            messages: Value::Array(prompt.messages),
            stream: Some(stream),
            stream_options: stream.then(|| StreamOptions {
                include_usage: Some(true),
                extra: Map::new(),
            }),
            extra: extra.into(),
        })
    }

    /// Checks and translates what the chat template renders (messages, tools, thinking); shared by
    /// generation and `count_tokens`, which has no `max_tokens`.
    pub fn chat_prompt(&self) -> Result<ChatPrompt, GatewayError> {
        if self.model.is_empty() {
            return Err(invalid("model", "model: must not be empty".into()));
        }
        if self.messages.is_empty() {
            return Err(invalid(
                "messages",
                "messages: at least one message is required".into(),
            ));
        }
        let tools = match &self.tools {
            Some(tools) if !tools.is_empty() => Some(
                tools
                    .iter()
                    .enumerate()
                    .map(|(i, tool)| openai_tool(i, tool))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            _ => None,
        };
        if let Some(choice @ (ToolChoice::Any { .. } | ToolChoice::Tool { .. })) = &self.tool_choice
        {
            if tools.is_none() {
                return Err(invalid(
                    "tool_choice",
                    "tool_choice: requires `tools`".into(),
                ));
            }
            if let ToolChoice::Tool { name, .. } = choice
                && !self.tools.iter().flatten().any(|t| &t.name == name)
            {
                return Err(invalid(
                    "tool_choice",
                    format!("tool_choice: no tool named `{name}` in `tools`"),
                ));
            }
        }

        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = &self.system {
            messages.push(json!({"role": "system", "content": system_text(system)?}));
        }
        for (i, message) in self.messages.iter().enumerate() {
            match message.role {
                Role::User => user_turn(i, &message.content, &mut messages)?,
                Role::Assistant => messages.push(assistant_turn(i, &message.content)?),
            }
        }
        let template_kwargs = self.thinking.as_ref().map(|thinking| match thinking {
            Thinking::Enabled { budget_tokens } => {
                json!({"enable_thinking": true, "thinking_budget": budget_tokens})
            }
            Thinking::Disabled {} => json!({"enable_thinking": false}),
        });
        Ok(ChatPrompt {
            messages,
            tools,
            template_kwargs,
        })
    }
}

/// An Anthropic client tool as an OpenAI function tool.
fn openai_tool(i: usize, tool: &Tool) -> Result<Value, GatewayError> {
    if let Some(kind) = tool.kind.as_deref().filter(|k| *k != "custom") {
        return Err(invalid(
            "tools",
            format!(
                "tools[{i}]: tool type `{kind}` is a server tool that workers do not run; only client tools (name, description, input_schema) are supported"
            ),
        ));
    }
    if tool.name.is_empty() {
        return Err(invalid(
            "tools",
            format!("tools[{i}].name: must not be empty"),
        ));
    }
    let Some(schema) = tool.input_schema.as_ref().filter(|s| s.is_object()) else {
        return Err(invalid(
            "tools",
            format!("tools[{i}].input_schema: Field required (a JSON schema object)"),
        ));
    };
    let mut function = json!({"name": tool.name, "parameters": schema});
    if let Some(description) = &tool.description {
        function["description"] = json!(description);
    }
    if let Some(strict) = tool.strict {
        function["strict"] = json!(strict);
    }
    Ok(json!({"type": "function", "function": function}))
}

/// `tool_choice` in OpenAI's form, and whether the client asked for one call at most.
fn openai_tool_choice(choice: &ToolChoice) -> (Value, Option<bool>) {
    match choice {
        ToolChoice::Auto {
            disable_parallel_tool_use,
        } => (json!("auto"), *disable_parallel_tool_use),
        ToolChoice::Any {
            disable_parallel_tool_use,
        } => (json!("required"), *disable_parallel_tool_use),
        ToolChoice::Tool {
            name,
            disable_parallel_tool_use,
        } => (
            json!({"type": "function", "function": {"name": name}}),
            *disable_parallel_tool_use,
        ),
        ToolChoice::None {} => (json!("none"), None),
    }
}

/// The system prompt's text: a string or text blocks joined by newlines.
fn system_text(system: &Content) -> Result<String, GatewayError> {
    match system {
        Content::Text(text) => Ok(text.clone()),
        Content::Blocks(blocks) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (j, block) in blocks.iter().enumerate() {
                match block {
                    ContentBlock::Text { text } => texts.push(text.as_str()),
                    other => {
                        return Err(invalid(
                            "system",
                            format!(
                                "system[{j}]: only `text` blocks are allowed, not `{}`",
                                other.kind()
                            ),
                        ));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
    }
}

/// A user turn: its tool results as `tool` messages (they must follow the assistant's calls), then
/// the rest as one user message, text only as a string, with images as a list of parts.
fn user_turn(i: usize, content: &Content, out: &mut Vec<Value>) -> Result<(), GatewayError> {
    let blocks = match content {
        Content::Text(text) => {
            out.push(json!({"role": "user", "content": text}));
            return Ok(());
        }
        Content::Blocks(blocks) => blocks,
    };
    let mut parts = Vec::new();
    // Images a tool returned (a screenshot): OpenAI's tool messages carry text only, so they go
    // to the worker in the user message that follows the results.
    let mut result_images = Vec::new();
    let mut has_image = false;
    let mut has_tool_result = false;
    for (j, block) in blocks.iter().enumerate() {
        match block {
            ContentBlock::Text { text } => parts.push(json!({"type": "text", "text": text})),
            ContentBlock::Image { source } => {
                has_image = true;
                parts.push(image_part(source));
            }
            ContentBlock::ToolResult {
                tool_use_id,
                content,
                is_error,
            } => {
                has_tool_result = true;
                let (text, images) =
                    tool_result_content(i, j, content.as_ref(), is_error.unwrap_or(false))?;
                out.push(json!({"role": "tool", "tool_call_id": tool_use_id, "content": text}));
                result_images.extend(images);
            }
            // Earlier reasoning is context the template drops anyway.
            ContentBlock::Thinking { .. } | ContentBlock::RedactedThinking {} => {}
            ContentBlock::ToolUse { .. } => {
                return Err(invalid(
                    "messages",
                    format!(
                        "messages[{i}].content[{j}]: `tool_use` blocks belong to assistant turns"
                    ),
                ));
            }
        }
    }
    if !result_images.is_empty() {
        has_image = true;
        parts.splice(0..0, result_images);
    }
    if parts.is_empty() && has_tool_result {
        return Ok(());
    }
    let content = if has_image {
        Value::Array(parts)
    } else {
        Value::String(joined_text(&parts))
    };
    out.push(json!({"role": "user", "content": content}));
    Ok(())
}

/// An assistant turn: its text as `content` (null when it only calls tools) and its `tool_use`
/// blocks as `tool_calls` with the input serialized, as OpenAI carries arguments.
fn assistant_turn(i: usize, content: &Content) -> Result<Value, GatewayError> {
    let blocks = match content {
        Content::Text(text) => return Ok(json!({"role": "assistant", "content": text})),
        Content::Blocks(blocks) => blocks,
    };
    let mut texts = Vec::new();
    let mut calls = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        match block {
            ContentBlock::Text { text } => texts.push(text.as_str()),
            ContentBlock::ToolUse { id, name, input } => calls.push(json!({
                "id": id,
                "type": "function",
                "function": {"name": name, "arguments": input.to_string()},
            })),
            ContentBlock::Thinking { .. } | ContentBlock::RedactedThinking {} => {}
            other @ (ContentBlock::Image { .. } | ContentBlock::ToolResult { .. }) => {
                return Err(invalid(
                    "messages",
                    format!(
                        "messages[{i}].content[{j}]: `{}` blocks belong to user turns",
                        other.kind()
                    ),
                ));
            }
        }
    }
    let mut message = json!({"role": "assistant", "content": texts.join("\n")});
    if !calls.is_empty() {
        if texts.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = Value::Array(calls);
    }
    Ok(message)
}

/// A `tool_result`'s content: the text of its `tool` message and its images as `image_url` parts.
/// OpenAI has no error flag, so a failed tool's text says so for the model to read.
fn tool_result_content(
    i: usize,
    j: usize,
    content: Option<&Content>,
    is_error: bool,
) -> Result<(String, Vec<Value>), GatewayError> {
    let mut images = Vec::new();
    let text = match content {
        None => String::new(),
        Some(Content::Text(text)) => text.clone(),
        Some(Content::Blocks(blocks)) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for block in blocks {
                match block {
                    ContentBlock::Text { text } => texts.push(text.as_str()),
                    ContentBlock::Image { source } => images.push(image_part(source)),
                    other => {
                        return Err(invalid(
                            "messages",
                            format!(
                                "messages[{i}].content[{j}].content: `{}` blocks in a tool result are not supported (text and images are)",
                                other.kind()
                            ),
                        ));
                    }
                }
            }
            texts.join("\n")
        }
    };
    let text = if is_error {
        format!("Error: {text}")
    } else {
        text
    };
    Ok((text, images))
}

/// An image block as an OpenAI `image_url` part (inline data as a `data:` URL).
fn image_part(source: &ImageSource) -> Value {
    let url = match source {
        ImageSource::Base64 { media_type, data } => format!("data:{media_type};base64,{data}"),
        ImageSource::Url { url } => url.clone(),
    };
    json!({"type": "image_url", "image_url": {"url": url}})
}

/// Text parts joined by newlines, as vLLM joins a message's text parts.
fn joined_text(parts: &[Value]) -> String {
    parts
        .iter()
        .filter_map(|p| p["text"].as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

impl ContentBlock {
    /// The block's `type`, for messages.
    fn kind(&self) -> &'static str {
        match self {
            ContentBlock::Text { .. } => "text",
            ContentBlock::Image { .. } => "image",
            ContentBlock::ToolUse { .. } => "tool_use",
            ContentBlock::ToolResult { .. } => "tool_result",
            ContentBlock::Thinking { .. } => "thinking",
            ContentBlock::RedactedThinking {} => "redacted_thinking",
        }
    }
}
