//! Several simulated workers in one `vllm-sim` process (`--port` as a list): each has its own cache,
//! metrics and KV-event stream, as if it ran alone, and a per-worker list that does not fit the ports
//! is refused at start.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testkit::{ChildGuard, free_port, tokenizer_dir};
use zeromq::{Socket, SocketRecv};

/// One HTTP/1.1 exchange with `Connection: close`: (status, body). The simulator answers these
/// requests with a Content-Length body.
fn call(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, rest.to_owned()))
}

fn json_of(port: u16, method: &str, path: &str, body: Option<&Value>) -> Value {
    let (status, text) = call(port, method, path, body).expect("http call");
    assert_eq!(status, 200, "{method} {path}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"))
}

fn vllm_sim(args: &[String]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_vllm-sim"));
    command
        .args([
            "--host",
            "127.0.0.1",
            "--model",
            "qwen2-sim",
            "--preset",
            "fast",
        ])
        .arg("--tokenizer-dir")
        .arg(tokenizer_dir())
        .args(["--block-size", "16", "--num-blocks", "64"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    command
}

fn wait_healthy(ports: &[u16]) {
    let deadline = Instant::now() + Duration::from_secs(90);
    for &port in ports {
        while !matches!(call(port, "GET", "/health", None), Ok((200, _))) {
            assert!(Instant::now() < deadline, "worker on {port} not ready");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

async fn next_topic(sub: &mut zeromq::SubSocket) -> String {
    let message = tokio::time::timeout(Duration::from_secs(20), sub.recv())
        .await
        .expect("a KV event batch within 20 s")
        .expect("receive");
    String::from_utf8_lossy(&message.into_vec()[0]).into_owned()
}

#[tokio::test]
async fn workers_in_one_process_keep_their_own_cache_metrics_and_events() {
    let ports = [free_port(), free_port()];
    // The agent's pattern: the subscriber binds, each worker connects with its own topic.
    let mut subs = Vec::new();
    let mut endpoints = Vec::new();
    for _ in 0..2 {
        let mut sub = zeromq::SubSocket::new();
        let endpoint = sub.bind("tcp://127.0.0.1:0").await.expect("bind sub");
        sub.subscribe("").await.expect("subscribe");
        endpoints.push(endpoint.to_string());
        subs.push(sub);
    }
    let args = vec![
        "--port".to_string(),
        format!("{},{}", ports[0], ports[1]),
        "--kv-events-endpoint".into(),
        endpoints.join(","),
        "--kv-topic".into(),
        "kv@w1,kv@w2".into(),
    ];
    let _child = ChildGuard(vllm_sim(&args).spawn().expect("spawn vllm-sim"));
    tokio::task::spawn_blocking(move || wait_healthy(&ports))
        .await
        .expect("health");
    // Let the subscriptions reach the publishers (PUB drops messages for unknown subscribers).
    tokio::time::sleep(Duration::from_millis(500)).await;

    let prompt: Vec<u32> = (100..164).collect();
    let request = json!({"prompt": prompt, "max_tokens": 2});
    let (first, second, other) = tokio::task::spawn_blocking(move || {
        let cached = |port| {
            json_of(port, "POST", "/v1/completions", Some(&request))["usage"]["prompt_tokens_details"]
                ["cached_tokens"]
                .as_u64()
                .expect("cached_tokens")
        };
        (cached(ports[0]), cached(ports[0]), cached(ports[1]))
    })
    .await
    .expect("requests");
    assert_eq!(first, 0, "a cold worker has nothing cached");
    assert!(second >= 48, "the repeat hits worker 1's cache: {second}");
    assert_eq!(other, 0, "worker 2 does not share worker 1's cache");

    assert_eq!(next_topic(&mut subs[0]).await, "kv@w1");
    assert_eq!(next_topic(&mut subs[1]).await, "kv@w2");

    let metrics = tokio::task::spawn_blocking(move || {
        ports.map(|port| call(port, "GET", "/metrics", None).expect("metrics").1)
    })
    .await
    .expect("metrics");
    let requests = |text: &str| {
        text.lines()
            .filter(|l| l.starts_with("vllm:request_success_total"))
            .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert_eq!(requests(&metrics[0]), 2.0, "{}", metrics[0]);
    assert_eq!(requests(&metrics[1]), 1.0, "{}", metrics[1]);
}

#[test]
fn a_per_worker_list_that_does_not_fit_the_ports_is_refused() {
    let args = vec![
        "--port".to_string(),
        format!("{},{}", free_port(), free_port()),
        "--kv-events-endpoint".into(),
        "tcp://127.0.0.1:1".into(),
    ];
    let out = vllm_sim(&args).output().expect("run vllm-sim");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--kv-events-endpoint has 1 values for 2 ports"),
        "{stderr}"
    );
}
