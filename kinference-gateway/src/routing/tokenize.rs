//! Prompt tokenization for routing: the model's own tokenizer when configured, else the worker's
//! `POST /tokenize` (vLLM's endpoint), so the gateway's block keys equal the worker's.
//!
//! The fallback costs a round trip per request; it is counted (`kinference_routing_tokenize_total`
//! by source) and logged once per model so an operator sees it.
//!
//! A request's tokens are kept in its [`PromptTokens`], one entry per served model, so the policy
//! stage's estimates and the router's pick share one tokenization. The prompt's size has one
//! definition: [`PromptTokens::size`], the tokenizer's count once known, else
//! [`Prompt::estimated_tokens`].

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kinference_api::tokenize::{ChatTokens, ModelTokenizer, TokenizeError};
use serde::Deserialize;

use super::Prompt;

/// Prompts with more new text than this many bytes (not in the tokenizer's segment cache) are
/// tokenized on the blocking pool, not on the reactor: a 16 KiB BPE takes about 0.5 ms, a cached
/// 7,600-token system prompt a lookup, and a thread handoff costs more than that lookup on a busy node.
const BLOCKING_THRESHOLD: usize = 16 * 1024;
/// Prompts longer than this go to the blocking pool without trying the reactor first: their render
/// alone (before the cache is asked) is long.
const INLINE_MAX: usize = 256 * 1024;
/// How long the fallback waits for a worker's `/tokenize`.
const REMOTE_TIMEOUT: Duration = Duration::from_secs(2);
/// A worker's `/tokenize` answer is read up to this many bytes per byte asked about, plus
/// [`REMOTE_SLACK`]: a token is at least one byte of the prompt (or a few of the template's) and
/// at most 7 bytes of JSON (`151643,`), so an honest answer is well within; a worker (a third
/// party's Remote pool) cannot make the gateway hold more than a multiple of what it sent.
const REMOTE_BYTES_PER_BYTE: usize = 16;
/// See [`REMOTE_BYTES_PER_BYTE`].
const REMOTE_SLACK: usize = 64 << 10;

/// Long encodes run at most this many at once, one per core: encoding is CPU-bound, so more at once
/// finish no sooner, and each holds tens of bytes per token (ids, offsets, the pre-tokenizer's
/// pieces) until it ends. Unbounded, 160 requests of 4 MB each took the gateway from 150 MiB to
/// over 1 GiB; the others wait, their bodies held within the body budget.
static ENCODERS: std::sync::LazyLock<tokio::sync::Semaphore> = std::sync::LazyLock::new(|| {
    tokio::sync::Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get()))
});

/// Runs `encode` (a long tokenization or chat rendering) off the reactor, at most one per core at
/// once ([`ENCODERS`]).
pub async fn off_reactor<T: Send + 'static>(
    encode: impl FnOnce() -> T + Send + 'static,
) -> Result<T, tokio::task::JoinError> {
    // The semaphore is never closed.
    let _permit = ENCODERS.acquire().await.expect("the encoders' semaphore");
    tokio::task::spawn_blocking(encode).await
}

/// Why a prompt has no tokens.
#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    /// The local tokenizer failed (bad messages, template error).
    #[error("tokenizer: {0}")]
    Local(#[from] TokenizeError),
    /// The worker's `/tokenize` failed.
    #[error("worker /tokenize at {worker}: {message}")]
    Remote {
        /// The worker asked.
        worker: String,
        /// What went wrong.
        message: String,
    },
    /// No tokenizer and no worker to ask.
    #[error("no tokenizer and no worker to ask")]
    NoSource,
    /// The blocking tokenization task failed.
    #[error("tokenizer task: {0}")]
    Task(String),
}

/// Where a prompt's tokens came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The gateway's own tokenizer.
    Local,
    /// A worker's `/tokenize`.
    Remote,
    /// The request's own token ids ([`Prompt::Ids`]).
    Given,
}

/// One request's prompt tokens, per served model (each model has its own tokenizer): every model
/// is tokenized at most once per request, whichever stage asks first (the plan's estimates, the
/// router's pick). A failed tokenization is remembered too, so it is not retried within the request.
#[derive(Debug, Default)]
pub struct PromptTokens {
    by_model: Mutex<Vec<(String, Tokenized)>>,
}

/// One served model's tokens of the prompt; `None` when tokenizing failed.
pub type Tokenized = Option<Arc<[u32]>>;

