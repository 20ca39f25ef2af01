//! `POST /v1/messages/count_tokens`: a request's prompt size as the worker will count it, from the
//! gateway's own tokenizer and chat template (tools included, as vLLM renders them into the prompt).

use kinference_api::tokenize::ModelTokenizer;
use serde_json::{Map, Value, json};

use super::request::{ChatPrompt, MessagesRequest};
use crate::errors::GatewayError;

/// The answer's body: `{"input_tokens": n}`.
pub fn response_body(input_tokens: usize) -> Value {
    json!({ "input_tokens": input_tokens })
}

/// Counts `request`'s prompt with `tokenizer` (the model's, `None` when the gateway has none).
/// Images are not counted: their size depends on the worker's vision encoder, which the gateway
/// does not know.
pub fn count(
    tokenizer: Option<&ModelTokenizer>,
    request: &MessagesRequest,
) -> Result<usize, GatewayError> {
    let prompt = request.chat_prompt()?;
    let Some(tokenizer) = tokenizer else {
        return Err(GatewayError::invalid(
            "model",
            format!(
                "count_tokens: the gateway has no tokenizer for model `{}` (set `tokenizer_dir` for it in the gateway's configuration)",
                request.model
            ),
        ));
    };
    let ChatPrompt {
        messages,
        tools,
        template_kwargs,
    } = prompt;
    let mut kwargs = match template_kwargs {
        Some(Value::Object(map)) => map,
        _ => Map::new(),
    };
    if let Some(tools) = tools {
        kwargs.insert("tools".into(), Value::Array(tools));
    }
    let messages = Value::Array(messages.into_iter().map(without_images).collect());
    let text = tokenizer
        .render_chat_with(&messages, true, Some(&Value::Object(kwargs)))
        .map_err(|e| GatewayError::invalid("messages", format!("count_tokens: {e}")))?;
    let ids = tokenizer
        .encode_text(&text, false)
        .map_err(|e| GatewayError::invalid("messages", format!("count_tokens: {e}")))?;
    Ok(ids.len())
}

/// A message with its image parts left out.
fn without_images(mut message: Value) -> Value {
    if let Some(parts) = message.get_mut("content").and_then(Value::as_array_mut) {
        parts.retain(|p| p.get("type").and_then(Value::as_str) != Some("image_url"));
    }
    message
}
