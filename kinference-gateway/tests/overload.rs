//! Overload protection, end to end: the real `kinference-gateway` binary in front of a real
//! `vllm-sim` worker, driven over raw loopback sockets (a client that sends half a body, or hangs
//! up mid-stream, is easiest to play byte by byte).
//!
//! - a slow-body client holds an in-flight slot only until the body deadline: then 408, and the
//!   next request gets the slot;
//! - past the in-flight limit a request is shed with 503 in its own protocol (OpenAI error JSON,
//!   Anthropic `overloaded_error`) and `Retry-After`;
//! - near the limit a low-priority tenant is shed while a high-priority one is still admitted;
//! - a client that hangs up mid-stream cancels its upstream request (the simulator's
//!   `vllm:num_requests_running` drops at once, not when the generation would have ended);
//! - a client that stops reading (connection open) is cut after `--client-write-timeout-ms` once
//!   the socket buffers are full, and its upstream request is cancelled the same way.

mod support;

use std::time::{Duration, Instant};

use testkit::ChildGuard;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MODEL: &str = "overload-model";

/// A `vllm-sim` worker at a realistic decode speed (about 30 tokens a second), and its port;
/// `None` (skipped) when the simulator is not built.
async fn worker() -> Option<(ChildGuard, u16)> {
    worker_at(1.0).await
}

/// [`worker`] with its clock scaled (`0.1`: ten times faster).
async fn worker_at(time_scale: f64) -> Option<(ChildGuard, u16)> {
    let sim = support::vllm_sim_binary()?;
    let time_scale = time_scale.to_string();
    let (child, port) = support::spawn_vllm_sim_with(
        &sim,
        MODEL,
        &["--preset", "l40s-27b-fp8", "--time-scale", &time_scale],
    );
    support::wait_until_ok(port, "/health").await;
    Some((child, port))
}

/// A gateway in front of the worker on `worker_port`, with `tenancy` (YAML under `tenancy:`, or
/// "") and `flags`: (process, API port, admin port), once `/readyz` answers.
async fn gateway(
    dir: &std::path::Path,
    worker_port: u16,
    tenancy: &str,
    flags: &[&str],
) -> (ChildGuard, u16, u16) {
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - name: {MODEL}\nworkers:\n  - url: http://127.0.0.1:{worker_port}\n    model: {MODEL}\nrouting: least-outstanding\n{tenancy}"
        ),
    )
    .expect("write config");
    support::start_gateway(&config, flags).await
}

fn chat_body(max_tokens: u32, stream: bool) -> String {
    format!(
        r#"{{"model":"{MODEL}","stream":{stream},"max_tokens":{max_tokens},"messages":[{{"role":"user","content":"overload"}}]}}"#
    )
}

fn messages_body() -> String {
    format!(
        r#"{{"model":"{MODEL}","max_tokens":1,"messages":[{{"role":"user","content":"overload"}}]}}"#
    )
}

/// The head of a POST with `body.len()` as its length and `key` as its bearer key (if any).
fn post_head(path: &str, key: Option<&str>, length: usize) -> String {
    let auth = key.map_or(String::new(), |k| format!("authorization: Bearer {k}\r\n"));
    format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{auth}content-length: {length}\r\nconnection: close\r\n\r\n"
    )
}

/// A whole POST on a fresh connection: the raw response.
async fn post(port: u16, path: &str, key: Option<&str>, body: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let req = format!("{}{body}", post_head(path, key, body.len()));
    s.write_all(req.as_bytes()).await.expect("send");
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut buf))
        .await
        .expect("no answer within 20 s")
        .expect("read");
    String::from_utf8_lossy(&buf).into_owned()
}

/// A request that sends its head and half its body, then nothing: it holds an in-flight slot
/// until the body deadline. Returns the connection to read the answer from.
async fn slow_body(port: u16, key: Option<&str>) -> TcpStream {
    let body = chat_body(1, false);
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let half = &body[..body.len() / 2];
    s.write_all(
        format!(
            "{}{half}",
            post_head("/v1/chat/completions", key, body.len())
        )
        .as_bytes(),
    )
    .await
    .expect("send");
    s
}

