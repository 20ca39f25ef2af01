//! Tokenization as the served model does it (HF `tokenizer.json` + the chat template from
//! `tokenizer_config.json`). Used by the gateway (block keys of a prompt) and by the vLLM simulator.
//!
//! vLLM tokenizes a completion prompt with the model's special tokens (`add_special_tokens=true`), and a
//! chat request by rendering the chat template (Jinja, `trim_blocks` + `lstrip_blocks` as in
//! `transformers`) and then encoding the rendered text *without* adding special tokens again, because
//! the template already wrote them. Both paths are reproduced here so the ids equal vLLM's `/tokenize`.
//!
//! The template is compiled once in [`ModelTokenizer::from_dir`]; each request only renders and encodes,
//! and a message list rendered recently is not rendered again (`rendered`).

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use minijinja::{Environment, ErrorKind, context};
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{Map, Value};

mod fast;
mod rendered;
#[cfg(test)]
mod tests;
mod tojson;

/// The name the compiled chat template is stored under inside the Jinja environment.
const CHAT_TEMPLATE: &str = "chat_template";

/// Why a tokenizer could not be loaded or a prompt could not be tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A file of the tokenizer directory could not be read.
    #[error("cannot read {path}: {source} (run `cargo xtask setup` to fetch the tokenizer)")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer.json` could not be parsed by the `tokenizers` crate.
    #[error("cannot load tokenizer {path}: {message}")]
    Load { path: PathBuf, message: String },
    /// `tokenizer_config.json` is not valid JSON.
    #[error("invalid {path}: {source}")]
    Config {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The chat template does not compile.
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(#[source] minijinja::Error),
    /// The model has no chat template, so chat requests cannot be tokenized.
    #[error("the model has no chat template")]
    NoChatTemplate,
    /// The `messages` array is not an OpenAI chat messages array.
    #[error("invalid messages: {0}")]
    InvalidMessages(String),
    /// The chat template failed while rendering (e.g. it called `raise_exception`).
    #[error("chat template error: {0}")]
    Render(#[source] minijinja::Error),
    /// The tokenizer failed to encode or decode.
    #[error("tokenizer error: {0}")]
    Encode(String),
}

/// A model's tokenizer and chat template, loaded once and shared (it is `Send + Sync`).
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    env: Environment<'static>,
    has_chat_template: bool,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Hand-written pre-tokenization for Qwen2-style pipelines (see `fast`); `None` for others.
    fast: Option<fast::FastPath>,
    rendered: rendered::RenderCache,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("vocab_size", &self.tokenizer.get_vocab_size(true))
            .field("has_chat_template", &self.has_chat_template)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl ModelTokenizer {
    /// Loads `tokenizer.json` and (if present) `tokenizer_config.json` from `dir`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, TokenizeError> {
        let dir = dir.as_ref();
        let tok_path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&tok_path).map_err(|source| TokenizeError::Io {
            path: tok_path.clone(),
            source,
        })?;
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizeError::Load {
                path: tok_path.clone(),
                message: e.to_string(),
            })?;

        let cfg_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read(&cfg_path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|source| TokenizeError::Config {
                path: cfg_path.clone(),
                source,
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Value::Null,
            Err(source) => {
                return Err(TokenizeError::Io {
                    path: cfg_path,
                    source,
                });
            }
        };
        let template = chat_template_of(&config);
        // The raw pipeline description decides whether the fast path applies; unparsable here means no.
        let fast = serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|json| fast::FastPath::detect(&json, &tokenizer));
        let mut tok = Self::new(
            tokenizer,
            template,
            special_token(&config, "bos_token"),
            special_token(&config, "eos_token"),
        )?;
        tok.fast = fast;
        Ok(tok)
    }

    /// Builds a tokenizer from parts (a chat template in Jinja source, if the model has one).
    pub fn new(
        tokenizer: tokenizers::Tokenizer,
        chat_template: Option<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        // transformers renders chat templates with these two options; without them the template's
        // newlines differ and so do the token ids.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // Python string and dict methods (`.strip()`, `.startswith()`, `.items()` ...) used by templates.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson::tojson);
        let has_chat_template = chat_template.is_some();
        if let Some(src) = chat_template {
            env.add_template_owned(CHAT_TEMPLATE, src)
                .map_err(TokenizeError::TemplateSyntax)?;
        }
        Ok(Self {
            tokenizer,
            env,
            has_chat_template,
            bos_token,
            eos_token,
            fast: None,
            rendered: rendered::RenderCache::default(),
        })
    }

    /// The underlying HF tokenizer (vocabulary, decoding).
    pub fn tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.tokenizer
    }

    /// Whether chat requests can be rendered.
    pub fn has_chat_template(&self) -> bool {
        self.has_chat_template
    }

    /// The `eos_token` of `tokenizer_config.json`, if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The `bos_token` of `tokenizer_config.json`, if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// Encodes plain text, as vLLM does for `/v1/completions` (`add_special_tokens=true` there).
    pub fn encode_text(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        // The fast path's pipeline has a ByteLevel post-processor, which adds no special tokens.
        if let Some(f) = &self.fast {
            return f
                .encode(&self.tokenizer, text)
                .map_err(|e| TokenizeError::Encode(e.to_string()));
        }
        // `encode_fast` skips the offset bookkeeping we never use.
        let enc = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Renders an OpenAI `messages` array with the chat template, as vLLM does before tokenizing.
    pub fn render_chat(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        self.render_chat_with(messages, add_generation_prompt, None)
    }

    /// [`Self::render_chat`] with extra template variables (a request's `chat_template_kwargs`,
    /// e.g. `{"enable_thinking": false}`) and `tools`, both as JSON objects/arrays.
    pub fn render_chat_with(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
        kwargs: Option<&Value>,
    ) -> Result<String, TokenizeError> {
        if !self.has_chat_template {
            return Err(TokenizeError::NoChatTemplate);
        }
        let input = rendered::RenderInput {
            messages,
            add_generation_prompt,
            kwargs,
        };
        let hash = match self.rendered.get(&input) {
            Ok(text) => return Ok(text),
            Err(hash) => hash,
        };
        let messages = normalize_messages(messages)?;
        let tmpl = self
            .env
            .get_template(CHAT_TEMPLATE)
            .map_err(TokenizeError::Render)?;
        let base = context! {
            messages => minijinja::Value::from_serialize(&messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_deref().unwrap_or(""),
            eos_token => self.eos_token.as_deref().unwrap_or(""),
        };
        let ctx = match kwargs {
            Some(Value::Object(map)) if !map.is_empty() => {
                // Later contexts are looked up only for names the first one lacks, so the request
                // cannot override `messages` (vLLM rejects that too).
                context! { ..base, ..tojson::template_kwargs(map) }
            }
            _ => base,
        };
        let text = tmpl.render(ctx).map_err(TokenizeError::Render)?;
        self.rendered.put(hash, &input, &text);
        Ok(text)
    }

    /// Renders a chat (with the generation prompt) and encodes it without adding special tokens again,
    /// exactly as vLLM tokenizes `/v1/chat/completions`.
    pub fn encode_chat(&self, messages: &Value) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(messages, true)?;
        self.encode_text(&text, false)
    }

    /// [`Self::encode_chat`] when at most `max_new_bytes` of the rendered prompt need a full encode:
    /// text seen recently (a shared system prompt, a conversation's earlier turns) comes from the
    /// segment cache almost for free. Otherwise the rendered prompt, for a worker thread to finish
    /// with [`Self::encode_text`] (no special tokens added), without rendering it again.
    pub fn encode_chat_within(
        &self,
        messages: &Value,
        max_new_bytes: usize,
    ) -> Result<ChatTokens, TokenizeError> {
        let text = self.render_chat(messages, true)?;
        Ok(
            match self.encode_text_within(&text, false, max_new_bytes)? {
                Some(ids) => ChatTokens::Ids(ids),
                None => ChatTokens::Rendered(text),
            },
        )
    }

    /// [`Self::encode_text`] under the same condition as [`Self::encode_chat_within`].
    pub fn encode_text_within(
        &self,
        text: &str,
        add_special_tokens: bool,
        max_new_bytes: usize,
    ) -> Result<Option<Vec<u32>>, TokenizeError> {
        match &self.fast {
            Some(f) => f
                .encode_within(&self.tokenizer, text, max_new_bytes)
                .map_err(|e| TokenizeError::Encode(e.to_string())),
            // Without the fast path nothing is cached: all of the text is new.
            None if text.len() > max_new_bytes => Ok(None),
            None => self.encode_text(text, add_special_tokens).map(Some),
        }
    }

    /// Encodes with the full `tokenizers` pipeline, bypassing the fast path (reference for tests).
    pub fn encode_text_reference(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let enc = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes token ids to text (special tokens skipped, as vLLM's default `skip_special_tokens`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// The vocabulary string of one token id (`token_strs` of vLLM's `/tokenize`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }
}

/// The `chat_template` of a `tokenizer_config.json`: a string, or (older HF format) a list of named
/// templates of which vLLM uses the one called `default`.
fn chat_template_of(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

/// A special token of `tokenizer_config.json`, written either as a string or as an `AddedToken` object.
fn special_token(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// What [`ModelTokenizer::encode_chat_within`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum ChatTokens {
    /// The prompt's tokens.
    Ids(Vec<u32>),
    /// Too much new text: the rendered prompt, not encoded.
    Rendered(String),
}

/// One message as the chat template sees it: its fields as sent, with `content` flattened to text.
/// Borrowed, so a long system prompt is copied once (into the template's values), not per step.
struct TemplateMessage<'a> {
    fields: &'a Map<String, Value>,
    content: Cow<'a, str>,
}

impl Serialize for TemplateMessage<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let others = self.fields.iter().filter(|(k, _)| *k != "content");
        let mut map = serializer.serialize_map(Some(others.clone().count() + 1))?;
        let assistant = self.fields.get("role").and_then(Value::as_str) == Some("assistant");
        for (k, v) in others {
            if assistant && k == "tool_calls" {
                map.serialize_entry(k, &tojson::ToolCalls(v))?;
            } else {
                map.serialize_entry(k, v)?;
            }
        }
        map.serialize_entry("content", &self.content)?;
        map.end()
    }
}

