//! Cloud providers (`InferenceProvider`): OpenAI- or Anthropic-compatible endpoints the policy stage
//! bursts to while local pools are saturated.
//!
//! - [`Providers`]: the HTTP(S) clients and one [`ProviderClient`] per provider, rebuilt when its spec
//!   changes (the API key is read then: the environment variable in local mode).
//! - [`translate`]: requests out in the provider's protocol, answers back as OpenAI chat (the pivot).
//!
//! The answer goes back to the client through the one relay of `backend::relay`, like a worker's.
//!
//! A provider never sees a request the policy stage marked local-only; that is enforced by the stage
//! (and by the engine) before anything is sent here.

pub mod translate;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kinference_crds::{ApiStyle, InferenceProviderSpec, TokenPrices};
use parking_lot::Mutex;

use crate::api::openai::{ChatCompletionRequest, CompletionRequest, UpstreamErrorBody};
use crate::backend::worker::error_chain;
use crate::errors::GatewayError;

#[cfg(test)]
mod tests;

/// Default request timeout (response headers) when the provider spec gives none.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

type HttpsConnector = hyper_rustls::HttpsConnector<HttpConnector>;

/// The request as the pipeline holds it (OpenAI shapes; Anthropic clients' requests are already
/// translated to chat).
#[derive(Debug, Clone, Copy)]
pub enum ProviderRequest<'a> {
    /// Chat (OpenAI chat clients and Anthropic clients).
    Chat(&'a ChatCompletionRequest),
    /// `/v1/completions` (OpenAI-style providers only).
    Completion(&'a CompletionRequest),
}

/// Why a provider did not serve a request (before anything reached the client).
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProviderError {
    /// The provider cannot take this request at all (no key, unsupported shape); nothing was sent.
    #[error("provider {provider} skipped: {reason}")]
    Unusable {
        /// Provider name.
        provider: String,
        /// Why.
        reason: String,
    },
    /// It was sent and failed (transport, timeout, non-2xx).
    #[error(transparent)]
    Failed(GatewayError),
}

/// HTTP clients shared by all providers, and the clients per provider.
pub struct Providers {
    http: Client<HttpConnector, Full<Bytes>>,
    https: Option<Client<HttpsConnector, Full<Bytes>>>,
    clients: Mutex<HashMap<String, Arc<ProviderClient>>>,
    credentials: Mutex<Option<CredentialResolver>>,
}

/// Resolves a provider's key (by provider name and its `credentials`) in cluster mode: from the
/// watched Secrets instead of the environment. `None`: no key (the provider is skipped).
pub type CredentialResolver =
    Arc<dyn Fn(&str, &kinference_crds::CredentialRef) -> Option<String> + Send + Sync>;

impl std::fmt::Debug for Providers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Providers")
            .field("https", &self.https.is_some())
            .field("clients", &self.clients.lock().len())
            .finish()
    }
}

impl Providers {
    /// Clients with `connect_timeout`. HTTPS uses the system's root certificates; without any, only
    /// plain-HTTP providers (e.g. a stand-in on loopback) are reachable, and the log says so.
    pub fn new(connect_timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_keepalive(Some(Duration::from_secs(30)));
        let http = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector.clone());
        connector.enforce_http(false);
        let https = match hyper_rustls::HttpsConnectorBuilder::new().with_native_roots() {
            Ok(builder) => Some(
                Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(Duration::from_secs(60))
                    .build(
                        builder
                            .https_only()
                            .enable_http1()
                            .wrap_connector(connector),
                    ),
            ),
            Err(error) => {
                tracing::warn!(%error, "no system root certificates: HTTPS providers are unreachable");
                None
            }
        };
        Providers {
            http,
            https,
            clients: Mutex::new(HashMap::new()),
            credentials: Mutex::new(None),
        }
    }

    /// Reads keys through `resolver` from now on (cluster mode: Secrets, not the environment).
    pub fn set_credentials(&self, resolver: CredentialResolver) {
        *self.credentials.lock() = Some(resolver);
    }

    /// The client of provider `name` with `spec` (cached until the spec changes).
    pub fn client(&self, name: &str, spec: &InferenceProviderSpec) -> Arc<ProviderClient> {
        let resolver = self.credentials.lock().clone();
        let api_key = match resolver {
            Some(resolve) => resolve(name, &spec.credentials),
            None => spec
                .credentials
                .env
                .as_deref()
                .and_then(|var| std::env::var(var).ok()),
        }
        .filter(|k| !k.is_empty());
        let mut clients = self.clients.lock();
        // Rebuilt when the spec or the key changed (a rotated Secret).
        if let Some(c) = clients
            .get(name)
            .filter(|c| c.spec == *spec && c.api_key == api_key)
        {
            return Arc::clone(c);
        }
        if api_key.is_none() {
            tracing::warn!(provider = name, env = ?spec.credentials.env,
                "provider has no API key in its environment variable; it will be skipped");
        }
        let client = Arc::new(ProviderClient {
            name: name.to_string(),
            base_url: spec.base_url.trim_end_matches('/').to_string(),
            spec: spec.clone(),
            api_key,
            http: self.http.clone(),
            https: self.https.clone(),
        });
        clients.insert(name.to_string(), Arc::clone(&client));
        client
    }
}

/// One provider's endpoint, protocol and key.
pub struct ProviderClient {
    name: String,
    base_url: String,
    spec: InferenceProviderSpec,
    api_key: Option<String>,
    http: Client<HttpConnector, Full<Bytes>>,
    https: Option<Client<HttpsConnector, Full<Bytes>>>,
}

