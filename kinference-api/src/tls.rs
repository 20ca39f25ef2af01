//! Mutual TLS (rustls) for Kinference's gRPC connections: the agent's summary stream (agent server,
//! gateway client) and the gateway's ext_proc server (Envoy client).
//!
//! Three promises, each tested in `kinference-gateway/tests/mtls.rs`:
//! - **Only the CA's certificates**: a server accepts only clients whose certificate its CA signed,
//!   and a client only servers of its CA.
//! - **Only the right role**: a certificate says what it is in its subject alternative names
//!   (`DNS:kinference-gateway`, `DNS:kinference-agent`, `DNS:kinference-envoy` by default); the agent
//!   admits gateways only, the ext_proc port the proxy only, and a gateway dials agents only
//!   ([`ServerTlsFiles::client_names`], [`ClientTlsFiles::server_name`]). An agent's certificate
//!   presented to another agent is refused, though the same CA signed it.
//! - **Renewed without a restart**: the PEM files (mounted from a Secret that cert-manager or Helm
//!   renews) are read again every [`RELOAD_EVERY`]; a complete new set replaces the old one for new
//!   connections; a set that does not load (half written, key not matching) is logged and counted,
//!   and the last good one stays: a bad rotation never opens the port nor closes it.

mod client;
mod material;
mod server;

#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::time::Duration;

pub use client::{ClientTls, ClientTlsFiles};
pub use server::{ServerTls, ServerTlsFiles};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// How often the PEM files are read again for renewed certificates.
pub const RELOAD_EVERY: Duration = Duration::from_secs(5);

/// How long a client has to complete the TLS handshake before its connection is closed.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A PEM file could not be read.
#[derive(Debug, thiserror::Error)]
#[error("reading {path}: {source}")]
pub struct TlsFileError {
    /// The file.
    pub path: PathBuf,
    /// The cause.
    pub source: std::io::Error,
}

/// A set of PEM files that does not make a usable TLS configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error(transparent)]
    File(#[from] TlsFileError),
    /// A file holds no PEM object of the kind expected, or one that does not parse.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// The pieces do not fit together (the key is not the certificate's, a CA that rustls refuses).
    #[error("{0}")]
    Config(String),
}

/// Labels of [`TlsMetrics::reloads`].
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    /// Which TLS endpoint (`grpc`, `extproc`, `agent-client`).
    pub endpoint: String,
    /// `applied` (a renewed set in use) or `failed` (kept the last good set).
    pub result: &'static str,
}

/// Labels of [`TlsMetrics::refused`].
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    /// Which TLS endpoint.
    pub endpoint: String,
}

/// What the TLS endpoints of a process count; clones share the counters.
#[derive(Clone, Debug, Default)]
pub struct TlsMetrics {
    /// Certificate reloads, by result.
    pub reloads: Family<ReloadLabels, Counter>,
    /// Handshakes that failed on a server: no certificate, another CA's, the wrong role, timed out.
    pub refused: Family<EndpointLabels, Counter>,
}

impl TlsMetrics {
    /// Registers the counters.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "kinference_tls_reloads",
            "Reloads of renewed TLS certificates, by endpoint and result (failed: the last good set kept)",
            crate::metrics::Described(self.reloads.clone()),
        );
        registry.register(
            "kinference_tls_handshakes_refused",
            "TLS handshakes refused by a server: no certificate, another CA's, the wrong role, or too slow",
            crate::metrics::Described(self.refused.clone()),
        );
    }

    fn reloaded(&self, endpoint: &str, result: &'static str) {
        self.reloads
            .get_or_create(&ReloadLabels {
                endpoint: endpoint.to_owned(),
                result,
            })
            .inc();
    }
}

/// Reads an endpoint's files again every [`RELOAD_EVERY`] and swaps in a changed set, until the
/// runtime stops; a changed set that does not load is logged and counted once, and the last good one
/// stays in use.
fn spawn_reloader<T: Send + Sync + 'static>(
    endpoint: String,
    metrics: TlsMetrics,
    watched: std::sync::Arc<material::Watched<T>>,
) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(RELOAD_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            match watched.reload() {
                Ok(false) => {}
                Ok(true) => {
                    metrics.reloaded(&endpoint, "applied");
                    tracing::info!(
                        endpoint,
                        "TLS certificates renewed: new connections use them"
                    );
                }
                Err(error) => {
                    metrics.reloaded(&endpoint, "failed");
                    tracing::warn!(endpoint, %error, "TLS certificates changed but do not load: keeping the last good set");
                }
            }
        }
    });
}
