//! The one relay: a backend's answer (a worker's or a provider's) to the client, in the client's
//! protocol, whole or streamed chunk by chunk, feeding a [`Meter`] as it passes.
//!
//! The backend's answer is brought to OpenAI chat form first (workers already speak it; an Anthropic
//! provider's events go through [`AnthropicStream`]), then shaped for the client: OpenAI clients get
//! the events as they are (minus the usage chunk they did not ask for), Anthropic clients the
//! translated event sequence ([`StreamTranslator`]). A worker's own Anthropic answer to an Anthropic
//! client passes verbatim ([`Spec::pass_through`]): its OpenAI form only feeds the meter. Nothing
//! waits for the whole response. A stream that stalls, breaks, carries an error event or ends before
//! the backend said it was complete ends with an error event in the client's protocol. The stream is
//! read to its end even after the completion event, so the worker's connection goes back to the
//! pool.
//!
//! The [`Meter`] hears every text chunk (first token, inter-token latency, the tenant's streamed
//! output) and the end exactly once: `finish` with the status and the backend's usage, or, when the
//! client goes away first, nothing: dropping the meter settles it as abandoned.
//!
//! A stream whose backend breaks or closes it before any output (a worker that crashed or restarted
//! while the request waited or ran its prefill) gets one second chance when the caller gave one
//! ([`Resend`]): the same request goes to another backend and its answer continues the stream, so
//! the client sees a later first token instead of an error. The client gets the opening once: the
//! new backend's chunks (or, passed through to an Anthropic client, its events) before its first
//! output are not passed when the client had the first one's (`Relay::pass_event`). Once output
//! has reached the client nothing is sent again (the answer would be a different one), and a stall
//! past the idle timeout is not a break (the worker may be alive and busy: sending again would
//! double its load).

use std::convert::Infallible;
use std::ops::ControlFlow;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use http::StatusCode;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Incoming;
use kinference_crds::ApiStyle;
use serde::Deserialize;
use tracing::Instrument as _;

use crate::api::anthropic::{self, StreamTranslator};
use crate::api::openai::{ChatCompletionResponse, StreamChunk, Usage, UsageOnly};
use crate::backend::provider::translate::{self, AnthropicStream};
use crate::backend::sse::SseParser;
use crate::backend::worker::{UpstreamLimits, error_chain, read_body};
use crate::body::Body;
use crate::errors::{GatewayError, Protocol};

mod glance;

/// What a relay reports to while the answer passes (the pipeline's settlement).
pub trait Meter: Send + 'static {
    /// A chunk carrying generated `text` arrived (the first one is the first token; `text` may be
    /// empty for a piece of a tool call).
    fn text_chunk(&mut self, text: &str);
    /// The answer ended with `status` and the backend's `usage` (called at most once).
    fn finish(&mut self, status: u16, usage: Option<&Usage>);
    /// The answer's id, when a later request may continue it (`/v1/responses`); called before
    /// `finish`.
    fn answer_id(&mut self, _id: String) {}
}

/// A stream's second chance: asked once, only when the backend broke the stream before any output,
/// it sends the same request to another backend; `None` when none could take it.
pub type Resend<M> = Box<dyn FnOnce() -> BoxFuture<'static, Option<Resent<M>>> + Send>;

/// Another backend's answer to a request sent again ([`Resend`]).
pub struct Resent<M> {
    /// Its streamed body, relayed from its first event.
    pub body: Incoming,
    /// Its label (worker URL), for errors and logs.
    pub label: String,
    /// Tells the meter which backend serves the request now.
    pub moved: Box<dyn FnOnce(&mut M) + Send>,
}

/// What the client expects back.
#[derive(Debug, Clone)]
pub enum ClientShape {
    /// OpenAI chat or completions.
    OpenAi {
        /// Whether the client asked for the final usage chunk of a stream (the gateway always asks
        /// the backend, to account).
        pass_usage_chunk: bool,
    },
    /// Anthropic Messages, reporting `model` (the model the client asked for).
    Anthropic {
        /// Model name reported to the client.
        model: String,
        /// The prompt's size announced in `message_start` (the gateway's count, or 0).
        input_tokens: u64,
    },
}

