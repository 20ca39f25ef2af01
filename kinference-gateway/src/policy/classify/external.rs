//! An optional external classifier over HTTP (e.g. a Presidio or model-based PII service).
//!
//! `POST <url>` with `{"text": ..., "model": ...}`; the answer is `{"tags": ["pii", ...]}`. `text` is
//! everything the built-in scan read (every key, string and number of the body, decoded token-id
//! prompts), so the external classifier sees what a provider would. The call has a hard timeout. On
//! timeout or error the configured [`OnError`] applies: `TagPii` (default) fails closed by treating
//! the request as personal data (local pools only, refused if none), `Ignore` proceeds with the
//! built-in classifiers only. Configured in `gateway.yaml` as `classifier.external`
//! ([`ExternalConfig`]).

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;

use super::tags;

#[cfg(test)]
mod tests;

/// What to do when the external classifier fails or times out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Add the `pii` tag: the request stays local (fail closed).
    #[default]
    TagPii,
    /// Go on without the external tags.
    Ignore,
}

/// `classifier.external` in `gateway.yaml`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExternalConfig {
    /// `http://` or `https://` URL the request text is posted to.
    pub url: String,
    /// For `https://`: the CA certificates (PEM) the classifier's certificate must chain to, e.g.
    /// the cluster's (`/var/run/secrets/kubernetes.io/serviceaccount/ca.crt`); absent: the system's.
    #[serde(default)]
    pub ca_file: Option<std::path::PathBuf>,
    /// How long the gateway waits for the answer, in milliseconds (default 200).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// What a timeout or an error means: `tag_pii` (default, fail closed) or `ignore`.
    #[serde(default)]
    pub on_error: OnError,
}

fn default_timeout_ms() -> u64 {
    200
}

/// The tag added when the external classifier did not answer (with `pii` under `tag_pii`).
pub const UNAVAILABLE_TAG: &str = "classifier-unavailable";

/// Why the external classifier gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum ExternalError {
    #[error("invalid classifier URL {0:?} (http:// or https://)")]
    Url(String),
    #[error("classifier TLS: {0}")]
    Tls(String),
    #[error("classifier timed out after {0:?}")]
    Timeout(Duration),
    #[error("classifier request failed: {0}")]
    Http(String),
    #[error("classifier answered HTTP {0}")]
    Status(u16),
    #[error("classifier answer is not {{\"tags\": [...]}}: {0}")]
    Body(String),
}

#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    tags: Vec<String>,
}

/// A client for one external classifier endpoint.
#[derive(Clone)]
pub struct ExternalClassifier {
    uri: http::Uri,
    timeout: Duration,
    on_error: OnError,
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl ExternalClassifier {
    /// The classifier `config` describes.
    pub fn from_config(config: &ExternalConfig) -> Result<Self, ExternalError> {
        Self::with_ca(
            &config.url,
            Duration::from_millis(config.timeout_ms),
            config.on_error,
            config.ca_file.as_deref(),
        )
    }

    /// A classifier at `url` (a sidecar on loopback or a cluster Service; `https://` checked
    /// against the system's CAs).
    pub fn new(url: &str, timeout: Duration, on_error: OnError) -> Result<Self, ExternalError> {
        Self::with_ca(url, timeout, on_error, None)
    }

    /// [`ExternalClassifier::new`], an `https://` classifier's certificate checked against the CAs
    /// in `ca_file` (PEM) instead of the system's.
    pub fn with_ca(
        url: &str,
        timeout: Duration,
        on_error: OnError,
        ca_file: Option<&std::path::Path>,
    ) -> Result<Self, ExternalError> {
        let uri: http::Uri = url
            .parse()
            .map_err(|_| ExternalError::Url(url.to_string()))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(ExternalError::Url(url.to_string()));
        }
        let tls = tls_config(ca_file)?;
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        Ok(ExternalClassifier {
            uri,
            timeout,
            on_error,
            client: Client::builder(TokioExecutor::new()).build(connector),
        })
    }

    /// Asks the classifier; errors are returned as such.
    pub async fn classify(
        &self,
        text: &str,
        model: &str,
    ) -> Result<BTreeSet<String>, ExternalError> {
        let body = serde_json::json!({"text": text, "model": model}).to_string();
        let request = http::Request::post(self.uri.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| ExternalError::Http(e.to_string()))?;
        let call = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| ExternalError::Http(e.to_string()))?;
            let status = response.status();
            let bytes = response
                .into_body()
                .collect()
                .await
                .map_err(|e| ExternalError::Http(e.to_string()))?
                .to_bytes();
            if !status.is_success() {
                return Err(ExternalError::Status(status.as_u16()));
            }
            let answer: Answer =
                serde_json::from_slice(&bytes).map_err(|e| ExternalError::Body(e.to_string()))?;
            Ok(tags::from_header(&answer.tags.join(",")))
        };
        tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| ExternalError::Timeout(self.timeout))?
    }

    /// Asks the classifier and applies [`OnError`] on failure (logged, never silent).
    pub async fn classify_or_fallback(&self, text: &str, model: &str) -> BTreeSet<String> {
        match self.classify(text, model).await {
            Ok(tags) => tags,
            Err(error) => self.fallback(&error, model),
        }
    }

    /// The tags that stand for an answer that did not come: `pii` (fail closed) and
    /// [`UNAVAILABLE_TAG`] under `TagPii`, [`UNAVAILABLE_TAG`] alone under `Ignore`. Logged.
    pub fn fallback(&self, error: &ExternalError, model: &str) -> BTreeSet<String> {
        tracing::warn!(%error, model, on_error = ?self.on_error, "external classifier unavailable");
        match self.on_error {
            OnError::TagPii => BTreeSet::from([
                crate::policy::engine::PII_TAG.to_string(),
                UNAVAILABLE_TAG.to_string(),
            ]),
            OnError::Ignore => BTreeSet::from([UNAVAILABLE_TAG.to_string()]),
        }
    }
}

/// The classifier's TLS settings: the CAs of `ca_file`, else the system's.
fn tls_config(ca_file: Option<&std::path::Path>) -> Result<rustls::ClientConfig, ExternalError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| ExternalError::Tls(format!("{}: {e}", path.display())))?;
            if certs.is_empty() {
                return Err(ExternalError::Tls(format!(
                    "{}: no certificate in it",
                    path.display()
                )));
            }
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|e| ExternalError::Tls(format!("{}: {e}", path.display())))?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(native.certs);
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ExternalError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

impl ExternalError {
    /// `timeout` or `error`, for the metric.
    pub fn outcome(&self) -> &'static str {
        match self {
            ExternalError::Timeout(_) => "timeout",
            _ => "error",
        }
    }
}
