//! The rest of the OpenAI surface agents and frameworks call, answered as vLLM 0.32 answers it:
//! `n` choices and `logprobs` on chat and completions, `POST /v1/embeddings`, `POST /v1/responses`
//! (whole and streamed), and the `--api-key` check on `/v1` routes.
//!
//! The simulated model generates one token stream per request; `n` choices repeat it (each with its
//! own `index`), and usage counts every choice. Logprobs are a fixed function of the token id, so a
//! test can tell they passed through unchanged.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::error::ApiError;
use super::openai::PromptInput;
use super::{AppState, Body, json_response, prompt_ids, text_of, unix_now};

/// Size of the simulated embedding vectors.
pub const EMBEDDING_DIMENSIONS: usize = 16;

/// vLLM's `--api-key` check: every `/v1` route wants `Authorization: Bearer <key>`; other routes
/// (`/health`, `/metrics`, `/tokenize`) stay open.
pub fn authorized(api_key: Option<&str>, path: &str, headers: &HeaderMap) -> bool {
    let Some(key) = api_key else {
        return true;
    };
    if !path.starts_with("/v1") {
        return true;
    }
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|given| given == key)
}

/// vLLM's answer to a request without the right key.
pub fn unauthorized() -> Response<Body> {
    json_response(StatusCode::UNAUTHORIZED, &json!({"error": "Unauthorized"}))
}

/// The logprob the simulated model gives token `id` (fixed, so a test can recompute it).
pub fn token_logprob(id: u32) -> f64 {
    -f64::from(id % 97 + 1) / 100.0
}

/// `k` alternatives for a token: it first, then the ids after it, each a little less likely.
fn alternatives(state: &AppState, id: u32, k: usize) -> Vec<(String, f64)> {
    (0..k as u32)
        .map(|i| {
            let alt = id.wrapping_add(i);
            let text = state.tokenizer.decode(&[alt]).unwrap_or_default();
            (text, token_logprob(id) - f64::from(i))
        })
        .collect()
}

/// One token of a chat choice's `logprobs.content`.
fn chat_entry(state: &AppState, id: u32, top: usize) -> Value {
    let entry = |text: &str, logprob: f64| json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()});
    let text = text_of(state, &[id]);
    let mut e = entry(&text, token_logprob(id));
    e["top_logprobs"] = alternatives(state, id, top)
        .iter()
        .map(|(t, lp)| entry(t, *lp))
        .collect();
    e
}

/// A chat choice's `logprobs` for `tokens`.
pub fn chat_logprobs(state: &AppState, tokens: &[u32], top: usize) -> Value {
    let content: Vec<Value> = tokens.iter().map(|&t| chat_entry(state, t, top)).collect();
    json!({ "content": content })
}

/// A completion choice's `logprobs` for `tokens`, the first starting at `offset` in the text.
pub fn completion_logprobs(state: &AppState, tokens: &[u32], top: usize, offset: usize) -> Value {
    let mut offsets = Vec::with_capacity(tokens.len());
    let mut texts = Vec::with_capacity(tokens.len());
    let mut at = offset;
    for &t in tokens {
        let text = text_of(state, &[t]);
        offsets.push(at);
        at += text.len();
        texts.push(text);
    }
    let tops: Vec<Value> = tokens
        .iter()
        .map(|&t| {
            let map: serde_json::Map<String, Value> = alternatives(state, t, top.max(1))
                .into_iter()
                .map(|(text, lp)| (text, json!(lp)))
                .collect();
            Value::Object(map)
        })
        .collect();
    json!({
        "text_offset": offsets,
        "token_logprobs": tokens.iter().map(|&t| token_logprob(t)).collect::<Vec<_>>(),
        "tokens": texts,
        "top_logprobs": tops,
    })
}

/// `body`'s one choice repeated as choices `0..n`, each with `logprobs` when asked for.
pub fn expand_choices(body: &mut Value, n: usize, logprobs: Option<Value>) {
    let Some(first) = body["choices"].get(0).cloned() else {
        return;
    };
    let choices: Vec<Value> = (0..n)
        .map(|i| {
            let mut c = first.clone();
            c["index"] = json!(i);
            if let Some(lp) = &logprobs {
                c["logprobs"] = lp.clone();
            }
            c
        })
        .collect();
    body["choices"] = Value::Array(choices);
}

