//! The request as it flows through the stages: the [`Exchange`] (made once per request from its
//! headers: endpoint, protocol, caller, the prompt's tokens, the explanation so far, its
//! [`Settlement`]) and the parsed
//! [`Request`] (read, parsed, validated and, for Anthropic clients, translated once), shared by both
//! front doors.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request as HttpRequest, Response, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::Endpoint;
use super::settle::Settlement;
use crate::api::anthropic::MessagesRequest;
use crate::api::openai::{self, ChatCompletionRequest, CompletionRequest};
use crate::backend::provider::ProviderRequest;
use crate::body::Body;
use crate::errors::{GatewayError, Protocol};
use crate::metrics::Metrics;
use crate::routing::Prompt;
use crate::routing::tokenize::PromptTokens;
use crate::tenancy::Caller;

#[cfg(test)]
mod tests;

/// One request's state through the stages.
#[derive(Debug)]
pub struct Exchange {
    /// The endpoint called.
    pub endpoint: Endpoint,
    /// The client's protocol (errors are answered in it).
    pub protocol: Protocol,
    /// The caller is an admin ([`crate::access`]): it is shown the worker's address.
    pub admin: bool,
    /// `x-kinference-debug: 1` from an admin: explain the decision in `x-kinference-decision`.
    pub debug: bool,
    /// `x-kinference-tags` (policy classification).
    pub tags: Option<String>,
    /// Who is calling (the authenticate stage).
    pub caller: Option<Caller>,
    /// The prompt's tokens per served model, each tokenized once for the request's stages (admit,
    /// plan, route).
    pub tokens: PromptTokens,
    /// The policy stage's one-line explanation (debug), also sent with refusals.
    pub explain: Option<String>,
    /// The request's books; moved into the relay when the answer is streamed.
    pub settlement: Option<Settlement>,
}

impl Exchange {
    /// An exchange for a request to `endpoint` with `headers`, from an admin or not.
    pub fn new(endpoint: Endpoint, headers: &HeaderMap, admin: bool, metrics: &Metrics) -> Self {
        let protocol = endpoint.protocol();
        Exchange {
            endpoint,
            protocol,
            admin,
            // Anyone else's debug header is ignored: explanations name workers and pools.
            debug: admin
                && headers
                    .get("x-kinference-debug")
                    .is_some_and(|v| v.as_bytes() == b"1"),
            tags: headers
                .get(crate::policy::classify::tags::TAGS_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            caller: None,
            tokens: PromptTokens::default(),
            explain: None,
            settlement: Some(Settlement::new(metrics, protocol)),
        }
    }

    /// The request's books (until the relay takes them).
    pub fn settlement(&mut self) -> Option<&mut Settlement> {
        self.settlement.as_mut()
    }

    /// The error answer in the client's protocol, the request settled with its status.
    pub fn refuse(&mut self, error: GatewayError) -> Response<Body> {
        tracing::debug!(kind = error.kind(), %error, "request failed");
        if let Some(mut settlement) = self.settlement.take() {
            settlement.finish(error.status().as_u16(), None);
        }
        let mut response = error.into_response(self.protocol);
        if let Some(v) = self
            .explain
            .as_deref()
            .and_then(|e| HeaderValue::from_str(e).ok())
        {
            response.headers_mut().insert("x-kinference-decision", v);
        }
        response
    }
}

/// A parsed, validated request in the worker's (OpenAI) terms.
#[derive(Debug)]
pub struct Request {
    /// Chat (also translated Anthropic) or completion request.
    pub openai: OpenAiRequest,
    /// The worker's body (the client's bytes when they could be kept).
    pub body: Bytes,
    /// The client's own body (what the policy stage classifies).
    pub client_body: Bytes,
    /// The client's body as JSON, when the policy stage will classify it (parsed once, the typed
    /// request read from it).
    pub json: Option<serde_json::Value>,
    /// Whether the answer is streamed.
    pub stream: bool,
    /// OpenAI streams: whether the client asked for the usage chunk itself.
    pub client_wants_usage: bool,
}

/// The typed request.
#[derive(Debug)]
pub enum OpenAiRequest {
    /// `/v1/chat/completions` (and translated `/v1/messages`).
    Chat(ChatCompletionRequest),
    /// `/v1/completions`.
    Completion(CompletionRequest),
}

impl Request {
    /// The model asked for.
    pub fn model(&self) -> &str {
        match &self.openai {
            OpenAiRequest::Chat(r) => &r.model,
            OpenAiRequest::Completion(r) => &r.model,
        }
    }

