//! What several integration tests of the gateway share: the real gateway binary started on free
//! loopback ports and waited for, a real `vllm-sim` worker, the tenants' key files, and one raw
//! HTTP/1.1 exchange; policy documents in [`policies`], hand-written misbehaving
//! workers' request reader in [`raw_worker`], an OTLP
//! trace receiver in [`otlp`], a proxy's-eye ext_proc client in [`envoy`].
// Each test crate compiles this module and calls only some of it.
#![allow(dead_code)]

use std::ffi::OsString;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use testkit::{ChildGuard, free_port, tokenizer_dir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub mod envoy;
pub mod otlp;
pub mod policies;
pub mod raw_worker;

/// How long a process gets to start answering: generous, for a busy machine.
const START_DEADLINE: Duration = Duration::from_secs(60);

/// A fresh directory under the system's temporary directory, removed with everything in it on
/// drop; the path is in `.0`.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Creates `kinference-<name>-<process id>-<random>`: unique across tests and runs.
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kinference-{name}-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Starts `kinference-gateway --config config` on free ports: (the process, API port, admin port).
pub fn spawn_gateway(config: &Path) -> (ChildGuard, u16, u16) {
    spawn_gateway_with(config, &[])
}

/// [`spawn_gateway`] with more flags.
pub fn spawn_gateway_with(config: &Path, flags: &[&str]) -> (ChildGuard, u16, u16) {
    let (api, admin) = (free_port(), free_port());
    let child = gateway_command(config, api, admin)
        .args(flags)
        .spawn()
        .expect("starting kinference-gateway");
    (ChildGuard(child), api, admin)
}

/// [`spawn_gateway_with`], waited for until `/readyz` answers (a gateway that exits first fails the
/// test with its exit status): (the process, API port, admin port).
pub async fn start_gateway(config: &Path, flags: &[&str]) -> (ChildGuard, u16, u16) {
    let (mut child, api, admin) = spawn_gateway_with(config, flags);
    wait_until_ready(&mut child, admin).await;
    (child, api, admin)
}

/// The command that starts the gateway with `config` on loopback `api` and `admin` ports, its
/// output discarded: for a test that sets environment variables or a log file before spawning.
pub fn gateway_command(config: &Path, api: u16, admin: u16) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kinference-gateway"));
    command
        .args(gateway_args("127.0.0.1", api, admin, config))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    command
}

/// The gateway's arguments to listen on `host:api` and `host:admin` with `config`; for a test that
/// starts the binary some other way (on another address, under a wrapper).
pub fn gateway_args(host: &str, api: u16, admin: u16, config: &Path) -> Vec<OsString> {
    vec![
        "--listen".into(),
        format!("{host}:{api}").into(),
        "--admin-listen".into(),
        format!("{host}:{admin}").into(),
        "--config".into(),
        config.into(),
    ]
}

/// Waits until the gateway's `/readyz` answers 200 on loopback `admin`.
pub async fn wait_until_ready(gateway: &mut ChildGuard, admin: u16) {
    wait_while_running(gateway, "the gateway ready (/readyz)", || async {
        status_of(admin, "/readyz").await == Some(200)
    })
    .await;
}

