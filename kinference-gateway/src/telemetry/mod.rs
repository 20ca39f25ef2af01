//! What lets an operator follow one request: its id ([`RequestId`], honoured from `x-request-id` or
//! made here, echoed to the client, a field of every log line and usage record), the logs (text or
//! JSON, one access line per request) and, when an OTLP endpoint is configured, its trace: the
//! client's W3C `traceparent` continued through the gateway's stages and on to the worker or
//! provider ([`propagation`]).
//!
//! Without an endpoint no exporter, no OpenTelemetry layer and no stage span exists: the stages'
//! spans are at `debug`, which the default `info` log filter leaves disabled, so they cost a
//! callsite check. The client's `traceparent` is then passed to the backend unchanged.

mod http_export;
pub mod propagation;
pub mod request_id;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

pub use propagation::ClientTrace;
pub use request_id::RequestId;

/// The header that carries the request id, both ways.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Whether spans are exported (set once by [`Telemetry::init`]).
static TRACING: AtomicBool = AtomicBool::new(false);

/// Whether traces are exported: the stages' spans exist and the backend gets the gateway's own
/// span as parent.
pub fn tracing_enabled() -> bool {
    TRACING.load(Ordering::Relaxed)
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines, the span fields (`request_id`, ...) in front.
    Text,
    /// One JSON object per line, with the fields of the line's spans.
    Json,
}

/// How spans are sent to the OTLP endpoint (`OTEL_EXPORTER_OTLP_PROTOCOL`'s values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (the collector's port 4317).
    Grpc,
    /// OTLP/HTTP with protobuf bodies (the collector's port 4318).
    #[value(name = "http", alias = "http/protobuf")]
    Http,
}

impl OtlpProtocol {
    /// Its name in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            OtlpProtocol::Grpc => "OTLP/gRPC",
            OtlpProtocol::Http => "OTLP/HTTP",
        }
    }
}

/// Logs and traces (`--log-format`, `--otlp-endpoint`, `--otlp-protocol`).
#[derive(Debug, Clone, clap::Args)]
pub struct TelemetryArgs {
    /// Log format: `text` or `json` (one object per line). The level filter is `RUST_LOG`
    /// (default `info`); the access log is target `kinference_gateway::access_log` at `info`.
    #[arg(long, env = "KINFERENCE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// OTLP endpoint that request traces are exported to, e.g. `http://otel-collector:4317` (gRPC)
    /// or `http://otel-collector:4318` (HTTP: spans are posted to its `/v1/traces`). Unset (the
    /// default): no trace is exported and the client's `traceparent` is passed to the backend
    /// unchanged.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,

    /// How spans travel to `--otlp-endpoint`: `grpc` (OTLP/gRPC) or `http` (OTLP/HTTP with
    /// protobuf bodies). The environment variable also takes the specification's `http/protobuf`.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_PROTOCOL", value_enum, default_value_t = OtlpProtocol::Grpc)]
    pub otlp_protocol: OtlpProtocol,

    /// `service.name` of the exported spans.
    #[arg(long, env = "OTEL_SERVICE_NAME", default_value = "kinference-gateway")]
    pub otel_service_name: String,
}

/// The installed log subscriber and, when traces are exported, the exporter (flushed by
/// [`Telemetry::shutdown`]).
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Installs the global subscriber: the log lines in `args.log_format`, and the OpenTelemetry
    /// layer when an endpoint is configured (an endpoint that is not an `http(s)://` URL is an error,
    /// not silently no traces). Call from inside the Tokio runtime (the exporter's gRPC channel).
    pub fn init(args: &TelemetryArgs) -> anyhow::Result<Telemetry> {
        let provider = match args.otlp_endpoint.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(endpoint) => Some(exporter(
                endpoint,
                args.otlp_protocol,
                &args.otel_service_name,
            )?),
        };
        TRACING.store(provider.is_some(), Ordering::Relaxed);
        subscriber(args.log_format, provider.as_ref())
            .try_init()
            .context("installing the log subscriber")?;
        if let Some(endpoint) = &args.otlp_endpoint {
            let protocol = args.otlp_protocol.as_str();
            tracing::info!(%endpoint, protocol, "exporting request traces");
        }
        Ok(Telemetry { provider })
    }

    /// Exports the spans still buffered (at the end of a graceful stop).
    pub fn shutdown(self) {
        if let Some(provider) = self.provider
            && let Err(error) = provider.shutdown()
        {
            tracing::warn!(%error, "flushing the last request traces");
        }
    }
}