    /// The prompt in the router's terms.
    pub fn prompt(&self) -> Prompt<'_> {
        match &self.openai {
            OpenAiRequest::Chat(r) => Prompt::Chat(&r.messages),
            OpenAiRequest::Completion(r) => Prompt::Text(r.prompt_text()),
        }
    }

    /// The request's other fields (`max_tokens`, ...) and whether it is a completion.
    pub fn fields(&self) -> (&serde_json::Map<String, serde_json::Value>, bool) {
        match &self.openai {
            OpenAiRequest::Chat(r) => (&r.extra, false),
            OpenAiRequest::Completion(r) => (&r.extra, true),
        }
    }

    /// The typed request for providers.
    pub fn provider_request(&self) -> ProviderRequest<'_> {
        match &self.openai {
            OpenAiRequest::Chat(r) => ProviderRequest::Chat(r),
            OpenAiRequest::Completion(r) => ProviderRequest::Completion(r),
        }
    }

    /// This request as sent to a pool serving `model`: `None` when it already names `model`,
    /// else a copy renamed ([`Request::for_model`]).
    pub fn renamed_for(&self, model: &str) -> Result<Option<Request>, GatewayError> {
        if model == self.model() {
            Ok(None)
        } else {
            self.for_model(model).map(Some)
        }
    }

    /// The same request for another served model (a policy chose a pool serving a different one).
    pub fn for_model(&self, model: &str) -> Result<Request, GatewayError> {
        let (openai, body) = match &self.openai {
            OpenAiRequest::Chat(r) => renamed(r, model)?,
            OpenAiRequest::Completion(r) => renamed(r, model)?,
        };
        Ok(Request {
            openai,
            body,
            client_body: self.client_body.clone(),
            json: None,
            stream: self.stream,
            client_wants_usage: self.client_wants_usage,
        })
    }
}

/// Stage "read": the body, bounded by the configured limit (413 beyond it) and by the read
/// deadline (408 after it: a slow client does not hold its slot).
pub async fn read_body(
    req: HttpRequest<Incoming>,
    limit: usize,
    deadline: std::time::Duration,
) -> Result<Bytes, GatewayError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(GatewayError::BodyTooLarge { limit });
    }
    let collect = Limited::new(req.into_body(), limit).collect();
    let Ok(collected) = tokio::time::timeout(deadline, collect).await else {
        return Err(GatewayError::BodyTimeout {
            timeout_ms: deadline.as_millis() as u64,
        });
    };
    match collected {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(GatewayError::BodyTooLarge { limit })
        }
        Err(e) => Err(GatewayError::MalformedJson(format!(
            "reading the request body: {e}"
        ))),
    }
}

/// Stage "parse": JSON into the endpoint's typed request, field checks, then the worker's OpenAI
/// request (Anthropic is translated here); 400 on bad JSON or shape. Streams always ask the worker
/// for the final usage chunk so every request can be accounted. OpenAI bodies that need no change
/// are forwarded byte for byte (no re-serialization on the hot path).
pub fn parse(endpoint: Endpoint, body: Bytes) -> Result<Request, GatewayError> {
    parse_as(endpoint, body, false)
}

/// [`parse`], keeping the body's JSON for the policy stage when `keep_json`: the body is parsed
/// once, the typed request read from that JSON.
pub fn parse_as(endpoint: Endpoint, body: Bytes, keep_json: bool) -> Result<Request, GatewayError> {
    let json: Option<serde_json::Value> = if keep_json {
        Some(openai::parse_body(&body)?)
    } else {
        None
    };
    let mut request = typed(endpoint, body, json.as_ref())?;
    request.json = json;
    Ok(request)
}