/// `chunk`'s one choice as choice `index`, with `logprobs` when asked for.
pub fn choice_chunk(chunk: &Value, index: usize, logprobs: Option<&Value>) -> Value {
    let mut c = chunk.clone();
    c["choices"][0]["index"] = json!(index);
    if let Some(lp) = logprobs {
        c["choices"][0]["logprobs"] = lp.clone();
    }
    c
}

/// `POST /v1/embeddings`: one vector per input (a string, a list of strings, token ids, or a list
/// of token-id lists), as floats or, with `encoding_format: base64`, as little-endian float32
/// bytes (what the `openai` SDK asks for by default).
pub fn embeddings(state: &AppState, body: &Value) -> Result<Response<Body>, ApiError> {
    if let Some(m) = body.get("model").and_then(Value::as_str)
        && m != state.model
    {
        return Err(ApiError::ModelNotFound(m.to_owned()));
    }
    let inputs = embedding_inputs(body.get("input"))?;
    let base64 = match body.get("encoding_format").and_then(Value::as_str) {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad_param(
                "encoding_format",
                format!("encoding_format must be `float` or `base64`, got `{other}`"),
            ));
        }
    };
    let mut data = Vec::with_capacity(inputs.len());
    let mut prompt_tokens = 0;
    for (index, input) in inputs.iter().enumerate() {
        let ids = prompt_ids(state, input)?;
        if ids.len() > state.max_model_len {
            return Err(ApiError::bad(format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens in the input for embedding generation. Please reduce the length of the input.",
                state.max_model_len,
                ids.len()
            )));
        }
        prompt_tokens += ids.len();
        let vector = embedding_of(&ids);
        let embedding = if base64 {
            let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            json!(vector)
        };
        data.push(json!({"index": index, "object": "embedding", "embedding": embedding}));
    }
    let id: u128 = rand::random();
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "id": format!("embd-{id:032x}"), "object": "list", "created": unix_now(),
            "model": state.model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": null},
        }),
    ))
}

fn embedding_inputs(input: Option<&Value>) -> Result<Vec<PromptInput>, ApiError> {
    let ids = |v: &[Value]| -> Option<Vec<u32>> {
        v.iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    };
    let bad = || {
        ApiError::bad_param(
            "input",
            "input must be a string, a list of strings, a list of token ids or a list of them",
        )
    };
    match input {
        Some(Value::String(s)) => Ok(vec![PromptInput::Text(s.clone())]),
        Some(Value::Array(items)) if !items.is_empty() => {
            if items.iter().all(Value::is_number) {
                return Ok(vec![PromptInput::Tokens(ids(items).ok_or_else(bad)?)]);
            }
            items
                .iter()
                .map(|item| match item {
                    Value::String(s) => Ok(PromptInput::Text(s.clone())),
                    Value::Array(inner) => Ok(PromptInput::Tokens(ids(inner).ok_or_else(bad)?)),
                    _ => Err(bad()),
                })
                .collect()
        }
        None | Some(Value::Null) => Err(ApiError::bad_param("input", "Field required: input")),
        Some(_) => Err(bad()),
    }
}

/// A unit vector that depends only on the token ids (equal inputs, equal embeddings).
pub fn embedding_of(ids: &[u32]) -> Vec<f32> {
    let mut v = [0f32; EMBEDDING_DIMENSIONS];
    for (i, &id) in ids.iter().enumerate() {
        let slot = (id as usize).wrapping_mul(31).wrapping_add(i) % EMBEDDING_DIMENSIONS;
        v[slot] += 1.0 + (id % 7) as f32;
    }
    let norm = v
        .iter()
        .map(|x| x * x)
        .sum::<f32>()
        .sqrt()
        .max(f32::MIN_POSITIVE);
    v.iter().map(|x| x / norm).collect()
}

