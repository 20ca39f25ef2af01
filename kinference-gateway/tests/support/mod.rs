//! What several integration tests of the gateway share: the real binary started on two free loopback
//! ports.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use testkit::{ChildGuard, free_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Starts `kinference-gateway --config config` on free ports: (the process, API port, admin port).
// Each test crate compiles this module; those that pass flags call only `spawn_gateway_with`.
#[allow(dead_code)]
pub fn spawn_gateway(config: &Path) -> (ChildGuard, u16, u16) {
    spawn_gateway_with(config, &[])
}

/// [`spawn_gateway`] with more flags.
pub fn spawn_gateway_with(config: &Path, flags: &[&str]) -> (ChildGuard, u16, u16) {
    let (api, admin) = (free_port(), free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_kinference-gateway"))
        .args(["--listen", &format!("127.0.0.1:{api}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .args(flags)
        .arg("--config")
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting kinference-gateway");
    (ChildGuard(child), api, admin)
}

/// One HTTP/1.1 exchange on a fresh connection to `host:port`: (status, lower-cased head, body).
// Each test crate compiles this module; only those that speak raw HTTP call it.
#[allow(dead_code)]
pub async fn call(
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    let mut s = TcpStream::connect((host, port)).await.expect("connect");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        req.push_str(&format!("{name}: {value}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut buf))
        .await
        .expect("answer in time")
        .expect("read");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_string())
}