/// Reads `T` from the parsed JSON when there is one, else from the bytes.
fn read<T: serde::de::DeserializeOwned>(
    body: &[u8],
    json: Option<&serde_json::Value>,
) -> Result<T, GatewayError> {
    match json {
        Some(v) => T::deserialize(v).map_err(|e| GatewayError::MalformedJson(e.to_string())),
        None => openai::parse_body(body),
    }
}

fn typed(
    endpoint: Endpoint,
    body: Bytes,
    json: Option<&serde_json::Value>,
) -> Result<Request, GatewayError> {
    match endpoint {
        Endpoint::ChatCompletions => openai_request::<ChatCompletionRequest>(body, json),
        Endpoint::Completions => openai_request::<CompletionRequest>(body, json),
        Endpoint::Messages => {
            let r: MessagesRequest = read(&body, json)?;
            let chat = r.to_chat_request()?;
            Ok(Request {
                stream: chat.stream == Some(true),
                body: serialize(&chat)?,
                client_body: body,
                json: None,
                openai: OpenAiRequest::Chat(chat),
                client_wants_usage: false,
            })
        }
    }
}

/// What the two OpenAI request types share, so one path parses, checks and renames both.
trait OpenAiBody: serde::de::DeserializeOwned + serde::Serialize + Clone {
    fn validate(&self) -> Result<(), GatewayError>;
    fn stream(&self) -> bool;
    fn stream_options(&mut self) -> &mut Option<openai::StreamOptions>;
    fn set_model(&mut self, model: &str);
    fn into_request(self) -> OpenAiRequest;
}

macro_rules! openai_body {
    ($type:ty, $variant:ident) => {
        impl OpenAiBody for $type {
            fn validate(&self) -> Result<(), GatewayError> {
                <$type>::validate(self)
            }
            fn stream(&self) -> bool {
                self.stream == Some(true)
            }
            fn stream_options(&mut self) -> &mut Option<openai::StreamOptions> {
                &mut self.stream_options
            }
            fn set_model(&mut self, model: &str) {
                self.model = model.to_string();
            }
            fn into_request(self) -> OpenAiRequest {
                OpenAiRequest::$variant(self)
            }
        }
    };
}

openai_body!(ChatCompletionRequest, Chat);
openai_body!(CompletionRequest, Completion);

/// An OpenAI chat or completion request: read, checked, and its worker body (the client's bytes
/// when they can be kept).
fn openai_request<T: OpenAiBody>(
    body: Bytes,
    json: Option<&serde_json::Value>,
) -> Result<Request, GatewayError> {
    let mut r: T = read(&body, json)?;
    r.validate()?;
    let stream = r.stream();
    let (worker_body, client_wants_usage) =
        match passthrough_body(r.stream_options(), stream, body.clone()) {
            (Some(b), wants) => (b, wants),
            (None, wants) => (serialize(&r)?, wants),
        };
    Ok(Request {
        openai: r.into_request(),
        body: worker_body,
        client_body: body,
        json: None,
        stream,
        client_wants_usage,
    })
}

/// `r` for `model`, and its body.
fn renamed<T: OpenAiBody>(r: &T, model: &str) -> Result<(OpenAiRequest, Bytes), GatewayError> {
    let mut r = r.clone();
    r.set_model(model);
    let body = serialize(&r)?;
    Ok((r.into_request(), body))
}

/// The body for the worker of an OpenAI request when the client's bytes can be used (`None`: the
/// request must be re-serialized), and whether the client asked for the usage chunk. Streams without
/// `stream_options` get `"stream_options":{"include_usage":true}` spliced in front of the client's fields.
fn passthrough_body(
    options: &mut Option<openai::StreamOptions>,
    stream: bool,
    original: Bytes,
) -> (Option<Bytes>, bool) {
    if !stream {
        return (Some(original), false);
    }
    let had_options = options.is_some();
    let client_wants_usage = openai::force_include_usage(options);
    if client_wants_usage {
        return (Some(original), true);
    }
    if had_options {
        return (None, false);
    }
    (openai::splice_include_usage(&original), false)
}

fn serialize<T: serde::Serialize>(request: &T) -> Result<Bytes, GatewayError> {
    serde_json::to_vec(request)
        .map(Bytes::from)
        .map_err(|e| GatewayError::MalformedJson(e.to_string()))
}
