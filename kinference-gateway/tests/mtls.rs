//! Mutual TLS on the two gRPC connections, end to end, with certificates made here by `openssl`: the
//! real `kinference-agent` serving its summary stream with `--grpc-tls-*`, and the real gateway serving
//! ext_proc with `--extproc-tls-*` while it watches that agent with `--agent-tls-*`.
//!
//! - a client presenting a certificate of the CA, for the role the port admits, streams (the agent's
//!   snapshot arrives; the ext_proc handler answers), and the gateway reports the agent connected over
//!   TLS;
//! - a client without a certificate, with one of another CA, of the same CA but another role (an
//!   agent's or a gateway's certificate at the ext_proc port), or in plaintext is refused;
//! - certificates renewed on disk apply without a restart: the agent moves to a new CA, the gateway
//!   loses it, its files are renewed, and it reconnects on its own.
//!
//! Needs `openssl`; under `CI=true` a missing one fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as PReq;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpHeaders, ProcessingRequest};
use kinference_api::summary::WatchRequest;
use kinference_api::summary::node_agent_client::NodeAgentClient;
use testkit::{ChildGuard, bin_dir, free_port};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

mod support;

use testkit::certs::{ca, leaf};

fn pem(dir: &Path, file: &str) -> Vec<u8> {
    std::fs::read(dir.join(file)).expect("PEM file")
}

/// A TLS client config trusting `ca.crt` for `server`, presenting `identity` (a certificate name).
fn client_tls(dir: &Path, server: &str, identity: Option<&str>) -> ClientTlsConfig {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(pem(dir, "ca.crt")))
        .domain_name(server);
    if let Some(name) = identity {
        tls = tls.identity(Identity::from_pem(
            pem(dir, &format!("{name}.crt")),
            pem(dir, &format!("{name}.key")),
        ));
    }
    tls
}

/// A gRPC channel to loopback `port`: over TLS with `tls`, else in plaintext.
async fn channel(port: u16, tls: Option<ClientTlsConfig>) -> Result<Channel, String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://127.0.0.1:{port}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
    }
    endpoint
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))
}

/// Opens a Watch stream to the agent on `port` and reads its first message.
async fn watch(port: u16, tls: Option<ClientTlsConfig>) -> Result<(), String> {
    let channel = channel(port, tls).await?;
    let mut stream = NodeAgentClient::new(channel)
        .watch(WatchRequest {
            gateway_id: "mtls-test".into(),
        })
        .await
        .map_err(|e| format!("watch: {e}"))?
        .into_inner();
    match tokio::time::timeout(Duration::from_secs(10), stream.message()).await {
        Ok(Ok(Some(_))) => Ok(()),
        Ok(Ok(None)) => Err("stream ended".into()),
        Ok(Err(e)) => Err(format!("message: {e}")),
        Err(_) => Err("no message in 10 s".into()),
    }
}

/// Sends request headers on a new ext_proc stream to `port` and reads the answer.
async fn ext_proc(port: u16, tls: Option<ClientTlsConfig>) -> Result<(), String> {
    let channel = channel(port, tls).await?;
    let header = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    };
    let headers = ProcessingRequest {
        request: Some(PReq::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":method", "POST"),
                    header(":path", "/v1/chat/completions"),
                ],
            }),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    };
    let mut answers = ExternalProcessorClient::new(channel)
        .process(tokio_stream::iter([headers]))
        .await
        .map_err(|e| format!("process: {e}"))?
        .into_inner();
    match tokio::time::timeout(Duration::from_secs(10), answers.message()).await {
        Ok(Ok(Some(_))) => Ok(()),
        Ok(Ok(None)) => Err("stream ended".into()),
        Ok(Err(e)) => Err(format!("message: {e}")),
        Err(_) => Err("no answer in 10 s".into()),
    }
}

/// Checks a TLS server named `server` through `connect`: a client presenting certificate `admitted`
/// (of the CA in `dir`, for the role the port admits) gets an answer; one without a certificate,
/// with another CA's, with one of the CA for another role (`wrong_roles`), or in plaintext is
/// refused.
async fn admits_only_its_role_of_the_ca<F: Future<Output = Result<(), String>>>(
    dir: &Path,
    server: &str,
    admitted: &str,
    wrong_roles: &[&str],
    connect: impl Fn(Option<ClientTlsConfig>) -> F,
) {
    connect(Some(client_tls(dir, server, Some(admitted))))
        .await
        .unwrap_or_else(|e| panic!("{server}: a client certificate of the CA was refused: {e}"));
    let mut refused = vec![
        ("no client certificate", Some(client_tls(dir, server, None))),
        (
            "another CA's certificate",
            Some(client_tls(dir, server, Some("rogue"))),
        ),
        ("plaintext", None),
    ];
    for role in wrong_roles {
        refused.push((
            "a certificate of the CA for another role",
            Some(client_tls(dir, server, Some(role))),
        ));
    }
    for (case, tls) in refused {
        assert!(connect(tls).await.is_err(), "{server}: {case} was let in");
    }
}

