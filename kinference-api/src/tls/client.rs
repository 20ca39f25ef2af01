//! A TLS client endpoint: its own certificate, the CA and the name (role) its servers' certificates
//! must carry, renewed in place; and the connector tonic dials through.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use super::material::{self, Watched};
use super::{TlsError, TlsMetrics};

/// A client's files: the CA the server's certificate must chain to, the client's own certificate and
/// key, and the name the server's certificate must carry (its role: servers are dialled by IP).
#[derive(Debug, Clone)]
pub struct ClientTlsFiles {
    /// The servers' CA (PEM; several certificates while a CA is rotated).
    pub ca: PathBuf,
    /// The client's certificate chain (PEM).
    pub cert: PathBuf,
    /// The client's private key (PEM).
    pub key: PathBuf,
    /// The DNS name checked in the server's certificate.
    pub server_name: String,
}

/// What the files make at one time.
struct Loaded {
    key: Arc<CertifiedKey>,
    servers: Arc<WebPkiServerVerifier>,
}

fn build(paths: &[PathBuf], bytes: &[Vec<u8>]) -> Result<Loaded, TlsError> {
    let key = material::certified_key((&paths[1], &bytes[1]), (&paths[2], &bytes[2]))?;
    let roots = material::roots(&paths[0], &bytes[0])?;
    let servers = WebPkiServerVerifier::builder_with_provider(roots, material::provider())
        .build()
        .map_err(|e| TlsError::Config(format!("{}: {e}", paths[0].display())))?;
    Ok(Loaded { key, servers })
}

/// A TLS client endpoint whose certificates are renewed in place. Cheap to clone.
#[derive(Clone)]
pub struct ClientTls {
    files: Arc<Watched<Loaded>>,
    server_name: ServerName<'static>,
    connector: TlsConnector,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Loads the files (a failure is a start-up error) and, inside a tokio runtime, starts reading
    /// them again for renewals.
    pub fn load(
        endpoint: &str,
        files: &ClientTlsFiles,
        metrics: &TlsMetrics,
    ) -> Result<ClientTls, TlsError> {
        let server_name = ServerName::try_from(files.server_name.clone())
            .map_err(|e| TlsError::Config(format!("server name {:?}: {e}", files.server_name)))?;
        let watched = Arc::new(Watched::load(
            vec![files.ca.clone(), files.cert.clone(), files.key.clone()],
            build,
        )?);
        if tokio::runtime::Handle::try_current().is_ok() {
            super::spawn_reloader(endpoint.to_owned(), metrics.clone(), Arc::clone(&watched));
        }
        let current = Arc::new(Current {
            files: Arc::clone(&watched),
        });
        let mut config = rustls::ClientConfig::builder_with_provider(material::provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default TLS versions")
            .dangerous()
            // Not dangerous: `Current` is rustls' own WebPKI verifier, reloaded.
            .with_custom_certificate_verifier(Arc::clone(&current) as Arc<dyn ServerCertVerifier>)
            .with_client_cert_resolver(current);
        config.alpn_protocols = vec![b"h2".to_vec()];
        // Every connection checks the server's current certificate (see the server's side).
        config.resumption = rustls::client::Resumption::disabled();
        Ok(ClientTls {
            files: watched,
            server_name,
            connector: TlsConnector::from(Arc::new(config)),
        })
    }

    /// Reads the files again now (what the reloader does every [`super::RELOAD_EVERY`]): whether
    /// a changed set was swapped in.
    pub fn reload_now(&self) -> Result<bool, TlsError> {
        self.files.reload()
    }

    /// Dials `uri` (`http://host:port`; the scheme is ignored) and completes the handshake.
    pub async fn connect(&self, uri: &http::Uri) -> std::io::Result<TokioIo<TlsStream<TcpStream>>> {
        let host = uri
            .host()
            .ok_or_else(|| std::io::Error::other(format!("{uri}: no host")))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port = uri.port_u16().unwrap_or(443);
        let tcp = TcpStream::connect((host, port)).await?;
        tcp.set_nodelay(true)?;
        let tls = self
            .connector
            .connect(self.server_name.clone(), tcp)
            .await?;
        Ok(TokioIo::new(tls))
    }
}

/// tonic dials through a `ClientTls` (`Endpoint::connect_with_connector`).
impl tower_service::Service<http::Uri> for ClientTls {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { this.connect(&uri).await })
    }
}

/// The verifier and certificate resolver handed to rustls: they read the current files on every
/// handshake.
struct Current {
    files: Arc<Watched<Loaded>>,
}

impl std::fmt::Debug for Current {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Current").finish_non_exhaustive()
    }
}

impl ResolvesClientCert for Current {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.files.current().key))
    }

    fn has_certs(&self) -> bool {
        true
    }
}

impl ServerCertVerifier for Current {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.files.current().servers.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.files
            .current()
            .servers
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.files
            .current()
            .servers
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.files.current().servers.supported_verify_schemes()
    }
}
