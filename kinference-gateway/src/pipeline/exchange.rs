//! The request as it flows through the stages: the [`Exchange`] (made once per request from its
//! headers, by either front door: endpoint, protocol, caller, the prompt's tokens, its
//! [`Settlement`]) and the parsed [`Request`] of any endpoint (read, parsed, validated and, for
//! Anthropic clients, translated once).

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::Value;

use super::routes::Endpoint;
use super::settle::Settlement;
use crate::api::anthropic::MessagesRequest;
use crate::api::members::with_members;
use crate::api::openai::passthrough::{PassthroughRequest, Route};
use crate::api::openai::{self, ChatCompletionRequest, CompletionRequest};
use crate::backend::provider::ProviderRequest;
use crate::body::Body;
use crate::errors::{GatewayError, Protocol};
use crate::metrics::Metrics;
use crate::routing::Prompt;
use crate::routing::tokenize::PromptTokens;
use crate::tenancy::Caller;
use kinference_crds::TenantPriority;

#[cfg(test)]
mod tests;

/// Which front door a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Door {
    /// The gateway's own HTTP port: it forwards and relays the answer itself.
    Http,
    /// Envoy's external processing: the gateway decides, Envoy forwards; the answer is seen (and
    /// billed) through the response phases.
    ExtProc,
}

/// The header naming the conversation a request continues ([`crate::routing::sessions`]).
pub const SESSION_HEADER: &str = "x-session-id";

/// One request's state through the stages.
#[derive(Debug)]
pub struct Exchange {
    /// The endpoint called.
    pub endpoint: Endpoint,
    /// The client's protocol (errors are answered in it).
    pub protocol: Protocol,
    /// The front door.
    pub door: Door,
    /// The caller is an admin ([`crate::access`]): it is shown the worker's address.
    pub admin: bool,
    /// `x-kinference-debug: 1` from an admin: explain the decision in `x-kinference-decision`.
    pub debug: bool,
    /// `x-kinference-tags` (policy classification).
    pub tags: Option<String>,
    /// Who is calling (the authenticate stage).
    pub caller: Option<Caller>,
    /// The prompt's tokens per served model, each tokenized once for the request's stages (limit,
    /// plan, route).
    pub tokens: PromptTokens,
    /// The policy stage's one-line explanation (debug), also sent with refusals.
    pub explain: Option<String>,
    /// The request's books; moved into the relay when the answer is streamed.
    pub settlement: Option<Settlement>,
    /// The band `x-kinference-priority` asks for (the queue stage decides whether it applies).
    pub asked_band: Option<kinference_crds::TenantPriority>,
    /// The standard `InferenceObjective` named in `x-gateway-inference-objective`.
    pub objective: Option<String>,
    /// The latency objectives the request names ([`Objectives`]; the queue stage decides whether
    /// its tenant may).
    pub objectives: Objectives,
    /// The band the queue stage gave the request (what a worker with priority scheduling is sent).
    pub band: Option<kinference_crds::TenantPriority>,
    /// `x-session-id`: the conversation the request continues ([`Request::session_name`]).
    pub session_header: Option<String>,
}

/// The header naming a request's time-to-first-token objective, in milliseconds.
pub const TTFT_OBJECTIVE_HEADER: &str = "x-kinference-ttft-objective-ms";
/// The header naming a request's time-per-output-token objective, in milliseconds.
pub const TPOT_OBJECTIVE_HEADER: &str = "x-kinference-tpot-objective-ms";

/// A request's own latency objectives, in milliseconds (unparsable or 0: none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Objectives {
    /// Time to first token.
    pub ttft_ms: Option<u32>,
    /// Time per output token.
    pub tpot_ms: Option<u32>,
}

impl Objectives {
    /// The objectives `headers` name.
    pub fn from_headers(headers: &HeaderMap) -> Self {
        let ms = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u32>().ok())
                .filter(|ms| *ms > 0)
        };
        Objectives {
            ttft_ms: ms(TTFT_OBJECTIVE_HEADER),
            tpot_ms: ms(TPOT_OBJECTIVE_HEADER),
        }
    }
}

