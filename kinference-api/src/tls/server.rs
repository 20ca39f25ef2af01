//! A TLS server endpoint: its certificate, the CA its clients' certificates must chain to, the roles
//! (subject alternative names) a client may have, all renewed in place; and the stream of accepted
//! TLS connections tonic serves.

use std::path::PathBuf;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use super::material::{self, Watched};
use super::{EndpointLabels, HANDSHAKE_TIMEOUT, TlsError, TlsMetrics};

/// A server's files: its certificate (chain) and key, the CA its clients' certificates must chain
/// to, and the names a client's certificate must carry one of.
#[derive(Debug, Clone)]
pub struct ServerTlsFiles {
    /// The server's certificate chain (PEM).
    pub cert: PathBuf,
    /// The server's private key (PEM).
    pub key: PathBuf,
    /// The CA of the clients (PEM; several certificates while a CA is rotated).
    pub client_ca: PathBuf,
    /// The roles admitted: a client's certificate must be valid for one of these DNS names (its
    /// subject alternative names). Empty: any certificate of the CA.
    pub client_names: Vec<String>,
}

impl ServerTlsFiles {
    /// The files when all three are given (clap makes them go together), else plaintext.
    pub fn from_flags(
        cert: Option<&PathBuf>,
        key: Option<&PathBuf>,
        client_ca: Option<&PathBuf>,
        client_names: &[String],
    ) -> Option<ServerTlsFiles> {
        Some(ServerTlsFiles {
            cert: cert?.clone(),
            key: key?.clone(),
            client_ca: client_ca?.clone(),
            client_names: client_names.to_vec(),
        })
    }
}

/// What the files make at one time.
struct Loaded {
    key: Arc<CertifiedKey>,
    clients: Arc<dyn ClientCertVerifier>,
}

fn build(paths: &[PathBuf], bytes: &[Vec<u8>]) -> Result<Loaded, TlsError> {
    let key = material::certified_key((&paths[0], &bytes[0]), (&paths[1], &bytes[1]))?;
    let roots = material::roots(&paths[2], &bytes[2])?;
    let clients = WebPkiClientVerifier::builder_with_provider(roots, material::provider())
        .build()
        .map_err(|e| TlsError::Config(format!("{}: {e}", paths[2].display())))?;
    Ok(Loaded { key, clients })
}

/// A TLS server endpoint whose certificates are renewed in place.
pub struct ServerTls {
    endpoint: String,
    files: Arc<Watched<Loaded>>,
    roles: Arc<Roles>,
    metrics: TlsMetrics,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("endpoint", &self.endpoint)
            .field("client_names", &self.roles.names)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Loads the files (a failure is a start-up error: never serve in plaintext by mistake) and,
    /// inside a tokio runtime, starts reading them again for renewals.
    pub fn load(
        endpoint: &str,
        files: &ServerTlsFiles,
        metrics: &TlsMetrics,
    ) -> Result<ServerTls, TlsError> {
        let roles = Roles::new(&files.client_names)?;
        let watched = Arc::new(Watched::load(
            vec![
                files.cert.clone(),
                files.key.clone(),
                files.client_ca.clone(),
            ],
            build,
        )?);
        if tokio::runtime::Handle::try_current().is_ok() {
            super::spawn_reloader(endpoint.to_owned(), metrics.clone(), Arc::clone(&watched));
        }
        Ok(ServerTls {
            endpoint: endpoint.to_owned(),
            files: watched,
            roles: Arc::new(roles),
            metrics: metrics.clone(),
        })
    }

    /// Reads the files again now (what the reloader does every [`super::RELOAD_EVERY`]): whether
    /// a changed set was swapped in.
    pub fn reload_now(&self) -> Result<bool, TlsError> {
        self.files.reload()
    }