/// One relayed answer: where it comes from and where it goes.
#[derive(Debug, Clone)]
pub struct Spec {
    /// The backend's protocol.
    pub style: ApiStyle,
    /// The backend's label (worker URL or `provider/<name>`), for errors and logs.
    pub label: String,
    /// The client's shape.
    pub shape: ClientShape,
    /// The client's protocol (error events).
    pub protocol: Protocol,
    /// Longest silence allowed between two chunks.
    pub idle_timeout: Duration,
    /// An Anthropic answer to an Anthropic client goes as it is (a worker's own `/v1/messages`);
    /// otherwise it is translated through the OpenAI form like any other.
    pub pass_through: bool,
    /// How much of the answer is held: past it, a bad upstream counted against the worker.
    pub limits: UpstreamLimits,
}

impl Spec {
    /// The answer passes as it is: asked for, and backend and client both speak Anthropic.
    fn verbatim(&self) -> bool {
        self.pass_through
            && self.style == ApiStyle::Anthropic
            && matches!(self.shape, ClientShape::Anthropic { .. })
    }

    fn bad(&self, detail: String) -> GatewayError {
        GatewayError::BadUpstream {
            worker: self.label.clone(),
            detail,
        }
    }

    /// What an error event in the backend's stream stands for. vLLM refuses a streamed request it
    /// cannot serve (a model without image input, a parameter it does not take) with status 200 and
    /// one `{"error": {"message", "code": 400}}` chunk: that refusal reaches the client with its
    /// status and message, as the same refusal of a non-streamed request does. Anything else is an
    /// answer the gateway cannot use.
    fn stream_error(&self, error: &serde_json::Value) -> GatewayError {
        let message = stream_error_detail(error);
        let code = error.get("code").and_then(|code| match code {
            serde_json::Value::Number(n) => n.as_u64(),
            serde_json::Value::String(s) => s.parse().ok(),
            _ => None,
        });
        match code
            .and_then(|code| u16::try_from(code).ok())
            .and_then(|code| StatusCode::from_u16(code).ok())
        {
            Some(status) if status.is_client_error() => {
                GatewayError::UpstreamRejected { status, message }
            }
            _ => self.bad(message),
        }
    }
}

/// A non-streamed answer, read and shaped for the client: the body and the backend's usage. OpenAI
/// clients of a worker get the worker's bytes untouched (only `usage` is read). The caller settles.
pub async fn whole(body: Incoming, spec: &Spec) -> Result<(Bytes, Option<Usage>), GatewayError> {
    let body = read_body(body, spec.idle_timeout, &spec.label, &spec.limits).await?;
    shape_whole(body, spec)
}

/// A non-streamed answer already read, shaped for the client: the body and the backend's usage
/// (what [`whole`] does once the body is in; the ext_proc door reads the usage of what Envoy relays).
pub fn shape_whole(body: Bytes, spec: &Spec) -> Result<(Bytes, Option<Usage>), GatewayError> {
    if spec.verbatim() {
        let message: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| spec.bad(format!("unreadable message: {e}")))?;
        let usage = serde_json::from_value::<UsageOnly>(translate::chat_from_anthropic(&message))
            .ok()
            .and_then(|u| u.usage);
        return Ok((body, usage));
    }
    // The OpenAI form of the answer.
    let openai = match spec.style {
        ApiStyle::OpenAI => body,
        ApiStyle::Anthropic => {
            let message: serde_json::Value = serde_json::from_slice(&body)
                .map_err(|e| spec.bad(format!("unreadable message: {e}")))?;
            Bytes::from(translate::chat_from_anthropic(&message).to_string())
        }
    };
    match &spec.shape {
        ClientShape::OpenAi { .. } => {
            let usage = serde_json::from_slice::<UsageOnly>(&openai)
                .ok()
                .and_then(|u| u.usage);
            Ok((openai, usage))
        }
        ClientShape::Anthropic { model, .. } => {
            let chat: ChatCompletionResponse = serde_json::from_slice(&openai)
                .map_err(|e| spec.bad(format!("unreadable chat completion: {e}")))?;
            let message =
                anthropic::message_from_chat(&chat, model).map_err(|e| spec.bad(e.to_string()))?;
            Ok((Bytes::from(message.to_string()), chat.usage))
        }
    }
}