/// Checks the OpenAI messages array and flattens content parts to text, as vLLM does for text-only
/// models (text parts joined with `"\n"`; a null content becomes `""`).
fn normalize_messages(messages: &Value) -> Result<Vec<TemplateMessage<'_>>, TokenizeError> {
    let list = messages
        .as_array()
        .ok_or_else(|| TokenizeError::InvalidMessages("`messages` must be an array".into()))?;
    if list.is_empty() {
        return Err(TokenizeError::InvalidMessages(
            "`messages` must not be empty".into(),
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let fields = m.as_object().ok_or_else(|| {
                TokenizeError::InvalidMessages(format!("messages[{i}] must be an object"))
            })?;
            if !fields.get("role").is_some_and(Value::is_string) {
                return Err(TokenizeError::InvalidMessages(format!(
                    "messages[{i}].role must be a string"
                )));
            }
            let content = match fields.get("content") {
                None | Some(Value::Null) => Cow::Borrowed(""),
                Some(Value::String(s)) => Cow::Borrowed(s.as_str()),
                Some(Value::Array(parts)) => Cow::Owned(flatten_parts(i, parts)?),
                Some(_) => {
                    return Err(TokenizeError::InvalidMessages(format!(
                        "messages[{i}].content must be a string or a list of parts"
                    )));
                }
            };
            Ok(TemplateMessage { fields, content })
        })
        .collect()
}

/// Joins the text parts of one message's content (`{"type": "text", "text": ...}`).
fn flatten_parts(i: usize, parts: &[Value]) -> Result<String, TokenizeError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("text");
        match (kind, part.get("text").and_then(Value::as_str)) {
            ("text" | "input_text" | "output_text", Some(t)) => texts.push(t),
            _ => {
                return Err(TokenizeError::InvalidMessages(format!(
                    "messages[{i}].content[{j}]: only text parts are supported (type {kind:?})"
                )));
            }
        }
    }
    Ok(texts.join("\n"))
}

/// `raise_exception(msg)` as transformers defines it for chat templates.
fn raise_exception(msg: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)` as transformers defines it; only the date formats templates use are needed, and a
/// fixed date keeps renders deterministic (a cache key must not change at midnight).
fn strftime_now(_fmt: String) -> String {
    "26 Jul 2024".to_owned()
}
