//! The external classifier over `https://`: asked with the certificate chain checked against the CA
//! the configuration names (`classifier.external.ca_file`, e.g. the cluster's), and, when the
//! classifier's certificate does not chain to it, not asked at all (the request then falls back as
//! for any unreachable classifier: `pii`, fail closed). A real TLS server on loopback, certificates
//! made by `openssl`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kinference_gateway::policy::classify::external::{ExternalClassifier, OnError};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

mod support;

use testkit::certs;

/// A classifier answering `{"tags": ["pii"]}` over TLS with `name`'s certificate from `dir`.
async fn tls_classifier(dir: &std::path::Path, name: &str) -> std::net::SocketAddr {
    let certs: Vec<CertificateDer> = CertificateDer::pem_file_iter(dir.join(format!("{name}.crt")))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(dir.join(format!("{name}.key"))).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = service_fn(|req: hyper::Request<hyper::body::Incoming>| async move {
                    let _ = req.into_body().collect().await;
                    Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from_static(
                        br#"{"tags": ["pii"]}"#,
                    ))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn an_https_classifier_is_asked_with_the_configured_ca_and_refused_without_it() {
    let dir = support::TempDir::new("classifier-tls");
    certs::ca(&dir.0, "cluster-ca");
    certs::ca(&dir.0, "other-ca");
    certs::leaf(
        &dir.0,
        "classifier",
        "IP:127.0.0.1,DNS:localhost",
        "cluster-ca",
    );
    let addr = tls_classifier(&dir.0, "classifier").await;
    let url = format!("https://127.0.0.1:{}/classify", addr.port());
    let timeout = Duration::from_secs(5);

    let trusted = ExternalClassifier::with_ca(
        &url,
        timeout,
        OnError::TagPii,
        Some(&dir.0.join("cluster-ca.crt")),
    )
    .expect("an https classifier");
    let tags = trusted
        .classify("hello", "m")
        .await
        .expect("answered over TLS");
    assert!(tags.contains("pii"), "{tags:?}");

    // A certificate of another CA: the handshake fails, nothing is sent.
    let wrong = ExternalClassifier::with_ca(
        &url,
        timeout,
        OnError::TagPii,
        Some(&dir.0.join("other-ca.crt")),
    )
    .expect("configured");
    let error = wrong.classify("hello", "m").await.expect_err("refused");
    assert_eq!(error.outcome(), "error", "{error}");
    let fallback = wrong.classify_or_fallback("hello", "m").await;
    assert!(fallback.contains("pii"), "fails closed: {fallback:?}");

    // A CA file that holds no certificate stops the configuration, as a bad URL does.
    std::fs::write(dir.0.join("empty.crt"), "").unwrap();
    assert!(
        ExternalClassifier::with_ca(
            &url,
            timeout,
            OnError::TagPii,
            Some(&dir.0.join("empty.crt"))
        )
        .is_err()
    );
    assert!(ExternalClassifier::new("ftp://x/classify", timeout, OnError::TagPii).is_err());
}
