//! Who may see what, end to end: the real `kinference-gateway` binary with an admin key in front of a
//! real `vllm-sim` worker, two tenants.
//!
//! - `/metrics`, `/healthz`, `/readyz` answer anyone; `/admin/usage` and `/healthz/workers` need the
//!   admin key, even from loopback once a key is configured;
//! - a tenant's own key on `/admin/usage` reads that tenant's usage only (another tenant's: 403);
//! - on the serving port `x-kinference-worker` and the debug explanation go to admins only.
//!
//! Without an admin key, loopback callers are admins and others are not (the peer's address is
//! checked, here through the machine's own non-loopback address when it has one).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use testkit::{ChildGuard, free_port};

mod support;

use support::call;

const MODEL: &str = "access-model";
const ADMIN_KEY: &str = "admin-key-for-the-access-test";
const ACME_KEY: &str = "sk-acme-access-test";
const GLOBEX_KEY: &str = "sk-globex-access-test";

async fn get(port: u16, path: &str, headers: &[(&str, &str)]) -> (u16, String, String) {
    call("127.0.0.1", port, "GET", path, headers, "").await
}

async fn chat(port: u16, headers: &[(&str, &str)]) -> (u16, String, String) {
    support::chat(port, MODEL, headers).await
}

/// The rows of an `/admin/usage` answer: the tenants it names.
fn tenants_in(report: &str) -> Vec<String> {
    let json: serde_json::Value = serde_json::from_str(report).expect("usage JSON");
    let mut names: Vec<String> = json["usage"]
        .as_array()
        .expect("usage rows")
        .iter()
        .map(|row| row["tenant"].as_str().unwrap_or_default().to_string())
        .collect();
    names.sort();
    names.dedup();
    names
}

