//! The TLS endpoints over loopback, with certificates made by `openssl`: the role check, renewal in
//! place, and a bad renewal that keeps the last good set. (The binaries' ports over gRPC:
//! `kinference-gateway/tests/mtls.rs`.)

use std::path::{Path, PathBuf};

use futures::StreamExt;
use testkit::certs::{ca, leaf};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

use super::*;

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// CAs `ca` and `ca2`; in each, an agent (server) and a gateway (client) certificate; and an
/// agent certificate of `ca` used as a client (the wrong role).
fn certificates(test: &str) -> Option<Dir> {
    if !testkit::require(
        Path::new("/usr/bin/openssl").exists(),
        "openssl",
        "not installed (apt-get install -y openssl)",
    ) {
        return None;
    }
    let dir = std::env::temp_dir().join(format!("kinference-tls-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for ca_name in ["ca", "ca2"] {
        ca(&dir, ca_name);
        leaf(
            &dir,
            &format!("agent-{ca_name}"),
            "DNS:kinference-agent",
            ca_name,
        );
        leaf(
            &dir,
            &format!("gateway-{ca_name}"),
            "DNS:kinference-gateway",
            ca_name,
        );
    }
    Some(Dir(dir))
}

/// Copies `{name}.crt`/`.key` to `{as_name}.crt`/`.key` (a renewal, as a Secret update writes it).
fn install(dir: &Path, name: &str, as_name: &str) {
    for ext in ["crt", "key"] {
        std::fs::copy(
            dir.join(format!("{name}.{ext}")),
            dir.join(format!("{as_name}.{ext}")),
        )
        .unwrap();
    }
}

fn server_files(dir: &Path) -> ServerTlsFiles {
    ServerTlsFiles {
        cert: dir.join("server.crt"),
        key: dir.join("server.key"),
        client_ca: dir.join("server-ca.crt"),
        client_names: vec!["kinference-gateway".into()],
    }
}

fn client_files(dir: &Path) -> ClientTlsFiles {
    ClientTlsFiles {
        ca: dir.join("client-ca.crt"),
        cert: dir.join("client.crt"),
        key: dir.join("client.key"),
        server_name: "kinference-agent".into(),
    }
}

/// Serves `tls` on loopback: each admitted connection gets one byte, `k`.
async fn serve(tls: &ServerTls) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut accepted = Box::pin(tls.accept(TcpListenerStream::new(listener)));
    tokio::spawn(async move {
        while let Some(Ok(mut conn)) = accepted.next().await {
            tokio::spawn(async move {
                let _ = conn.write_all(b"k").await;
                let _ = conn.flush().await;
                let mut rest = Vec::new();
                let _ = conn.read_to_end(&mut rest).await;
            });
        }
    });
    port
}

/// Whether `client` is admitted by the server on `port` (reads its byte; a refusal shows as an
/// error at the first read under TLS 1.3).
async fn admitted(client: &ClientTls, port: u16) -> bool {
    let uri: http::Uri = format!("http://127.0.0.1:{port}").parse().unwrap();
    let Ok(io) = client.connect(&uri).await else {
        return false;
    };
    let mut tls = io.into_inner();
    let mut byte = [0u8; 1];
    matches!(
        tokio::time::timeout(std::time::Duration::from_secs(5), tls.read(&mut byte)).await,
        Ok(Ok(1))
    ) && byte == *b"k"
}

/// A client of `ca_name` presenting certificate `cert`.
fn client(dir: &Path, ca_name: &str, cert: &str, metrics: &TlsMetrics) -> ClientTls {
    let sub = dir.join(format!("client-{ca_name}-{cert}"));
    std::fs::create_dir_all(&sub).unwrap();
    std::fs::copy(
        dir.join(format!("{ca_name}.crt")),
        sub.join("client-ca.crt"),
    )
    .unwrap();
    for ext in ["crt", "key"] {
        std::fs::copy(
            dir.join(format!("{cert}.{ext}")),
            sub.join(format!("client.{ext}")),
        )
        .unwrap();
    }
    ClientTls::load("test-client", &client_files(&sub), metrics).unwrap()
}

/// The agent's server (certificate `agent-{ca_name}`, admitting gateways of `ca_name`) on loopback.
async fn agent_of(dir: &Path, ca_name: &str, metrics: &TlsMetrics) -> (ServerTls, u16) {
    install(dir, &format!("agent-{ca_name}"), "server");
    std::fs::copy(
        dir.join(format!("{ca_name}.crt")),
        dir.join("server-ca.crt"),
    )
    .unwrap();
    let server = ServerTls::load("grpc", &server_files(dir), metrics).unwrap();
    let port = serve(&server).await;
    (server, port)
}

/// Handshakes the agent's server refused so far.
fn refused(metrics: &TlsMetrics) -> u64 {
    metrics
        .refused
        .get_or_create(&EndpointLabels {
            endpoint: "grpc".into(),
        })
        .get()
}