impl Exchange {
    /// An exchange for a request to `endpoint` through `door` with `headers`, from an admin or not.
    pub fn new(
        endpoint: Endpoint,
        door: Door,
        headers: &HeaderMap,
        admin: bool,
        metrics: &Metrics,
    ) -> Self {
        let protocol = endpoint.protocol();
        Exchange {
            endpoint,
            protocol,
            door,
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
            asked_band: asked_band(headers),
            objective: headers
                .get(kinference_crds::standard::OBJECTIVE_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty()),
            objectives: Objectives::from_headers(headers),
            band: None,
            session_header: headers
                .get(SESSION_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
        }
    }

    /// The request's books (until the relay takes them).
    pub fn settlement(&mut self) -> Option<&mut Settlement> {
        self.settlement.as_mut()
    }

    /// The request is refused with `error`: settled with its status (once), and the error's
    /// answer in the client's protocol, with the decision's explanation when debugging.
    pub fn refuse(&mut self, error: GatewayError) -> Response<Body> {
        tracing::debug!(kind = error.kind(), %error, "request failed");
        if let Some(mut settlement) = self.settlement.take() {
            settlement.finish(error.status().as_u16(), None);
        }
        let mut response = error.into_response(self.protocol);
        if let Some(v) = self.explain_header() {
            response.headers_mut().insert("x-kinference-decision", v);
        }
        response
    }

    /// `x-kinference-decision` with the explanation so far, when there is one.
    pub fn explain_header(&self) -> Option<HeaderValue> {
        self.explain
            .as_deref()
            .and_then(|e| HeaderValue::from_str(e).ok())
    }
}

/// A parsed, validated request, its worker body (in the worker's terms) beside the client's own.
#[derive(Debug)]
pub struct Request {
    /// The endpoint's typed request.
    pub kind: Kind,
    /// The worker's body (the client's bytes when they could be kept).
    pub body: Bytes,
    /// The client's own body (what the policy stage classifies).
    pub client_body: Bytes,
    /// The client's body as JSON, when the policy stage will classify it.
    pub json: Option<Value>,
    /// Whether the answer is streamed.
    pub stream: bool,
    /// OpenAI streams: whether the client asked for the usage chunk itself.
    pub client_wants_usage: bool,
    /// The client's own `cache_salt`, if it sent one.
    pub client_salt: Option<String>,
    /// The `cache_salt` its workers are sent ([`crate::tenancy::isolation`], set by stage "limit";
    /// `None`: unsalted): the router keys the prompt's blocks with it, as the worker will.
    pub cache_salt: Option<String>,
    /// The conversation it continues, hashed with the caller's tenant (set by stage "limit").
    pub session: Option<crate::routing::sessions::SessionKey>,
    /// The stored answer it continues and whose its own will be (`/v1/responses`; set with
    /// `session`).
    pub answers: crate::routing::sessions::Answers,
}

/// What each endpoint's request is.
#[derive(Debug)]
pub enum Kind {
    /// `/v1/chat/completions` (and translated `/v1/messages`).
    Chat(ChatCompletionRequest),
    /// `/v1/completions`.
    Completion(CompletionRequest),
    /// A pass-through endpoint's request, and the text its prompt is made of.
    Passthrough {
        /// Which endpoint.
        route: Route,
        /// The fields the gateway reads.
        request: PassthroughRequest,
        /// The input's text ([`PassthroughRequest::text`]).
        text: String,
    },
    /// `/v1/messages/count_tokens`: the request, and its messages in OpenAI chat terms.
    CountTokens {
        /// The Anthropic request.
        request: Box<MessagesRequest>,
        /// Its messages as OpenAI chat messages (what the router would tokenize).
        messages: Value,
    },
    /// `/v1/models`: nothing to read.
    Models,
}

/// The output-limit fields a worker honours on each endpoint, the one the gateway sets first.
fn limit_fields(endpoint: Endpoint) -> &'static [&'static str] {
    match endpoint {
        Endpoint::ChatCompletions | Endpoint::Messages => &["max_tokens", "max_completion_tokens"],
        Endpoint::Completions => &["max_tokens"],
        Endpoint::Responses => &["max_output_tokens"],
        _ => &[],
    }
}