/// The log lines in `format` (level filter from `RUST_LOG`, default `info`) and, with a
/// `provider`, the gateway's spans (and only spans: log events stay log lines) as OpenTelemetry
/// spans.
fn subscriber(
    format: LogFormat,
    provider: Option<&SdkTracerProvider>,
) -> impl tracing::Subscriber + Send + Sync {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer().boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer().json().boxed(),
    }
    .with_filter(filter);
    let spans = provider.map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("kinference-gateway"))
            .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
                meta.is_span() && meta.target().starts_with("kinference_gateway")
            }))
    });
    tracing_subscriber::registry().with(logs).with(spans)
}

/// The OTLP exporter to `endpoint` over `protocol`, batching spans.
fn exporter(
    endpoint: &str,
    protocol: OtlpProtocol,
    service: &str,
) -> anyhow::Result<SdkTracerProvider> {
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        anyhow::bail!("--otlp-endpoint {endpoint:?}: expected an http:// or https:// URL");
    }
    let builder = opentelemetry_otlp::SpanExporter::builder();
    let exporter = match protocol {
        OtlpProtocol::Grpc => builder.with_tonic().with_endpoint(endpoint).build(),
        OtlpProtocol::Http => builder
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_http_client(
                http_export::OnRuntime::current().context("OTLP/HTTP needs the Tokio runtime")?,
            )
            .with_endpoint(http_export::traces_url(endpoint))
            .build(),
    }
    .with_context(|| format!("the {} exporter to {endpoint}", protocol.as_str()))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service.to_string())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// One request's telemetry context, which the backend reads when it sends the request on.
#[derive(Debug, Clone)]
pub struct RequestContext {
    /// The request's id.
    pub id: RequestId,
    /// The client's trace context, when it sent a valid one.
    pub trace: Option<ClientTrace>,
    /// The path the client called (empty when not known).
    pub path: Arc<str>,
}

tokio::task_local! {
    static CURRENT: RequestContext;
}

impl RequestContext {
    /// The context of a request with `headers`.
    pub fn from_headers(headers: &http::HeaderMap) -> Self {
        RequestContext {
            id: RequestId::from_headers(headers),
            trace: ClientTrace::from_headers(headers),
            path: Arc::from(""),
        }
    }

    /// The context of a request to `path` with `headers`.
    pub fn for_request(path: &str, headers: &http::HeaderMap) -> Self {
        RequestContext {
            path: Arc::from(path),
            ..Self::from_headers(headers)
        }
    }

    /// The request's root span (`info`: its `request_id` is on every log line of the request),
    /// continuing the client's trace when traces are exported.
    pub fn span(&self, method: &http::Method, path: &str) -> tracing::Span {
        self.span_exported(method, path, tracing_enabled())
    }

    fn span_exported(&self, method: &http::Method, path: &str, exported: bool) -> tracing::Span {
        let span = tracing::info_span!(
            "request",
            request_id = %self.id,
            otel.name = %format_args!("{method} {path}"),
            otel.kind = "server",
        );
        if exported && let Some(trace) = &self.trace {
            use tracing_opentelemetry::OpenTelemetrySpanExt as _;
            let _ = span.set_parent(trace.context());
        }
        span
    }

    /// The context of the request being served, when there is one.
    pub fn current() -> Option<RequestContext> {
        CURRENT.try_with(RequestContext::clone).ok()
    }

    /// Runs `work` with this context as the current request's (what [`current_headers`] reads).
    pub async fn scope<F: Future>(self, work: F) -> F::Output {
        CURRENT.scope(self, work).await
    }
}

/// The headers that carry the current request to a backend: `x-request-id`, and `traceparent`
/// (with `tracestate`) naming the current span when traces are exported, else the client's own.
/// Empty outside a request (health probes).
pub fn current_headers() -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    let _ = CURRENT.try_with(|request| {
        headers.insert(REQUEST_ID_HEADER, request.id.header_value());
        let injected = tracing_enabled() && propagation::inject_current(&mut headers);
        if !injected && let Some(trace) = &request.trace {
            trace.copy_to(&mut headers);
        }
    });
    headers
}

#[cfg(test)]
mod tests;
