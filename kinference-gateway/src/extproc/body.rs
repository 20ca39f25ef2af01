//! The inference request inside an ext_proc body: which API it speaks (from `:path`, else from the
//! JSON's shape), or which pass-through endpoint it calls (from `:path`), and what the router needs
//! from it (model, prompt).
//!
//! Parsing and validation are the HTTP pipeline's own parse stage, so a body the gateway would refuse
//! with 400 is refused here with the same message, and a body it accepts is
//! routed on exactly the same prompt (Anthropic requests are translated to OpenAI messages first).

use serde_json::Value;

use bytes::Bytes;

use crate::api::openai;
use crate::api::openai::passthrough::Route;
use crate::errors::{GatewayError, Protocol};
use crate::pipeline::Endpoint;
use crate::pipeline::exchange::{self, OpenAiRequest};
use crate::routing::Prompt;

/// The pass-through endpoint a request path names (query string ignored), routed the way the HTTP
/// gateway routes it ([`crate::pipeline::passthrough`]); `None` for other paths.
pub fn passthrough_of(path: &str) -> Option<Route> {
    let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
    Route::of_path(path)
}

/// Which inference API a request uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// OpenAI `POST /v1/chat/completions`.
    Chat,
    /// OpenAI `POST /v1/completions`.
    Completions,
    /// Anthropic `POST /v1/messages`.
    Messages,
}

impl Api {
    /// The API named by a request path (query string ignored); `None` for other paths.
    pub fn from_path(path: &str) -> Option<Self> {
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        match path {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/completions" => Some(Api::Completions),
            "/v1/messages" => Some(Api::Messages),
            _ => None,
        }
    }

    /// The gateway endpoint of the same API.
    pub fn endpoint(self) -> Endpoint {
        match self {
            Api::Chat => Endpoint::ChatCompletions,
            Api::Completions => Endpoint::Completions,
            Api::Messages => Endpoint::Messages,
        }
    }

    /// The protocol errors are reported in.
    pub fn protocol(self) -> Protocol {
        match self {
            Api::Chat | Api::Completions => Protocol::OpenAi,
            Api::Messages => Protocol::Anthropic,
        }
    }
}

/// What the router needs from a request, owned (the body buffer is gone by the time it routes).
#[derive(Clone, Debug, PartialEq)]
pub struct Parsed {
    /// The API the request uses.
    pub api: Api,
    /// Requested model.
    pub model: String,
    /// The prompt in the router's terms.
    pub prompt: OwnedPrompt,
}

/// An owned [`Prompt`].
#[derive(Clone, Debug, PartialEq)]
pub enum OwnedPrompt {
    /// Completion prompt text.
    Text(String),
    /// Chat `messages` (OpenAI shape).
    Chat(Value),
}

impl OwnedPrompt {
    /// The router's view.
    pub fn as_prompt(&self) -> Prompt<'_> {
        match self {
            OwnedPrompt::Text(t) => Prompt::Text(t),
            OwnedPrompt::Chat(m) => Prompt::Chat(m),
        }
    }
}

/// The API of a request: `api` from `:path`; when the path is not an inference path (an HTTPRoute
/// may rewrite it), the body's shape decides: `messages` is OpenAI chat, `prompt` a completion
/// (Anthropic is recognised by its path only).
pub fn detect(api: Option<Api>, body: &[u8]) -> Result<Api, GatewayError> {
    if let Some(api) = api {
        return Ok(api);
    }
    let value: Value = openai::parse_body(body)?;
    if value.get("messages").is_some() {
        Ok(Api::Chat)
    } else if value.get("prompt").is_some() {
        Ok(Api::Completions)
    } else {
        Err(GatewayError::invalid(
            "messages",
            "the body has neither `messages` nor `prompt`",
        ))
    }
}

/// Parses a request body with the HTTP pipeline's own parse stage ([`exchange::parse`]).
pub fn parse(api: Option<Api>, body: &[u8]) -> Result<Parsed, GatewayError> {
    let api = detect(api, body)?;
    let request = exchange::parse(api.endpoint(), Bytes::copy_from_slice(body))?;
    let prompt = match &request.openai {
        OpenAiRequest::Chat(r) => OwnedPrompt::Chat(r.messages.clone()),
        OpenAiRequest::Completion(r) => OwnedPrompt::Text(r.prompt_text().to_string()),
    };
    Ok(Parsed {
        api,
        model: request.model().to_string(),
        prompt,
    })
}
