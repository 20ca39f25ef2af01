//! The drain on SIGTERM, end to end: the real `kinference-gateway` binary in front of a real `vllm-sim`
//! worker (a realistic decode speed, so a stream lasts seconds).
//!
//! A stream is open when SIGTERM arrives: `/readyz` must turn 503 at once while the API still accepts
//! connections for `--shutdown-delay-seconds`; then new connections are refused, the open stream still
//! completes (`[DONE]`), and the process exits cleanly within delay + `--drain-timeout-seconds`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use testkit::{ChildGuard, free_port, tokenizer_dir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MODEL: &str = "drain-model";
const DELAY_S: u64 = 2;
const DRAIN_S: u64 = 20;

/// One HTTP/1.1 GET on a fresh connection: the status, or None when the connection fails.
async fn get_status(port: u16, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&buf);
    text.split_whitespace().nth(1)?.parse().ok()
}

async fn get_body(port: u16, path: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.expect("read");
    String::from_utf8_lossy(&buf).into_owned()
}

async fn wait_status(port: u16, path: &str, want: u16, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while get_status(port, path).await != Some(want) {
        assert!(
            Instant::now() < deadline,
            "{path} on port {port} never answered {want}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn sigterm_flips_readiness_then_drains_the_open_stream() {
    let sim = testkit::bin_dir().join("vllm-sim");
    if !testkit::require(
        sim.exists(),
        "vllm-sim",
        format_args!("{} not built", sim.display()),
    ) {
        return;
    }
    let worker_port = free_port();
    let _worker = ChildGuard(
        Command::new(&sim)
            .args(["--host", "127.0.0.1", "--port", &worker_port.to_string()])
            .args([
                "--model",
                MODEL,
                "--preset",
                "l40s-27b-fp8",
                "--tokenizer-dir",
            ])
            .arg(tokenizer_dir())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start vllm-sim"),
    );
    wait_status(worker_port, "/health", 200, Duration::from_secs(60)).await;

    let dir = std::env::temp_dir().join(format!("kinference-drain-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - name: {MODEL}\nworkers:\n  - url: http://127.0.0.1:{worker_port}\n    model: {MODEL}\nrouting: least-outstanding\n"
        ),
    )
    .expect("write config");
    let (api, admin) = (free_port(), free_port());
    let mut gateway = ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_kinference-gateway"))
            .arg(format!("--listen=127.0.0.1:{api}"))
            .arg(format!("--admin-listen=127.0.0.1:{admin}"))
            .arg(format!("--shutdown-delay-seconds={DELAY_S}"))
            .arg(format!("--drain-timeout-seconds={DRAIN_S}"))
            .arg("--config")
            .arg(&config)
            .current_dir(&dir)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .expect("start gateway"),
    );
    wait_status(admin, "/readyz", 200, Duration::from_secs(60)).await;
    let health = get_body(admin, "/healthz/workers").await;
    assert!(
        health.contains(r#""healthy":1"#) && health.contains(&worker_port.to_string()),
        "{health}"
    );

    // A stream of 200 tokens: about 6 s at this preset's decode speed, longer than the delay.
    let mut stream = TcpStream::connect(("127.0.0.1", api))
        .await
        .expect("connect api");
    let body = format!(
        r#"{{"model":"{MODEL}","stream":true,"max_tokens":200,"messages":[{{"role":"user","content":"drain"}}]}}"#
    );
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await.expect("send");
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    while !String::from_utf8_lossy(&received).contains("data: ") {
        let n = stream.read(&mut chunk).await.expect("read first chunk");
        assert!(n > 0, "stream closed before its first event");
        received.extend_from_slice(&chunk[..n]);
    }
    assert!(
        String::from_utf8_lossy(&received).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&received)
    );
    // An idle keep-alive connection, opened before SIGTERM: it must not hold the exit.
    let _idle = TcpStream::connect(("127.0.0.1", api))
        .await
        .expect("idle connection");

    let term = Instant::now();
    let status = Command::new("kill")
        .args(["-TERM", &gateway.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    // Not ready at once; the API port still accepts during the delay.
    wait_status(admin, "/readyz", 503, Duration::from_millis(1000)).await;
    assert!(term.elapsed() < Duration::from_secs(1));
    assert_eq!(get_status(api, "/v1/models").await, Some(200));

    // After the delay: the listening sockets are closed.
    tokio::time::sleep(Duration::from_secs(DELAY_S) + Duration::from_millis(500)).await;
    let refused = TcpStream::connect(("127.0.0.1", api)).await;
    assert!(
        refused.is_err(),
        "the API port still accepts after the delay"
    );

    // The stream still completes.
    loop {
        let n = tokio::time::timeout(Duration::from_secs(DRAIN_S), stream.read(&mut chunk))
            .await
            .expect("stream stalled")
            .expect("stream read");
        if n == 0 {
            break;
        }
        received.extend_from_slice(&chunk[..n]);
        if String::from_utf8_lossy(&received).contains("data: [DONE]") {
            break;
        }
    }
    let text = String::from_utf8_lossy(&received);
    assert!(text.contains("data: [DONE]"), "stream cut: {text}");
    assert!(
        term.elapsed() > Duration::from_secs(DELAY_S),
        "the stream ended before the delay: too short to test the drain"
    );

    // The process exits, cleanly, within the bound.
    let deadline = term + Duration::from_secs(DELAY_S + DRAIN_S + 2);
    let exit = loop {
        if let Some(exit) = gateway.0.try_wait().expect("wait") {
            break exit;
        }
        assert!(Instant::now() < deadline, "gateway still running");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(exit.success(), "gateway exit: {exit:?}");
    // The stream was the last thing it waited for, not the drain timeout.
    assert!(term.elapsed() < Duration::from_secs(DELAY_S + 10));
}