impl std::fmt::Debug for ProviderClient {
    // Never prints the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderClient")
            .field("name", &self.name)
            .field("base_url", &self.base_url)
            .field("api_style", &self.spec.api_style)
            .field("has_key", &self.api_key.is_some())
            .finish()
    }
}

impl ProviderClient {
    /// Provider name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Base URL (what `x-kinference-worker` reports for provider-served answers).
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// The provider's protocol.
    pub fn api_style(&self) -> ApiStyle {
        self.spec.api_style
    }

    /// The price of `model` (the provider's model name): the model's own, else the provider's.
    pub fn prices(&self, model: &str) -> Option<TokenPrices> {
        self.spec
            .models
            .iter()
            .find(|m| m.name == model)
            .and_then(|m| m.prices.clone())
            .or_else(|| self.spec.prices.clone())
    }

    /// Label for metrics and errors: `provider/<name>`.
    pub fn label(&self) -> String {
        format!("provider/{}", self.name)
    }

    fn unusable(&self, reason: impl Into<String>) -> ProviderError {
        ProviderError::Unusable {
            provider: self.name.clone(),
            reason: reason.into(),
        }
    }

    fn failed(&self, detail: String) -> ProviderError {
        ProviderError::Failed(GatewayError::BadUpstream {
            worker: self.label(),
            detail,
        })
    }

    /// The provider's path and body for `request` with the provider's `model`.
    fn build(
        &self,
        request: ProviderRequest<'_>,
        model: &str,
        stream: bool,
    ) -> Result<(&'static str, Bytes), ProviderError> {
        let to_bytes = |v: Result<Vec<u8>, serde_json::Error>| {
            v.map(Bytes::from).map_err(|e| self.unusable(e.to_string()))
        };
        match (self.spec.api_style, request) {
            (ApiStyle::OpenAI, ProviderRequest::Chat(chat)) => {
                let mut chat = chat.clone();
                chat.model = model.to_string();
                Ok(("/chat/completions", to_bytes(serde_json::to_vec(&chat))?))
            }
            (ApiStyle::OpenAI, ProviderRequest::Completion(completion)) => {
                let mut completion = completion.clone();
                completion.model = model.to_string();
                Ok(("/completions", to_bytes(serde_json::to_vec(&completion))?))
            }
            (ApiStyle::Anthropic, ProviderRequest::Chat(chat)) => {
                let body = translate::anthropic_request(chat, model, stream)
                    .map_err(|e| self.unusable(e.0))?;
                Ok(("/messages", to_bytes(serde_json::to_vec(&body))?))
            }
            (ApiStyle::Anthropic, ProviderRequest::Completion(_)) => {
                Err(self.unusable("an Anthropic provider cannot serve /v1/completions requests"))
            }
        }
    }

    /// Sends `request` (as `model`) and waits for the response headers; non-2xx answers are errors.
    pub async fn send(
        &self,
        request: ProviderRequest<'_>,
        model: &str,
        stream: bool,
    ) -> Result<Response<Incoming>, ProviderError> {
        let Some(key) = self.api_key.as_deref() else {
            return Err(self.unusable(format!(
                "no API key (environment variable {:?} is unset)",
                self.spec.credentials.env.as_deref().unwrap_or("")
            )));
        };
        let (path, body) = self.build(request, model, stream)?;
        let uri = format!("{}{path}", self.base_url);
        let mut builder = Request::builder()
            .method(Method::POST)
            .uri(uri.as_str())
            .header(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        builder = match self.spec.api_style {
            ApiStyle::OpenAI => builder.header(header::AUTHORIZATION, format!("Bearer {key}")),
            ApiStyle::Anthropic => builder
                .header("x-api-key", key)
                .header("anthropic-version", translate::ANTHROPIC_VERSION),
        };
        let mut request = builder
            .body(Full::new(body))
            .map_err(|e| self.unusable(format!("building the request: {e}")))?;
        // The request's `x-request-id` and `traceparent`, as workers get them.
        request
            .headers_mut()
            .extend(crate::telemetry::current_headers());
        let timeout = self
            .spec
            .timeout_seconds
            .map_or(DEFAULT_TIMEOUT, |s| Duration::from_secs(u64::from(s)));
        let sent = if uri.starts_with("https://") {
            let Some(https) = &self.https else {
                return Err(self.unusable("HTTPS is unavailable (no root certificates)"));
            };
            tokio::time::timeout(timeout, https.request(request)).await
        } else {
            tokio::time::timeout(timeout, self.http.request(request)).await
        };
        let response = match sent {
            Err(_) => {
                return Err(ProviderError::Failed(GatewayError::UpstreamTimeout {
                    worker: self.label(),
                    what: "no response headers within the provider's timeout",
                }));
            }
            Ok(Err(e)) if e.is_connect() => {
                return Err(ProviderError::Failed(GatewayError::WorkerUnreachable {
                    worker: self.label(),
                    detail: error_chain(&e),
                }));
            }
            Ok(Err(e)) => return Err(self.failed(error_chain(&e))),
            Ok(Ok(response)) => response,
        };
        if response.status().is_success() {
            return Ok(response);
        }
        let status = response.status();
        // Only the message is wanted: a provider's error answer is read up to 1 MiB.
        let limits = crate::backend::worker::UpstreamLimits::new(
            1 << 20,
            crate::backend::sse::SseLimits::default(),
        );
        let body = crate::backend::worker::read_body(
            response.into_body(),
            timeout,
            &self.label(),
            &limits,
        )
        .await
        .unwrap_or_default();
        Err(self.failed(format!(
            "status {status}: {}",
            UpstreamErrorBody::message_from(&body)
        )))
    }
}