/// Polls `ready` until it holds; fails the test after a minute, or at once if `process` exits
/// (its exit status then says why, rather than a timeout).
pub async fn wait_while_running<F: Future<Output = bool>>(
    process: &mut ChildGuard,
    what: &str,
    mut ready: impl FnMut() -> F,
) {
    let deadline = Instant::now() + START_DEADLINE;
    loop {
        if let Ok(Some(status)) = process.0.try_wait() {
            panic!("the process exited with {status} before {what}");
        }
        if ready().await {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: not within a minute");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls `ready` until it holds; fails the test after a minute.
pub async fn wait_for<F: Future<Output = bool>>(what: &str, mut ready: impl FnMut() -> F) {
    let deadline = Instant::now() + START_DEADLINE;
    while !ready().await {
        assert!(Instant::now() < deadline, "{what}: not within a minute");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until `GET path` on loopback `port` answers 2xx.
pub async fn wait_until_ok(port: u16, path: &str) {
    wait_for(&format!("127.0.0.1:{port}{path} answering 2xx"), || async {
        status_of(port, path)
            .await
            .is_some_and(|s| (200..300).contains(&s))
    })
    .await;
}

/// The status of `GET path` on loopback `port`; `None` while nothing answers there (nothing
/// listens yet, or the connection was refused or reset while the process starts).
async fn status_of(port: u16, path: &str) -> Option<u16> {
    let (status, _, _) = try_call("127.0.0.1", port, "GET", path, &[], "")
        .await
        .ok()?;
    Some(status)
}

/// The `/metrics` exposition on loopback `port` (the gateway's admin port, or a worker's).
pub async fn metrics_text(port: u16) -> String {
    let (status, _, text) = call("127.0.0.1", port, "GET", "/metrics", &[], "").await;
    assert_eq!(status, 200, "GET /metrics on {port}: {text}");
    text
}

/// The value of one series in the gateway's `/metrics` on loopback `admin` (0 when absent).
/// `series` is the name with its labels, as the exposition writes it.
pub async fn metric(admin: u16, series: &str) -> f64 {
    metrics_text(admin)
        .await
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The built `vllm-sim` binary; `None` when it is not built (a failure under `CI=true`).
pub fn vllm_sim_binary() -> Option<PathBuf> {
    let sim = testkit::bin_dir().join("vllm-sim");
    testkit::require(
        sim.exists(),
        "vllm-sim",
        format_args!(
            "{} not built (cargo build -p kinference-bench)",
            sim.display()
        ),
    )
    .then_some(sim)
}

/// The built `kinference-agent` binary; a test that starts one cannot run without it, so its
/// absence fails the test (build it first: `cargo build --workspace --bins`, or set
/// `KINFERENCE_BIN_DIR`).
pub fn agent_binary() -> PathBuf {
    let agent = testkit::bin_dir().join("kinference-agent");
    assert!(
        agent.exists(),
        "{} not found: build it first (cargo build --workspace --bins) or set KINFERENCE_BIN_DIR",
        agent.display()
    );
    agent
}

/// Starts `sim` (a `vllm-sim` binary) serving `model` with the `fast` preset and the test
/// tokenizer on a free loopback port: (the process, its port). It may not answer yet.
pub fn spawn_vllm_sim(sim: &Path, model: &str) -> (ChildGuard, u16) {
    spawn_vllm_sim_with(sim, model, &["--preset", "fast"])
}

/// [`spawn_vllm_sim`] with `flags` instead of the `fast` preset (another preset, `--time-scale`).
pub fn spawn_vllm_sim_with(sim: &Path, model: &str, flags: &[&str]) -> (ChildGuard, u16) {
    let port = free_port();
    let child = Command::new(sim)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--model", model])
        .args(flags)
        .arg("--tokenizer-dir")
        .arg(tokenizer_dir())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start vllm-sim");
    (ChildGuard(child), port)
}

/// Writes each `(tenant, key)`'s key file under `dir/secrets/<tenant>/api-key` and
/// `dir/tenants.yaml` with one `InferenceTenant` per tenant using that key, and `extra_spec`
/// (more lines of its spec, indented two spaces, e.g. limits) for all of them.
pub fn write_tenants(dir: &Path, tenants: &[(&str, &str)], extra_spec: &str) {
    let mut yaml = Vec::new();
    for (tenant, key) in tenants {
        let secrets = dir.join("secrets").join(tenant);
        std::fs::create_dir_all(&secrets).unwrap();
        std::fs::write(secrets.join("api-key"), key).unwrap();
        yaml.push(format!(
            "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {{name: {tenant}}}\nspec:\n  apiKeys:\n    - secretRef: {{name: {tenant}, key: api-key}}\n{extra_spec}"
        ));
    }
    std::fs::write(dir.join("tenants.yaml"), yaml.join("---\n")).unwrap();
}

/// A short non-streamed chat ("hello there", two tokens at most) for `model` through loopback
/// `port` with `headers`: (status, lower-cased head, body).
pub async fn chat(port: u16, model: &str, headers: &[(&str, &str)]) -> (u16, String, String) {
    try_chat(port, model, headers).await.expect("an answer")
}

/// [`chat`], with a failed connection, write or read returned rather than a panic (see [`try_call`]).
pub async fn try_chat(
    port: u16,
    model: &str,
    headers: &[(&str, &str)],
) -> std::io::Result<(u16, String, String)> {
    let body = format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"hello there"}}],"max_tokens":2}}"#
    );
    try_call(
        "127.0.0.1",
        port,
        "POST",
        "/v1/chat/completions",
        headers,
        &body,
    )
    .await
}

/// One HTTP/1.1 exchange on a fresh connection to `host:port`: (status, lower-cased head, body).
pub async fn call(
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    try_call(host, port, method, path, headers, body)
        .await
        .expect("an answer")
}

/// [`call`], with a failed connection, write or read returned rather than a panic: for waits on a
/// process that is still starting.
pub async fn try_call(
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<(u16, String, String)> {
    let mut s = TcpStream::connect((host, port)).await?;
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        req.push_str(&format!("{name}: {value}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut buf))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer in 20 s"))??;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((status, head.to_ascii_lowercase(), body.to_string()))
}
