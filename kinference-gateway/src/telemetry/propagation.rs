//! W3C Trace Context (`traceparent`, `tracestate`) from the client and on to the backend.
//!
//! A client's `traceparent` is kept only in its valid form (version `00`, 32 and 16 lowercase hex
//! digits, neither all zero); anything else starts a new trace. With traces exported the backend's
//! `traceparent` names the gateway's current span (the upstream call), in the client's trace;
//! without, the client's own headers pass unchanged.

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use opentelemetry::trace::TraceContextExt as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// `traceparent`.
pub const TRACEPARENT: &str = "traceparent";
/// `tracestate`.
pub const TRACESTATE: &str = "tracestate";

/// The client's trace context: a valid `traceparent` and its `tracestate`, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTrace {
    traceparent: HeaderValue,
    tracestate: Option<HeaderValue>,
}

impl ClientTrace {
    /// The client's trace context from `headers`, when its `traceparent` is valid.
    pub fn from_headers(headers: &HeaderMap) -> Option<ClientTrace> {
        let traceparent = headers.get(TRACEPARENT)?;
        if !valid_traceparent(traceparent.to_str().ok()?) {
            return None;
        }
        Some(ClientTrace {
            traceparent: traceparent.clone(),
            tracestate: headers.get(TRACESTATE).cloned(),
        })
    }

    /// The trace id (32 hex digits).
    pub fn trace_id(&self) -> &str {
        self.traceparent.to_str().map_or("", |t| &t[3..35])
    }

    /// The context the gateway's root span continues.
    pub fn context(&self) -> opentelemetry::Context {
        let mut carrier = HeaderMap::new();
        self.copy_to(&mut carrier);
        TraceContextPropagator::new().extract(&Headers(&mut carrier))
    }

    /// The client's headers, unchanged, into `headers`.
    pub fn copy_to(&self, headers: &mut HeaderMap) {
        headers.insert(TRACEPARENT, self.traceparent.clone());
        if let Some(state) = &self.tracestate {
            headers.insert(TRACESTATE, state.clone());
        }
    }
}

/// `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, ids not all zero.
pub fn valid_traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    let hex = |s: &str, len: usize| {
        s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
    matches!(parts.as_slice(), [version, trace, parent, flags]
        if *version == "00"
            && hex(trace, 32)
            && hex(parent, 16)
            && hex(flags, 2)
            && nonzero(trace)
            && nonzero(parent))
}

/// The current span's trace context into `headers`; `false` when there is none (the span is not
/// exported).
pub fn inject_current(headers: &mut HeaderMap) -> bool {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let context = tracing::Span::current().context();
    if !context.span().span_context().is_valid() {
        return false;
    }
    TraceContextPropagator::new().inject_context(&context, &mut Headers(headers));
    true
}

/// A [`HeaderMap`] as the propagator's carrier.
struct Headers<'a>(&'a mut HeaderMap);

impl Injector for Headers<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}
