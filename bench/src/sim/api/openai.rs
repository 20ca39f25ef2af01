//! OpenAI request fields the simulator reads, and the JSON shapes vLLM 0.32 returns (non-streaming
//! bodies, SSE chunks, `usage`), as captured live in `docs/vllm-interfaces.md` section 3.2.

use std::sync::Arc;

use serde_json::{Value, json};

use super::error::ApiError;
use super::tools::{self, PlannedCall};

/// What to tokenize.
#[derive(Debug, Clone)]
pub enum PromptInput {
    /// `/v1/completions` text (tokenized with special tokens).
    Text(String),
    /// `/v1/completions` with token ids.
    Tokens(Vec<u32>),
    /// `/v1/chat/completions` messages.
    Chat {
        messages: Value,
        add_generation_prompt: bool,
        kwargs: Option<Value>,
    },
}

/// The fields of a completion or chat request that matter here.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub model: Option<String>,
    pub prompt: PromptInput,
    pub max_tokens: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    /// The tool call the simulated model makes (chat requests with `tools`, see [`tools`]).
    pub tool_call: Option<PlannedCall>,
    /// Choices to generate (`n`).
    pub n: usize,
    /// Logprobs asked for: `Some(k)` with `k` alternatives per token (chat: `logprobs: true` and
    /// `top_logprobs: k`; completions: `logprobs: k`).
    pub logprobs: Option<usize>,
    /// `cache_salt`: hashed into the prompt's first block, so only requests of the same salt hit it.
    pub cache_salt: Option<Arc<str>>,
}

/// Most choices one request may ask for.
pub const MAX_N: usize = 16;

/// Most alternatives per token (vLLM's default `--max-logprobs`).
pub const MAX_LOGPROBS: usize = 20;

fn opt_usize(body: &Value, key: &'static str) -> Result<Option<usize>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
            ApiError::bad_param(key, format!("{key} must be a non-negative integer"))
        }),
    }
}

fn opt_bool(body: &Value, key: &'static str, default: bool) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_param(key, format!("{key} must be a boolean"))),
    }
}

fn common(body: &Value, prompt: PromptInput) -> Result<GenRequest, ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad("the request body must be a JSON object"));
    }
    let model = match body.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ApiError::bad_param("model", "model must be a string")),
    };
    let n = opt_usize(body, "n")?.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::bad_param(
            "n",
            format!("n must be between 1 and {MAX_N}, got {n}."),
        ));
    }
    let logprobs = logprobs(body)?;
    let max_tokens = match opt_usize(body, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => opt_usize(body, "max_tokens")?,
    };
    if max_tokens == Some(0) {
        return Err(ApiError::bad_param(
            "max_tokens",
            "max_tokens must be at least 1, got 0.",
        ));
    }
    // vLLM declares `min_tokens: int = 0`: pydantic refuses null like any other non-integer (checked
    // on vLLM 0.32: "Input should be a valid integer"), so a router must send 0, not null.
    if body.get("min_tokens").is_some_and(|v| !v.is_u64()) {
        return Err(ApiError::bad_param(
            "min_tokens",
            "min_tokens: Input should be a valid integer",
        ));
    }
    let stream = opt_bool(body, "stream", false)?;
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(o @ Value::Object(_)) => {
            if !stream {
                return Err(ApiError::bad_param(
                    "stream_options",
                    "Stream options can only be defined when `stream=True`.",
                ));
            }
            opt_bool(o, "include_usage", false)?
        }
        Some(_) => {
            return Err(ApiError::bad_param(
                "stream_options",
                "stream_options must be an object",
            ));
        }
    };
    Ok(GenRequest {
        model,
        prompt,
        max_tokens,
        stream,
        include_usage,
        tool_call: None,
        n,
        logprobs,
        cache_salt: cache_salt(body)?,
    })
}

/// Longest `cache_salt` vLLM takes, and the characters it refuses in one (0.32's
/// `validate_cache_salt`).
const MAX_CACHE_SALT: usize = 128;
const CACHE_SALT_FORBIDDEN: [char; 4] = ['@', '/', '\\', '\0'];

/// `cache_salt`, checked as vLLM checks it: a non-empty string of at most 128 characters without
/// `@`, `/`, `\` or NUL.
fn cache_salt(body: &Value) -> Result<Option<Arc<str>>, ApiError> {
    match body.get("cache_salt") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s))
            if !s.is_empty()
                && s.chars().count() <= MAX_CACHE_SALT
                && !s.contains(CACHE_SALT_FORBIDDEN) =>
        {
            Ok(Some(Arc::from(s.as_str())))
        }
        Some(_) => Err(ApiError::bad_param(
            "cache_salt",
            "Parameter 'cache_salt' must be a non-empty string of at most 128 characters and must not contain '@', '/', '\\\\', or NUL.",
        )),
    }
}

