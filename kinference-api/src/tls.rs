//! Mutual TLS (rustls) for Kinference's gRPC connections: the agent's summary stream (agent server,
//! gateway client) and the gateway's ext_proc server. PEM files named by flags, read once at start-up
//! (mounted from Secrets, e.g. cert-manager's `tls.crt`, `tls.key`, `ca.crt`); a server configured with
//! them accepts only clients whose certificate its CA signed.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// A PEM file could not be read.
#[derive(Debug, thiserror::Error)]
#[error("reading {path}: {source}")]
pub struct TlsFileError {
    /// The file.
    pub path: PathBuf,
    /// The cause.
    pub source: std::io::Error,
}

fn read(path: &Path) -> Result<Vec<u8>, TlsFileError> {
    std::fs::read(path).map_err(|source| TlsFileError {
        path: path.to_owned(),
        source,
    })
}

/// A server's files: its certificate (chain) and key, and the CA its clients' certificates must
/// chain to (a client without one is refused during the handshake).
#[derive(Debug, Clone)]
pub struct ServerTlsFiles {
    /// The server's certificate chain (PEM).
    pub cert: PathBuf,
    /// The server's private key (PEM).
    pub key: PathBuf,
    /// The CA of the clients (PEM).
    pub client_ca: PathBuf,
}

impl ServerTlsFiles {
    /// The files when all three are given (clap makes them go together), else plaintext.
    pub fn from_flags(
        cert: Option<&PathBuf>,
        key: Option<&PathBuf>,
        client_ca: Option<&PathBuf>,
    ) -> Option<ServerTlsFiles> {
        Some(ServerTlsFiles {
            cert: cert?.clone(),
            key: key?.clone(),
            client_ca: client_ca?.clone(),
        })
    }

    /// The server's rustls configuration: client certificates required.
    pub fn config(&self) -> Result<ServerTlsConfig, TlsFileError> {
        Ok(ServerTlsConfig::new()
            .identity(Identity::from_pem(read(&self.cert)?, read(&self.key)?))
            .client_ca_root(Certificate::from_pem(read(&self.client_ca)?)))
    }
}

/// A client's files: the CA the server's certificate must chain to, the client's own certificate and
/// key, and the name the server's certificate must carry.
#[derive(Debug, Clone)]
pub struct ClientTlsFiles {
    /// The servers' CA (PEM).
    pub ca: PathBuf,
    /// The client's certificate chain (PEM).
    pub cert: PathBuf,
    /// The client's private key (PEM).
    pub key: PathBuf,
    /// The DNS name checked in the server's certificate (servers are dialled by IP).
    pub server_name: String,
}

impl ClientTlsFiles {
    /// The client's rustls configuration.
    pub fn config(&self) -> Result<ClientTlsConfig, TlsFileError> {
        Ok(ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read(&self.ca)?))
            .identity(Identity::from_pem(read(&self.cert)?, read(&self.key)?))
            .domain_name(self.server_name.clone()))
    }
}
