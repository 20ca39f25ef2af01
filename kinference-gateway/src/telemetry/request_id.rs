//! The request id: the client's `x-request-id` when it is safe to log and to pass on (1 to
//! [`MAX_LEN`] characters of `A-Z a-z 0-9 - _ . : @`), else one made here (32 hex digits).

use std::fmt;
use std::sync::Arc;

use http::{HeaderMap, HeaderValue};

/// Longest client request id kept (a longer one is replaced).
pub const MAX_LEN: usize = 128;

/// A request's id (cheap to clone: the settlement, the span and the backend's headers share it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(Arc<str>);

impl RequestId {
    /// The client's `x-request-id` when it is [`RequestId::acceptable`], else a new id.
    pub fn from_headers(headers: &HeaderMap) -> Self {
        headers
            .get(super::REQUEST_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|id| Self::acceptable(id))
            .map_or_else(Self::generate, |id| RequestId(Arc::from(id)))
    }

    /// A new random id: 32 lowercase hex digits.
    pub fn generate() -> Self {
        RequestId(Arc::from(format!("{:032x}", rand::random::<u128>())))
    }

    /// Whether a client's id is kept: not empty, at most [`MAX_LEN`] characters, and only
    /// characters that need no escaping in a log line, a header or a JSON string.
    pub fn acceptable(id: &str) -> bool {
        !id.is_empty()
            && id.len() <= MAX_LEN
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':' | b'@'))
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as a header value (always valid: its characters were checked or made here).
    pub fn header_value(&self) -> HeaderValue {
        HeaderValue::from_str(&self.0).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
