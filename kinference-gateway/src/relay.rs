//! Streaming a worker's SSE answer back to the client, chunk by chunk, in the client's protocol.
//!
//! The [`Relay`] reads one upstream frame at a time, parses the SSE events it completes, and emits
//! what they translate to; nothing waits for the whole response. OpenAI clients get the worker's events
//! as they are (minus the usage chunk when they did not ask for it); Anthropic clients get the
//! translated event sequence. A stream that stalls, breaks or ends without `[DONE]` ends with an error
//! event in the client's protocol. Accounting (metrics, the router's ledger) happens exactly once: at
//! the end of the stream, or with status 499 when the client goes away first.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Incoming;

use crate::api::anthropic::StreamTranslator;
use crate::api::openai::{StreamChunk, Usage};
use crate::errors::{GatewayError, Protocol};
use crate::metrics::{InFlightGuard, Metrics, RequestLabels, WorkerLabels};
use crate::routing::{Decision, InFlight};
use crate::server::Body;
use crate::upstream::error_chain;
use crate::upstream::sse::{SseEvent, SseParser};

/// How upstream events become client events.
#[derive(Debug)]
pub enum RelayMode {
    /// OpenAI in, OpenAI out.
    OpenAi {
        /// Whether the client asked for the final usage chunk (the gateway always asks the worker).
        pass_usage_chunk: bool,
    },
    /// OpenAI in, Anthropic out.
    Anthropic(StreamTranslator),
}

/// The state of one relayed stream.
pub struct Relay {
    body: Incoming,
    parser: SseParser,
    mode: RelayMode,
    worker: String,
    ticket: Option<InFlight>,
    metrics: Metrics,
    idle_timeout: Duration,
    started: Instant,
    last_text: Option<Instant>,
    labels: WorkerLabels,
    protocol: Protocol,
    usage: Option<Usage>,
    saw_done: bool,
    ended: bool,
    out: BytesMut,
    _in_flight: Option<InFlightGuard>,
    /// The tenant's admission, settled with the request (see [`Relay::with_admission`]).
    admission: Option<crate::tenancy::Admission>,
}