impl PromptTokens {
    /// What is known for `model`: `None` not tokenized yet, `Some(None)` tokenization failed.
    pub fn get(&self, model: &str) -> Option<Tokenized> {
        self.by_model
            .lock()
            .iter()
            .find(|(m, _)| m == model)
            .map(|(_, tokens)| tokens.clone())
    }

    /// Records `model`'s tokens (`None`: it failed); the first record for a model stays.
    pub fn set(&self, model: &str, tokens: Tokenized) {
        let mut by_model = self.by_model.lock();
        if !by_model.iter().any(|(m, _)| m == model) {
            by_model.push((model.to_string(), tokens));
        }
    }

    /// The prompt's size in tokens: the first tokenizer's count once the prompt has been
    /// tokenized, else the estimate from its text ([`Prompt::estimated_tokens`]).
    pub fn size(&self, prompt: Prompt<'_>) -> u64 {
        self.by_model
            .lock()
            .iter()
            .find_map(|(_, tokens)| tokens.as_ref().map(|t| t.len() as u64))
            .unwrap_or_else(|| prompt.estimated_tokens())
    }
}

impl Prompt<'_> {
    /// Bytes of the prompt's text: the completion prompt, or every string in the chat messages
    /// (contents, content blocks, tool calls, roles).
    pub fn text_bytes(&self) -> usize {
        match self {
            Prompt::Text(t) => t.len(),
            Prompt::Chat(messages) => text_bytes(messages),
            // About four bytes a token, as `estimated_tokens` assumes.
            Prompt::Ids(ids) => ids.len() * 4,
        }
    }

    /// The prompt's size in tokens before any tokenizer has run: about four bytes per token.
    pub fn estimated_tokens(&self) -> u64 {
        (self.text_bytes() as u64).div_ceil(4)
    }
}

/// Owned copy of a prompt for the blocking pool.
enum OwnedPrompt {
    Text(String),
    Chat(serde_json::Value),
    /// A chat prompt already rendered with its template.
    Rendered(String),
}

/// Per-model tokenizers plus the HTTP fallback.
pub struct Tokenizers {
    local: HashMap<String, Arc<ModelTokenizer>>,
    client: Client<HttpConnector, Full<Bytes>>,
    warned: HashMap<String, AtomicBool>,
}

impl std::fmt::Debug for Tokenizers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizers")
            .field("local", &self.local.keys().collect::<Vec<_>>())
            .finish()
    }
}

#[derive(Deserialize)]
struct TokenizeResponse {
    tokens: Vec<u32>,
}

