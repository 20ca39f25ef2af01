//! The gateway's one error type and its mapping, once, at the edge, to the client's protocol.
//!
//! Every stage of the pipeline returns [`GatewayError`]; only [`GatewayError::into_response`] and
//! [`GatewayError::stream_event`] know what an OpenAI or Anthropic client expects (status, JSON shape,
//! error type names), so the stages stay protocol-neutral.

use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use serde_json::json;

use crate::routing::RouteError;

/// Which wire protocol the client speaks; decides the error shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/models`).
    OpenAi,
    /// Anthropic (`/v1/messages`).
    Anthropic,
}

impl Protocol {
    /// Label value for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::OpenAi => "openai",
            Protocol::Anthropic => "anthropic",
        }
    }
}

/// Everything that can go wrong with one request.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GatewayError {
    /// The body is not JSON, or not the expected JSON shape.
    #[error("malformed request body: {0}")]
    MalformedJson(String),
    /// A field is missing or has a value the gateway does not accept.
    #[error("{message}")]
    InvalidRequest {
        /// What is wrong, for humans.
        message: String,
        /// The offending field, when one is to blame.
        param: Option<&'static str>,
    },
    /// No worker serves the requested model.
    #[error("The model `{0}` does not exist")]
    UnknownModel(String),
    /// The request body exceeds the configured limit.
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The body's JSON would hold more memory once parsed than one tenant's bodies may (many small
    /// values: a tree of them costs many times their text).
    #[error(
        "request body too costly to parse: about {cost} bytes once parsed, past the limit of {limit}"
    )]
    BodyTooCostly {
        /// What it would cost, in bytes.
        cost: usize,
        /// The per-tenant body budget.
        limit: usize,
    },
    /// No route for this method and path.
    #[error("no route for {method} {path}")]
    NotFound {
        /// Request method.
        method: String,
        /// Request path.
        path: String,
    },
    /// The stored answer a request continues (`previous_response_id`) is another tenant's. Worded
    /// as vLLM words an answer it does not hold, so that the refusal tells nothing of whose it is.
    #[error("Response with id '{0}' not found.")]
    ResponseNotFound(String),
    /// Workers serve the model but none is healthy.
    #[error("no healthy worker serves model `{0}`")]
    NoHealthyWorker(String),
    /// The worker could not be reached (refused connection, connect timeout).
    #[error("worker {worker} is unreachable: {detail}")]
    WorkerUnreachable {
        /// Worker base URL.
        worker: String,
        /// The cause.
        detail: String,
    },
    /// The worker answered something the gateway cannot use, or broke the connection.
    #[error("bad response from worker {worker}: {detail}")]
    BadUpstream {
        /// Worker base URL.
        worker: String,
        /// The cause.
        detail: String,
    },
    /// The worker did not answer (or went silent mid-stream) within the configured timeout.
    #[error("worker {worker} timed out ({what})")]
    UpstreamTimeout {
        /// Worker base URL.
        worker: String,
        /// Which timeout fired.
        what: &'static str,
    },
    /// The worker rejected the request itself (its own 4xx); passed on with its status and message.
    #[error("{message}")]
    UpstreamRejected {
        /// The worker's status.
        status: StatusCode,
        /// The worker's error message.
        message: String,
    },
    /// An inference policy refused the request (or left it no backend, e.g. personal data with no
    /// local pool available): the policy's status, a machine-readable code and the message.
    #[error("{message}")]
    PolicyRejected {
        /// The policy's status.
        status: StatusCode,
        /// `policy_rejected`, `local_processing_required`, `model_not_allowed`, ...
        code: &'static str,
        /// For the client.
        message: String,
    },
    /// No API key, or one no tenant has (401).
    #[error("{0}")]
    Unauthenticated(String),
    /// A tenant's rate limit is reached (429); `headers` are `Retry-After` and the protocol's
    /// rate-limit headers.
    #[error("{message}")]
    RateLimited {
        /// For the client (never holds a key).
        message: String,
        /// Response headers.
        headers: Vec<(&'static str, String)>,
    },
    /// A tenant's monthly budget is spent (429; OpenAI `insufficient_quota`).
    #[error("{message}")]
    BudgetExceeded {
        /// For the client.
        message: String,
        /// Response headers (`Retry-After`: the end of the month).
        headers: Vec<(&'static str, String)>,
    },
    /// The shared rate-limit store is unreachable and the tenant fails closed (503).
    #[error(
        "rate limits cannot be checked right now (the shared limit store is unreachable); retry shortly"
    )]
    LimitsUnavailable,
    /// The usage journal cannot be written (a full disk) and the tenant's `on_usage_unrecorded`
    /// is `refuse` (503).
    #[error(
        "usage cannot be recorded right now (the gateway's usage journal cannot be written); retry shortly"
    )]
    UsageUnrecorded,
    /// Tenants are configured but no valid tenant set has ever been loaded: the gateway refuses
    /// every request (503) rather than serve it unauthenticated.
    #[error("{0}")]
    TenantsUnavailable(String),
    /// The gateway is at its connection or in-flight limit and sheds the request before reading
    /// its body (503 with `Retry-After`; Anthropic `overloaded_error`).
    #[error("the gateway is overloaded ({reason}); retry after {retry_after_s} s")]
    Overloaded {
        /// `connections`, `queue_full` or `queue_timeout`.
        reason: &'static str,
        /// `Retry-After`, in seconds.
        retry_after_s: u64,
    },
    /// The flow control shed the request while its pool was saturated ([`crate::overload::flow`]):
    /// 429 when its tenant already has its share of the queue waiting, else 503; `Retry-After`.
    #[error(
        "the model's workers are saturated and the request was not served ({reason}); retry after {retry_after_s} s"
    )]
    FlowShed {
        /// `queue_deadline`, `queue_full`, `displaced` or `tenant_queue_full`.
        reason: &'static str,
        /// `Retry-After`, in seconds.
        retry_after_s: u64,
        /// The tenant's own share is the cause (429).
        tenants_own: bool,
    },
    /// The client did not send its whole body within the read deadline (408); its slot is freed.
    #[error("the request body did not arrive within {timeout_ms} ms")]
    BodyTimeout {
        /// The deadline in milliseconds.
        timeout_ms: u64,
    },
    /// The proxy's ext_proc processing mode does not let the gateway govern the request (no body
    /// sent for an endpoint that needs one, trailers after a streamed body): a configuration
    /// error of the proxy, not the client's (500).
    #[error("{0}")]
    ProxyModeUnsupported(String),
}