/// A streamed answer as a response body, relayed event by event; `meter` hears it pass. The relay
/// runs in the `stream` span (a child of the current one), which notes the first token's time.
/// `resend`, when given, is the stream's second chance if the backend breaks it before any output.
pub fn stream<M: Meter>(body: Incoming, spec: Spec, meter: M, resend: Option<Resend<M>>) -> Body {
    let span = tracing::debug_span!(
        "stream",
        backend = %spec.label,
        first_token_ms = tracing::field::Empty,
        status = tracing::field::Empty,
    );
    let relay = Relay {
        body,
        resend,
        feed: Feed::new(spec, meter, span),
    };
    let stream = futures::stream::unfold(relay, |mut relay| async move {
        let span = relay.feed.span.clone();
        let chunk = relay.next_chunk().instrument(span).await?;
        Some((Ok::<_, Infallible>(Frame::data(chunk)), relay))
    });
    StreamBody::new(stream).boxed_unsync()
}

impl<M: Meter> Feed<M> {
    /// The relay of a streamed answer described by `spec`, fed by its caller ([`Feed::feed`],
    /// [`Feed::end`]), its output taken with [`Feed::output`]; `meter` hears it pass. The ext_proc
    /// door feeds it the response chunks Envoy shows it; [`stream`] feeds it a backend's body.
    pub fn new(spec: Spec, meter: M, span: tracing::Span) -> Self {
        let mut feed = Feed {
            parser: SseParser::with_limits(spec.limits.sse),
            from_anthropic: match spec.style {
                ApiStyle::OpenAI => None,
                ApiStyle::Anthropic => Some(AnthropicStream::new()),
            },
            to_anthropic: match &spec.shape {
                ClientShape::Anthropic { .. } if spec.verbatim() => None,
                ClientShape::Anthropic { model, .. } => Some(StreamTranslator::new(
                    model,
                    anthropic::message_id(&format!("{:x}", rand::random::<u64>())),
                )),
                ClientShape::OpenAi { .. } => None,
            },
            pass_usage_chunk: matches!(
                spec.shape,
                ClientShape::OpenAi {
                    pass_usage_chunk: true
                }
            ),
            usage: None,
            done: false,
            ended: false,
            out: BytesMut::with_capacity(512),
            meter: Some(meter),
            spec,
            span,
            started: std::time::Instant::now(),
            first_token: false,
            passed_any: false,
            skip_preamble: false,
            opened: Opened::default(),
        };
        if let (Some(t), ClientShape::Anthropic { input_tokens, .. }) =
            (&mut feed.to_anthropic, &feed.spec.shape)
        {
            t.start(&mut feed.out, *input_tokens);
        }
        feed
    }

    /// The bytes for the client so far (taken).
    pub fn output(&mut self) -> Bytes {
        self.out.split().freeze()
    }

    /// Whether nothing more will be emitted (the answer completed or failed).
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// A piece of the backend's body.
    pub fn feed(&mut self, data: &[u8]) {
        if self.ended {
            return;
        }
        self.parser.feed(data);
        while let Some(event) = self.parser.next_event() {
            let forward = self.spec.verbatim() && !self.done;
            self.on_event(&event.data);
            // An event that failed the stream is replaced by the gateway's error.
            if forward && !self.ended && self.pass_event(event.event.as_deref()) {
                put_event(&mut self.out, event.event.as_deref(), &event.data);
            }
            if self.ended {
                break;
            }
        }
        if let Some(overflow) = self.parser.overflow()
            && !self.ended
        {
            let error = self.spec.limits.exceeded(&self.spec.label, overflow);
            self.fail(error);
        }
    }

    /// The backend's body ended: the answer completes, or (before the backend said it was
    /// complete) fails.
    pub fn end(&mut self) {
        if self.ended {
            return;
        }
        if self.done {
            self.completed();
        } else {
            let error = self.closed_early();
            self.fail(error);
        }
    }

    /// The backend failed the stream with `error` (it broke, or stalled).
    pub fn fail_with(&mut self, error: GatewayError) {
        if !self.ended {
            self.fail(error);
        }
    }
}

/// One relayed stream read from a backend's body, with its second chance.
struct Relay<M: Meter> {
    body: Incoming,
    /// The second chance, until used ([`Resend`]).
    resend: Option<Resend<M>>,
    feed: Feed<M>,
}

