//! The simulator's HTTP server (hyper 1, HTTP/1.1 like vLLM's uvicorn): vLLM's OpenAI-compatible routes,
//! `/tokenize`, `/metrics`, `/health`, `/version`, `/reset_prefix_cache`, the `render` routes (vLLM 0.32's
//! `GenerateRequest` shape, which vllm-router's `cache_aware`/`kv_aware` read for token ids), and the
//! simulator-only `/sim/estimate`, `/sim/state`, `/sim/slowdown`, and the KV connector's
//! `/sim/kv/pull` and `/sim/kv/room/ROOM` ([`crate::sim::kv_transfer`]).
//!
//! Each generation request is tokenized here (real tokenizer and chat template), checked against
//! `max_model_len`, queued in the engine and answered from its token stream, whole or as SSE.
//! A client that disconnects drops the stream, which aborts the request in the engine.
//! Chat requests with `tools` may be answered with a tool call, by the fixed rule in [`tools`].

pub mod error;
pub mod lora;
pub mod messages;
pub mod openai;
pub mod surface;
pub mod tools;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kinference_api::tokenize::{ModelTokenizer, TokenizeError};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use self::error::ApiError;
use self::openai::{GenRequest, PromptInput};
use self::tools::PlannedCall;
use crate::sim::engine::{Engine, TokenOut};
use crate::sim::kv_transfer::{self, KvConnector, Transfer};
use crate::sim::metrics::{CacheInfo, Metrics};

/// Response body: whole or streamed.
pub type Body = BoxBody<Bytes, Infallible>;