impl Tokenizers {
    /// Loads the configured tokenizers. `models` pairs a model name with its tokenizer directory.
    pub fn load<'a>(
        models: impl IntoIterator<Item = (&'a str, Option<&'a Path>)>,
    ) -> Result<Self, (String, TokenizeError)> {
        let mut local = HashMap::new();
        let mut warned = HashMap::new();
        for (name, dir) in models {
            warned.insert(name.to_string(), AtomicBool::new(false));
            if let Some(dir) = dir {
                let tok = ModelTokenizer::from_dir(dir).map_err(|e| (name.to_string(), e))?;
                local.insert(name.to_string(), Arc::new(tok));
            }
        }
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(REMOTE_TIMEOUT));
        let client = Client::builder(TokioExecutor::new()).build(http);
        Ok(Self {
            local,
            client,
            warned,
        })
    }

    /// Adds (or replaces) a model's tokenizer; for tests and benches.
    pub fn insert(&mut self, model: &str, tokenizer: Arc<ModelTokenizer>) {
        self.local.insert(model.to_string(), tokenizer);
    }

    /// Whether the gateway tokenizes `model` itself.
    pub fn has_local(&self, model: &str) -> bool {
        self.local.contains_key(model)
    }

    /// The gateway's own tokenizer for `model`, if one is configured.
    pub fn local(&self, model: &str) -> Option<&Arc<ModelTokenizer>> {
        self.local.get(model)
    }

    /// Tokenizes `prompt` for `model`; without a local tokenizer asks `fallback_worker`.
    pub async fn tokens(
        &self,
        model: &str,
        prompt: Prompt<'_>,
        fallback_worker: Option<&str>,
    ) -> Result<(Vec<u32>, Source), TokensError> {
        if let Prompt::Ids(ids) = prompt {
            return Ok((given_ids(ids), Source::Given));
        }
        if let Some(tok) = self.local.get(model) {
            let len = prompt.text_bytes();
            let owned = match prompt {
                Prompt::Text(t) if len > INLINE_MAX => OwnedPrompt::Text(t.to_string()),
                Prompt::Chat(v) if len > INLINE_MAX => OwnedPrompt::Chat(v.clone()),
                Prompt::Text(t) => match tok.encode_text_within(t, true, BLOCKING_THRESHOLD)? {
                    Some(ids) => return Ok((ids, Source::Local)),
                    None => OwnedPrompt::Text(t.to_string()),
                },
                Prompt::Chat(v) => match tok.encode_chat_within(v, BLOCKING_THRESHOLD)? {
                    ChatTokens::Ids(ids) => return Ok((ids, Source::Local)),
                    ChatTokens::Rendered(text) => OwnedPrompt::Rendered(text),
                },
                Prompt::Ids(ids) => return Ok((given_ids(ids), Source::Given)),
            };
            let tok = Arc::clone(tok);
            let ids = off_reactor(move || match &owned {
                OwnedPrompt::Text(t) => encode(&tok, Prompt::Text(t)),
                OwnedPrompt::Chat(v) => encode(&tok, Prompt::Chat(v)),
                OwnedPrompt::Rendered(t) => tok.encode_text(t, false),
            })
            .await
            .map_err(|e| TokensError::Task(e.to_string()))??;
            return Ok((ids, Source::Local));
        }
        let worker = fallback_worker.ok_or(TokensError::NoSource)?;
        if let Some(flag) = self.warned.get(model)
            && !flag.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                model,
                worker,
                "no tokenizer configured: routing tokenizes through the worker's /tokenize"
            );
        }
        let ids = self.remote(model, prompt, worker).await?;
        Ok((ids, Source::Remote))
    }

    async fn remote(
        &self,
        model: &str,
        prompt: Prompt<'_>,
        worker: &str,
    ) -> Result<Vec<u32>, TokensError> {
        let fail = |message: String| TokensError::Remote {
            worker: worker.to_string(),
            message,
        };
        let body = match prompt {
            Prompt::Text(t) => serde_json::json!({ "model": model, "prompt": t }),
            Prompt::Chat(m) => serde_json::json!({ "model": model, "messages": m }),
            Prompt::Ids(ids) => return Ok(given_ids(ids)),
        };
        let body = serde_json::to_vec(&body).map_err(|e| fail(e.to_string()))?;
        let most = body
            .len()
            .saturating_mul(REMOTE_BYTES_PER_BYTE)
            .saturating_add(REMOTE_SLACK);
        let uri = format!("{}/tokenize", worker.trim_end_matches('/'));
        let req = http::Request::post(uri)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| fail(e.to_string()))?;
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| fail(e.to_string()))?;
            let status = resp.status();
            let bytes = http_body_util::Limited::new(resp.into_body(), most)
                .collect()
                .await
                .map_err(|e| fail(format!("reading the answer (at most {most} bytes): {e}")))?
                .to_bytes();
            if !status.is_success() {
                return Err(fail(format!(
                    "HTTP {status}: {}",
                    String::from_utf8_lossy(&bytes)
                )));
            }
            let parsed: TokenizeResponse =
                serde_json::from_slice(&bytes).map_err(|e| fail(e.to_string()))?;
            Ok(parsed.tokens)
        };
        tokio::time::timeout(REMOTE_TIMEOUT, fut)
            .await
            .map_err(|_| fail("timed out".into()))?
    }
}

fn encode(tok: &ModelTokenizer, prompt: Prompt<'_>) -> Result<Vec<u32>, TokenizeError> {
    match prompt {
        // vLLM adds special tokens to completion prompts.
        Prompt::Text(t) => tok.encode_text(t, true),
        Prompt::Chat(m) => tok.encode_chat(m),
        Prompt::Ids(ids) => Ok(given_ids(ids)),
    }
}

/// A token-id prompt's ids as the worker reads them (vLLM adds no special token to them), up to the
/// first value that is not one: a malformed prompt is the worker's to refuse, and routing keys only
/// the part before it.
fn given_ids(ids: &[serde_json::Value]) -> Vec<u32> {
    ids.iter()
        .map_while(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect()
}

fn text_bytes(v: &serde_json::Value) -> usize {
    match v {
        serde_json::Value::String(s) => s.len(),
        serde_json::Value::Array(a) => a.iter().map(text_bytes).sum(),
        serde_json::Value::Object(o) => o.values().map(text_bytes).sum(),
        _ => 8,
    }
}

#[cfg(test)]
mod tests;
