//! Errors at the HTTP edge, written as vLLM 0.32 writes them:
//! `{"error": {"message", "type", "param", "code"}}` with `type` `BadRequestError` (400) or
//! `NotFoundError` (404), and FastAPI's `{"detail": ...}` for unknown routes.

use http::StatusCode;
use serde_json::json;

/// A request the simulator refuses, mapped once to vLLM's error JSON.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Malformed or invalid request (vLLM's `BadRequestError`).
    #[error("{message}")]
    BadRequest {
        message: String,
        param: Option<&'static str>,
    },
    /// The `model` field names a model this server does not serve.
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// `previous_response_id` names an answer this worker does not hold (vLLM's store is the memory
    /// of the worker that made the answer).
    #[error("Response with id '{0}' not found.")]
    ResponseNotFound(String),
    /// The body exceeds the size limit.
    #[error("request body too large")]
    TooLarge,
    /// Unknown route (FastAPI's 404).
    #[error("Not Found")]
    RouteNotFound,
    /// Known route, wrong method (FastAPI's 405).
    #[error("Method Not Allowed")]
    MethodNotAllowed,
}

impl ApiError {
    /// A 400 with a message.
    pub fn bad(message: impl Into<String>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param: None,
        }
    }

    /// A 400 about one request field.
    pub fn bad_param(param: &'static str, message: impl Into<String>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param: Some(param),
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::ModelNotFound(_) | Self::RouteNotFound | Self::ResponseNotFound(_) => {
                StatusCode::NOT_FOUND
            }
            Self::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        let status = self.status().as_u16();
        match self {
            Self::RouteNotFound | Self::MethodNotAllowed => json!({"detail": self.to_string()}),
            Self::BadRequest { param, .. } => json!({"error": {
                "message": self.to_string(), "type": "BadRequestError", "param": param, "code": status,
            }}),
            Self::ModelNotFound(_) => json!({"error": {
                "message": self.to_string(), "type": "NotFoundError", "param": "model", "code": status,
            }}),
            Self::ResponseNotFound(_) => json!({"error": {
                "message": self.to_string(), "type": "invalid_request_error", "param": "response_id",
                "code": status,
            }}),
            Self::TooLarge => json!({"error": {
                "message": self.to_string(), "type": "BadRequestError", "param": null, "code": status,
            }}),
        }
    }
}