/// The state of one relayed stream, fed the backend's bytes (see [`Feed::new`]).
pub struct Feed<M: Meter> {
    parser: SseParser,
    /// Set for Anthropic backends: their events become OpenAI chunks first.
    from_anthropic: Option<AnthropicStream>,
    /// Set for Anthropic clients.
    to_anthropic: Option<StreamTranslator>,
    pass_usage_chunk: bool,
    usage: Option<Usage>,
    /// The backend said the answer is complete (`[DONE]`, `message_stop`).
    done: bool,
    /// Nothing more will be emitted.
    ended: bool,
    out: BytesMut,
    /// Taken when the answer ends; dropped with the relay (an abandoned request) otherwise.
    meter: Option<M>,
    spec: Spec,
    /// The `stream` span (disabled unless traces are exported).
    span: tracing::Span,
    started: std::time::Instant,
    first_token: bool,
    /// Some chunk of the backend's went to an OpenAI client as it is.
    passed_any: bool,
    /// Sent again after the client had the first backend's opening chunk (the role, no text):
    /// the new backend's chunks without output are not passed until its first output.
    skip_preamble: bool,
    /// The opening events an Anthropic client got as they are (pass-through), so that after a second
    /// chance the new backend's are not passed again.
    opened: Opened,
}

/// The opening events of an Anthropic stream passed to the client as they are ([`Relay::pass_event`]).
#[derive(Default)]
struct Opened {
    /// `message_start` went out.
    message: bool,
    /// A `content_block_start` went out.
    block: bool,
    /// Sent again: the new backend's opening events are being passed over.
    again: bool,
}

impl<M: Meter> Relay<M> {
    /// The next bytes for the client, or `None` when the stream is over.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        let feed = &mut self.feed;
        loop {
            if !feed.out.is_empty() {
                return Some(feed.output());
            }
            if feed.ended {
                return None;
            }
            match next_frame(&mut self.body, feed.spec.idle_timeout, &feed.spec.label).await {
                Err(error) => Self::broken(feed, &mut self.body, &mut self.resend, error).await,
                Ok(None) if !feed.done => {
                    let error = feed.closed_early();
                    Self::broken(feed, &mut self.body, &mut self.resend, error).await
                }
                Ok(None) => feed.completed(),
                Ok(Some(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        feed.feed(data);
                    }
                }
            }
        }
    }

    /// The backend broke the stream (or closed it early, or stalled). Before any output, and
    /// unless it only stalled, the request goes once more to another backend ([`Resend`]) and the
    /// stream goes on with its answer; otherwise it fails.
    async fn broken(
        feed: &mut Feed<M>,
        body: &mut Incoming,
        resend: &mut Option<Resend<M>>,
        error: GatewayError,
    ) {
        let stalled = matches!(error, GatewayError::UpstreamTimeout { .. });
        // A backend's stream can be continued by another's where the client gets either the chunks as
        // the backend sent them (an OpenAI backend and client) or its events (an Anthropic worker
        // passed through): the relay then knows which opening the client already has. A translated
        // stream keeps state of the backend's events.
        let continuable = feed.spec.verbatim() || feed.from_anthropic.is_none();
        let second_chance = match resend.take() {
            Some(resend) if continuable && !feed.first_token && !stalled => resend,
            _ => return feed.fail(error),
        };
        tracing::warn!(backend = %feed.spec.label, %error, "stream broke before any output; sending the request again");
        let Some(resent) = second_chance().await else {
            return feed.fail(error);
        };
        tracing::info!(from = %feed.spec.label, to = %resent.label, "stream continues from another backend");
        *body = resent.body;
        feed.parser = SseParser::with_limits(feed.spec.limits.sse);
        feed.spec.label = resent.label;
        if let Some(meter) = &mut feed.meter {
            (resent.moved)(meter);
        }
        feed.skip_preamble = feed.passed_any;
        if feed.from_anthropic.is_some() {
            // A new stream from its own `message_start`.
            feed.from_anthropic = Some(AnthropicStream::new());
            feed.opened.again = true;
        }
    }
}

