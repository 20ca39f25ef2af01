//! `POST /v1/messages`: Anthropic's Messages API, which recent vLLM serves beside the OpenAI one, in
//! its minimal form: text turns and a `system` prompt, answered whole or as Anthropic's event stream.
//! The generation is the chat route's (same tokenization, cache and timing); a streamed answer is sent
//! as Anthropic's event sequence once the text is complete (one `text_delta`).

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};

use super::error::ApiError;
use super::{AppState, Body, full, generate, json_response, openai};

/// Serves one Messages request.
pub async fn messages(
    state: &Arc<AppState>,
    engine: &Arc<crate::sim::engine::Engine>,
    body: &Value,
) -> Result<Response<Body>, ApiError> {
    let chat = chat_request(body)?;
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let answer = generate(state, engine, openai::parse_chat(&chat)?, true, None).await?;
    let bytes = answer
        .into_body()
        .collect()
        .await
        .map_err(|e| ApiError::bad(format!("generation failed: {e}")))?
        .to_bytes();
    let chat: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad(format!("generation failed: {e}")))?;
    let message = message_from_chat(&chat, body["model"].as_str().unwrap_or_default());
    if stream {
        Ok(full(StatusCode::OK, "text/event-stream", events(&message)))
    } else {
        Ok(json_response(StatusCode::OK, &message))
    }
}

/// The Messages request as an OpenAI chat request: `system` first, each turn's text blocks joined.
fn chat_request(body: &Value) -> Result<Value, ApiError> {
    let max_tokens = body
        .get("max_tokens")
        .and_then(Value::as_u64)
        .ok_or_else(|| ApiError::bad_param("max_tokens", "Field required: max_tokens"))?;
    let mut messages = Vec::new();
    if let Some(system) = body.get("system").filter(|s| !s.is_null()) {
        messages.push(json!({"role": "system", "content": text_of(system)?}));
    }
    let turns = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad_param("messages", "Field required: messages"))?;
    for turn in turns {
        let role = turn["role"].as_str().unwrap_or_default();
        if role != "user" && role != "assistant" {
            return Err(ApiError::bad_param(
                "messages",
                format!("unknown role {role:?}"),
            ));
        }
        messages.push(json!({"role": role, "content": text_of(&turn["content"])?}));
    }
    let mut chat = json!({"model": body["model"], "messages": messages, "max_tokens": max_tokens});
    // vLLM's `/v1/messages` takes a `cache_salt` and salts the chat request it makes.
    if let Some(salt) = body.get("cache_salt") {
        chat["cache_salt"] = salt.clone();
    }
    Ok(chat)
}

/// A string, or the text of text blocks (this minimal route takes no other block).
fn text_of(content: &Value) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| match (b["type"].as_str(), b["text"].as_str()) {
                (Some("text"), Some(text)) => Ok(text.to_string()),
                (kind, _) => Err(ApiError::bad_param(
                    "messages",
                    format!("content block {kind:?} is not served by this simulator"),
                )),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|texts| texts.join("\n")),
        _ => Err(ApiError::bad_param(
            "messages",
            "content must be a string or blocks",
        )),
    }
}

/// The chat answer as an Anthropic message; usage as Anthropic counts it (cached tokens apart).
fn message_from_chat(chat: &Value, model: &str) -> Value {
    let choice = &chat["choices"][0];
    let prompt = chat["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    let cached = chat["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    let stop_reason = match choice["finish_reason"].as_str() {
        Some("length") => "max_tokens",
        _ => "end_turn",
    };
    let id = chat["id"]
        .as_str()
        .unwrap_or_default()
        .replace("chatcmpl-", "msg_");
    json!({
        "id": id, "type": "message", "role": "assistant", "model": model,
        "content": [{"type": "text", "text": choice["message"]["content"].as_str().unwrap_or_default()}],
        "stop_reason": stop_reason, "stop_sequence": null,
        "usage": {
            "input_tokens": prompt - cached.min(prompt),
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": chat["usage"]["completion_tokens"],
        },
    })
}

/// A whole message as Anthropic's event stream.
fn events(message: &Value) -> Bytes {
    let mut start = message.clone();
    start["content"] = json!([]);
    start["stop_reason"] = Value::Null;
    start["usage"]["output_tokens"] = json!(0);
    let text = message["content"][0]["text"].clone();
    let sequence = [
        (
            "message_start",
            json!({"type": "message_start", "message": start}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": text}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": message["stop_reason"], "stop_sequence": null},
                   "usage": {"output_tokens": message["usage"]["output_tokens"]}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ];
    let mut out = String::new();
    for (event, data) in sequence {
        out.push_str(&format!("event: {event}\ndata: {data}\n\n"));
    }
    Bytes::from(out)
}