impl From<RouteError> for GatewayError {
    fn from(e: RouteError) -> Self {
        match e {
            RouteError::UnknownModel(m) => GatewayError::UnknownModel(m),
            RouteError::NoHealthyWorker(m) => GatewayError::NoHealthyWorker(m),
        }
    }
}

impl From<crate::overload::flow::Shed> for GatewayError {
    fn from(shed: crate::overload::flow::Shed) -> Self {
        GatewayError::FlowShed {
            reason: shed.reason.as_str(),
            retry_after_s: shed.retry_after_s,
            tenants_own: shed.reason.tenants_own(),
        }
    }
}

impl From<crate::overload::Refused> for GatewayError {
    fn from(refused: crate::overload::Refused) -> Self {
        GatewayError::Overloaded {
            reason: refused.reason,
            retry_after_s: refused.retry_after_s,
        }
    }
}

impl GatewayError {
    /// A 400 for a bad field.
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        GatewayError::InvalidRequest {
            message: message.into(),
            param: Some(param),
        }
    }

    /// The HTTP status this error maps to.
    pub fn status(&self) -> StatusCode {
        match self {
            GatewayError::MalformedJson(_) | GatewayError::InvalidRequest { .. } => {
                StatusCode::BAD_REQUEST
            }
            GatewayError::UnknownModel(_)
            | GatewayError::NotFound { .. }
            | GatewayError::ResponseNotFound(_) => StatusCode::NOT_FOUND,
            GatewayError::BodyTooLarge { .. } | GatewayError::BodyTooCostly { .. } => {
                StatusCode::PAYLOAD_TOO_LARGE
            }
            GatewayError::NoHealthyWorker(_) => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::WorkerUnreachable { .. } | GatewayError::BadUpstream { .. } => {
                StatusCode::BAD_GATEWAY
            }
            GatewayError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            GatewayError::UpstreamRejected { status, .. } => *status,
            GatewayError::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            GatewayError::RateLimited { .. } | GatewayError::BudgetExceeded { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            GatewayError::LimitsUnavailable
            | GatewayError::TenantsUnavailable(_)
            | GatewayError::UsageUnrecorded => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::PolicyRejected { status, .. } => *status,
            GatewayError::Overloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::FlowShed { tenants_own, .. } => {
                if *tenants_own {
                    StatusCode::TOO_MANY_REQUESTS
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            }
            GatewayError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            GatewayError::ProxyModeUnsupported(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Short label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            GatewayError::MalformedJson(_) => "malformed_json",
            GatewayError::InvalidRequest { .. } => "invalid_request",
            GatewayError::UnknownModel(_) => "unknown_model",
            GatewayError::BodyTooLarge { .. } => "body_too_large",
            GatewayError::BodyTooCostly { .. } => "body_too_costly",
            GatewayError::NotFound { .. } => "not_found",
            GatewayError::ResponseNotFound(_) => "response_not_found",
            GatewayError::NoHealthyWorker(_) => "no_healthy_worker",
            GatewayError::WorkerUnreachable { .. } => "worker_unreachable",
            GatewayError::BadUpstream { .. } => "bad_upstream",
            GatewayError::UpstreamTimeout { .. } => "upstream_timeout",
            GatewayError::UpstreamRejected { .. } => "upstream_rejected",
            GatewayError::Unauthenticated(_) => "unauthenticated",
            GatewayError::RateLimited { .. } => "rate_limited",
            GatewayError::BudgetExceeded { .. } => "budget_exceeded",
            GatewayError::LimitsUnavailable => "limits_unavailable",
            GatewayError::UsageUnrecorded => "usage_unrecorded",
            GatewayError::TenantsUnavailable(_) => "tenants_unavailable",
            GatewayError::PolicyRejected { .. } => "policy_rejected",
            GatewayError::Overloaded { .. } => "overloaded",
            GatewayError::FlowShed { .. } => "flow_shed",
            GatewayError::BodyTimeout { .. } => "body_timeout",
            GatewayError::ProxyModeUnsupported(_) => "proxy_mode_unsupported",
        }
    }

    fn openai_type(&self) -> &'static str {
        match self {
            GatewayError::BudgetExceeded { .. } => return "insufficient_quota",
            // As vLLM types an answer it does not hold.
            GatewayError::ResponseNotFound(_) => return "invalid_request_error",
            _ => {}
        }
        match self.status().as_u16() {
            400 | 413 | 422 => "invalid_request_error",
            404 => "not_found_error",
            401 => "authentication_error",
            403 => "permission_error",
            429 => "rate_limit_error",
            503 => "service_unavailable_error",
            408 | 504 => "timeout_error",
            _ => "api_error",
        }
    }

    fn openai_code(&self) -> Option<&'static str> {
        match self {
            GatewayError::UnknownModel(_) => Some("model_not_found"),
            GatewayError::BodyTooLarge { .. } | GatewayError::BodyTooCostly { .. } => {
                Some("request_too_large")
            }
            GatewayError::NoHealthyWorker(_) => Some("no_healthy_worker"),
            GatewayError::WorkerUnreachable { .. } => Some("worker_unreachable"),
            GatewayError::BadUpstream { .. } => Some("bad_upstream"),
            GatewayError::UpstreamTimeout { .. } => Some("upstream_timeout"),
            GatewayError::Unauthenticated(_) => Some("invalid_api_key"),
            GatewayError::RateLimited { .. } => Some("rate_limit_exceeded"),
            GatewayError::BudgetExceeded { .. } => Some("insufficient_quota"),
            GatewayError::LimitsUnavailable => Some("limits_unavailable"),
            GatewayError::UsageUnrecorded => Some("usage_unrecorded"),
            GatewayError::TenantsUnavailable(_) => Some("tenants_unavailable"),
            GatewayError::PolicyRejected { code, .. } => Some(*code),
            GatewayError::Overloaded { .. } => Some("overloaded"),
            GatewayError::FlowShed { reason, .. } => Some(reason),
            GatewayError::BodyTimeout { .. } => Some("request_timeout"),
            GatewayError::ProxyModeUnsupported(_) => Some("proxy_mode_unsupported"),
            _ => None,
        }
    }

    fn anthropic_type(&self) -> &'static str {
        match self.status().as_u16() {
            400 | 422 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            408 | 504 => "timeout_error",
            _ => "api_error",
        }
    }

    /// What the client is told: the error's text, except that a worker's address stays in the
    /// gateway's logs (internal addresses are for admins only).
    pub fn client_message(&self) -> String {
        match self {
            GatewayError::WorkerUnreachable { .. } => {
                "the worker chosen for the request is unreachable".into()
            }
            GatewayError::BadUpstream { .. } => {
                "the worker chosen for the request answered something the gateway cannot use".into()
            }
            GatewayError::UpstreamTimeout { what, .. } => {
                format!("the worker chosen for the request timed out ({what})")
            }
            other => other.to_string(),
        }
    }

    /// The JSON error body in the client's protocol.
    pub fn body(&self, protocol: Protocol) -> serde_json::Value {
        let message = self.client_message();
        match protocol {
            Protocol::OpenAi => {
                let param = match self {
                    GatewayError::InvalidRequest { param, .. } => *param,
                    GatewayError::UnknownModel(_) => Some("model"),
                    GatewayError::ResponseNotFound(_) => Some("response_id"),
                    _ => None,
                };
                json!({"error": {
                    "message": message,
                    "type": self.openai_type(),
                    "param": param,
                    "code": self.openai_code(),
                }})
            }
            Protocol::Anthropic => json!({
                "type": "error",
                "error": {"type": self.anthropic_type(), "message": message},
            }),
        }
    }

    /// A complete HTTP error response in the client's protocol.
    pub fn into_response(&self, protocol: Protocol) -> http::Response<crate::body::Body> {
        let body = Bytes::from(self.body(protocol).to_string());
        let mut response = http::Response::new(crate::body::full(body));
        *response.status_mut() = self.status();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let GatewayError::RateLimited { headers, .. }
        | GatewayError::BudgetExceeded { headers, .. } = self
        {
            for (name, value) in headers {
                if let Ok(v) = HeaderValue::from_str(value) {
                    response.headers_mut().insert(*name, v);
                }
            }
        }
        if let GatewayError::Overloaded { retry_after_s, .. }
        | GatewayError::FlowShed { retry_after_s, .. } = self
        {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(*retry_after_s));
        }
        response
    }

    /// The terminal SSE event for a stream that breaks after its headers were sent: OpenAI clients get a
    /// `data: {"error": ...}` chunk, Anthropic clients an `event: error`.
    pub fn stream_event(&self, protocol: Protocol) -> Bytes {
        let body = self.body(protocol);
        match protocol {
            Protocol::OpenAi => Bytes::from(format!("data: {body}\n\n")),
            Protocol::Anthropic => Bytes::from(format!("event: error\ndata: {body}\n\n")),
        }
    }
}

#[cfg(test)]
mod tests;