/// The logprobs a request asks for: chat sends `logprobs: true` (with `top_logprobs`), completions
/// `logprobs: k`.
fn logprobs(body: &Value) -> Result<Option<usize>, ApiError> {
    let top = match body.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => return Ok(None),
        Some(Value::Bool(true)) => opt_usize(body, "top_logprobs")?.unwrap_or(0),
        Some(_) => opt_usize(body, "logprobs")?.unwrap_or(0),
    };
    if top > MAX_LOGPROBS {
        return Err(ApiError::bad_param(
            "logprobs",
            format!(
                "Requested sample logprobs of {top}, which is greater than max allowed: {MAX_LOGPROBS}"
            ),
        ));
    }
    Ok(Some(top))
}

fn token_list(v: &[Value]) -> Option<Vec<u32>> {
    v.iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

/// Reads a `/v1/completions` body.
pub fn parse_completion(body: &Value) -> Result<GenRequest, ApiError> {
    let prompt = match body.get("prompt") {
        Some(Value::String(s)) => PromptInput::Text(s.clone()),
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            PromptInput::Text(items[0].as_str().unwrap_or_default().to_owned())
        }
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_array() => {
            let inner = items[0].as_array().map(Vec::as_slice).unwrap_or_default();
            PromptInput::Tokens(token_list(inner).ok_or_else(|| {
                ApiError::bad_param("prompt", "prompt token ids must be non-negative integers")
            })?)
        }
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_number) => {
            PromptInput::Tokens(token_list(items).ok_or_else(|| {
                ApiError::bad_param("prompt", "prompt token ids must be non-negative integers")
            })?)
        }
        Some(Value::Array(items)) if items.len() > 1 => {
            return Err(ApiError::bad_param(
                "prompt",
                "batched prompts are not supported by the simulator",
            ));
        }
        None | Some(Value::Null) => {
            return Err(ApiError::bad_param("prompt", "Field required: prompt"));
        }
        Some(_) => {
            return Err(ApiError::bad_param(
                "prompt",
                "prompt must be a string, a list of token ids or a list with one of them",
            ));
        }
    };
    common(body, prompt)
}

/// Reads a `/v1/chat/completions` body.
pub fn parse_chat(body: &Value) -> Result<GenRequest, ApiError> {
    let messages = match body.get("messages") {
        Some(m @ Value::Array(_)) => m.clone(),
        None | Some(Value::Null) => {
            return Err(ApiError::bad_param("messages", "Field required: messages"));
        }
        Some(_) => return Err(ApiError::bad_param("messages", "messages must be a list")),
    };
    let prompt = PromptInput::Chat {
        messages: with_image_placeholders(messages),
        add_generation_prompt: opt_bool(body, "add_generation_prompt", true)?,
        kwargs: template_kwargs(body),
    };
    let mut request = common(body, prompt)?;
    request.tool_call = tools::plan(body);
    Ok(request)
}

/// `chat_template_kwargs` plus `tools`, which vLLM hands to the chat template too (the template
/// lists them in the system prompt, so they count as prompt tokens).
fn template_kwargs(body: &Value) -> Option<Value> {
    let kwargs = body.get("chat_template_kwargs").cloned();
    let tools = body
        .get("tools")
        .filter(|t| t.as_array().is_some_and(|a| !a.is_empty()));
    match (kwargs, tools) {
        (kwargs, None) => kwargs,
        (Some(Value::Object(mut map)), Some(tools)) => {
            map.entry("tools").or_insert_with(|| tools.clone());
            Some(Value::Object(map))
        }
        (_, Some(tools)) => Some(json!({"tools": tools})),
    }
}

/// Image parts as the text a Qwen2-VL template puts in their place, so a multimodal request renders
/// (each image counts as those three tokens, where a real vision model has hundreds).
fn with_image_placeholders(mut messages: Value) -> Value {
    for message in messages.as_array_mut().into_iter().flatten() {
        let parts = message.get_mut("content").and_then(Value::as_array_mut);
        for part in parts.into_iter().flatten() {
            if part.get("type").and_then(Value::as_str) == Some("image_url") {
                *part = json!({"type": "text", "text": IMAGE_PLACEHOLDER});
            }
        }
    }
    messages
}

/// What an image becomes in the prompt.
pub const IMAGE_PLACEHOLDER: &str = "<|vision_start|><|image_pad|><|vision_end|>";