/// A `/v1/responses` request as chat messages (`instructions` as the system message, `input` a
/// string or a list of messages whose content is text or `input_text` parts), and its output limit.
pub fn responses_prompt(body: &Value) -> Result<(Value, Option<usize>), ApiError> {
    let text_of_content = |content: &Value| -> Option<String> {
        match content {
            Value::String(s) => Some(s.clone()),
            Value::Array(parts) => Some(
                parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join(""),
            ),
            _ => None,
        }
    };
    let mut messages = Vec::new();
    if let Some(instructions) = body.get("instructions").and_then(Value::as_str) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match body.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) if !items.is_empty() => {
            for item in items {
                let role = item.get("role").and_then(Value::as_str).unwrap_or("user");
                let content = item
                    .get("content")
                    .and_then(text_of_content)
                    .ok_or_else(|| {
                        ApiError::bad_param("input", "each input item needs a text `content`")
                    })?;
                messages.push(json!({"role": role, "content": content}));
            }
        }
        None | Some(Value::Null) => {
            return Err(ApiError::bad_param("input", "Field required: input"));
        }
        Some(_) => {
            return Err(ApiError::bad_param(
                "input",
                "input must be a string or a non-empty list of messages",
            ));
        }
    }
    let max = match body.get("max_output_tokens") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().filter(|n| *n > 0).ok_or_else(|| {
            ApiError::bad_param("max_output_tokens", "max_output_tokens must be at least 1")
        })? as usize),
    };
    Ok((Value::Array(messages), max))
}

/// `POST /v1/responses`: the input generated like a chat turn, answered as one `message` output
/// item, whole or as the Responses event stream (`response.created` ... `response.completed`,
/// which carries the usage; no `[DONE]`).
pub async fn responses(state: &Arc<AppState>, body: &Value) -> Result<Response<Body>, ApiError> {
    if let Some(m) = body.get("model").and_then(Value::as_str)
        && m != state.model
    {
        return Err(ApiError::ModelNotFound(m.to_owned()));
    }
    let (messages, max) = responses_prompt(body)?;
    let messages = match body.get("previous_response_id").and_then(Value::as_str) {
        // As vLLM: the stored conversation, then the new input.
        Some(id) => {
            let held = state
                .responses_store
                .as_ref()
                .and_then(|store| store.get(id))
                .ok_or_else(|| ApiError::ResponseNotFound(id.to_string()))?;
            let mut all = held.as_ref().clone();
            all.extend(messages.as_array().cloned().unwrap_or_default());
            Value::Array(all)
        }
        None => messages,
    };
    // What a stored answer keeps: the conversation so far; the answer's text is added at its end.
    let keep = state
        .responses_store
        .as_ref()
        .filter(|_| body.get("store").and_then(Value::as_bool).unwrap_or(true))
        .map(|_| messages.as_array().cloned().unwrap_or_default());
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let prompt = PromptInput::Chat {
        messages,
        add_generation_prompt: true,
        kwargs: None,
    };
    let ids = prompt_ids(state, &prompt)?;
    let max_tokens = max.unwrap_or(16);
    if ids.len() + max_tokens > state.max_model_len {
        return Err(ApiError::bad(format!(
            "This model's maximum context length is {} tokens. However, you requested {} tokens. Please reduce the length of the input.",
            state.max_model_len,
            ids.len() + max_tokens
        )));
    }
    let n_prompt = ids.len();
    let generation = state.engine.submit(ids, max_tokens);
    let r: u128 = rand::random();
    let shell = ResponseShell {
        id: format!("resp_{r:032x}"),
        message_id: format!("msg_{r:032x}"),
        created: unix_now(),
        model: state.model.clone(),
    };
    let mut tokens = generation.tokens;
    if !stream {
        let (mut out, mut cached) = (Vec::new(), 0);
        while let Some(t) = tokens.recv().await {
            cached = t.cached_tokens;
            out.push(t.token);
            if t.finish.is_some() {
                break;
            }
        }
        let text = text_of(state, &out);
        store_answer(state, &shell.id, keep, &text);
        let body = shell.body("completed", &text, Some((n_prompt, out.len(), cached)));
        return Ok(json_response(StatusCode::OK, &body));
    }
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(64);
    let state = Arc::clone(state);
    tokio::spawn(async move {
        let mut seq = 0u64;
        let mut event = |kind: &str, mut data: Value| {
            data["type"] = json!(kind);
            data["sequence_number"] = json!(seq);
            seq += 1;
            Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
        };
        let mut added = shell.item("in_progress", "");
        added["content"] = json!([]);
        let mut opening = vec![
            event(
                "response.created",
                json!({"response": shell.body("in_progress", "", None)}),
            ),
            event(
                "response.in_progress",
                json!({"response": shell.body("in_progress", "", None)}),
            ),
        ];
        opening.push(event(
            "response.output_item.added",
            json!({"output_index": 0, "item": added}),
        ));
        opening.push(event(
            "response.content_part.added",
            json!({"output_index": 0, "content_index": 0, "item_id": shell.message_id,
                   "part": {"type": "output_text", "text": "", "annotations": []}}),
        ));
        for b in opening {
            if tx.send(Ok(Frame::data(b))).await.is_err() {
                return;
            }
        }
        let (mut text, mut n, mut prompt, mut cached) = (String::new(), 0, 0, 0);
        while let Some(t) = tokens.recv().await {
            n += 1;
            prompt = t.prompt_tokens;
            cached = t.cached_tokens;
            let delta = text_of(&state, &[t.token]);
            text.push_str(&delta);
            let b = event(
                "response.output_text.delta",
                json!({"output_index": 0, "content_index": 0, "item_id": shell.message_id,
                       "delta": delta, "logprobs": []}),
            );
            if tx.send(Ok(Frame::data(b))).await.is_err() {
                return;
            }
            if t.finish.is_some() {
                break;
            }
        }
        let closing = [
            event(
                "response.output_text.done",
                json!({"output_index": 0, "content_index": 0, "item_id": shell.message_id,
                       "text": text, "logprobs": []}),
            ),
            event(
                "response.content_part.done",
                json!({"output_index": 0, "content_index": 0, "item_id": shell.message_id,
                       "part": {"type": "output_text", "text": text, "annotations": []}}),
            ),
            event(
                "response.output_item.done",
                json!({"output_index": 0, "item": shell.item("completed", &text)}),
            ),
            event(
                "response.completed",
                json!({"response": shell.body("completed", &text, Some((prompt, n, cached)))}),
            ),
        ];
        store_answer(&state, &shell.id, keep, &text);
        for b in closing {
            if tx.send(Ok(Frame::data(b))).await.is_err() {
                return;
            }
        }
    });
    let mut r = Response::new(BodyExt::boxed(StreamBody::new(ReceiverStream::new(rx))));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    Ok(r)
}