impl Relay {
    /// A relay for `body`; Anthropic clients get their opening events at once.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        body: Incoming,
        mode: RelayMode,
        decision: Decision,
        metrics: Metrics,
        idle_timeout: Duration,
        started: Instant,
        labels: WorkerLabels,
        protocol: Protocol,
        in_flight: Option<InFlightGuard>,
    ) -> Self {
        let mut relay = Relay {
            body,
            parser: SseParser::new(),
            mode,
            worker: decision.worker,
            ticket: Some(decision.ticket),
            metrics,
            idle_timeout,
            started,
            last_text: None,
            labels,
            protocol,
            usage: None,
            saw_done: false,
            ended: false,
            out: BytesMut::with_capacity(512),
            _in_flight: in_flight,
            admission: None,
        };
        if let RelayMode::Anthropic(translator) = &mut relay.mode {
            let estimate = decision.prompt_tokens.unwrap_or(0) as u64;
            translator.start(&mut relay.out, estimate);
        }
        relay
    }

    /// Settles `admission` (usage, rate-limit reconciliation, per-tenant metrics) when the stream
    /// ends, exactly once, like the rest of the accounting.
    pub fn with_admission(mut self, admission: Option<crate::tenancy::Admission>) -> Self {
        self.admission = admission;
        self
    }

    /// The relay as a streaming response body.
    pub fn into_body(self) -> Body {
        let stream = futures::stream::unfold(self, |mut relay| async move {
            let chunk = relay.next_chunk().await?;
            Some((Ok::<_, Infallible>(Frame::data(chunk)), relay))
        });
        StreamBody::new(stream).boxed_unsync()
    }

    /// The next bytes for the client, or `None` when the stream is over.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            if !self.out.is_empty() {
                return Some(self.out.split().freeze());
            }
            if self.ended {
                return None;
            }
            match next_frame(&mut self.body, self.idle_timeout, &self.worker).await {
                Err(error) => self.fail(error),
                Ok(None) => self.upstream_ended(),
                Ok(Some(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        self.parser.feed(data);
                        while let Some(event) = self.parser.next_event() {
                            self.on_event(event);
                            if self.ended {
                                break;
                            }
                        }
                    }
                }
            }
        }
    }

    fn on_event(&mut self, event: SseEvent) {
        if self.saw_done {
            return;
        }
        if event.is_done() {
            self.saw_done = true;
            if let RelayMode::OpenAi { .. } = self.mode {
                self.out.extend_from_slice(b"data: [DONE]\n\n");
            }
            return;
        }
        let chunk: StreamChunk = match serde_json::from_slice(&event.data) {
            Ok(chunk) => chunk,
            Err(e) => {
                tracing::debug!(worker = %self.worker, error = %e, "unparsable stream chunk");
                if let RelayMode::OpenAi { .. } = self.mode {
                    put_data(&mut self.out, &event.data);
                }
                return;
            }
        };
        if let Some(error) = &chunk.error {
            let detail = error
                .get("message")
                .and_then(|m| m.as_str())
                .unwrap_or("error event in the stream")
                .to_string();
            self.fail(GatewayError::BadUpstream {
                worker: self.worker.clone(),
                detail,
            });
            return;
        }
        if chunk.has_text() {
            self.observe_text();
        }
        if chunk.usage.is_some() {
            self.usage = chunk.usage;
        }
        match &mut self.mode {
            RelayMode::OpenAi { pass_usage_chunk } => {
                let usage_only = chunk.choices.is_empty() && chunk.usage.is_some();
                if !usage_only || *pass_usage_chunk {
                    put_data(&mut self.out, &event.data);
                }
            }
            RelayMode::Anthropic(translator) => translator.chunk(&mut self.out, &chunk),
        }
    }

    fn observe_text(&mut self) {
        if let Some(admission) = &mut self.admission {
            admission.text_chunk();
        }
        let now = Instant::now();
        match self.last_text {
            None => {
                self.metrics
                    .ttft(&self.labels, now.duration_since(self.started).as_secs_f64());
                if let Some(ticket) = &mut self.ticket {
                    ticket.first_token();
                }
            }
            Some(last) => self
                .metrics
                .itl(&self.labels, now.duration_since(last).as_secs_f64()),
        }
        self.last_text = Some(now);
    }

    fn upstream_ended(&mut self) {
        if !self.saw_done {
            return self.fail(GatewayError::BadUpstream {
                worker: self.worker.clone(),
                detail: "the worker closed the stream before it was complete".to_string(),
            });
        }
        if let RelayMode::Anthropic(translator) = &mut self.mode {
            translator.finish(&mut self.out);
        }
        self.account(200, true);
        self.ended = true;
    }

    fn fail(&mut self, error: GatewayError) {
        tracing::warn!(worker = %self.worker, model = %self.labels.model, %error, "stream ended with an error");
        self.out
            .extend_from_slice(&error.stream_event(self.protocol));
        self.account(error.status().as_u16(), false);
        self.ended = true;
    }

    fn account(&mut self, status: u16, ok: bool) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        if let Some(admission) = self.admission.take() {
            admission.settle(status, self.usage.as_ref());
        }
        let usage = self.usage.unwrap_or_default();
        let cached = usage.cached_tokens();
        self.metrics
            .e2e(&self.labels, self.started.elapsed().as_secs_f64());
        self.metrics.tokens(
            &self.labels,
            usage.prompt_tokens,
            usage.completion_tokens,
            cached.unwrap_or(0),
        );
        self.metrics.request(RequestLabels {
            model: self.labels.model.clone(),
            worker: self.labels.worker.clone(),
            status,
            protocol: self.protocol.as_str(),
        });
        ticket.finish(
            ok,
            usize::try_from(usage.completion_tokens).unwrap_or(usize::MAX),
            cached.and_then(|c| usize::try_from(c).ok()),
        );
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // The client went away before the end: 499, and the ticket is released as failed.
        if self.ticket.is_some() {
            tracing::debug!(worker = %self.worker, "client closed the stream early");
            self.account(499, false);
        }
    }
}

/// Waits at most `idle` for the next frame of `worker`'s stream: `Ok(None)` when the stream ended, the
/// error to end the client's stream with when it stalled or broke.
pub(crate) async fn next_frame(
    body: &mut Incoming,
    idle: Duration,
    worker: &str,
) -> Result<Option<Frame<Bytes>>, GatewayError> {
    match tokio::time::timeout(idle, body.frame()).await {
        Err(_) => Err(GatewayError::UpstreamTimeout {
            worker: worker.to_string(),
            what: "the stream stalled past the idle timeout",
        }),
        Ok(None) => Ok(None),
        Ok(Some(Err(e))) => Err(GatewayError::BadUpstream {
            worker: worker.to_string(),
            detail: format!("the stream broke: {}", error_chain(&e)),
        }),
        Ok(Some(Ok(frame))) => Ok(Some(frame)),
    }
}

/// Appends `data` to `out` as one SSE `data:` event.
pub(crate) fn put_data(out: &mut BytesMut, data: &[u8]) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\n\n");
}