#[tokio::test]
async fn only_clients_of_the_ca_with_the_admitted_role_get_in() {
    let Some(dir) = certificates("role") else {
        return;
    };
    let dir = &dir.0;
    let metrics = TlsMetrics::default();
    let (server, port) = agent_of(dir, "ca", &metrics).await;

    assert!(admitted(&client(dir, "ca", "gateway-ca", &metrics), port).await);
    // Same CA, but an agent's certificate: the wrong role.
    assert!(!admitted(&client(dir, "ca", "agent-ca", &metrics), port).await);
    // The right role from another CA.
    assert!(!admitted(&client(dir, "ca", "gateway-ca2", &metrics), port).await);
    assert_eq!(refused(&metrics), 2, "each refused handshake is counted");
    // A TCP probe (connect, close) is not a refusal.
    drop(
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap(),
    );
    assert!(admitted(&client(dir, "ca", "gateway-ca", &metrics), port).await);
    let after_probe = refused(&metrics);
    assert_eq!(
        after_probe, 2,
        "a connection closed before its handshake is not counted"
    );

    // The client checks the server's role too: a gateway's certificate serving is refused.
    install(dir, "gateway-ca", "server");
    assert!(server.reload_now().unwrap());
    assert!(!admitted(&client(dir, "ca", "gateway-ca", &metrics), port).await);
}

#[tokio::test]
async fn renewed_certificates_replace_the_old_ones_without_a_restart() {
    let Some(dir) = certificates("renew") else {
        return;
    };
    let dir = &dir.0;
    let metrics = TlsMetrics::default();
    let (server, port) = agent_of(dir, "ca", &metrics).await;
    let old_world = client(dir, "ca", "gateway-ca", &metrics);
    let new_world = client(dir, "ca2", "gateway-ca2", &metrics);
    assert!(admitted(&old_world, port).await);
    assert!(!admitted(&new_world, port).await);
    assert!(!server.reload_now().unwrap(), "nothing changed yet");

    // The whole set moves to the new CA.
    install(dir, "agent-ca2", "server");
    std::fs::copy(dir.join("ca2.crt"), dir.join("server-ca.crt")).unwrap();
    assert!(server.reload_now().unwrap());
    assert!(
        admitted(&new_world, port).await,
        "the renewed set is served"
    );
    assert!(!admitted(&old_world, port).await, "the old CA is gone");

    // A renewal half written (a key that is not the certificate's) is refused; the last good set
    // stays in use, and the same bad set is reported once.
    std::fs::copy(dir.join("agent-ca.key"), dir.join("server.key")).unwrap();
    assert!(matches!(server.reload_now(), Err(TlsError::Config(_))));
    assert!(!server.reload_now().unwrap());
    assert!(admitted(&new_world, port).await, "kept the last good set");
    std::fs::write(dir.join("server.crt"), "not a certificate").unwrap();
    assert!(server.reload_now().is_err());
    assert!(admitted(&new_world, port).await, "kept the last good set");
    std::fs::remove_file(dir.join("server-ca.crt")).unwrap();
    assert!(matches!(server.reload_now(), Err(TlsError::File(_))));
    assert!(admitted(&new_world, port).await, "kept the last good set");
}

#[tokio::test]
async fn a_client_renews_its_own_certificate_and_trust() {
    let Some(dir) = certificates("client") else {
        return;
    };
    let dir = &dir.0;
    // A server of the new world, and a client still in the old one.
    let metrics = TlsMetrics::default();
    let (_server, port) = agent_of(dir, "ca2", &metrics).await;
    std::fs::copy(dir.join("ca.crt"), dir.join("client-ca.crt")).unwrap();
    install(dir, "gateway-ca", "client");
    let renewing = ClientTls::load("agent-client", &client_files(dir), &metrics).unwrap();
    assert!(!admitted(&renewing, port).await);
    std::fs::copy(dir.join("ca2.crt"), dir.join("client-ca.crt")).unwrap();
    install(dir, "gateway-ca2", "client");
    assert!(renewing.reload_now().unwrap());
    assert!(
        admitted(&renewing, port).await,
        "the renewed client gets in"
    );
}

#[test]
fn a_set_that_does_not_load_is_a_start_up_error() {
    let Some(dir) = certificates("start") else {
        return;
    };
    let dir = &dir.0;
    install(dir, "agent-ca", "server");
    let metrics = TlsMetrics::default();
    // No CA file.
    assert!(matches!(
        ServerTls::load("grpc", &server_files(dir), &metrics),
        Err(TlsError::File(_))
    ));
    std::fs::copy(dir.join("ca.crt"), dir.join("server-ca.crt")).unwrap();
    // A key of another certificate.
    std::fs::copy(dir.join("gateway-ca.key"), dir.join("server.key")).unwrap();
    assert!(matches!(
        ServerTls::load("grpc", &server_files(dir), &metrics),
        Err(TlsError::Config(_))
    ));
    // A client name that is not a name.
    install(dir, "agent-ca", "server");
    let mut files = server_files(dir);
    files.client_names = vec!["not a name!".into()];
    assert!(ServerTls::load("grpc", &files, &metrics).is_err());
    assert!(ServerTls::load("grpc", &server_files(dir), &metrics).is_ok());
}