/// The most answers a worker keeps; the oldest go first (vLLM keeps them all, in memory).
const STORED_ANSWERS: usize = 10_000;

/// The answers a worker stored (`store`, with the store on): each one's conversation, its own
/// text last, for a later request to continue by `previous_response_id`.
#[derive(Debug, Default)]
pub struct ResponseStore {
    held: parking_lot::Mutex<Stored>,
}

/// The stored answers by id, and their ids oldest first.
#[derive(Debug, Default)]
struct Stored {
    by_id: HashMap<String, Arc<Vec<Value>>>,
    order: VecDeque<String>,
}

impl ResponseStore {
    /// The conversation of stored answer `id`.
    pub fn get(&self, id: &str) -> Option<Arc<Vec<Value>>> {
        self.held.lock().by_id.get(id).cloned()
    }

    fn put(&self, id: &str, conversation: Vec<Value>) {
        let mut held = self.held.lock();
        let Stored { by_id, order } = &mut *held;
        by_id.insert(id.to_string(), Arc::new(conversation));
        order.push_back(id.to_string());
        while order.len() > STORED_ANSWERS {
            if let Some(oldest) = order.pop_front() {
                by_id.remove(&oldest);
            }
        }
    }
}

/// Stores answer `id` (its conversation `kept`, then `text`) when the request asked to keep it.
fn store_answer(state: &AppState, id: &str, kept: Option<Vec<Value>>, text: &str) {
    if let (Some(store), Some(mut conversation)) = (&state.responses_store, kept) {
        conversation.push(json!({"role": "assistant", "content": text}));
        store.put(id, conversation);
    }
}

/// What every form of one response shares.
struct ResponseShell {
    id: String,
    message_id: String,
    created: u64,
    model: String,
}

impl ResponseShell {
    /// The `message` output item.
    fn item(&self, status: &str, text: &str) -> Value {
        json!({
            "id": self.message_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        })
    }

    /// The response object; `usage` as (prompt, output, cached) tokens once complete.
    fn body(&self, status: &str, text: &str, usage: Option<(usize, usize, usize)>) -> Value {
        let output = if usage.is_some() {
            json!([self.item(status, text)])
        } else {
            json!([])
        };
        json!({
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status, "output": output, "error": null, "incomplete_details": null,
            "instructions": null, "metadata": null, "parallel_tool_calls": true,
            "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto", "tools": [],
            "usage": usage.map(|(input, output, cached)| json!({
                "input_tokens": input, "output_tokens": output, "total_tokens": input + output,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens_details": {"reasoning_tokens": 0},
            })),
        })
    }
}