struct Setup {
    _worker: ChildGuard,
    dir: std::path::PathBuf,
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A `vllm-sim` worker and a `gateway.yaml` with two tenants; None when vllm-sim is not built
/// (a failure under `CI=true`).
fn setup(tag: &str) -> Option<(Setup, std::path::PathBuf)> {
    let (worker, worker_port) = support::spawn_vllm_sim(&support::vllm_sim_binary()?, MODEL);
    let dir = std::env::temp_dir().join(format!("kinference-access-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    support::write_tenants(&dir, &[("acme", ACME_KEY), ("globex", GLOBEX_KEY)], "");
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - name: {MODEL}\nworkers:\n  - url: http://127.0.0.1:{worker_port}\n    model: {MODEL}\ntenancy:\n  tenants_dir: {tenants}\n  secrets_dir: {secrets}\n",
            tenants = dir.join("tenants.yaml").display(),
            secrets = dir.join("secrets").display(),
        ),
    )
    .unwrap();
    Some((
        Setup {
            _worker: worker,
            dir,
        },
        config,
    ))
}

/// Starts the gateway on `bind` with `extra` flags; waits until the worker serves through it.
async fn gateway(config: &std::path::Path, bind: &str, extra: &[&str]) -> (ChildGuard, u16, u16) {
    let (api, admin) = (free_port(), free_port());
    let mut child = ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_kinference-gateway"))
            .args(support::gateway_args(bind, api, admin, config))
            .args(extra)
            .env_remove("KINFERENCE_ADMIN_KEY")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting kinference-gateway"),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let auth = format!("Bearer {ACME_KEY}");
    loop {
        if let Ok(Some(status)) = child.0.try_wait() {
            panic!("kinference-gateway exited with {status}");
        }
        // A gateway still starting may refuse or reset a connection: wait and ask again.
        let answer = support::try_chat(api, MODEL, &[("authorization", &auth)]).await;
        if matches!(answer, Ok((200, _, _))) {
            return (child, api, admin);
        }
        assert!(
            Instant::now() < deadline,
            "the gateway never served; last answer: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn the_admin_key_guards_usage_workers_and_internal_headers() {
    let Some((_setup, config)) = setup("key") else {
        return;
    };
    let (_gw, api, admin) = gateway(&config, "127.0.0.1", &["--admin-key", ADMIN_KEY]).await;
    let acme = format!("Bearer {ACME_KEY}");
    let globex = format!("Bearer {GLOBEX_KEY}");
    let admin_bearer = format!("Bearer {ADMIN_KEY}");

    // Both tenants use the gateway (acme's first request was made while starting).
    assert_eq!(chat(api, &[("authorization", &globex)]).await.0, 200);

    // Probes and Prometheus need nothing.
    for path in ["/metrics", "/healthz", "/readyz"] {
        assert_eq!(get(admin, path, &[]).await.0, 200, "{path}");
    }
    // The admin API needs the key, even from loopback.
    for path in ["/admin/usage", "/healthz/workers"] {
        let (status, head, _) = get(admin, path, &[]).await;
        assert_eq!(status, 401, "{path}");
        assert!(head.contains("www-authenticate: bearer"), "{head}");
        let wrong = get(
            admin,
            path,
            &[("authorization", "Bearer not-the-admin-key-at-all")],
        )
        .await;
        assert_eq!(wrong.0, 401, "{path}");
    }
    let (status, _, workers) = get(
        admin,
        "/healthz/workers",
        &[("authorization", &admin_bearer)],
    )
    .await;
    assert_eq!(status, 200);
    assert!(workers.contains("127.0.0.1:"), "{workers}");
    let (status, _, all) = get(admin, "/admin/usage", &[("authorization", &admin_bearer)]).await;
    assert_eq!(status, 200, "{all}");
    assert_eq!(tenants_in(&all), ["acme", "globex"]);

    // A tenant's key reads that tenant's usage only.
    let (status, _, own) = get(admin, "/admin/usage", &[("authorization", &acme)]).await;
    assert_eq!(status, 200, "{own}");
    assert_eq!(tenants_in(&own), ["acme"]);
    let (status, _, own) = get(admin, "/admin/usage", &[("x-api-key", GLOBEX_KEY)]).await;
    assert_eq!(status, 200, "{own}");
    assert_eq!(tenants_in(&own), ["globex"]);
    let (status, _, body) = get(
        admin,
        "/admin/usage?tenant=globex",
        &[("authorization", &acme)],
    )
    .await;
    assert_eq!(status, 403, "{body}");
    // A tenant's key is no admin key: the workers' addresses stay hidden.
    assert_eq!(
        get(admin, "/healthz/workers", &[("authorization", &acme)])
            .await
            .0,
        401
    );

    // Serving port: a tenant's debug header shows nothing internal.
    let (status, head, _) = chat(
        api,
        &[("authorization", &acme), ("x-kinference-debug", "1")],
    )
    .await;
    assert_eq!(status, 200);
    assert!(!head.contains("x-kinference-worker"), "{head}");
    assert!(!head.contains("x-kinference-decision"), "{head}");
    // The admin key (in its own header; `Authorization` is the tenant's) shows both.
    let (status, head, _) = chat(
        api,
        &[
            ("authorization", &acme),
            ("x-kinference-debug", "1"),
            ("x-kinference-admin-key", ADMIN_KEY),
        ],
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        head.contains("x-kinference-worker: http://127.0.0.1:"),
        "{head}"
    );
    assert!(head.contains("x-kinference-decision"), "{head}");
}

/// This machine's own non-loopback IPv4 address, when it has a route anywhere (no packet is sent).
fn own_address() -> Option<std::net::IpAddr> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    socket.connect("192.0.2.1:9").ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[tokio::test]
async fn without_a_key_only_loopback_callers_are_admins() {
    let Some((_setup, config)) = setup("loopback") else {
        return;
    };
    let (_gw, api, admin) = gateway(&config, "0.0.0.0", &[]).await;
    let acme = format!("Bearer {ACME_KEY}");
    let (status, _, all) = get(admin, "/admin/usage", &[]).await;
    assert_eq!(status, 200, "{all}");
    assert_eq!(tenants_in(&all), ["acme"]);
    let (_, head, _) = chat(api, &[("authorization", &acme)]).await;
    assert!(head.contains("x-kinference-worker"), "{head}");

    let Some(ip) = own_address() else {
        eprintln!(
            "no non-loopback address on this machine: the remote half is covered by the unit tests"
        );
        return;
    };
    let host = ip.to_string();
    let (status, _, _) = call(&host, admin, "GET", "/admin/usage", &[], "").await;
    assert_eq!(status, 401, "a caller from {host} is no admin");
    assert_eq!(call(&host, admin, "GET", "/metrics", &[], "").await.0, 200);
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":2}}"#
    );
    let (status, head, _) = call(
        &host,
        api,
        "POST",
        "/v1/chat/completions",
        &[("authorization", &acme), ("x-kinference-debug", "1")],
        &body,
    )
    .await;
    assert_eq!(status, 200);
    assert!(!head.contains("x-kinference-worker"), "{head}");
    assert!(!head.contains("x-kinference-decision"), "{head}");
}