impl<M: Meter> Feed<M> {
    /// Whether an Anthropic event goes to a pass-through client: every one, except, once the request
    /// was sent again, the new backend's opening events the client already had from the first (its
    /// `message_start`, a `content_block_start` before any output, `ping`).
    fn pass_event(&mut self, name: Option<&str>) -> bool {
        let opened = &mut self.opened;
        match name {
            Some("message_start") => !std::mem::replace(&mut opened.message, true),
            Some("content_block_start") if opened.again && opened.block => false,
            Some("content_block_start") => {
                opened.block = true;
                true
            }
            Some("ping") if opened.again => false,
            _ => {
                opened.again = false;
                true
            }
        }
    }

    fn on_event(&mut self, data: &[u8]) {
        if self.done {
            return;
        }
        let step = self.from_anthropic.as_mut().map(|conv| conv.event(data));
        match step {
            Some(step) => {
                for chunk in step.chunks {
                    let data = chunk.to_string();
                    self.on_openai_chunk(data.as_bytes());
                }
                if let Some(message) = step.error {
                    return self.fail(self.spec.bad(message));
                }
                if step.done {
                    self.complete();
                }
            }
            None if data == b"[DONE]" => self.complete(),
            None => self.on_openai_chunk(data),
        }
    }

    fn on_openai_chunk(&mut self, data: &[u8]) {
        if self.ended {
            return;
        }
        if self.to_anthropic.is_none() {
            return self.on_passed_chunk(data);
        }
        // Translated for an Anthropic client: the whole chunk is needed.
        let Some(chunk) = self.parse::<StreamChunk>(data) else {
            return;
        };
        if self.hear(&chunk).is_break() {
            return;
        }
        if let Some(t) = &mut self.to_anthropic {
            t.chunk(&mut self.out, &chunk);
        }
    }

    /// [`Self::on_openai_chunk`] for a chunk the client gets as it is (or not at all): only glanced
    /// at, not parsed into a [`StreamChunk`].
    fn on_passed_chunk(&mut self, data: &[u8]) {
        let Some(chunk) = self.parse::<glance::ChunkGlance>(data) else {
            if !self.spec.verbatim() {
                put_data(&mut self.out, data);
            }
            return;
        };
        if self.hear(&chunk).is_break() {
            return;
        }
        if self.skip_preamble {
            if !chunk.carries_text() && chunk.usage().is_none() {
                return;
            }
            self.skip_preamble = false;
        }
        if !self.spec.verbatim() && (!chunk.usage_only() || self.pass_usage_chunk) {
            put_data(&mut self.out, data);
            self.passed_any = true;
        }
    }

    /// An OpenAI chunk read as `C`; `None` (noted in the debug log) when it does not parse.
    fn parse<'a, C: Deserialize<'a>>(&self, data: &'a [u8]) -> Option<C> {
        serde_json::from_slice(data)
            .inspect_err(|e| {
                tracing::debug!(backend = %self.spec.label, error = %e, "unparsable stream chunk");
            })
            .ok()
    }

    /// What every OpenAI chunk tells the relay, however much of it was parsed: an error event fails
    /// the stream (`Break`: nothing more of the chunk goes out), generated output reaches the meter,
    /// usage is kept for the end.
    fn hear(&mut self, chunk: &impl HeardChunk) -> ControlFlow<()> {
        if let Some(error) = chunk.error() {
            self.fail(self.spec.stream_error(error));
            return ControlFlow::Break(());
        }
        if chunk.carries_text() {
            let mut text = String::new();
            chunk.text(&mut text);
            self.heard_text(&text);
        }
        if let Some(usage) = chunk.usage() {
            self.usage = Some(usage);
        }
        ControlFlow::Continue(())
    }

    /// A chunk carried generated output: the meter hears it, the span notes the first one.
    fn heard_text(&mut self, text: &str) {
        if let Some(meter) = &mut self.meter {
            meter.text_chunk(text);
            if !std::mem::replace(&mut self.first_token, true) {
                self.span
                    .record("first_token_ms", self.started.elapsed().as_millis() as u64);
            }
        }
    }

    /// The backend said the answer is complete; OpenAI clients get `[DONE]` at once, the rest waits
    /// for the end of the backend's body.
    fn complete(&mut self) {
        self.done = true;
        if self.to_anthropic.is_none() && !self.spec.verbatim() {
            self.out.extend_from_slice(b"data: [DONE]\n\n");
        }
    }

