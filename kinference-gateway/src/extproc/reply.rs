//! The ext_proc messages the handler sends back, built the way the Gateway API Inference Extension's
//! endpoint picker builds them, so an Envoy configured for that picker works unchanged.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

/// The header (and `envoy.lb` metadata key) naming the chosen endpoint, as `ip:port`.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The dynamic metadata namespace Envoy's original-destination load balancer reads.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The worker's base URL, for logs and tests (the same header the HTTP gateway returns).
pub const WORKER_HEADER: &str = "x-kinference-worker";

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            // Envoy sends and prefers `raw_value`; the endpoint picker sets it too.
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// `envoy.lb { x-gateway-destination-endpoint: endpoint }`.
pub fn destination_metadata(endpoint: &str) -> Struct {
    let inner = Struct {
        fields: HashMap::from([(DESTINATION_HEADER.to_string(), string_value(endpoint))]),
    };
    Struct {
        fields: HashMap::from([(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]),
    }
}

/// `headers` as header settings (values that are not text are left out: ids and trace contexts
/// are).
fn set_all(headers: &http::HeaderMap) -> impl Iterator<Item = HeaderValueOption> + '_ {
    headers
        .iter()
        .filter_map(|(name, value)| Some(set_header(name.as_str(), value.to_str().ok()?)))
}

/// What a client may send that never reaches a worker: its own credentials (the worker gets the
/// pool's, set instead), the admin key, and a destination of its choosing.
pub const CLIENT_ONLY_HEADERS: [&str; 4] = [
    "authorization",
    "x-api-key",
    crate::access::ADMIN_KEY_HEADER,
    DESTINATION_HEADER,
];

/// Which request message a routing answer answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The request headers: a request without a body, or `FULL_DUPLEX_STREAMED`, where the headers
    /// wait for the body to be read (the body then follows as [`streamed_request_body`] chunks).
    Headers,
    /// The last request-body chunk (`BUFFERED`, `STREAMED`): the new body rides in this answer.
    Body,
}

/// The answer once a worker is chosen: the destination header (the route cache is cleared so
/// Envoy re-evaluates the route with it) and the same value in the `envoy.lb` metadata
/// (`endpoints`: the chosen `ip:port`, then any fallbacks, comma-separated), and `headers` for the
/// worker (its pool's credentials, the request's `x-request-id` and trace context), the client's
/// own credentials and admin key removed ([`CLIENT_ONLY_HEADERS`]). With `body` the worker gets
/// that body: its length is set, and in the [`Phase::Body`] answer the body itself.
pub fn routed(
    endpoints: &str,
    worker: &str,
    headers: &http::HeaderMap,
    body: Option<&bytes::Bytes>,
    phase: Phase,
) -> ProcessingResponse {
    let mut set_headers = vec![
        set_header(DESTINATION_HEADER, endpoints),
        set_header(WORKER_HEADER, worker),
    ];
    set_headers.extend(set_all(headers));
    if let Some(body) = body {
        set_headers.push(set_header("content-length", &body.len().to_string()));
    }
    let remove_headers = CLIENT_ONLY_HEADERS
        .iter()
        .filter(|h| !headers.contains_key(**h))
        .map(|h| h.to_string())
        .collect();
    let common = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers,
            remove_headers,
        }),
        body_mutation: body.filter(|_| phase == Phase::Body).map(|b| BodyMutation {
            mutation: Some(Mutation::Body(b.to_vec())),
        }),
        clear_route_cache: true,
        ..Default::default()
    };
    ProcessingResponse {
        response: Some(match phase {
            Phase::Headers => Response::RequestHeaders(HeadersResponse {
                response: Some(common),
            }),
            Phase::Body => Response::RequestBody(BodyResponse {
                response: Some(common),
            }),
        }),
        dynamic_metadata: Some(destination_metadata(endpoints)),
        ..Default::default()
    }
}

/// The largest body chunk sent back in `FULL_DUPLEX_STREAMED` (Envoy's own default gRPC message
/// limit is far above it; the reference picker sends chunks of this order too).
pub const STREAMED_CHUNK_BYTES: usize = 62 * 1024;

fn streamed(body: &[u8], end_of_stream: bool) -> CommonResponse {
    CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                body: body.to_vec(),
                end_of_stream,
                ..Default::default()
            })),
        }),
        ..Default::default()
    }
}

/// `body` for the worker in `FULL_DUPLEX_STREAMED` answers: Envoy forwards exactly what these carry,
/// in chunks of at most [`STREAMED_CHUNK_BYTES`]; the last ends the body when `end_of_stream`
/// (not when trailers end the request).
pub fn streamed_request_body(body: &[u8], end_of_stream: bool) -> Vec<ProcessingResponse> {
    chunked(body, end_of_stream, |common| {
        Response::RequestBody(BodyResponse {
            response: Some(common),
        })
    })
}

