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
use std::time::Duration;

use kinference_gateway::tenancy::limits::{FailMode, TenantSettings};
use kinference_gateway::tenancy::store::RedisStore;
use testkit::{ChildGuard, free_port};
use tokio::net::TcpStream;

mod support;

use testkit::certs;

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

/// A CA, a server certificate for 127.0.0.1 signed by it, and an unrelated CA, in `dir`.
fn make_certs(dir: &Path) {
    certs::ca(dir, "other-ca");
    certs::ca(dir, "ca");
    certs::leaf(dir, "server", "IP:127.0.0.1,DNS:localhost", "ca");
}

/// One exchange on loopback as the tenant: (status, body).
async fn call(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    let auth = format!("Bearer {KEY}");
    let (status, _, body) = support::call(
        "127.0.0.1",
        port,
        method,
        path,
        &[("authorization", &auth)],
        body,
    )
    .await;
    (status, body)
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
    let mut cmd = support::gateway_command(config, api, admin);
    cmd.env_remove("SSL_CERT_FILE").env_remove("SSL_CERT_DIR");
    if let Some(ca) = ca {
        cmd.env("SSL_CERT_FILE", ca);
    }
    let mut child = ChildGuard(cmd.spawn().expect("starting kinference-gateway"));
    support::wait_while_running(
        &mut child,
        "the gateway seeing its worker healthy",
        || async {
            TcpStream::connect(("127.0.0.1", admin)).await.is_ok()
                && call(admin, "GET", "/healthz/workers", "")
                    .await
                    .1
                    .contains("\"healthy\":1")
        },
    )
    .await;
    (child, api)
}

#[tokio::test]
async fn limits_hold_through_a_tls_only_redis_and_an_untrusted_one_fails_closed() {
    let redis = tool("redis-server");
    let have_openssl = tool("openssl").is_some();
    if !testkit::require(
        redis.is_some() && have_openssl,
        "redis-server and openssl",
        "not installed (apt-get install -y redis-server openssl)",
    ) {
        return;
    }
    let Some(sim) = support::vllm_sim_binary() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kinference-redis-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
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
    let (_worker, worker_port) = support::spawn_vllm_sim(&sim, MODEL);
    support::write_tenants(
        &dir,
        &[("acme", KEY)],
        "  limits:\n    requestsPerMinute: 2\n",
    );
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
