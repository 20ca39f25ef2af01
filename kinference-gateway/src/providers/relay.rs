//! A provider's answer to the client, in the client's protocol: whole, or streamed chunk by chunk.
//!
//! The provider's answer is first brought to OpenAI chat form ([`super::translate`]), then shaped for
//! the client: OpenAI clients get it as is (minus the usage chunk they did not ask for), Anthropic
//! clients through the same translators as worker answers ([`crate::api::anthropic`]). A stream that
//! stalls, breaks or ends early ends with an error event in the client's protocol. Accounting (request
//! counter, latencies, tokens) happens exactly once, labelled `worker="provider/<name>"`.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Response, StatusCode, header};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Incoming;
use kinference_crds::ApiStyle;

use super::translate::AnthropicStream;
use crate::api::anthropic::{self, StreamTranslator};
use crate::api::openai::{ChatCompletionResponse, StreamChunk, Usage, UsageOnly};
use crate::errors::{GatewayError, Protocol};
use crate::metrics::{InFlightGuard, Metrics, RequestLabels, WorkerLabels};
use crate::relay::{next_frame, put_data};
use crate::server::{Body, full};
use crate::upstream::error_chain;
use crate::upstream::sse::SseParser;

/// What the client expects back.
#[derive(Debug, Clone)]
pub enum ClientShape {
    /// OpenAI chat or completions: the provider's OpenAI answer as is.
    OpenAi {
        /// Whether the client asked for the final usage chunk of a stream.
        pass_usage_chunk: bool,
    },
    /// Anthropic Messages, reporting `model` (the model the client asked for).
    Anthropic {
        /// Model name reported to the client.
        model: String,
    },
}

/// Everything accounting needs, moved into the response.
#[derive(Debug)]
pub struct Accounting {
    /// Gateway metrics.
    pub metrics: Metrics,
    /// `model` = the requested model, `worker` = `provider/<name>`.
    pub labels: WorkerLabels,
    /// The client's protocol.
    pub protocol: Protocol,
    /// When the request arrived.
    pub started: Instant,
    /// Longest silence allowed between two chunks.
    pub idle_timeout: Duration,
    /// The in-flight gauge's guard, released with the response.
    pub in_flight: Option<InFlightGuard>,
}

impl Accounting {
    fn finish(&self, status: u16, usage: Option<Usage>) {
        let usage = usage.unwrap_or_default();
        self.metrics
            .e2e(&self.labels, self.started.elapsed().as_secs_f64());
        self.metrics.tokens(
            &self.labels,
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_tokens().unwrap_or(0),
        );
        self.metrics.request(RequestLabels {
            model: self.labels.model.clone(),
            worker: self.labels.worker.clone(),
            status,
            protocol: self.protocol.as_str(),
        });
    }
}

/// Reads a whole body, allowing `idle` between frames.
pub async fn read_all(body: Incoming, idle: Duration) -> Result<Bytes, String> {
    let mut body = body;
    let mut out = BytesMut::new();
    loop {
        match tokio::time::timeout(idle, body.frame()).await {
            Err(_) => return Err("the response body stalled".into()),
            Ok(None) => return Ok(out.freeze()),
            Ok(Some(Err(e))) => return Err(error_chain(&e)),
            Ok(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    out.extend_from_slice(data);
                }
            }
        }
    }
}

/// A non-streamed answer: read, translated for the client, accounted.
pub async fn whole(
    style: ApiStyle,
    label: &str,
    response: Response<Incoming>,
    shape: &ClientShape,
    acct: Accounting,
) -> Result<Response<Body>, GatewayError> {
    let bad = |detail: String| GatewayError::BadUpstream {
        worker: label.to_string(),
        detail,
    };
    let body = read_all(response.into_body(), acct.idle_timeout)
        .await
        .map_err(|e| bad(format!("reading the response body: {e}")))?;
    // The OpenAI form of the answer.
    let openai = match style {
        ApiStyle::OpenAI => body,
        ApiStyle::Anthropic => {
            let message: serde_json::Value = serde_json::from_slice(&body)
                .map_err(|e| bad(format!("unreadable message: {e}")))?;
            Bytes::from(super::translate::chat_from_anthropic(&message).to_string())
        }
    };
    let (out, usage) = match shape {
        ClientShape::OpenAi { .. } => {
            let usage = serde_json::from_slice::<UsageOnly>(&openai)
                .ok()
                .and_then(|u| u.usage);
            (openai, usage)
        }
        ClientShape::Anthropic { model } => {
            let chat: ChatCompletionResponse = serde_json::from_slice(&openai)
                .map_err(|e| bad(format!("unreadable chat completion: {e}")))?;
            let message = anthropic::message_from_chat(&chat, model);
            (Bytes::from(message.to_string()), chat.usage)
        }
    };
    acct.finish(200, usage);
    let mut response = Response::new(full(out));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(response)
}

