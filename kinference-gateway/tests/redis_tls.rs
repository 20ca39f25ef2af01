//! The shared limit store over TLS (`rediss://`), end to end: a real `redis-server` serving TLS only,
//! with a certificate of a private CA made here by `openssl`, in front of the real gateway binary and a
//! real `vllm-sim` worker.
//!
//! - trusting the CA (`SSL_CERT_FILE`), the gateway enforces a tenant's limit through Redis: two
//!   requests a minute pass, the third gets 429, and the bucket is in Redis;
//! - not trusting it, the TLS handshake fails and the tenant (default `on_store_unavailable`:
//!   closed) gets 503 `limits_unavailable`: a store the gateway cannot verify never lifts a limit.
//!
//! Needs `redis-server` (built with TLS, as Debian's is) and `openssl`; under `CI=true` a missing one fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kinference_gateway::tenancy::limits::{FailMode, TenantSettings};
use kinference_gateway::tenancy::store::RedisStore;
use testkit::{ChildGuard, free_port, tokenizer_dir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MODEL: &str = "tls-model";
const KEY: &str = "sk-acme-redis-tls";

#[test]
fn rediss_urls_build_a_tls_client_and_limits_fail_closed_by_default() {
    // Without the TLS feature the client refuses `rediss://` at once ("can't connect with TLS").
    for url in [
        "rediss://127.0.0.1:6380/0",
        "rediss://redis.kinference.svc:6380",
        "redis://127.0.0.1:6379",
    ] {
        assert!(
            RedisStore::new(url, Duration::from_millis(100)).is_ok(),
            "{url}"
        );
    }
    assert!(RedisStore::new("http://127.0.0.1:6379", Duration::from_millis(100)).is_err());
    assert_eq!(FailMode::default(), FailMode::Closed);
    let unset: TenantSettings = serde_yaml::from_str("burst_seconds: 1").unwrap();
    assert_eq!(unset.on_store_unavailable, FailMode::Closed);
}

fn tool(name: &str) -> Option<PathBuf> {
    ["/usr/bin", "/usr/local/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
}

fn openssl(dir: &Path, args: &[&str]) {
    let status = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl runs");
    assert!(status.success(), "openssl {args:?}");
}

/// A CA, a server certificate for 127.0.0.1 signed by it, and an unrelated CA, in `dir`.
fn make_certs(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "other-ca.key",
            "-out",
            "other-ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=someone-else",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=kinference-test-ca",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ],
    );
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "san.ext",
        ],
    );
}

async fn call(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut buf))
        .await
        .expect("answer in time")
        .expect("read");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

async fn chat(port: u16) -> (u16, String) {
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":2}}"#
    );
    call(port, "POST", "/v1/chat/completions", &body).await
}

/// The gateway on free ports with `config`, `SSL_CERT_FILE` set to `ca` when given; waits until its
/// worker is probed healthy (loopback callers read `/healthz/workers`).
async fn gateway(config: &Path, ca: Option<&Path>) -> (ChildGuard, u16) {
    let (api, admin) = (free_port(), free_port());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kinference-gateway"));
    cmd.args(["--listen", &format!("127.0.0.1:{api}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .arg("--config")
        .arg(config)
        .env_remove("SSL_CERT_FILE")
        .env_remove("SSL_CERT_DIR")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(ca) = ca {
        cmd.env("SSL_CERT_FILE", ca);
    }
    let mut child = ChildGuard(cmd.spawn().expect("starting kinference-gateway"));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Some(status)) = child.0.try_wait() {
            panic!("kinference-gateway exited with {status}");
        }
        if TcpStream::connect(("127.0.0.1", admin)).await.is_ok() {
            let (_, workers) = call(admin, "GET", "/healthz/workers", "").await;
            if workers.contains("\"healthy\":1") {
                return (child, api);
            }
        }
        assert!(
            Instant::now() < deadline,
            "the gateway never saw its worker healthy"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn limits_hold_through_a_tls_only_redis_and_an_untrusted_one_fails_closed() {
    let redis = tool("redis-server");
    let have_openssl = tool("openssl").is_some();
    let sim = testkit::bin_dir().join("vllm-sim");
    if !testkit::require(
        redis.is_some() && have_openssl,
        "redis-server and openssl",
        "not installed (apt-get install -y redis-server openssl)",
    ) || !testkit::require(
        sim.exists(),
        "vllm-sim",
        format_args!("{} not built", sim.display()),
    ) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("kinference-redis-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("secrets/acme")).unwrap();
    make_certs(&dir);

    let tls_port = free_port();
    let _redis = ChildGuard(
        Command::new(redis.unwrap())
            .args(["--port", "0", "--tls-port", &tls_port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args([
                "--tls-cert-file",
                "server.crt",
                "--tls-key-file",
                "server.key",
            ])
            .args(["--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no"])
            .current_dir(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts"),
    );
    let worker_port = free_port();
    let _worker = ChildGuard(
        Command::new(&sim)
            .args(["--host", "127.0.0.1", "--port", &worker_port.to_string()])
            .args(["--model", MODEL, "--preset", "fast", "--tokenizer-dir"])
            .arg(tokenizer_dir())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start vllm-sim"),
    );
    std::fs::write(dir.join("secrets/acme/api-key"), KEY).unwrap();
    std::fs::write(
        dir.join("tenants.yaml"),
        "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {name: acme}\nspec:\n  apiKeys:\n    - secretRef: {name: acme, key: api-key}\n  limits:\n    requestsPerMinute: 2\n",
    )
    .unwrap();
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - name: {MODEL}\nworkers:\n  - url: http://127.0.0.1:{worker_port}\n    model: {MODEL}\ntenancy:\n  tenants_dir: {d}/tenants.yaml\n  secrets_dir: {d}/secrets\n  store: redis\n  redis_url: rediss://127.0.0.1:{tls_port}/0\n  redis_timeout_ms: 2000\n  usage_journal: {d}/usage.jsonl\n",
            d = dir.display()
        ),
    )
    .unwrap();

    // Trusted: the limit is enforced in Redis, over TLS.
    {
        let (_gw, api) = gateway(&config, Some(&dir.join("ca.crt"))).await;
        assert_eq!(chat(api).await.0, 200);
        assert_eq!(chat(api).await.0, 200);
        let (status, text) = chat(api).await;
        assert_eq!(status, 429, "{text}");
    }
    let keys = Command::new("redis-cli")
        .args([
            "--tls",
            "--cacert",
            "ca.crt",
            "-p",
            &tls_port.to_string(),
            "--scan",
        ])
        .args(["--pattern", "kinf:rl:*"])
        .current_dir(&dir)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    assert!(keys.contains("kinf:rl:{acme}:*:requests"), "{keys}");

    // Untrusted: the handshake fails, the tenant is refused rather than served without limits.
    let (_gw, api) = gateway(&config, Some(&dir.join("other-ca.crt"))).await;
    let (status, text) = chat(api).await;
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("limits_unavailable"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
