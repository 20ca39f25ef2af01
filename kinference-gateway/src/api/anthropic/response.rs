//! The worker's OpenAI chat answer as an Anthropic message: whole ([`message_from_chat`]) or as the
//! event sequence ([`StreamTranslator`]). Reasoning becomes a `thinking` block, text a `text` block,
//! each tool call a `tool_use` block (streamed as `input_json_delta` pieces of its arguments), in the
//! order the worker produced them.

use bytes::{BufMut, BytesMut};
use serde::Serialize;
use serde_json::{Value, json};

use crate::api::openai::{ChatCompletionResponse, StreamChunk, ToolCall, Usage};

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

/// Why a worker's answer cannot be an Anthropic message.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TranslateError {
    /// A tool call whose arguments are not a JSON object (Anthropic's `input` must be one).
    #[error("tool call `{name}` has arguments that are not a JSON object: {detail}")]
    ToolArguments {
        /// The tool.
        name: String,
        /// What is wrong.
        detail: String,
    },
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

/// A turn that called tools and was not cut short ended for the tools, whatever the worker's
/// `finish_reason`: vLLM says `stop` for a call forced by a named `tool_choice`.
fn called_tools(
    (reason, sequence): (&'static str, Option<String>),
    called: bool,
) -> (&'static str, Option<String>) {
    match reason {
        "end_turn" | "stop_sequence" if called => ("tool_use", None),
        _ => (reason, sequence),
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

/// The id of a tool call the worker sent without one.
fn new_tool_use_id() -> String {
    format!("toolu_{:024x}", rand::random::<u128>() >> 32)
}

/// A tool call's arguments as the `input` object (no arguments at all: an empty object).
fn tool_input(name: &str, arguments: Option<&str>) -> Result<Value, TranslateError> {
    let arguments = arguments.map(str::trim).filter(|a| !a.is_empty());
    let Some(arguments) = arguments else {
        return Ok(json!({}));
    };
    match serde_json::from_str::<Value>(arguments) {
        Ok(input @ Value::Object(_)) => Ok(input),
        Ok(other) => Err(TranslateError::ToolArguments {
            name: name.to_string(),
            detail: format!("got {other}"),
        }),
        Err(e) => Err(TranslateError::ToolArguments {
            name: name.to_string(),
            detail: e.to_string(),
        }),
    }
}

fn tool_use_block(call: &ToolCall) -> Result<Value, TranslateError> {
    let function = call.function.clone().unwrap_or_default();
    let name = function.name.unwrap_or_default();
    let input = tool_input(&name, function.arguments.as_deref())?;
    Ok(json!({
        "type": "tool_use",
        "id": call.id.clone().unwrap_or_else(new_tool_use_id),
        "name": name,
        "input": input,
    }))
}

/// Translates a non-streaming chat completion into an Anthropic message.
pub fn message_from_chat(
    response: &ChatCompletionResponse,
    model: &str,
) -> Result<Value, TranslateError> {
    let choice = response.choices.first();
    let message = choice.map(|c| &c.message);
    let mut content = Vec::new();
    if let Some(reasoning) = message
        .and_then(|m| m.reasoning())
        .filter(|r| !r.is_empty())
    {
        content.push(json!({"type": "thinking", "thinking": reasoning, "signature": ""}));
    }
    let calls = message
        .and_then(|m| m.tool_calls.as_deref())
        .unwrap_or_default();
    let text = message.and_then(|m| m.content.as_deref()).unwrap_or("");
    // A turn that only calls tools has no text block; any other turn has one, even if empty.
    if !text.is_empty() || calls.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    for call in calls {
        content.push(tool_use_block(call)?);
    }
    let (reason, sequence) = stop_reason(
        choice.and_then(|c| c.finish_reason.as_deref()),
        choice.and_then(|c| c.stop_reason.as_ref()),
    );
    let (reason, sequence) = called_tools((reason, sequence), !calls.is_empty());
    let usage = MessageUsage::from(response.usage.unwrap_or_default());
    Ok(json!({
        "id": message_id(&response.id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
    }))
}

fn put_event(out: &mut BytesMut, name: &str, data: &Value) {
    out.put_slice(b"event: ");
    out.put_slice(name.as_bytes());
    out.put_slice(b"\ndata: ");
    // Serializing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer((&mut *out).writer(), data);
    out.put_slice(b"\n\n");
}

/// The kind of the content block being streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Text,
    Thinking,
    /// A `tool_use` block for the worker's tool call number `call`.
    ToolUse {
        call: u32,
    },
}

/// Turns the worker's OpenAI chat stream into Anthropic's event sequence, one upstream chunk at a time.
/// One block is open at a time; a delta of another kind (or another tool call) closes it and opens
/// the next, so block indices count up as Anthropic's do.
#[derive(Debug)]
pub struct StreamTranslator {
    model: String,
    id: String,
    started: bool,
    /// The open block and its index.
    open: Option<(u32, Block)>,
    /// The id of the open `tool_use` block.
    open_tool_id: Option<String>,
    next_index: u32,
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
            open: None,
            open_tool_id: None,
            next_index: 0,
            finish_reason: None,
            matched_stop: None,
            usage: None,
            output_chunks: 0,
        }
    }

    /// The opening event (`message_start`), sent as soon as the worker accepted the request.
    /// `input_tokens` is the gateway's own estimate; `message_delta` corrects it.
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
    }

    /// Closes the open block, if any.
    fn close(&mut self, out: &mut BytesMut) {
        if let Some((index, _)) = self.open.take() {
            put_event(
                out,
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            );
        }
    }

    /// Opens a block of `kind` starting as `block` (after the first one, a `ping` as Anthropic sends).
    fn open(&mut self, out: &mut BytesMut, kind: Block, block: Value) -> u32 {
        self.close(out);
        let index = self.next_index;
        self.next_index += 1;
        self.open = Some((index, kind));
        put_event(
            out,
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": block}),
        );
        if index == 0 {
            put_event(out, "ping", &json!({"type": "ping"}));
        }
        index
    }

    /// The index of the open block of `kind`, opening one starting as `block` when another is open.
    fn block(&mut self, out: &mut BytesMut, kind: Block, block: impl FnOnce() -> Value) -> u32 {
        match self.open {
            Some((index, open)) if open == kind => index,
            _ => self.open(out, kind, block()),
        }
    }

    fn delta(out: &mut BytesMut, index: u32, delta: Value) {
        put_event(
            out,
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
        );
    }

    /// Translates one upstream chunk.
    pub fn chunk(&mut self, out: &mut BytesMut, chunk: &StreamChunk) {
        self.start(out, 0);
        for choice in &chunk.choices {
            let reasoning = choice.delta.as_ref().and_then(|d| d.reasoning());
            if let Some(reasoning) = reasoning.filter(|r| !r.is_empty()) {
                self.output_chunks += 1;
                let index = self.block(
                    out,
                    Block::Thinking,
                    || json!({"type": "thinking", "thinking": "", "signature": ""}),
                );
                Self::delta(
                    out,
                    index,
                    json!({"type": "thinking_delta", "thinking": reasoning}),
                );
            }
            if let Some(text) = choice.text().filter(|t| !t.is_empty()) {
                self.output_chunks += 1;
                let index = self.block(out, Block::Text, || json!({"type": "text", "text": ""}));
                Self::delta(out, index, json!({"type": "text_delta", "text": text}));
            }
            let calls = choice.delta.as_ref().and_then(|d| d.tool_calls.as_deref());
            for call in calls.unwrap_or_default() {
                self.tool_call_piece(out, call);
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

    /// One piece of a tool call: its first piece (with the id and name) opens a `tool_use` block,
    /// every piece of arguments becomes an `input_json_delta`.
    fn tool_call_piece(&mut self, out: &mut BytesMut, call: &ToolCall) {
        let number = call.index.unwrap_or(0);
        let kind = Block::ToolUse { call: number };
        let function = call.function.as_ref();
        // Some parsers repeat the id on every piece: only a new id (or number) is a new call.
        let same_call = call.id.is_none() || call.id == self.open_tool_id;
        let index = match self.open {
            Some((index, open)) if open == kind && same_call => index,
            _ => {
                let id = call.id.clone().unwrap_or_else(new_tool_use_id);
                let block = json!({
                    "type": "tool_use",
                    "id": id,
                    "name": function.and_then(|f| f.name.as_deref()).unwrap_or(""),
                    "input": {},
                });
                let index = self.open(out, kind, block);
                self.open_tool_id = Some(id);
                index
            }
        };
        if let Some(arguments) = function
            .and_then(|f| f.arguments.as_deref())
            .filter(|a| !a.is_empty())
        {
            self.output_chunks += 1;
            Self::delta(
                out,
                index,
                json!({"type": "input_json_delta", "partial_json": arguments}),
            );
        }
    }

    /// Whether the worker said why generation ended (a stream without it was cut short).
    pub fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }

    /// The closing events (`content_block_stop`, `message_delta`, `message_stop`). An answer with
    /// no content at all still has one (empty) text block.
    pub fn finish(&mut self, out: &mut BytesMut) {
        self.start(out, 0);
        if self.next_index == 0 {
            self.open(out, Block::Text, json!({"type": "text", "text": ""}));
        }
        self.close(out);
        let (reason, sequence) =
            stop_reason(self.finish_reason.as_deref(), self.matched_stop.as_ref());
        let (reason, sequence) = called_tools((reason, sequence), self.open_tool_id.is_some());
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