/// A streamed answer, relayed event by event.
pub fn stream(
    style: ApiStyle,
    label: &str,
    response: Response<Incoming>,
    shape: ClientShape,
    acct: Accounting,
) -> Response<Body> {
    let mut relay = ProviderRelay {
        body: response.into_body(),
        parser: SseParser::new(),
        from_anthropic: match style {
            ApiStyle::OpenAI => None,
            ApiStyle::Anthropic => Some(AnthropicStream::new()),
        },
        to_anthropic: match &shape {
            ClientShape::Anthropic { model } => Some(StreamTranslator::new(
                model,
                anthropic::message_id(&format!("{:x}", rand::random::<u64>())),
            )),
            ClientShape::OpenAi { .. } => None,
        },
        pass_usage_chunk: matches!(
            shape,
            ClientShape::OpenAi {
                pass_usage_chunk: true
            }
        ),
        label: label.to_string(),
        usage: None,
        last_text: None,
        done: false,
        ended: false,
        accounted: false,
        out: BytesMut::with_capacity(512),
        acct,
    };
    if let Some(t) = &mut relay.to_anthropic {
        t.start(&mut relay.out, 0);
    }
    let body = futures::stream::unfold(relay, |mut relay| async move {
        let chunk = relay.next_chunk().await?;
        Some((Ok::<_, Infallible>(Frame::data(chunk)), relay))
    });
    let mut response = Response::new(StreamBody::new(body).boxed_unsync());
    *response.status_mut() = StatusCode::OK;
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

struct ProviderRelay {
    body: Incoming,
    parser: SseParser,
    /// Set for Anthropic providers: their events become OpenAI chunks first.
    from_anthropic: Option<AnthropicStream>,
    /// Set for Anthropic clients.
    to_anthropic: Option<StreamTranslator>,
    pass_usage_chunk: bool,
    label: String,
    usage: Option<Usage>,
    last_text: Option<Instant>,
    /// The provider said the stream is complete.
    done: bool,
    /// Nothing more will be emitted.
    ended: bool,
    accounted: bool,
    out: BytesMut,
    acct: Accounting,
}

impl ProviderRelay {
    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            if !self.out.is_empty() {
                return Some(self.out.split().freeze());
            }
            if self.ended {
                return None;
            }
            match next_frame(&mut self.body, self.acct.idle_timeout, &self.label).await {
                Err(error) => self.fail(error),
                Ok(None) => self.upstream_ended(),
                Ok(Some(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        self.parser.feed(data);
                        while let Some(event) = self.parser.next_event() {
                            self.on_event(&event.data);
                            if self.ended {
                                break;
                            }
                        }
                    }
                }
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
                    self.on_openai_chunk(chunk.to_string().as_bytes());
                }
                if let Some(message) = step.error {
                    return self.fail(GatewayError::BadUpstream {
                        worker: self.label.clone(),
                        detail: message,
                    });
                }
                if step.done {
                    self.finish();
                }
            }
            None => {
                if data == b"[DONE]" {
                    self.finish();
                } else {
                    self.on_openai_chunk(data);
                }
            }
        }
    }

    fn on_openai_chunk(&mut self, data: &[u8]) {
        if self.ended {
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<StreamChunk>(data) else {
            tracing::debug!(provider = %self.label, "unparsable stream chunk");
            return;
        };
        if let Some(error) = &chunk.error {
            let detail = error
                .get("message")
                .and_then(|m| m.as_str())
                .unwrap_or("error event in the stream")
                .to_string();
            return self.fail(GatewayError::BadUpstream {
                worker: self.label.clone(),
                detail,
            });
        }
        if chunk.has_text() {
            let now = Instant::now();
            match self.last_text {
                None => {
                    self.acct.metrics.ttft(
                        &self.acct.labels,
                        now.duration_since(self.acct.started).as_secs_f64(),
                    );
                }
                Some(last) => self
                    .acct
                    .metrics
                    .itl(&self.acct.labels, now.duration_since(last).as_secs_f64()),
            }
            self.last_text = Some(now);
        }
        if chunk.usage.is_some() {
            self.usage = chunk.usage;
        }
        match &mut self.to_anthropic {
            Some(t) => t.chunk(&mut self.out, &chunk),
            None => {
                let usage_only = chunk.choices.is_empty() && chunk.usage.is_some();
                if !usage_only || self.pass_usage_chunk {
                    put_data(&mut self.out, data);
                }
            }
        }
    }

    fn finish(&mut self) {
        self.done = true;
        match &mut self.to_anthropic {
            Some(t) => t.finish(&mut self.out),
            None => self.out.extend_from_slice(b"data: [DONE]\n\n"),
        }
        self.account(200);
        self.ended = true;
    }

    fn upstream_ended(&mut self) {
        if self.done {
            self.ended = true;
            return;
        }
        self.fail(GatewayError::BadUpstream {
            worker: self.label.clone(),
            detail: "the provider closed the stream before it was complete".into(),
        });
    }

    fn fail(&mut self, error: GatewayError) {
        tracing::warn!(provider = %self.label, %error, "provider stream ended with an error");
        self.out
            .extend_from_slice(&error.stream_event(self.acct.protocol));
        self.account(error.status().as_u16());
        self.ended = true;
    }

    fn account(&mut self, status: u16) {
        if std::mem::replace(&mut self.accounted, true) {
            return;
        }
        self.acct.finish(status, self.usage);
    }
}

impl Drop for ProviderRelay {
    fn drop(&mut self) {
        // The client went away before the end.
        self.account(499);
    }
}