fn status(response: &str) -> u16 {
    response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// The value of the first sample of `name` in a Prometheus exposition.
fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn in_flight(admin: u16) -> f64 {
    let metrics = support::metrics_text(admin).await;
    sample(&metrics, "kinference_gateway_overload_in_flight").expect("in-flight gauge")
}

#[tokio::test]
async fn a_slow_body_times_out_and_frees_its_slot_and_the_next_request_is_shed_until_then() {
    let Some((_worker, worker_port)) = worker().await else {
        return;
    };
    let scratch = support::TempDir::new("overload-slow");
    let dir = &scratch.0;
    let (_gw, api, admin) = gateway(
        dir,
        worker_port,
        "",
        &[
            "--max-in-flight=1",
            "--overload-queue-timeout-ms=0",
            "--body-read-timeout-ms=1000",
            "--overload-retry-after-seconds=3",
        ],
    )
    .await;

    let started = Instant::now();
    let mut slow = slow_body(api, None).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(in_flight(admin).await, 1.0);

    // The slot is taken: both protocols get their own overload error, before their body is read.
    let openai = post(api, "/v1/chat/completions", None, &chat_body(1, false)).await;
    assert_eq!(status(&openai), 503, "{openai}");
    assert!(
        openai.to_ascii_lowercase().contains("retry-after: 3"),
        "{openai}"
    );
    assert!(openai.contains(r#""code":"overloaded""#), "{openai}");
    let anthropic = post(api, "/v1/messages", None, &messages_body()).await;
    assert_eq!(status(&anthropic), 503, "{anthropic}");
    assert!(
        anthropic.contains(r#""type":"overloaded_error""#),
        "{anthropic}"
    );
    assert!(
        anthropic.to_ascii_lowercase().contains("retry-after: 3"),
        "{anthropic}"
    );

    // The slow client gets 408 after the deadline (not before), and its slot is free again.
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut answer))
        .await
        .expect("the slow client was never answered")
        .expect("read");
    let answer = String::from_utf8_lossy(&answer);
    assert_eq!(status(&answer), 408, "{answer}");
    assert!(started.elapsed() >= Duration::from_millis(1000));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(in_flight(admin).await, 0.0);
    let served = post(api, "/v1/chat/completions", None, &chat_body(1, false)).await;
    assert_eq!(status(&served), 200, "{served}");

    let metrics = support::metrics_text(admin).await;
    assert!(
        metrics
            .contains(r#"kinference_gateway_shed_total{reason="queue_full",priority="medium"} 2"#),
        "{metrics}"
    );
}

const TENANT: &str = r#"apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata:
  name: NAME
spec:
  apiKeys:
    - secretRef: {name: NAME, key: api-key}
  priority: PRIORITY
"#;

#[tokio::test]
async fn near_the_limit_a_low_priority_tenant_is_shed_and_a_high_priority_one_admitted() {
    let Some((_worker, worker_port)) = worker().await else {
        return;
    };
    let scratch = support::TempDir::new("overload-priority");
    let dir = &scratch.0;
    let tenants = dir.join("tenants");
    std::fs::create_dir_all(&tenants).expect("tenants dir");
    for (name, priority) in [("gold", "High"), ("bronze", "Low")] {
        std::fs::write(
            tenants.join(format!("{name}.yaml")),
            TENANT.replace("NAME", name).replace("PRIORITY", priority),
        )
        .expect("tenant");
        let secret = dir.join("secrets").join(name);
        std::fs::create_dir_all(&secret).expect("secret dir");
        std::fs::write(secret.join("api-key"), format!("sk-{name}")).expect("key");
    }
    let tenancy = format!(
        "tenancy:\n  tenants_dir: {}\n  secrets_dir: {}\n  usage_journal: {}\n",
        tenants.display(),
        dir.join("secrets").display(),
        dir.join("usage.jsonl").display()
    );
    // Limit 10, reserve 20%: high may use 10 slots, medium 8, low 6.
    let (_gw, api, admin) = gateway(
        dir,
        worker_port,
        &tenancy,
        &[
            "--max-in-flight=10",
            "--priority-reserve-percent=20",
            "--overload-queue-timeout-ms=300",
            "--body-read-timeout-ms=10000",
        ],
    )
    .await;

    // Six slots held by slow bodies: low priority is at its ceiling.
    let mut held = Vec::new();
    for _ in 0..6 {
        held.push(slow_body(api, Some("sk-gold")).await);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while in_flight(admin).await < 6.0 {
        assert!(
            Instant::now() < deadline,
            "the slow bodies never took their slots"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let started = Instant::now();
    let low = post(
        api,
        "/v1/chat/completions",
        Some("sk-bronze"),
        &chat_body(1, false),
    )
    .await;
    assert_eq!(status(&low), 503, "{low}");
    // It waited in the queue for its timeout before it was shed.
    assert!(started.elapsed() >= Duration::from_millis(300));
    let high = post(
        api,
        "/v1/chat/completions",
        Some("sk-gold"),
        &chat_body(1, false),
    )
    .await;
    assert_eq!(status(&high), 200, "{high}");

    let metrics = support::metrics_text(admin).await;
    assert!(
        metrics
            .contains(r#"kinference_gateway_shed_total{reason="queue_timeout",priority="low"} 1"#),
        "{metrics}"
    );
    drop(held);
}

async fn running(worker_port: u16) -> f64 {
    let metrics = support::metrics_text(worker_port).await;
    sample(&metrics, "vllm:num_requests_running").expect("vllm:num_requests_running")
}

#[tokio::test]
async fn a_client_that_hangs_up_mid_stream_cancels_its_upstream_request() {
    let Some((_worker, worker_port)) = worker().await else {
        return;
    };
    let scratch = support::TempDir::new("overload-vanish");
    let dir = &scratch.0;
    let (_gw, api, admin) = gateway(dir, worker_port, "", &[]).await;

    // 2,000 tokens: about a minute at this preset's decode speed.
    let body = chat_body(2_000, true);
    let mut stream = TcpStream::connect(("127.0.0.1", api))
        .await
        .expect("connect");
    stream
        .write_all(
            format!(
                "{}{body}",
                post_head("/v1/chat/completions", None, body.len())
            )
            .as_bytes(),
        )
        .await
        .expect("send");
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    while !String::from_utf8_lossy(&received).contains("data: ") {
        let n = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut chunk))
            .await
            .expect("no first event")
            .expect("read");
        assert!(n > 0, "stream closed before its first event");
        received.extend_from_slice(&chunk[..n]);
    }
    assert_eq!(running(worker_port).await, 1.0);

    drop(stream);
    let hung_up = Instant::now();
    while running(worker_port).await > 0.0 {
        assert!(
            hung_up.elapsed() < Duration::from_secs(5),
            "the worker still generates for a client that is gone"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(in_flight(admin).await, 0.0);
}

#[tokio::test]
async fn a_client_that_stops_reading_is_cut_after_the_write_deadline_and_its_upstream_cancelled() {
    // Fifty times real speed: the socket buffers fill within seconds; the whole answer would take
    // 20 s (a cut one is told apart by its 499 below).
    let Some((_worker, worker_port)) = worker_at(0.02).await else {
        return;
    };
    let scratch = support::TempDir::new("overload-stall");
    let dir = &scratch.0;
    let (_gw, api, admin) = gateway(dir, worker_port, "", &["--client-write-timeout-ms=500"]).await;

    // A small receive window, so the gateway's writes block soon after the client stops reading.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut stream = socket
        .connect(std::net::SocketAddr::from(([127, 0, 0, 1], api)))
        .await
        .expect("connect");
    // Long answers with long lines: the socket buffers fill within seconds.
    let body = format!(
        r#"{{"model":"{MODEL}","stream":true,"max_tokens":30000,"ignore_eos":true,"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "stall ".repeat(20)
    );
    stream
        .write_all(
            format!(
                "{}{body}",
                post_head("/v1/chat/completions", None, body.len())
            )
            .as_bytes(),
        )
        .await
        .expect("send");
    let mut first = [0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut first))
        .await
        .expect("no first bytes")
        .expect("read");
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    assert_eq!(running(worker_port).await, 1.0);

    // Now the client reads nothing, and keeps its connection open.
    let stopped = Instant::now();
    while running(worker_port).await > 0.0 {
        assert!(
            stopped.elapsed() < Duration::from_secs(30),
            "the worker still generates for a client that reads nothing"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(in_flight(admin).await, 0.0);
    // Cut, not finished: the request is counted as abandoned (499), not as a 200.
    let metrics = support::metrics_text(admin).await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kinference_gateway_requests_total")
                && l.contains("status=\"499\"")),
        "{metrics}"
    );
    drop(stream);
}