/// A response-body chunk in `FULL_DUPLEX_STREAMED`: what the client gets of it (as the relay
/// passes it), the last one ending the answer when `end_of_stream`.
pub fn streamed_response_body(body: &[u8], end_of_stream: bool) -> Vec<ProcessingResponse> {
    chunked(body, end_of_stream, |common| {
        Response::ResponseBody(BodyResponse {
            response: Some(common),
        })
    })
}

fn chunked(
    body: &[u8],
    end_of_stream: bool,
    wrap: impl Fn(CommonResponse) -> Response,
) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = if body.is_empty() {
        vec![&[]]
    } else {
        body.chunks(STREAMED_CHUNK_BYTES).collect()
    };
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| ProcessingResponse {
            response: Some(wrap(streamed(chunk, end_of_stream && i == last))),
            ..Default::default()
        })
        .collect()
}

/// Continue after request headers, setting `headers` and removing `content-length` (the body may
/// be rewritten for the worker; Envoy sets its length again).
pub fn request_headers_continue_without_length(headers: &http::HeaderMap) -> ProcessingResponse {
    let mut common = setting(headers);
    common
        .header_mutation
        .get_or_insert_with(HeaderMutation::default)
        .remove_headers
        .push("content-length".to_string());
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(common),
        })),
        ..Default::default()
    }
}

/// A request-body chunk (streamed body mode) taken off the request: the gateway keeps it, and the
/// last chunk's answer carries the whole body.
pub fn request_body_taken() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(Mutation::ClearBody(true)),
                }),
                ..Default::default()
            }),
        })),
        ..Default::default()
    }
}

/// A response-body chunk replaced by `body` (what the relay passes to the client of it).
pub fn response_body_replaced(body: bytes::Bytes) -> ProcessingResponse {
    let mutation = if body.is_empty() {
        Mutation::ClearBody(true)
    } else {
        Mutation::Body(body.to_vec())
    };
    ProcessingResponse {
        response: Some(Response::ResponseBody(BodyResponse {
            response: Some(CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(mutation),
                }),
                ..Default::default()
            }),
        })),
        ..Default::default()
    }
}

/// Continue after request headers, setting `headers` on the request (its `x-request-id`, so a
/// request Envoy routes without a body still carries it to the backend).
pub fn request_headers_continue(headers: &http::HeaderMap) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(setting(headers)),
        })),
        ..Default::default()
    }
}

/// A common response that sets `headers` (none: unchanged).
fn setting(headers: &http::HeaderMap) -> CommonResponse {
    CommonResponse {
        header_mutation: (!headers.is_empty()).then(|| HeaderMutation {
            set_headers: set_all(headers).collect(),
            remove_headers: Vec::new(),
        }),
        ..Default::default()
    }
}

/// Continue after a request-body chunk that is not the last (streamed body mode).
pub fn request_body_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(CommonResponse::default()),
        })),
        ..Default::default()
    }
}

/// Continue after response headers, setting `headers` on the response (the `x-request-id` echoed
/// to the client).
pub fn response_headers_continue(headers: &http::HeaderMap) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse {
            response: Some(setting(headers)),
        })),
        ..Default::default()
    }
}

/// Continue after a response-body chunk.
pub fn response_body_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseBody(BodyResponse {
            response: Some(CommonResponse::default()),
        })),
        ..Default::default()
    }
}

/// Continue after request trailers.
pub fn request_trailers_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestTrailers(TrailersResponse::default())),
        ..Default::default()
    }
}

/// Continue after response trailers.
pub fn response_trailers_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseTrailers(TrailersResponse::default())),
        ..Default::default()
    }
}

/// A local reply Envoy sends to the client instead of forwarding: `status` with a JSON body and
/// `headers` besides its content type. `details` shows up in Envoy's access log
/// (`%RESPONSE_CODE_DETAILS%`).
pub fn immediate(
    status: u16,
    body: &serde_json::Value,
    details: &str,
    headers: &[(&str, &str)],
) -> ProcessingResponse {
    let mut set_headers = vec![set_header("content-type", "application/json")];
    set_headers.extend(headers.iter().map(|(k, v)| set_header(k, v)));
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers,
                remove_headers: Vec::new(),
            }),
            body: body.to_string().into_bytes(),
            grpc_status: None,
            details: details.to_string(),
        })),
        ..Default::default()
    }
}
