//! The backends a request is forwarded to, behind one interface ([`send`]): vLLM workers (the pooled
//! client in [`worker`], their `/health` probing in [`health`]) and cloud providers ([`provider`]),
//! and the one [`relay`] that brings either's answer back to the client in the client's protocol
//! (SSE parsed by [`sse`]) while feeding a [`relay::Meter`] (the pipeline's settlement) as chunks
//! pass.

pub mod adapters;
pub mod health;
pub mod provider;
pub mod relay;
pub mod sse;
pub mod worker;

use bytes::Bytes;
use http::Response;
use hyper::body::Incoming;
use kinference_crds::ApiStyle;
use tracing::Instrument as _;

use crate::errors::GatewayError;
use provider::{ProviderClient, ProviderError, ProviderRequest};
use worker::Upstream;

/// Where a request is sent: a worker (base URL) or a provider (with its model name).
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// A vLLM worker: its base URL and the path of the endpoint (`/v1/chat/completions`, ...).
    Worker {
        /// Worker base URL.
        url: &'a str,
        /// The worker's data-parallel rank to serve it, sent as `X-data-parallel-rank` (`None`: no
        /// header; the worker balances over its ranks itself).
        dp_rank: Option<u32>,
        /// Endpoint path on the worker.
        path: &'static str,
    },
    /// A provider and the model name it is asked for.
    Provider {
        /// The provider's client.
        client: &'a ProviderClient,
        /// The provider's model name.
        model: &'a str,
    },
}

impl Target<'_> {
    /// The protocol the backend answers in (workers speak OpenAI).
    pub fn api_style(&self) -> ApiStyle {
        match self {
            Target::Worker { .. } => ApiStyle::OpenAI,
            Target::Provider { client, .. } => client.api_style(),
        }
    }

    /// The label of metrics and errors: the worker URL, or `provider/<name>`.
    pub fn label(&self) -> String {
        match self {
            Target::Worker {
                url,
                dp_rank: Some(rank),
                ..
            } => format!("{url}#dp{rank}"),
            Target::Worker { url, .. } => (*url).to_string(),
            Target::Provider { client, .. } => client.label(),
        }
    }
}

/// The request in the forms a backend takes: the worker's body (already serialized, forwarded byte
/// for byte when the client's bytes could be kept) and the typed request providers translate.
#[derive(Debug, Clone, Copy)]
pub struct Outgoing<'a> {
    /// The worker's JSON body.
    pub body: &'a Bytes,
    /// The typed request, for providers (none: an endpoint no provider serves).
    pub typed: Option<ProviderRequest<'a>>,
    /// Whether the answer is streamed.
    pub stream: bool,
}

/// Why a backend did not answer (before anything reached the client).
#[derive(Debug)]
pub enum SendError {
    /// The backend cannot take this request at all; nothing was sent (a provider without a key, ...).
    Unusable(String),
    /// Sent, and it failed: the error the client would get.
    Failed(GatewayError),
}

/// Sends `request` to `target` and waits for the response headers. Workers' non-2xx answers come
/// back as responses (the pipeline reads their message); providers' as [`SendError::Failed`]. The
/// wait is the `upstream` span (time to first byte); the backend's `traceparent` names it.
pub async fn send(
    upstream: &Upstream,
    target: Target<'_>,
    request: Outgoing<'_>,
) -> Result<Response<Incoming>, SendError> {
    let span = tracing::debug_span!(
        "upstream",
        otel.kind = "client",
        backend = %target.label(),
        status = tracing::field::Empty,
    );
    let sent = send_now(upstream, target, request)
        .instrument(span.clone())
        .await;
    if let Ok(response) = &sent {
        span.record("status", response.status().as_u16());
    }
    sent
}

async fn send_now(
    upstream: &Upstream,
    target: Target<'_>,
    request: Outgoing<'_>,
) -> Result<Response<Incoming>, SendError> {
    match target {
        Target::Worker { url, dp_rank, path } => upstream
            .post_json_to_rank(url, dp_rank, path, request.body.clone())
            .await
            .map_err(SendError::Failed),
        Target::Provider { client, model } => client
            .send(
                request.typed.ok_or_else(|| {
                    SendError::Unusable("providers serve chat and completions only".into())
                })?,
                model,
                request.stream,
            )
            .await
            .map_err(|e| match e {
                ProviderError::Unusable { reason, .. } => SendError::Unusable(reason),
                ProviderError::Failed(error) => SendError::Failed(error),
            }),
    }
}
