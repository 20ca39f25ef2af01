//! The benchmarks' HTTP client: hyper-util's pooled HTTP/1.1 client with the few calls the harness,
//! the load generator and the oracle make.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// Errors of one HTTP exchange.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The request could not be built (bad URL).
    #[error("bad request to {url}: {source}")]
    Build {
        /// The URL.
        url: String,
        /// Why.
        source: http::Error,
    },
    /// Connecting or sending failed.
    #[error("{url}: {source}")]
    Send {
        /// The URL.
        url: String,
        /// Why.
        source: hyper_util::client::legacy::Error,
    },
    /// Reading the body failed.
    #[error("{url}: reading the body: {source}")]
    Body {
        /// The URL.
        url: String,
        /// Why.
        source: hyper::Error,
    },
    /// The peer answered with an unexpected status.
    #[error("{url}: status {status}: {body}")]
    Status {
        /// The URL.
        url: String,
        /// The status.
        status: StatusCode,
        /// The start of the body.
        body: String,
    },
    /// The body was not the JSON expected.
    #[error("{url}: bad JSON: {source}")]
    Json {
        /// The URL.
        url: String,
        /// Why.
        source: serde_json::Error,
    },
    /// No answer in time.
    #[error("{url}: timed out after {0:?}", .timeout)]
    Timeout {
        /// The URL.
        url: String,
        /// The limit.
        timeout: Duration,
    },
}

/// A pooled HTTP/1.1 client with the few calls the benchmark makes.
#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpClient {
    /// A client with keep-alive connections and Nagle off (small SSE chunks must not wait).
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let inner = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Self { inner }
    }

    /// Sends a request and returns the response once its headers arrived.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<http::Response<Incoming>, HttpError> {
        let mut builder = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let request = builder
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|source| HttpError::Build {
                url: url.to_string(),
                source,
            })?;
        self.inner
            .request(request)
            .await
            .map_err(|source| HttpError::Send {
                url: url.to_string(),
                source,
            })
    }

    /// Sends a request and reads the whole body; any status but 2xx is an error.
    pub async fn call(&self, method: Method, url: &str, body: Bytes) -> Result<Bytes, HttpError> {
        let response = self.send(method, url, &[], body).await?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|source| HttpError::Body {
                url: url.to_string(),
                source,
            })?
            .to_bytes();
        if !status.is_success() {
            return Err(HttpError::Status {
                url: url.to_string(),
                status,
                body: String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned(),
            });
        }
        Ok(body)
    }

    /// `GET url` as text.
    pub async fn get_text(&self, url: &str) -> Result<String, HttpError> {
        let body = self.call(Method::GET, url, Bytes::new()).await?;
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    /// `POST url` with a JSON body, answer parsed as JSON.
    pub async fn post_json(&self, url: &str, body: &Value) -> Result<Value, HttpError> {
        let bytes = Bytes::from(body.to_string());
        let answer = self.call(Method::POST, url, bytes).await?;
        if answer.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&answer).map_err(|source| HttpError::Json {
            url: url.to_string(),
            source,
        })
    }
}