impl Request {
    /// The model asked for (empty for the model list).
    pub fn model(&self) -> &str {
        match &self.kind {
            Kind::Chat(r) => &r.model,
            Kind::Completion(r) => &r.model,
            Kind::Passthrough { request, .. } => &request.model,
            Kind::CountTokens { request, .. } => &request.model,
            Kind::Models => "",
        }
    }

    /// The prompt in the router's terms.
    pub fn prompt(&self) -> Prompt<'_> {
        match &self.kind {
            Kind::Chat(r) => Prompt::Chat(&r.messages),
            Kind::Completion(r) => r.routing_prompt(),
            Kind::Passthrough { text, .. } => Prompt::Text(text),
            Kind::CountTokens { messages, .. } => Prompt::Chat(messages),
            Kind::Models => Prompt::Text(""),
        }
    }

    /// The largest output limit the request sets among the fields its worker honours
    /// (`max_completion_tokens`, `max_tokens`, `max_output_tokens`, Anthropic's `max_tokens`).
    pub fn output_limit(&self, endpoint: Endpoint) -> Option<u64> {
        let fields = limit_fields(endpoint);
        match &self.kind {
            Kind::Chat(r) => largest(fields, |f| r.extra.u64(f)),
            Kind::Completion(r) => largest(fields, |f| r.extra.u64(f)),
            Kind::Passthrough { request, .. } => request.max_output_tokens,
            _ => None,
        }
    }

    /// How many answers the request asks for (`n`): each generates up to the limit.
    pub fn choices(&self) -> u64 {
        let n = match &self.kind {
            Kind::Chat(r) => r.extra.u64("n"),
            Kind::Completion(r) => r.extra.u64("n"),
            _ => None,
        };
        n.unwrap_or(1).max(1)
    }

    /// Makes the worker's body carry exactly `limit` as its output limit: every limit field it sets
    /// (which may disagree: the worker honours one, the client may mean another) becomes `limit`,
    /// and when it sets none and `add` holds, the endpoint's first field is added. The body is
    /// rewritten only when something changes.
    pub fn limit_output(
        &mut self,
        endpoint: Endpoint,
        limit: u64,
        add: bool,
    ) -> Result<(), GatewayError> {
        let fields = limit_fields(endpoint);
        let extra = match &mut self.kind {
            Kind::Chat(r) => Some(&mut r.extra),
            Kind::Completion(r) => Some(&mut r.extra),
            Kind::Passthrough { request, .. } => {
                if fields.is_empty() || (request.max_output_tokens.is_none() && !add) {
                    return Ok(());
                }
                request.max_output_tokens = Some(limit);
                None
            }
            // Anthropic's `max_tokens` is required: the translated chat request carries it.
            _ => return Ok(()),
        };
        let mut set: Vec<(&str, String)> = Vec::new();
        match extra {
            Some(extra) => {
                for f in fields {
                    if extra.contains_key(f) {
                        extra.insert(f, &limit);
                        set.push((f, limit.to_string()));
                    }
                }
                if set.is_empty()
                    && add
                    && let Some(f) = fields.first()
                {
                    extra.insert(f, &limit);
                    set.push((f, limit.to_string()));
                }
            }
            None => set.extend(fields.first().map(|f| (*f, limit.to_string()))),
        }
        if !set.is_empty() {
            self.body = with_members(&self.body, &set)?;
        }
        Ok(())
    }

    /// The typed request for providers (chat and completions only).
    pub fn provider_request(&self) -> Option<ProviderRequest<'_>> {
        match &self.kind {
            Kind::Chat(r) => Some(ProviderRequest::Chat(r)),
            Kind::Completion(r) => Some(ProviderRequest::Completion(r)),
            _ => None,
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

    /// The same request for another served model (a policy chose a pool serving a different one,
    /// or resolved an alias or class).
    pub fn for_model(&self, model: &str) -> Result<Request, GatewayError> {
        let (kind, body) = match &self.kind {
            Kind::Chat(r) => renamed(r, model)?,
            Kind::Completion(r) => renamed(r, model)?,
            Kind::Passthrough {
                route,
                request,
                text,
            } => {
                let mut request = request.clone();
                request.model = model.to_string();
                let body = with_members(&self.body, &[("model", json_string(model))])?;
                let kind = Kind::Passthrough {
                    route: *route,
                    request,
                    text: text.clone(),
                };
                (kind, body)
            }
            Kind::CountTokens { .. } | Kind::Models => {
                return Err(GatewayError::invalid(
                    "model",
                    "the gateway answers this endpoint itself",
                ));
            }
        };
        Ok(Request {
            kind,
            body,
            client_body: self.client_body.clone(),
            json: None,
            stream: self.stream,
            client_wants_usage: self.client_wants_usage,
            client_salt: self.client_salt.clone(),
            cache_salt: self.cache_salt.clone(),
            session: self.session,
            answers: self.answers,
        })
    }

    /// The name the client gave the conversation this request continues: `header` (`x-session-id`)
    /// first, then the body's `safety_identifier`, then its `user` (Anthropic's `metadata.user_id`
    /// arrives translated to it). Empty names count as none.
    pub fn session_name(&self, header: Option<&str>) -> Option<String> {
        let from_body = |get: &dyn Fn(&str) -> Option<Value>| {
            ["safety_identifier", "user"].into_iter().find_map(|f| {
                get(f)?
                    .as_str()
                    .map(str::to_string)
                    .filter(|s| !s.is_empty())
            })
        };
        let named = header.filter(|h| !h.is_empty()).map(str::to_string);
        named.or_else(|| match &self.kind {
            Kind::Chat(r) => from_body(&|f| r.extra.get(f)),
            Kind::Completion(r) => from_body(&|f| r.extra.get(f)),
            Kind::Passthrough { request, .. } => request.session_name(),
            _ => None,
        })
    }

    /// Whether the worker may store the answer for a later request to continue (`/v1/responses`).
    pub fn stores_answers(&self) -> bool {
        matches!(
            self.kind,
            Kind::Passthrough {
                route: Route::Responses,
                ..
            }
        )
    }

    /// The stored answer this request continues (`/v1/responses`' `previous_response_id`).
    pub fn previous_response_id(&self) -> Option<&str> {
        match &self.kind {
            Kind::Passthrough {
                route: Route::Responses,
                request,
                ..
            } => request.previous_response_id(),
            _ => None,
        }
    }

    /// `body` with the request's `cache_salt` (unchanged when it has none, or holds it already).
    pub fn salted(&self, body: &Bytes) -> Result<Bytes, GatewayError> {
        match &self.cache_salt {
            Some(salt) => with_members(body, &[("cache_salt", json_string(salt))]),
            None => Ok(body.clone()),
        }
    }
}

