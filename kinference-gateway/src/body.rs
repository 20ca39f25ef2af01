//! The response body every route of the gateway answers with: whole or streamed, never failing
//! (a stream's errors become events in the client's protocol). At the bottom of the module graph so
//! that errors, relays and servers can all build responses without importing each other.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};

/// Response body of every route.
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// A complete body.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed_unsync()
}
