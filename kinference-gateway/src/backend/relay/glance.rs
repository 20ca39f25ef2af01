//! What the relay reads of a stream chunk that an OpenAI client gets as it is: whether it is an
//! error, whether it carries generated output, and its usage. Read without copying the text: the
//! strings are borrowed from the event (unless they hold escapes), where a [`StreamChunk`] would
//! allocate each one only for the relay to look at its length.
//!
//! A chunk glances exactly when it parses as a [`StreamChunk`] (the same fields with the same
//! types), so an odd chunk takes the same path either way; the tests check both against each other.
//!
//! [`StreamChunk`]: crate::api::openai::StreamChunk

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::Value;

use crate::api::openai::{ToolCall, Usage};

#[cfg(test)]
mod tests;

/// The parts of a stream chunk the relay needs.
#[derive(Debug, Deserialize)]
pub(super) struct ChunkGlance<'a> {
    #[serde(default, borrow)]
    choices: Vec<ChoiceGlance<'a>>,
    /// As [`StreamChunk::usage`](crate::api::openai::StreamChunk::usage).
    #[serde(default)]
    pub usage: Option<Usage>,
    /// As [`StreamChunk::error`](crate::api::openai::StreamChunk::error).
    #[serde(default)]
    pub error: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct ChoiceGlance<'a> {
    #[serde(default, borrow)]
    delta: Option<DeltaGlance<'a>>,
    #[serde(default, borrow)]
    text: Option<Text<'a>>,
    /// Not needed, but typed as in [`StreamChunk`] so the same chunks are refused.
    #[serde(default, borrow, rename = "finish_reason")]
    _finish_reason: Option<Text<'a>>,
}

#[derive(Debug, Deserialize)]
struct DeltaGlance<'a> {
    #[serde(default, borrow)]
    content: Option<Text<'a>>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCall>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Text<'a>>,
    #[serde(default, borrow)]
    reasoning: Option<Text<'a>>,
}

/// A string of the event, borrowed unless it holds escapes. (Serde borrows a `Cow` field only
/// when it is not inside an `Option`: hence the newtype.)
#[derive(Debug, Deserialize)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

impl Text<'_> {
    fn as_str(&self) -> &str {
        &self.0
    }
}

impl ChunkGlance<'_> {
    /// As [`StreamChunk::has_text`](crate::api::openai::StreamChunk::has_text): text, reasoning or
    /// a piece of a tool call.
    pub(super) fn has_text(&self) -> bool {
        self.choices.iter().any(|c| {
            let text = c
                .delta
                .as_ref()
                .and_then(|d| d.content.as_ref())
                .or(c.text.as_ref())
                .map(Text::as_str);
            text.is_some_and(|t| !t.is_empty())
                || c.delta.as_ref().is_some_and(|d| {
                    d.reasoning
                        .as_ref()
                        .or(d.reasoning_content.as_ref())
                        .is_some_and(|r| !r.as_str().is_empty())
                        || d.tool_calls.as_ref().is_some_and(|t| !t.is_empty())
                })
        })
    }

    /// Appends the chunk's text and reasoning to `out`.
    pub(super) fn text_into(&self, out: &mut String) {
        for c in &self.choices {
            let text = c
                .delta
                .as_ref()
                .and_then(|d| d.content.as_ref())
                .or(c.text.as_ref());
            if let Some(t) = text {
                out.push_str(t.as_str());
            }
            if let Some(r) = c
                .delta
                .as_ref()
                .and_then(|d| d.reasoning.as_ref().or(d.reasoning_content.as_ref()))
            {
                out.push_str(r.as_str());
            }
        }
    }

    /// The final usage chunk: no choices, only usage.
    pub(super) fn usage_only(&self) -> bool {
        self.choices.is_empty() && self.usage.is_some()
    }
}