/// The largest of `fields` that `get` finds as a number.
fn largest(fields: &[&str], get: impl Fn(&str) -> Option<u64>) -> Option<u64> {
    fields.iter().filter_map(|f| get(f)).max()
}

/// `s` as a JSON string.
pub(crate) fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string())
}

/// Stage "read": the body, bounded by `limit` (413 beyond it) and by the read deadline (408 after
/// it: a slow client does not hold its slot).
pub async fn read_body(
    body: Incoming,
    declared: Option<usize>,
    limit: usize,
    deadline: std::time::Duration,
) -> Result<Bytes, GatewayError> {
    if declared.is_some_and(|n| n > limit) {
        return Err(GatewayError::BodyTooLarge { limit });
    }
    let collect = Limited::new(body, limit).collect();
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

/// The `content-length` a client declared.
pub fn declared_length(headers: &HeaderMap) -> Option<usize> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok())
}

/// Stage "parse": JSON into the endpoint's typed request, field checks, then the worker's request
/// (Anthropic is translated here); 400 on bad JSON or shape. Streams always ask the worker for the
/// final usage chunk so every request can be accounted. OpenAI bodies that need no change are
/// forwarded byte for byte (no re-serialization on the hot path).
pub fn parse(endpoint: Endpoint, body: Bytes) -> Result<Request, GatewayError> {
    parse_as(endpoint, body, false)
}

/// [`parse`], keeping the body's JSON for the policy stage when `keep_json`.
pub fn parse_as(endpoint: Endpoint, body: Bytes, keep_json: bool) -> Result<Request, GatewayError> {
    let json: Option<Value> = if keep_json && endpoint.has_body() {
        Some(openai::parse_body(&body)?)
    } else {
        None
    };
    let mut request = typed(endpoint, body)?;
    request.json = json;
    Ok(request)
}

