//! The answers of the pass-through endpoints (`/v1/embeddings`, `/v1/responses`, `/tokenize`,
//! `/detokenize`) back to the client byte for byte, their usage read on the way: a whole answer's
//! `usage`, a streamed response's from its `response.completed` event. The requests themselves go
//! through the same stages as chat's ([`super::run`]); only the answer's shape differs.
//!
//! [`Passing`] is fed the worker's bytes by either door: the HTTP pipeline from the worker's body
//! ([`stream`]), the ext_proc handler from the response chunks Envoy shows it.

use std::convert::Infallible;

use bytes::{Bytes, BytesMut};
use http::StatusCode;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};

use crate::api::openai::Usage;
use crate::api::openai::passthrough::{Route, answer_id_of, usage_of};
use crate::backend::relay::{Meter, next_frame};
use crate::backend::sse::SseParser;
use crate::body::Body;
use crate::errors::{GatewayError, Protocol};

/// A streamed worker body with the worker's label, for errors.
pub struct StreamedBody {
    /// The worker's body.
    pub body: Incoming,
    /// The worker's URL.
    pub worker: String,
}

/// The worker's event stream passed on byte for byte; `meter` hears each text delta and, at the
/// end, the usage of the `response.completed` event. A stream that stalls, breaks or ends without
/// a final event ends with an OpenAI error event.
pub fn stream<M: Meter>(body: StreamedBody, idle: std::time::Duration, meter: M) -> Body {
    // Of the pass-through endpoints only `/v1/responses` streams.
    let state = (body, idle, Passing::new(Route::Responses, meter));
    let frames = futures::stream::unfold(state, |(mut body, idle, mut passing)| async move {
        if passing.is_over() {
            return None;
        }
        let bytes = match next_frame(&mut body.body, idle, &body.worker).await {
            Ok(Some(frame)) => match frame.into_data() {
                Ok(data) => passing.feed(&data),
                Err(_) => Bytes::new(),
            },
            Ok(None) => passing.end(&body.worker),
            Err(error) => passing.fail(error),
        };
        Some((
            Ok::<_, Infallible>(Frame::data(bytes)),
            (body, idle, passing),
        ))
    });
    StreamBody::new(frames).boxed_unsync()
}

/// One passed-on answer of a pass-through endpoint.
pub struct Passing<M: Meter> {
    route: Route,
    parser: SseParser,
    usage: Option<Usage>,
    /// A final event (`response.completed`, `.incomplete`, `.failed`) passed.
    complete: bool,
    /// The answer's id was told to the meter (from `response.created`).
    id_told: bool,
    /// Taken when the stream ends; dropped (the request abandoned) when the client leaves first.
    meter: Option<M>,
}

impl<M: Meter> Passing<M> {
    /// A streamed answer of `route` (only `/v1/responses` streams).
    pub fn new(route: Route, meter: M) -> Self {
        Passing {
            route,
            parser: SseParser::new(),
            usage: None,
            complete: false,
            id_told: false,
            meter: Some(meter),
        }
    }

    /// Whether the answer was settled (nothing more passes).
    pub fn is_over(&self) -> bool {
        self.meter.is_none()
    }

    /// A piece of the worker's event stream: passed as it is, heard on the way.
    pub fn feed(&mut self, data: &[u8]) -> Bytes {
        let Some(meter) = self.meter.as_mut() else {
            return Bytes::new();
        };
        self.parser.feed(data);
        while let Some(event) = self.parser.next_event() {
            let kind = event.event.as_deref().unwrap_or_default();
            if !self.id_told
                && matches!(kind, "response.created" | "response.completed")
                && let Some(id) = answer_id_of(self.route, &event.data)
            {
                self.id_told = true;
                meter.answer_id(id);
            }
            if kind == "response.output_text.delta" {
                let text = serde_json::from_slice::<serde_json::Value>(&event.data)
                    .ok()
                    .and_then(|v| v.get("delta")?.as_str().map(str::to_string))
                    .unwrap_or_default();
                meter.text_chunk(&text);
            } else if matches!(
                kind,
                "response.completed" | "response.incomplete" | "response.failed"
            ) {
                self.complete = true;
                self.usage = usage_of(self.route, &event.data);
            }
        }
        Bytes::copy_from_slice(data)
    }

    /// The worker's stream ended: settled with the final event's usage, or (no final event) failed
    /// with an error event for the client.
    pub fn end(&mut self, worker: &str) -> Bytes {
        if self.complete {
            if let Some(mut meter) = self.meter.take() {
                meter.finish(StatusCode::OK.as_u16(), self.usage.as_ref());
            }
            return Bytes::new();
        }
        self.fail(GatewayError::BadUpstream {
            worker: worker.to_string(),
            detail: "the worker closed the stream before it was complete".into(),
        })
    }

    /// The stream failed with `error`: settled with its status; the error event for the client.
    pub fn fail(&mut self, error: GatewayError) -> Bytes {
        let Some(mut meter) = self.meter.take() else {
            return Bytes::new();
        };
        tracing::warn!(%error, "stream ended with an error");
        meter.finish(error.status().as_u16(), self.usage.as_ref());
        let mut out = BytesMut::new();
        out.extend_from_slice(&error.stream_event(Protocol::OpenAi));
        out.freeze()
    }
}

#[cfg(test)]
mod tests;
