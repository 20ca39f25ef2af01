//! Anthropic Messages API: `POST /v1/messages`, translated to the worker's OpenAI chat API and back,
//! and `POST /v1/messages/count_tokens`, answered from the gateway's own tokenizer.
//!
//! - [`count_tokens`]: the prompt's size from the gateway's tokenizer;
//! - [`request`]: the client's body, checked, as an OpenAI chat request (tools, images, thinking);
//! - [`response`]: the worker's answer as a message, whole or as the SSE event sequence
//!   `message_start`, (`content_block_start`, `content_block_delta`..., `content_block_stop`) per
//!   block, `message_delta`, `message_stop`.
//!
//! Usage follows Anthropic's meaning: `input_tokens` counts the prompt tokens *not* read from the cache,
//! `cache_read_input_tokens` those that were, so their sum is the worker's `prompt_tokens`.

pub mod count_tokens;
pub mod request;
pub mod response;

pub use request::{ChatPrompt, Content, ContentBlock, InputMessage, MessagesRequest, Role};
pub use response::{
    MessageUsage, StreamTranslator, TranslateError, message_from_chat, message_id, stop_reason,
};

#[cfg(test)]
mod tests;