fn typed(endpoint: Endpoint, body: Bytes) -> Result<Request, GatewayError> {
    let plain = |kind, body: Bytes, stream, client_salt| Request {
        kind,
        body: body.clone(),
        client_body: body,
        json: None,
        stream,
        client_wants_usage: false,
        client_salt,
        cache_salt: None,
        session: None,
        answers: Default::default(),
    };
    match endpoint {
        Endpoint::ChatCompletions => openai_request::<ChatCompletionRequest>(body),
        Endpoint::Completions => openai_request::<CompletionRequest>(body),
        Endpoint::Messages => {
            let r: MessagesRequest = openai::parse_body(&body)?;
            let chat = r.to_chat_request()?;
            Ok(Request {
                stream: chat.stream == Some(true),
                body: serialize(&chat)?,
                client_body: body,
                json: None,
                kind: Kind::Chat(chat),
                client_wants_usage: false,
                client_salt: r.cache_salt,
                cache_salt: None,
                session: None,
                answers: Default::default(),
            })
        }
        Endpoint::CountTokens => {
            let request: MessagesRequest = openai::parse_body(&body)?;
            let messages = Value::Array(request.chat_prompt()?.messages);
            let kind = Kind::CountTokens {
                request: Box::new(request),
                messages,
            };
            Ok(plain(kind, body, false, None))
        }
        Endpoint::Embeddings | Endpoint::Responses | Endpoint::Tokenize | Endpoint::Detokenize => {
            let route = endpoint.passthrough().unwrap_or(Route::Embeddings);
            let request = PassthroughRequest::parse(route, &body)?;
            let stream = request.stream();
            let text = request.text();
            let client_salt = request.cache_salt.clone();
            let kind = Kind::Passthrough {
                route,
                request,
                text,
            };
            Ok(plain(kind, body, stream, client_salt))
        }
        Endpoint::Models => Ok(plain(Kind::Models, Bytes::new(), false, None)),
    }
}

/// What the two OpenAI request types share, so one path parses, checks and renames both.
trait OpenAiBody: serde::de::DeserializeOwned + serde::Serialize + Clone {
    fn validate(&self) -> Result<(), GatewayError>;
    fn stream(&self) -> bool;
    fn stream_options(&mut self) -> &mut Option<openai::StreamOptions>;
    fn set_model(&mut self, model: &str);
    fn into_kind(self) -> Kind;
    fn client_salt(&self) -> Option<String>;
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
            fn into_kind(self) -> Kind {
                Kind::$variant(self)
            }
            fn client_salt(&self) -> Option<String> {
                match self.extra.get("cache_salt") {
                    Some(Value::String(s)) => Some(s),
                    _ => None,
                }
            }
        }
    };
}

openai_body!(ChatCompletionRequest, Chat);
openai_body!(CompletionRequest, Completion);

/// An OpenAI chat or completion request: read, checked, and its worker body (the client's bytes
/// when they can be kept).
fn openai_request<T: OpenAiBody>(body: Bytes) -> Result<Request, GatewayError> {
    let mut r: T = openai::parse_body(&body)?;
    r.validate()?;
    let stream = r.stream();
    let client_salt = r.client_salt();
    let (worker_body, client_wants_usage) =
        match passthrough_body(r.stream_options(), stream, body.clone()) {
            (Some(b), wants) => (b, wants),
            (None, wants) => (serialize(&r)?, wants),
        };
    Ok(Request {
        kind: r.into_kind(),
        body: worker_body,
        client_body: body,
        json: None,
        stream,
        client_wants_usage,
        client_salt,
        cache_salt: None,
        session: None,
        answers: Default::default(),
    })
}

/// `r` for `model`, and its body.
fn renamed<T: OpenAiBody>(r: &T, model: &str) -> Result<(Kind, Bytes), GatewayError> {
    let mut r = r.clone();
    r.set_model(model);
    let body = serialize(&r)?;
    Ok((r.into_kind(), body))
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

/// The header a request names its band with.
pub const PRIORITY_HEADER: &str = "x-kinference-priority";

/// The band `headers` ask for, if any (`high`, `medium`, `low`).
pub fn asked_band(headers: &HeaderMap) -> Option<TenantPriority> {
    headers
        .get(PRIORITY_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(TenantPriority::parse)
}