    /// The rustls configuration: HTTP/2 only, client certificates required and checked for their
    /// role, the certificate and CA always the current ones.
    pub fn config(&self) -> Arc<rustls::ServerConfig> {
        let current = Arc::new(Current {
            files: Arc::clone(&self.files),
            roles: Arc::clone(&self.roles),
        });
        let mut config = rustls::ServerConfig::builder_with_provider(material::provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default TLS versions")
            .with_client_cert_verifier(Arc::clone(&current) as Arc<dyn ClientCertVerifier>)
            .with_cert_resolver(current);
        config.alpn_protocols = vec![b"h2".to_vec()];
        // No session resumption: a resumed session skips the certificate checks, so a client of a
        // CA rotated out (or of a role no longer admitted) could come back on an old ticket. The
        // connections are long-lived gRPC streams; a full handshake each time costs nothing here.
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        config.send_tls13_tickets = 0;
        Arc::new(config)
    }

    /// The accepted connections of `incoming` after their TLS handshake, for tonic's
    /// `serve_with_incoming`. Handshakes run concurrently, each within [`HANDSHAKE_TIMEOUT`]; one that
    /// fails (no certificate, another CA's, the wrong role, too slow) is counted and dropped.
    pub fn accept<S, IO>(
        &self,
        incoming: S,
    ) -> impl Stream<Item = std::io::Result<TlsStream<IO>>> + Send + 'static
    where
        S: Stream<Item = std::io::Result<IO>> + Send + Unpin + 'static,
        IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let acceptor = TlsAcceptor::from(self.config());
        let endpoint = self.endpoint.clone();
        let refused = self.metrics.refused.get_or_create(&EndpointLabels {
            endpoint: endpoint.clone(),
        });
        let refused = refused.clone();
        incoming
            .filter_map(|accepted| std::future::ready(accepted.ok()))
            .map(move |io| {
                let (acceptor, endpoint, refused) =
                    (acceptor.clone(), endpoint.clone(), refused.clone());
                async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(io)).await {
                        Ok(Ok(tls)) => Some(Ok(tls)),
                        // Closed before a word: a TCP probe (a kubelet's readiness check), not a refusal.
                        Ok(Err(error)) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
                            tracing::trace!(endpoint, "connection closed before its TLS handshake");
                            None
                        }
                        Ok(Err(error)) => {
                            refused.inc();
                            tracing::debug!(endpoint, %error, "TLS handshake refused");
                            None
                        }
                        Err(_) => {
                            refused.inc();
                            tracing::debug!(endpoint, "TLS handshake timed out");
                            None
                        }
                    }
                }
            })
            .buffer_unordered(HANDSHAKES_AT_ONCE)
            .filter_map(std::future::ready)
    }
}

/// Handshakes in progress at once on one endpoint (the listener's connection cap bounds the rest).
const HANDSHAKES_AT_ONCE: usize = 64;

/// The roles a client may have.
#[derive(Debug)]
struct Roles {
    names: Vec<String>,
    parsed: Vec<ServerName<'static>>,
}

impl Roles {
    fn new(names: &[String]) -> Result<Roles, TlsError> {
        let parsed = names
            .iter()
            .map(|n| {
                ServerName::try_from(n.clone())
                    .map_err(|e| TlsError::Config(format!("client name {n:?}: {e}")))
            })
            .collect::<Result<_, _>>()?;
        Ok(Roles {
            names: names.to_vec(),
            parsed,
        })
    }

    /// Whether `cert` (already verified as the CA's) is valid for one of the roles.
    fn admits(&self, cert: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        if self.parsed.is_empty() {
            return Ok(());
        }
        let parsed = rustls::server::ParsedCertificate::try_from(cert)?;
        if self
            .parsed
            .iter()
            .any(|name| rustls::client::verify_server_name(&parsed, name).is_ok())
        {
            Ok(())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName,
            ))
        }
    }
}

/// The verifier and certificate resolver handed to rustls: they read the current files on every
/// handshake.
struct Current {
    files: Arc<Watched<Loaded>>,
    roles: Arc<Roles>,
}

impl std::fmt::Debug for Current {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Current")
            .field("roles", &self.roles.names)
            .finish_non_exhaustive()
    }
}

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.files.current().key))
    }
}

impl ClientCertVerifier for Current {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // The hints are optional; clients here hold one certificate and send it regardless.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified =
            self.files
                .current()
                .clients
                .verify_client_cert(end_entity, intermediates, now)?;
        self.roles.admits(end_entity)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.files
            .current()
            .clients
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.files
            .current()
            .clients
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.files.current().clients.supported_verify_schemes()
    }
}
