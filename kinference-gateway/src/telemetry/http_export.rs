//! OTLP over HTTP: where the spans are posted, and the HTTP client that posts them.
//!
//! The batch exporter calls its client from a thread of its own, outside the Tokio runtime, while
//! hyper's client needs one: [`OnRuntime`] runs each export on the gateway's runtime.

use std::time::Duration;

use bytes::Bytes;
use opentelemetry_http::hyper::HyperClient;
use opentelemetry_http::{HttpClient, HttpError};

/// How long one export may take before it is given up (the collector is down or stalled).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The URL spans are posted to: the endpoint's `/v1/traces`, as the OTLP specification appends to
/// `OTEL_EXPORTER_OTLP_ENDPOINT` for HTTP (an endpoint already naming it is kept).
pub fn traces_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    if base.ends_with("/v1/traces") {
        base.to_string()
    } else {
        format!("{base}/v1/traces")
    }
}

/// Hyper's OTLP client, its requests run on the runtime it was made on.
#[derive(Debug)]
pub struct OnRuntime {
    client: HyperClient,
    runtime: tokio::runtime::Handle,
}

impl OnRuntime {
    /// A client on the current Tokio runtime; an error outside one.
    pub fn current() -> Result<Self, tokio::runtime::TryCurrentError> {
        Ok(OnRuntime {
            client: HyperClient::with_default_connector(EXPORT_TIMEOUT, None),
            runtime: tokio::runtime::Handle::try_current()?,
        })
    }
}

#[tonic::async_trait]
impl HttpClient for OnRuntime {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, HttpError> {
        let client = self.client.clone();
        self.runtime
            .spawn(async move { client.send_bytes(request).await })
            .await?
    }
}
