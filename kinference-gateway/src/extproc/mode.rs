//! How the proxy sends bodies on one stream: the `protocol_config` Envoy puts on the first message
//! of each stream (`ProcessingRequest.protocol_config`, Envoy 1.32 and later). A proxy that sends
//! none is read the way older Envoys behave: one answer per message, a body ends at
//! `end_of_stream`.

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::ProtocolConfiguration;

/// One direction's body mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BodyMode {
    /// The proxy did not say (no `protocol_config`).
    #[default]
    Unknown,
    /// `NONE`: the body never reaches the processor.
    None,
    /// `BUFFERED`: the whole body in one message (trailers may follow it).
    Buffered,
    /// `STREAMED` or `BUFFERED_PARTIAL`: chunks, one answer each, before the proxy sends the next.
    Streamed,
    /// `FULL_DUPLEX_STREAMED`: chunks sent without waiting; the processor's streamed answers are
    /// all the proxy forwards, and it holds the headers until they are answered.
    FullDuplex,
}

impl BodyMode {
    fn of(mode: i32) -> Self {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::None) => BodyMode::None,
            Ok(BodySendMode::Buffered) => BodyMode::Buffered,
            Ok(BodySendMode::Streamed | BodySendMode::BufferedPartial) => BodyMode::Streamed,
            Ok(BodySendMode::FullDuplexStreamed) => BodyMode::FullDuplex,
            // `GRPC` (gRPC messages, not an inference API) or a mode newer than this build.
            _ => BodyMode::Unknown,
        }
    }
}

/// Both directions' body modes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Modes {
    /// The request body's.
    pub request: BodyMode,
    /// The response body's.
    pub response: BodyMode,
}

impl From<&ProtocolConfiguration> for Modes {
    fn from(config: &ProtocolConfiguration) -> Self {
        Modes {
            request: BodyMode::of(config.request_body_mode),
            response: BodyMode::of(config.response_body_mode),
        }
    }
}