    /// The backend's body ended before it said the answer was complete.
    fn closed_early(&self) -> GatewayError {
        let who = if self.spec.label.starts_with("provider/") {
            "provider"
        } else {
            "worker"
        };
        self.spec.bad(format!(
            "the {who} closed the stream before it was complete"
        ))
    }

    /// The backend's body ended after it said the answer was complete.
    fn completed(&mut self) {
        if let Some(t) = &mut self.to_anthropic {
            t.finish(&mut self.out);
        }
        self.settle(200);
        self.ended = true;
    }

    fn fail(&mut self, error: GatewayError) {
        tracing::warn!(backend = %self.spec.label, %error, "stream ended with an error");
        self.out
            .extend_from_slice(&error.stream_event(self.spec.protocol));
        self.settle(error.status().as_u16());
        self.ended = true;
    }

    fn settle(&mut self, status: u16) {
        self.span.record("status", status);
        if let Some(mut meter) = self.meter.take() {
            meter.finish(status, self.usage.as_ref());
        }
    }
}

/// What [`Relay::hear`] reads of an OpenAI chunk, the same whether the chunk was parsed whole (a
/// [`StreamChunk`], to translate it) or only glanced at (a [`glance::ChunkGlance`], passed as it is).
trait HeardChunk {
    /// The error event the backend sent instead of output.
    fn error(&self) -> Option<&serde_json::Value>;
    /// Whether the chunk carries generated output: text, reasoning or a piece of a tool call.
    fn carries_text(&self) -> bool;
    /// The backend's token counts, when the chunk has them.
    fn usage(&self) -> Option<Usage>;
    /// Appends the chunk's generated text (and reasoning) to `out`.
    fn text(&self, out: &mut String);
}

impl HeardChunk for StreamChunk {
    fn error(&self) -> Option<&serde_json::Value> {
        self.error.as_ref()
    }
    fn carries_text(&self) -> bool {
        self.has_text()
    }
    fn usage(&self) -> Option<Usage> {
        self.usage
    }
    fn text(&self, out: &mut String) {
        for c in &self.choices {
            if let Some(t) = c.text() {
                out.push_str(t);
            }
            if let Some(r) = c.delta.as_ref().and_then(|d| d.reasoning()) {
                out.push_str(r);
            }
        }
    }
}

impl HeardChunk for glance::ChunkGlance<'_> {
    fn error(&self) -> Option<&serde_json::Value> {
        self.error.as_ref()
    }
    fn carries_text(&self) -> bool {
        self.has_text()
    }
    fn usage(&self) -> Option<Usage> {
        self.usage
    }
    fn text(&self, out: &mut String) {
        self.text_into(out);
    }
}

/// The message of an error event in a stream.
fn stream_error_detail(error: &serde_json::Value) -> String {
    error
        .get("message")
        .and_then(|m| m.as_str())
        .unwrap_or("error event in the stream")
        .to_string()
}

/// Waits at most `idle` for the next frame of `backend`'s body: `Ok(None)` when it ended, the error
/// to end the client's answer with when it stalled or broke.
pub(crate) async fn next_frame(
    body: &mut Incoming,
    idle: Duration,
    backend: &str,
) -> Result<Option<Frame<Bytes>>, GatewayError> {
    match tokio::time::timeout(idle, body.frame()).await {
        Err(_) => Err(GatewayError::UpstreamTimeout {
            worker: backend.to_string(),
            what: "the stream stalled past the idle timeout",
        }),
        Ok(None) => Ok(None),
        Ok(Some(Err(e))) => Err(GatewayError::BadUpstream {
            worker: backend.to_string(),
            detail: format!("the stream broke: {}", error_chain(&e)),
        }),
        Ok(Some(Ok(frame))) => Ok(Some(frame)),
    }
}

/// Appends one SSE event, named `event` when it has a name, carrying `data`.
fn put_event(out: &mut BytesMut, event: Option<&str>, data: &[u8]) {
    if let Some(name) = event {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b"\n");
    }
    for line in data.split(|b| *b == b'\n') {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line);
        out.extend_from_slice(b"\n");
    }
    out.extend_from_slice(b"\n");
}

/// Appends `data` to `out` as one SSE `data:` event.
pub(crate) fn put_data(out: &mut BytesMut, data: &[u8]) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\n\n");
}

#[cfg(test)]
mod tests;
