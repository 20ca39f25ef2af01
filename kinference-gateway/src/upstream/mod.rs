//! The connection to the workers: a pooled hyper client with the configured timeouts, and the
//! translation of transport failures into [`GatewayError`]s.
//!
//! Connections are kept alive and reused (the pool is what keeps the gateway's added latency well
//! under a millisecond); Nagle is off so small SSE chunks leave at once.

pub mod sse;

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::config::HttpSettings;
use crate::errors::GatewayError;

/// Pooled HTTP/1.1 client for worker requests.
#[derive(Clone, Debug)]
pub struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
    probe: Client<HttpConnector, Empty<Bytes>>,
    first_byte_timeout: Duration,
    idle_timeout: Duration,
}

impl Upstream {
    /// A client with the given timeouts and pool size.
    pub fn new(settings: &HttpSettings) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(settings.connect_timeout()));
        connector.set_keepalive(Some(Duration::from_secs(30)));
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(settings.pool_max_idle_per_host)
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector.clone());
        let probe = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(2)
            .build(connector);
        Upstream {
            client,
            probe,
            first_byte_timeout: settings.first_byte_timeout(),
            idle_timeout: settings.idle_timeout(),
        }
    }

    /// Longest silence allowed between two body chunks.
    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// POSTs a JSON body to `worker` + `path` and waits for the response headers.
    pub async fn post_json(
        &self,
        worker: &str,
        path: &str,
        body: Bytes,
    ) -> Result<Response<Incoming>, GatewayError> {
        let uri = format!("{worker}{path}");
        let request = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )
            .body(Full::new(body))
            .map_err(|e| GatewayError::BadUpstream {
                worker: worker.to_string(),
                detail: format!("building the request: {e}"),
            })?;
        match tokio::time::timeout(self.first_byte_timeout, self.client.request(request)).await {
            Err(_) => Err(GatewayError::UpstreamTimeout {
                worker: worker.to_string(),
                what: "no response headers within the first-byte timeout",
            }),
            Ok(Err(e)) if e.is_connect() => Err(GatewayError::WorkerUnreachable {
                worker: worker.to_string(),
                detail: error_chain(&e),
            }),
            Ok(Err(e)) => Err(GatewayError::BadUpstream {
                worker: worker.to_string(),
                detail: error_chain(&e),
            }),
            Ok(Ok(response)) => Ok(response),
        }
    }

    /// Reads a whole (non-streamed) response body, allowing `idle_timeout` between chunks.
    pub async fn read_body(&self, worker: &str, body: Incoming) -> Result<Bytes, GatewayError> {
        let mut body = body;
        let mut out = bytes::BytesMut::new();
        loop {
            match tokio::time::timeout(self.idle_timeout, body.frame()).await {
                Err(_) => {
                    return Err(GatewayError::UpstreamTimeout {
                        worker: worker.to_string(),
                        what: "the response body stalled past the idle timeout",
                    });
                }
                Ok(None) => return Ok(out.freeze()),
                Ok(Some(Err(e))) => {
                    return Err(GatewayError::BadUpstream {
                        worker: worker.to_string(),
                        detail: format!("reading the response body: {}", error_chain(&e)),
                    });
                }
                Ok(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        out.extend_from_slice(data);
                    }
                }
            }
        }
    }

    /// GETs `worker` + `path` within `timeout`; the status, or why there is none.
    pub async fn probe(
        &self,
        worker: &str,
        path: &str,
        timeout: Duration,
    ) -> Result<StatusCode, String> {
        let request = Request::builder()
            .method(Method::GET)
            .uri(format!("{worker}{path}"))
            .body(Empty::new())
            .map_err(|e| e.to_string())?;
        match tokio::time::timeout(timeout, self.probe.request(request)).await {
            Err(_) => Err("timed out".to_string()),
            Ok(Err(e)) => Err(error_chain(&e)),
            Ok(Ok(response)) => {
                let status = response.status();
                // Drain so the connection goes back to the pool.
                let _ = response.into_body().collect().await;
                Ok(status)
            }
        }
    }
}

/// An error with its causes, e.g. "client error (Connect): tcp connect error: Connection refused".
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
