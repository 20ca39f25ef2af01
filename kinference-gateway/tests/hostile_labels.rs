//! A client cannot choose metric labels: thousands of requests with random 2 KB model names, sent to
//! the real `kinference-gateway` binary, leave its `/metrics` exposition the same size.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

mod support;

/// One HTTP/1.1 exchange on a fresh connection: (status line, body).
fn exchange(port: u16, request: &str) -> Option<(String, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    stream.write_all(request.as_bytes()).ok()?;
    let mut out = String::new();
    stream.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    Some((head.lines().next()?.to_string(), body.to_string()))
}

fn metrics(admin: u16) -> Option<String> {
    let (status, body) = exchange(
        admin,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )?;
    status.contains(" 200 ").then_some(body)
}

fn chat(port: u16, model: &str) -> String {
    let body = format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":1}}"#
    );
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    exchange(port, &request)
        .map(|(status, _)| status)
        .unwrap_or_default()
}

#[test]
fn random_model_names_do_not_grow_metrics() {
    let dir = std::env::temp_dir().join(format!("kinference-labels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("gateway.yaml");
    // An unreachable worker: every request fails fast, before or at routing.
    std::fs::write(
        &config,
        "workers:\n  - url: http://127.0.0.1:9\n    model: served\nrouting: kinference\n",
    )
    .unwrap();
    let (mut gateway, api, admin) = support::spawn_gateway(&config);
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics(admin).is_none() {
        if let Ok(Some(status)) = gateway.0.try_wait() {
            panic!("kinference-gateway exited with {status}");
        }
        assert!(Instant::now() < deadline, "no /metrics in 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }

    // Warm up every family an error request touches, then measure.
    let first = chat(api, "served");
    assert!(!first.is_empty(), "no answer from the gateway");
    chat(api, "unknown-warm-up");
    let before = metrics(admin).expect("/metrics");
    let filler = "x".repeat(2048);
    let mut refused = 0;
    for i in 0..2_000 {
        let status = chat(api, &format!("m{i}-{filler}"));
        if status.contains(" 404 ") || status.contains(" 503 ") {
            refused += 1;
        }
    }
    assert_eq!(refused, 2_000, "every random model is refused");
    let after = metrics(admin).expect("/metrics after the flood");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        !after.contains(&filler[..64]),
        "a client-chosen model name became a label"
    );
    assert_eq!(
        after.lines().count(),
        before.lines().count(),
        "new series after 2,000 random model names"
    );
    assert!(
        after.len() < before.len() + 256,
        "/metrics grew from {} to {} bytes",
        before.len(),
        after.len()
    );
}