/// Largest accepted request body.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// Everything the handlers share.
pub struct AppState {
    /// The KV connector (prefill/decode disaggregation), when the worker has a `kv_role`.
    pub kv: Option<KvConnector>,
    /// Rank 0's engine: the one of a worker without data parallelism, and the one `/sim/estimate`,
    /// `/sim/state` and the Responses API use.
    pub engine: Arc<Engine>,
    /// Every rank's engine; completions, chat and messages pick theirs here.
    pub ranks: crate::sim::ranks::Ranks,
    pub tokenizer: Arc<ModelTokenizer>,
    pub metrics: Arc<Metrics>,
    /// Served model name.
    pub model: String,
    /// `root` of `/v1/models` (the tokenizer directory).
    pub root: String,
    pub max_model_len: usize,
    pub num_blocks: usize,
    pub prompt_tokens_details: bool,
    /// Whether `auto` tool choice is enabled (vLLM's `--enable-auto-tool-choice`).
    pub auto_tool_choice: bool,
    /// LoRA adapters served beside the base model (vLLM's `--lora-modules`).
    pub lora_modules: Vec<Arc<crate::sim::cache::LoraAdapter>>,
    /// vLLM's `--api-key`: `/v1` routes want it as a bearer token.
    pub api_key: Option<String>,
    /// Whether `POST /v1/responses` is served (vLLM before 0.10 has no such route).
    pub responses_api: bool,
    /// The answers `/v1/responses` stored, when the worker stores them (vLLM's
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`).
    pub responses_store: Option<surface::ResponseStore>,
    /// Whether `POST /v1/messages` (Anthropic's Messages API) is served.
    pub messages_api: bool,
    /// Text of each token the engine can generate.
    pub token_text: Arc<HashMap<u32, String>>,
    pub started: u64,
    /// Extra facts echoed by `/sim/state` (preset, time scale ...).
    pub info: Value,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

/// Token ids the simulator generates: whole lowercase words with a leading space (`Ġword` in byte-level
/// BPE vocabularies), so every token decodes on its own and text streams cleanly. Sorted by id.
pub fn output_vocabulary(tok: &ModelTokenizer) -> Vec<(u32, String)> {
    let mut words: Vec<(u32, String)> = tok
        .tokenizer()
        .get_vocab(false)
        .into_iter()
        .filter(|(s, _)| {
            s.strip_prefix('Ġ').is_some_and(|w| {
                (3..=8).contains(&w.len()) && w.bytes().all(|b| b.is_ascii_lowercase())
            })
        })
        .filter_map(|(_, id)| Some((id, tok.decode(&[id]).ok()?)))
        .collect();
    words.sort_by_key(|(id, _)| *id);
    words.truncate(4096);
    words
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs()
}

/// Serves HTTP on `listener` until `shutdown`, then drains open connections (at most 5 s).
pub async fn serve(listener: TcpListener, state: Arc<AppState>, shutdown: CancellationToken) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // E.g. out of file descriptors: keep serving the connections we have.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let st = state.clone();
        let conn = http1::Builder::new().serve_connection(
            TokioIo::new(stream),
            service_fn(move |req| handle(st.clone(), req)),
        );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(Duration::from_secs(5)) => {
            tracing::warn!("connections still open after 5 s; closing");
        }
    }
}

fn full(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    r
}

pub(crate) fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    full(status, "application/json", v.to_string())
}

fn error_response(e: &ApiError) -> Response<Body> {
    json_response(e.status(), &e.body())
}

/// Routes one request; never fails (errors become vLLM error JSON).
pub async fn handle(
    state: Arc<AppState>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let result = route(&state, &method, &path, req).await;
    Ok(result.unwrap_or_else(|e| {
        tracing::debug!(%method, %path, error = %e, "request refused");
        error_response(&e)
    }))
}

async fn read_json(req: Request<Incoming>) -> Result<Value, ApiError> {
    let body = Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                ApiError::TooLarge
            } else {
                ApiError::bad(format!("cannot read the request body: {e}"))
            }
        })?
        .to_bytes();
    serde_json::from_slice(&body).map_err(|e| ApiError::bad(format!("Invalid JSON body: {e}")))
}

async fn route(
    state: &Arc<AppState>,
    method: &Method,
    path: &str,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let get = method == Method::GET;
    let post = method == Method::POST;
    if !surface::authorized(state.api_key.as_deref(), path, req.headers()) {
        return Ok(surface::unauthorized());
    }
    match path {
        "/health" | "/ping" if get || post => Ok(full(StatusCode::OK, "application/json", "")),
        "/version" if get => Ok(json_response(StatusCode::OK, &json!({"version": "0.32.0"}))),
        "/v1/models" if get => Ok(json_response(StatusCode::OK, &lora::models_body(state))),
        "/metrics" if get => {
            let mut text = state.metrics.render(
                &state.ranks.gauges(),
                &CacheInfo {
                    block_size: state.engine.block_size(),
                    num_gpu_blocks: state.num_blocks,
                },
            );
            if let Some(kv) = &state.kv {
                text.push_str(&kv.render(&state.model));
            }
            Ok(full(
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                text,
            ))
        }
        "/v1/completions" if post => {
            let engine = pick_rank(state, &req)?;
            let body = read_json(req).await?;
            let r = openai::parse_completion(&body)?;
            let transfer = state.kv.as_ref().and_then(|kv| kv.transfer_of(&body));
            generate(state, &engine, r, false, transfer).await
        }
        "/v1/chat/completions" if post => {
            let engine = pick_rank(state, &req)?;
            let body = read_json(req).await?;
            if !state.auto_tool_choice && tools::wants_auto(&body) {
                return Err(ApiError::bad(tools::AUTO_REFUSED));
            }
            let r = openai::parse_chat(&body)?;
            let transfer = state.kv.as_ref().and_then(|kv| kv.transfer_of(&body));
            generate(state, &engine, r, true, transfer).await
        }
        "/sim/kv/pull" if post => {
            let body = read_json(req).await?;
            let blocks = body
                .get("request_id")
                .and_then(Value::as_str)
                .zip(state.kv.as_ref())
                .and_then(|(id, kv)| kv.hand_over(id))
                .ok_or(ApiError::RouteNotFound)?;
            Ok(json_response(StatusCode::OK, &json!({ "blocks": blocks })))
        }
        room if get && room.starts_with("/sim/kv/room/") => {
            let room = room["/sim/kv/room/".len()..]
                .parse::<u64>()
                .map_err(|_| ApiError::RouteNotFound)?;
            let kv = state.kv.as_ref().ok_or(ApiError::RouteNotFound)?;
            let blocks = kv
                .room(room, kv_transfer::ROOM_WAIT)
                .await
                .ok_or(ApiError::RouteNotFound)?;
            Ok(json_response(StatusCode::OK, &json!({ "blocks": blocks })))
        }
        "/v1/completions/render" if post => {
            let r = openai::parse_completion(&read_json(req).await?)?;
            render(state, &r, false)
        }
        "/v1/chat/completions/render" if post => {
            let r = openai::parse_chat(&read_json(req).await?)?;
            render(state, &r, true)
        }
        "/v1/embeddings" if post => surface::embeddings(state, &read_json(req).await?),
        "/v1/responses" if post && state.responses_api => {
            surface::responses(state, &read_json(req).await?).await
        }
        "/v1/messages" if post && state.messages_api => {
            let engine = pick_rank(state, &req)?;
            messages::messages(state, &engine, &read_json(req).await?).await
        }
        "/tokenize" if post => tokenize(state, &read_json(req).await?),
        "/detokenize" if post => detokenize(state, &read_json(req).await?),
        "/reset_prefix_cache" if post => {
            for engine in state.ranks.all() {
                if !engine.reset_prefix_cache() {
                    tracing::warn!("reset_prefix_cache refused: requests are running");
                }
            }
            Ok(full(StatusCode::OK, "application/json", ""))
        }
        "/sim/estimate" if post => {
            let body = read_json(req).await?;
            let r = if body.get("messages").is_some() {
                openai::parse_chat(&body)?
            } else {
                openai::parse_completion(&body)?
            };
            check_model(state, &r)?;
            let ids = prompt_ids(state, &r.prompt)?;
            Ok(json_response(
                StatusCode::OK,
                &serde_json::to_value(state.engine.estimate(&ids)).unwrap_or(Value::Null),
            ))
        }
        "/sim/state" if get => {
            let mut v = serde_json::to_value(state.engine.snapshot()).unwrap_or(Value::Null);
            v["model"] = json!(state.model);
            v["info"] = state.info.clone();
            v["slowdown"] = json!(state.engine.slowdown());
            v["kv_connector"] = state.kv.as_ref().map_or(Value::Null, KvConnector::info);
            v["data_parallel"] = state.ranks.info();
            Ok(json_response(StatusCode::OK, &v))
        }
        "/sim/slowdown" if post => {
            let body = read_json(req).await?;
            let factor = body["factor"]
                .as_f64()
                .ok_or_else(|| ApiError::bad("expected {\"factor\": <number above 0>}"))?;
            for engine in state.ranks.all() {
                engine
                    .set_slowdown(factor)
                    .map_err(|e| ApiError::bad(e.to_string()))?;
            }
            tracing::info!(factor, "slowdown changed");
            Ok(json_response(StatusCode::OK, &json!({"slowdown": factor})))
        }
        "/health"
        | "/ping"
        | "/version"
        | "/v1/models"
        | "/metrics"
        | "/v1/completions"
        | "/v1/chat/completions"
        | "/v1/embeddings"
        | "/v1/completions/render"
        | "/v1/chat/completions/render"
        | "/tokenize"
        | "/detokenize"
        | "/reset_prefix_cache"
        | "/sim/estimate"
        | "/sim/state"
        | "/sim/slowdown" => Err(ApiError::MethodNotAllowed),
        _ => Err(ApiError::RouteNotFound),
    }
}

fn check_model(state: &AppState, r: &GenRequest) -> Result<(), ApiError> {
    match &r.model {
        Some(m) if !state.serves(m) => Err(ApiError::ModelNotFound(m.clone())),
        _ => Ok(()),
    }
}

fn tokenize_error(e: TokenizeError) -> ApiError {
    match e {
        TokenizeError::InvalidMessages(m) => ApiError::bad_param("messages", m),
        other => ApiError::bad(other.to_string()),
    }
}

/// Token ids of a request's prompt, as vLLM computes them.
pub(crate) fn prompt_ids(state: &AppState, p: &PromptInput) -> Result<Vec<u32>, ApiError> {
    let ids = match p {
        PromptInput::Text(t) => state
            .tokenizer
            .encode_text(t, true)
            .map_err(tokenize_error)?,
        PromptInput::Tokens(ids) => ids.clone(),
        PromptInput::Chat {
            messages,
            add_generation_prompt,
            kwargs,
        } => {
            let text = state
                .tokenizer
                .render_chat_with(messages, *add_generation_prompt, kwargs.as_ref())
                .map_err(tokenize_error)?;
            state
                .tokenizer
                .encode_text(&text, false)
                .map_err(tokenize_error)?
        }
    };
    if ids.is_empty() {
        return Err(ApiError::bad_param("prompt", "The prompt cannot be empty"));
    }
    Ok(ids)
}

/// Generated text of some tokens.
pub(crate) fn text_of(state: &AppState, tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(|t| state.token_text.get(t).map(String::as_str).unwrap_or(""))
        .collect()
}

fn request_id(chat: bool) -> String {
    let r: u128 = rand::random();
    if chat {
        format!("chatcmpl-{r:032x}")
    } else {
        format!("cmpl-{r:032x}")
    }
}

/// The rank's engine that serves a generation request ([`crate::sim::ranks`]).
fn pick_rank(state: &AppState, req: &Request<Incoming>) -> Result<Arc<Engine>, ApiError> {
    let (rank, engine) = state
        .ranks
        .pick(req.headers())
        .map_err(|e| ApiError::bad(e.to_string()))?;
    tracing::debug!(rank, "data-parallel rank picked");
    Ok(engine)
}

async fn generate(
    state: &Arc<AppState>,
    engine: &Arc<Engine>,
    r: GenRequest,
    chat: bool,
    transfer: Option<Transfer>,
) -> Result<Response<Body>, ApiError> {
    check_model(state, &r)?;
    let ids = prompt_ids(state, &r.prompt)?;
    // The prefill half of a split request ends at its first token, whatever the client asked.
    let max_tokens = if transfer.as_ref().is_some_and(Transfer::produces) {
        1
    } else {
        r.max_tokens.unwrap_or(16)
    };
    let total = ids.len() + max_tokens;
    if total > state.max_model_len {
        return Err(ApiError::bad(format!(
            "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the messages, {} in the completion). Please reduce the length of the messages or completion.",
            state.max_model_len,
            total,
            ids.len(),
            max_tokens
        )));
    }
    // A request that can never fit in the KV cache would wait forever.
    let capacity = (state.num_blocks.saturating_sub(1)) * engine.block_size();
    if total > capacity {
        return Err(ApiError::bad(format!(
            "the request needs {total} tokens of KV cache but the simulator has {capacity}"
        )));
    }
    let n_prompt = ids.len();
    // A tool call takes as many tokens as its text; one that does not fit is not made (the model
    // would have been cut off mid-call).
    let tool_call = r.tool_call.filter(|_| chat).and_then(|call| {
        let n = state
            .tokenizer
            .encode_text(&call.model_text(), false)
            .ok()?
            .len()
            .max(1);
        (n <= max_tokens).then_some((call, n))
    });
    let generated = tool_call.as_ref().map_or(max_tokens, |(_, n)| *n);
    let lora = r.model.as_deref().and_then(|m| state.lora(m));
    let salt = r.cache_salt.clone();
    let block_size = engine.block_size();
    let generation = match (&transfer, &state.kv) {
        (Some(t), Some(kv)) if t.produces() => {
            kv.started(t);
            engine.submit_with(ids, generated, lora, salt)
        }
        (Some(t), Some(kv)) => {
            let local = engine.cached_tokens(&ids, lora.as_deref(), salt.as_deref()) / block_size;
            match kv.pull(t, n_prompt / block_size, local).await {
                Some(_) => engine.submit_remote(ids, generated, lora, salt),
                None => engine.submit_with(ids, generated, lora, salt),
            }
        }
        _ => engine.submit_with(ids, generated, lora, salt),
    };
    let id = request_id(chat);
    // What a producer's answer ends with: its transfer kept for the pull (or its room marked done).
    let produced = transfer
        .filter(Transfer::produces)
        .map(|t| (t, n_prompt / block_size));
    let created = unix_now();
    tracing::debug!(request = %id, engine_id = generation.id, n_prompt, max_tokens, "queued");
    if r.stream {
        return Ok(stream_response(
            state.clone(),
            generation.tokens,
            id,
            created,
            chat,
            tool_call,
            Choices {
                n: r.n,
                logprobs: r.logprobs,
                include_usage: r.include_usage,
            },
            produced,
        ));
    }
    let mut tokens = generation.tokens;
    let mut out = Vec::with_capacity(max_tokens);
    let mut cached = 0;
    while let Some(t) = tokens.recv().await {
        cached = t.cached_tokens;
        out.push(t.token);
        if t.finish.is_some() {
            break;
        }
    }
    let usage = openai::usage(
        n_prompt,
        out.len() * r.n,
        cached,
        state.prompt_tokens_details,
    );
    let text = text_of(state, &out);
    let mut body = if let Some((call, _)) = &tool_call {
        openai::chat_tool_call_body(&id, created, &state.model, call, usage)
    } else if chat {
        openai::chat_body(&id, created, &state.model, &text, usage)
    } else {
        openai::completion_body(&id, created, &state.model, &text, usage)
    };
    let logprobs = r.logprobs.map(|top| {
        if chat {
            surface::chat_logprobs(state, &out, top)
        } else {
            surface::completion_logprobs(state, &out, top, 0)
        }
    });
    surface::expand_choices(&mut body, r.n, logprobs);
    if let (Some((t, blocks)), Some(kv)) = (&produced, &state.kv)
        && let Some(params) = kv.produced(t, &id, *blocks)
    {
        body["kv_transfer_params"] = params;
    }
    Ok(json_response(StatusCode::OK, &body))
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

#[allow(clippy::too_many_arguments)]
fn stream_response(
    state: Arc<AppState>,
    mut tokens: mpsc::UnboundedReceiver<TokenOut>,
    id: String,
    created: u64,
    chat: bool,
    tool_call: Option<(PlannedCall, usize)>,
    choices: Choices,
    produced: Option<(Transfer, usize)>,
) -> Response<Body> {
    let mut call_stream = tool_call.map(|(call, tokens)| CallStream::new(call, tokens));
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(64);
    tokio::spawn(async move {
        let model = state.model.clone();
        let send = |b: Bytes| {
            let tx = tx.clone();
            async move { tx.send(Ok(Frame::data(b))).await.is_ok() }
        };
        let (mut n, mut prompt, mut cached) = (0usize, 0usize, 0usize);
        let mut text_offset = 0;
        // Dropping `tokens` (on return) tells the engine the client is gone.
        while let Some(t) = tokens.recv().await {
            // As vLLM does, the role chunk goes out with the first token (the headers went before the
            // prefill).
            if chat && n == 0 {
                let first = openai::chat_chunk(
                    &id,
                    created,
                    &model,
                    json!({"role": "assistant", "content": ""}),
                    None,
                );
                for index in 0..choices.n {
                    if !send(sse(&surface::choice_chunk(&first, index, None))).await {
                        return;
                    }
                }
            }
            n += 1;
            prompt = t.prompt_tokens;
            cached = t.cached_tokens;
            let text = text_of(&state, &[t.token]);
            let finish = t.finish.map(|f| f.as_str());
            let chunk = if let Some(call) = &mut call_stream {
                let last = finish.is_some();
                let Some(delta) = call.delta(t.index, last) else {
                    continue;
                };
                let finish = last.then_some("tool_calls");
                openai::chat_chunk(&id, created, &model, delta, finish)
            } else if chat {
                openai::chat_chunk(&id, created, &model, json!({"content": text}), finish)
            } else {
                openai::completion_chunk(&id, created, &model, &text, finish)
            };
            let logprobs = match choices.logprobs {
                Some(top) if call_stream.is_none() && chat => {
                    Some(surface::chat_logprobs(&state, &[t.token], top))
                }
                Some(top) if !chat => {
                    let offset = text_offset;
                    Some(surface::completion_logprobs(
                        &state,
                        &[t.token],
                        top,
                        offset,
                    ))
                }
                _ => None,
            };
            text_offset += text.len();
            for index in 0..choices.n {
                let chunk = surface::choice_chunk(&chunk, index, logprobs.as_ref());
                if !send(sse(&chunk)).await {
                    return;
                }
            }
            if finish.is_some() {
                break;
            }
        }
        // A streamed prefill (SGLang's bootstrap protocol sends the client's `stream`) hands its
        // cache over when it ends; vLLM's protocol carries no params in a stream.
        if let (Some((t, blocks)), Some(kv)) = (&produced, &state.kv) {
            kv.produced(t, &id, *blocks);
        }
        if choices.include_usage {
            let usage = openai::usage(prompt, n * choices.n, cached, state.prompt_tokens_details);
            if !send(sse(&openai::usage_chunk(&id, created, &model, chat, usage))).await {
                return;
            }
        }
        send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    });
    let mut r = Response::new(BodyExt::boxed(StreamBody::new(ReceiverStream::new(rx))));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    r
}

/// How many choices a stream carries, the logprobs they report (alternatives per token), and
/// whether it ends with the usage chunk.
struct Choices {
    n: usize,
    logprobs: Option<usize>,
    include_usage: bool,
}

/// A tool call streamed over the tokens that write it: the first token opens the call (id and
/// name), the arguments' pieces spread evenly over the rest, the last token flushes what remains.
struct CallStream {
    call: PlannedCall,
    pieces: Vec<String>,
    sent: usize,
    /// Tokens the call takes (the engine was asked for exactly these).
    tokens: usize,
}

impl CallStream {
    fn new(call: PlannedCall, tokens: usize) -> Self {
        CallStream {
            pieces: call.argument_pieces(),
            call,
            sent: 0,
            tokens,
        }
    }

    /// The delta for token `index`, `None` when this token adds nothing to send.
    fn delta(&mut self, index: usize, last: bool) -> Option<Value> {
        let upto = if last {
            self.pieces.len()
        } else {
            (self.pieces.len() * index / self.tokens.saturating_sub(1).max(1))
                .min(self.pieces.len())
        };
        let piece: String = self.pieces[self.sent.min(upto)..upto].concat();
        self.sent = self.sent.max(upto);
        if index == 0 {
            let mut delta = self.call.opening_delta();
            if !piece.is_empty() {
                delta["tool_calls"][0]["function"]["arguments"] = json!(piece);
            }
            return Some(delta);
        }
        match (piece.is_empty(), last) {
            (false, _) => Some(PlannedCall::arguments_delta(&piece)),
            (true, true) => Some(json!({})),
            (true, false) => None,
        }
    }
}

fn tokenize(state: &AppState, body: &Value) -> Result<Response<Body>, ApiError> {
    let model = body.get("model").and_then(Value::as_str).map(str::to_owned);
    if let Some(m) = &model
        && !state.serves(m)
    {
        return Err(ApiError::ModelNotFound(m.clone()));
    }
    let ids = if let Some(messages) = body.get("messages") {
        let add_gen = body
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let add_special = body
            .get("add_special_tokens")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let text = state
            .tokenizer
            .render_chat_with(messages, add_gen, body.get("chat_template_kwargs"))
            .map_err(tokenize_error)?;
        state
            .tokenizer
            .encode_text(&text, add_special)
            .map_err(tokenize_error)?
    } else if let Some(prompt) = body.get("prompt").and_then(Value::as_str) {
        let add_special = body
            .get("add_special_tokens")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        state
            .tokenizer
            .encode_text(prompt, add_special)
            .map_err(tokenize_error)?
    } else {
        return Err(ApiError::bad_param(
            "prompt",
            "either `prompt` (a string) or `messages` is required",
        ));
    };
    let token_strs = body
        .get("return_token_strs")
        .and_then(Value::as_bool)
        .unwrap_or(false)
        .then(|| {
            ids.iter()
                .map(|&i| state.tokenizer.id_to_token(i).unwrap_or_default())
                .collect::<Vec<_>>()
        });
    Ok(json_response(
        StatusCode::OK,
        &json!({"count": ids.len(), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": token_strs}),
    ))
}

fn detokenize(state: &AppState, body: &Value) -> Result<Response<Body>, ApiError> {
    let ids: Vec<u32> = body
        .get("tokens")
        .and_then(Value::as_array)
        .and_then(|a| {
            a.iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect()
        })
        .ok_or_else(|| ApiError::bad_param("tokens", "tokens must be a list of token ids"))?;
    let text = state.tokenizer.decode(&ids).map_err(tokenize_error)?;
    Ok(json_response(StatusCode::OK, &json!({"prompt": text})))
}

/// `render` routes, as vLLM 0.32 answers them (`vllm/entrypoints/serve/disagg`): the request turned into
/// the `GenerateRequest` of the token-in/token-out API (`/inference/v1/generate`) without running it.
/// `/v1/chat/completions/render` returns one object; `/v1/completions/render` a list, one per prompt.
fn render(state: &AppState, r: &GenRequest, chat: bool) -> Result<Response<Body>, ApiError> {
    check_model(state, r)?;
    let ids = prompt_ids(state, &r.prompt)?;
    let one = openai::generate_request(
        &request_id(chat),
        &state.model,
        &ids,
        r.max_tokens,
        r.stream,
    );
    let body = if chat { one } else { Value::Array(vec![one]) };
    Ok(json_response(StatusCode::OK, &body))
}