fn wait_listening(port: u16, child: &mut ChildGuard, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = child.0.try_wait() {
            panic!("{what} exited with {status}");
        }
        assert!(Instant::now() < deadline, "{what} never listened on {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test]
async fn mtls_admits_only_its_role_of_the_ca_and_renews_in_place() {
    let agent_bin = bin_dir().join("kinference-agent");
    let have_openssl = ["/usr/bin/openssl", "/usr/local/bin/openssl"]
        .iter()
        .any(|p| Path::new(p).exists());
    if !testkit::require(
        have_openssl,
        "openssl",
        "not installed (apt-get install -y openssl)",
    ) || !testkit::require(
        agent_bin.exists(),
        "kinference-agent",
        format_args!("{} not built", agent_bin.display()),
    ) {
        return;
    }
    let dir: PathBuf = std::env::temp_dir().join(format!("kinference-mtls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    ca(&dir, "ca");
    ca(&dir, "other-ca");
    leaf(&dir, "agent", "DNS:kinference-agent", "ca");
    leaf(&dir, "gateway", "DNS:kinference-gateway", "ca");
    leaf(&dir, "envoy", "DNS:kinference-envoy", "ca");
    leaf(&dir, "rogue", "DNS:kinference-gateway", "other-ca");
    // The renewal: a new CA, and the agent's and the gateway's certificates of it.
    ca(&dir, "ca2");
    leaf(&dir, "agent2", "DNS:kinference-agent", "ca2");
    leaf(&dir, "gateway2", "DNS:kinference-gateway", "ca2");
    // The files the gateway dials the agents with, renewed in place below.
    for (from, to) in [
        ("ca.crt", "client-ca.crt"),
        ("gateway.crt", "client.crt"),
        ("gateway.key", "client.key"),
    ] {
        std::fs::copy(dir.join(from), dir.join(to)).unwrap();
    }
    let path = |f: &str| dir.join(f).display().to_string();

    // The agent, mTLS on its gRPC port.
    std::fs::write(dir.join("workers.yaml"), "workers: []\n").unwrap();
    let (grpc, agent_metrics) = (free_port(), free_port());
    let start_agent = |cert: &str, client_ca: &str| {
        ChildGuard(
            Command::new(&agent_bin)
                .args(["--grpc-listen", &format!("127.0.0.1:{grpc}")])
                .args(["--metrics-listen", &format!("127.0.0.1:{agent_metrics}")])
                .args(["--workers", &path("workers.yaml")])
                .args(["--grpc-tls-cert", &path(&format!("{cert}.crt"))])
                .args(["--grpc-tls-key", &path(&format!("{cert}.key"))])
                .args(["--grpc-tls-client-ca", &path(client_ca)])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("starting kinference-agent"),
        )
    };
    let mut agent = start_agent("agent", "ca.crt");
    wait_listening(grpc, &mut agent, "kinference-agent");
    // The agent admits gateways: another agent's certificate of the same CA is refused.
    admits_only_its_role_of_the_ca(&dir, "kinference-agent", "gateway", &["agent"], |tls| {
        watch(grpc, tls)
    })
    .await;

    // The gateway: ext_proc with mTLS, watching the agent with its client certificate.
    std::fs::write(
        dir.join("gateway.yaml"),
        format!("workers: []\nagents: [\"http://127.0.0.1:{grpc}\"]\nrouting: kinference\n"),
    )
    .unwrap();
    let (api, admin, extproc) = (free_port(), free_port(), free_port());
    let mut gateway = ChildGuard(
        support::gateway_command(&dir.join("gateway.yaml"), api, admin)
            .args(["--extproc-listen", &format!("127.0.0.1:{extproc}")])
            .args(["--extproc-tls-cert", &path("gateway.crt")])
            .args(["--extproc-tls-key", &path("gateway.key")])
            .args(["--extproc-tls-client-ca", &path("ca.crt")])
            .args(["--agent-tls-ca", &path("client-ca.crt")])
            .args(["--agent-tls-cert", &path("client.crt")])
            .args(["--agent-tls-key", &path("client.key")])
            .spawn()
            .expect("starting kinference-gateway"),
    );
    wait_listening(extproc, &mut gateway, "kinference-gateway");
    // The ext_proc port admits the proxy: a gateway's or an agent's certificate of the CA is refused.
    admits_only_its_role_of_the_ca(
        &dir,
        "kinference-gateway",
        "envoy",
        &["gateway", "agent"],
        |tls| ext_proc(extproc, tls),
    )
    .await;

    // The gateway's own Watch stream to the agent runs over mTLS.
    let connected = |up: u8| {
        format!("kinference_routing_agent_connected{{agent=\"http://127.0.0.1:{grpc}\"}} {up}")
    };
    wait_metric(
        admin,
        &connected(1),
        "the gateway never connected to the agent over mTLS",
    )
    .await;

    // Renewal without a restart: the agent comes back under a new CA; the gateway, still holding
    // the old files, cannot reach it, and once its files are renewed on disk it reconnects by itself.
    drop(agent);
    let mut agent = start_agent("agent2", "ca2.crt");
    wait_listening(grpc, &mut agent, "kinference-agent (new CA)");
    wait_metric(
        admin,
        &connected(0),
        "the gateway kept an agent of another CA",
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        reqwest_free_get(admin, "/metrics")
            .await
            .contains(&connected(0)),
        "the gateway reached an agent of a CA it does not trust"
    );
    for (from, to) in [
        ("ca2.crt", "client-ca.crt"),
        ("gateway2.crt", "client.crt"),
        ("gateway2.key", "client.key"),
    ] {
        std::fs::copy(dir.join(from), dir.join(to)).unwrap();
    }
    wait_metric(
        admin,
        &connected(1),
        "the gateway never reconnected with its renewed certificates",
    )
    .await;
    let metrics = reqwest_free_get(admin, "/metrics").await;
    assert!(
        metrics.contains(
            r#"kinference_tls_reloads_total{endpoint="agent-client",result="applied"} 1"#
        ),
        "the renewal is counted"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Waits (up to 30 s) for the gateway's `/metrics` on `admin` to hold `line`.
async fn wait_metric(admin: u16, line: &str, failure: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !reqwest_free_get(admin, "/metrics").await.contains(line) {
        assert!(Instant::now() < deadline, "{failure}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One plain HTTP/1.1 GET on loopback: the body (empty on any failure).
async fn reqwest_free_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return String::new();
    };
    let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    String::from_utf8_lossy(&buf).into_owned()
}