/// The `usage` object. `details`: whether `prompt_tokens_details` is reported (on by default here, as
/// with vLLM's `--enable-prompt-tokens-details`).
pub fn usage(prompt: usize, completion: usize, cached: usize, details: bool) -> Value {
    json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": if details { json!({"cached_tokens": cached}) } else { Value::Null },
    })
}

/// `system_fingerprint` of vLLM 0.32 responses.
pub const FINGERPRINT: &str = "vllm-0.32.0-sim";

/// A whole `/v1/completions` response.
pub fn completion_body(id: &str, created: u64, model: &str, text: &str, usage: Value) -> Value {
    json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{
            "index": 0, "text": text, "logprobs": null, "finish_reason": "length",
            "stop_reason": null, "token_ids": null, "prompt_logprobs": null, "prompt_token_ids": null,
        }],
        "service_tier": null, "system_fingerprint": FINGERPRINT, "usage": usage, "kv_transfer_params": null,
    })
}

/// A whole `/v1/chat/completions` response.
pub fn chat_body(id: &str, created: u64, model: &str, text: &str, usage: Value) -> Value {
    json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": 0,
            "message": {
                "role": "assistant", "content": text, "refusal": null, "annotations": null,
                "audio": null, "function_call": null, "tool_calls": [], "reasoning_content": null,
            },
            "logprobs": null, "finish_reason": "length", "stop_reason": null, "token_ids": null,
        }],
        "service_tier": null, "system_fingerprint": FINGERPRINT, "usage": usage,
        "prompt_logprobs": null, "prompt_token_ids": null, "kv_transfer_params": null,
    })
}

/// A whole `/v1/chat/completions` response whose message is a tool call.
pub fn chat_tool_call_body(
    id: &str,
    created: u64,
    model: &str,
    call: &PlannedCall,
    usage: Value,
) -> Value {
    let mut body = chat_body(id, created, model, "", usage);
    let choice = &mut body["choices"][0];
    choice["message"]["content"] = Value::Null;
    choice["message"]["tool_calls"] = json!([call.whole()]);
    choice["finish_reason"] = json!("tool_calls");
    body
}

/// One streamed completion chunk.
pub fn completion_chunk(
    id: &str,
    created: u64,
    model: &str,
    text: &str,
    finish: Option<&str>,
) -> Value {
    json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{
            "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
            "stop_reason": null, "prompt_token_ids": null, "token_ids": null,
        }],
    })
}

/// One streamed chat chunk with `delta`.
pub fn chat_chunk(
    id: &str,
    created: u64,
    model: &str,
    delta: Value,
    finish: Option<&str>,
) -> Value {
    let mut choice = json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish});
    if finish.is_some() {
        choice["stop_reason"] = Value::Null;
    }
    json!({
        "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [choice],
    })
}

/// The final usage chunk (`choices: []`), sent with `stream_options.include_usage`.
pub fn usage_chunk(id: &str, created: u64, model: &str, chat: bool, usage: Value) -> Value {
    json!({
        "id": id,
        "object": if chat { "chat.completion.chunk" } else { "text_completion" },
        "created": created, "model": model, "choices": [], "usage": usage,
        "system_fingerprint": FINGERPRINT,
    })
}

/// `GET /v1/models`.
pub fn models_body(model: &str, root: &str, max_model_len: usize, created: u64) -> Value {
    json!({"object": "list", "data": [{
        "id": model, "object": "model", "created": created, "owned_by": "vllm", "root": root,
        "parent": null, "max_model_len": max_model_len,
        "permission": [{
            "id": format!("modelperm-{model}"), "object": "model_permission", "created": created,
            "allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
            "allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
            "organization": "*", "group": null, "is_blocking": false,
        }],
    }]})
}

/// The `GenerateRequest` a `render` route returns (vLLM 0.32, `serve/disagg/protocol.py`): the prompt's
/// token ids and the sampling parameters the request would run with; `features` is null without
/// multimodal inputs.
pub fn generate_request(
    request_id: &str,
    model: &str,
    token_ids: &[u32],
    max_tokens: Option<usize>,
    stream: bool,
) -> Value {
    json!({
        "request_id": request_id,
        "token_ids": token_ids,
        "features": null,
        "sampling_params": {
            "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": null, "stop": [],
            "stop_token_ids": [], "ignore_eos": false, "max_tokens": max_tokens, "min_tokens": 0,
            "logprobs": null, "prompt_logprobs": null, "skip_special_tokens": true,
            "spaces_between_special_tokens": true, "output_kind": 0,
        },
        "model": model,
        "stream": stream,
        "stream_options": null,
        "cache_salt": null,
        "priority": 0,
        "kv_transfer_params": null,
    })
}
