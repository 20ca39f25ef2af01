//! Flow control through the real `kinference-gateway` binary (`--flow-control`): a request to a
//! saturated pool waits in the gateway and is shed past its band's deadline with 503 and
//! `Retry-After` in its own protocol; a tenant with its share of the queue waiting gets 429; an
//! unsaturated pool serves at once; the shed and saturation metrics say why. The workers are
//! loopback servers (nothing here needs a real engine). The saturated pool is saturated the way a
//! busy one is: its worker holds a request before its first token, and with a 1 ms TTFT target a
//! worker with a first token on its way is full by the estimate (an idle one never is: it takes
//! the request that holds it).
//!
//! Per-request objectives and the engine's priority: a TTFT objective no worker is estimated to
//! meet is refused at once (503 `objective_unmet`, `Retry-After`) where the tenant's `onMiss` says
//! `Refuse`, served where it says `Serve` or the objective is met, and ignored from a tenant
//! without `objectives`; a gateway whose workers run `--scheduling-policy priority` sends each
//! request's band as the body's `priority`, and one whose workers do not sends none.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

mod support;

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const MODEL: &str = "flow-model";

/// A worker that answers every request with one short chat completion; its port.
async fn canned_worker() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                // One request per connection is enough for the gateway's pool and probes.
                let _ = socket.read(&mut buf).await;
                let response = support::raw_worker::chat_completion_response(MODEL);
                let _ = socket.write_all(response.as_bytes()).await;
            });
        }
    });
    port
}

/// A worker that never answers a POST (each one waits for its first token for good) and answers
/// anything else (the gateway's health probes) like [`canned_worker`]; its port and how many POSTs
/// it holds.
async fn holding_worker() -> (u16, Arc<AtomicUsize>) {
    let held = Arc::new(AtomicUsize::new(0));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let count = Arc::clone(&held);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let count = Arc::clone(&count);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let Ok(n) = socket.read(&mut buf).await else {
                    return;
                };
                if buf[..n].starts_with(b"POST") {
                    count.fetch_add(1, Ordering::SeqCst);
                    // Held, the connection open, until the test ends.
                    std::future::pending::<()>().await;
                }
                let body = "{}";
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
            });
        }
    });
    (port, held)
}

/// A worker that answers like [`canned_worker`] and keeps every request body it receives.
async fn recording_worker() -> (u16, Arc<parking_lot::Mutex<Vec<String>>>) {
    let bodies = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let kept = Arc::clone(&bodies);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let kept = Arc::clone(&kept);
            tokio::spawn(async move {
                // Head and body, by its content-length.
                let mut got = Vec::new();
                let mut buf = vec![0u8; 65536];
                loop {
                    let Ok(n) = socket.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&got).to_string();
                    let Some(end) = text.find("\r\n\r\n") else {
                        continue;
                    };
                    let length = text[..end]
                        .lines()
                        .find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            k.eq_ignore_ascii_case("content-length")
                                .then(|| v.trim().parse::<usize>().ok())?
                        })
                        .unwrap_or(0);
                    if got.len() >= end + 4 + length {
                        if text.starts_with("POST") {
                            kept.lock().push(text[end + 4..].to_string());
                        }
                        break;
                    }
                }
                let response = support::raw_worker::chat_completion_response(MODEL);
                let _ = socket.write_all(response.as_bytes()).await;
            });
        }
    });
    (port, bodies)
}

/// A gateway with tenants `bulk` (low priority) and `gold` (high) in front of `worker`, with
/// `flags`: (process, API port, admin port).
async fn gateway(
    dir: &std::path::Path,
    worker: u16,
    flags: &[&str],
) -> (testkit::ChildGuard, u16, u16) {
    gateway_with(dir, worker, flags, "", &[]).await
}

/// [`gateway`] with `extra` lines in `gateway.yaml` and more tenants (name, priority, spec lines).
async fn gateway_with(
    dir: &std::path::Path,
    worker: u16,
    flags: &[&str],
    extra: &str,
    more: &[(&str, &str, &str)],
) -> (testkit::ChildGuard, u16, u16) {
    let mut specs: Vec<(&str, &str, &str)> = vec![("bulk", "Low", ""), ("gold", "High", "")];
    specs.extend_from_slice(more);
    for &(name, priority, spec) in &specs {
        let secret = dir.join("secrets").join(name);
        std::fs::create_dir_all(&secret).expect("secret dir");
        std::fs::write(secret.join("api-key"), format!("sk-{name}")).expect("key");
        std::fs::write(
            dir.join(format!("{name}.yaml")),
            format!(
                "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {{name: {name}}}\nspec:\n  apiKeys: [{{secretRef: {{name: {name}, key: api-key}}}}]\n  priority: {priority}\n{spec}"
            ),
        )
        .expect("tenant");
    }
    let tenants = dir.join("tenants");
    std::fs::create_dir_all(&tenants).expect("tenants dir");
    for &(name, _, _) in &specs {
        std::fs::rename(
            dir.join(format!("{name}.yaml")),
            tenants.join(format!("{name}.yaml")),
        )
        .expect("move tenant");
    }
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - name: {MODEL}\nworkers:\n  - url: http://127.0.0.1:{worker}\n    model: {MODEL}\nrouting: least-outstanding\n{extra}tenancy:\n  tenants_dir: {}\n  secrets_dir: {}\n  usage_journal: {}\n",
            tenants.display(),
            dir.join("secrets").display(),
            dir.join("usage.jsonl").display()
        ),
    )
    .expect("config");
    support::start_gateway(&config, flags).await
}

fn chat_body() -> String {
    format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hello"}}],"max_tokens":2}}"#
    )
}

async fn post(api: u16, path: &str, key: &str, body: &str) -> (u16, String, String) {
    let bearer = format!("Bearer {key}");
    support::call(
        "127.0.0.1",
        api,
        "POST",
        path,
        &[("authorization", &bearer)],
        body,
    )
    .await
}

#[tokio::test]
async fn a_saturated_pool_holds_requests_then_sheds_them_with_retry_after_in_their_protocol() {
    let (worker, held) = holding_worker().await;
    let scratch = support::TempDir::new("flow-saturated");
    // A TTFT target of 1 ms: a worker with a request waiting for its first token is full
    // (est_ttft).
    let (_gw, api, admin) = gateway(
        &scratch.0,
        worker,
        &[
            "--flow-control",
            "--flow-ttft-target-ms=1",
            "--flow-deadline-ms=5000,5000,300",
            "--flow-tenant-queue=1",
            "--flow-retry-after-seconds=3",
        ],
    )
    .await;
    // The idle pool takes gold's request at once, however far past the target its estimate: the
    // worker holds it, and the pool is saturated from then on.
    let holding = tokio::spawn(async move {
        let body = chat_body();
        post(api, "/v1/chat/completions", "sk-gold", &body).await
    });
    let count = &held;
    support::wait_for("gold's request held by the worker", || async move {
        count.load(Ordering::SeqCst) == 1
    })
    .await;

    let started = Instant::now();
    let body = chat_body();
    let (status, head, answer) = post(api, "/v1/chat/completions", "sk-bulk", &body).await;
    let waited = started.elapsed();
    assert_eq!(status, 503, "{answer}");
    assert!(head.contains("retry-after: 3"), "{head}");
    assert!(answer.contains(r#""code":"queue_deadline""#), "{answer}");
    assert!(
        waited >= Duration::from_millis(300),
        "shed after {waited:?}, before its deadline"
    );

    let anthropic = format!(
        r#"{{"model":"{MODEL}","max_tokens":2,"messages":[{{"role":"user","content":"hello"}}]}}"#
    );
    let (status, head, answer) = post(api, "/v1/messages", "sk-bulk", &anthropic).await;
    assert_eq!(status, 503, "{answer}");
    assert!(head.contains("retry-after: 3"), "{head}");
    assert!(answer.contains(r#""type":"overloaded_error""#), "{answer}");

    // One of bulk's requests waits; its second is past its share of the queue: 429 at once.
    let waiting = tokio::spawn(async move {
        let body = chat_body();
        post(api, "/v1/chat/completions", "sk-bulk", &body).await
    });
    support::wait_for("bulk's request in the queue", || async {
        support::metric(
            admin,
            r#"kinference_gateway_flow_tenant_queued{band="low",tenant="bulk"}"#,
        )
        .await
            == 1.0
    })
    .await;
    let started = Instant::now();
    let (status, head, answer) = post(api, "/v1/chat/completions", "sk-bulk", &body).await;
    assert_eq!(status, 429, "{answer}");
    assert!(head.contains("retry-after: 3"), "{head}");
    assert!(answer.contains("tenant_queue_full"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_millis(250),
        "refused at once"
    );
    assert_eq!(waiting.await.expect("join").0, 503);

    let metrics = support::metrics_text(admin).await;
    for line in [
        r#"kinference_gateway_flow_shed_total{band="low",tenant="bulk",reason="queue_deadline"} 3"#,
        r#"kinference_gateway_flow_shed_total{band="low",tenant="bulk",reason="tenant_queue_full"} 1"#,
        r#"kinference_gateway_flow_saturated{pool="default/flow-model",reason="est_ttft"} 1"#,
        r#"kinference_gateway_flow_tenant_queued{band="low",tenant="bulk"} 0"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    assert!(
        !metrics.contains(r#"kinference_gateway_flow_shed_total{band="high""#),
        "gold's request was let through: {metrics}"
    );
    assert_eq!(
        held.load(Ordering::SeqCst),
        1,
        "nothing else reached the worker"
    );
    holding.abort();
}

#[tokio::test]
async fn a_pool_with_room_serves_at_once() {
    let worker = canned_worker().await;
    let scratch = support::TempDir::new("flow-room");
    let (_gw, api, admin) = gateway(&scratch.0, worker, &["--flow-control"]).await;
    let body = chat_body();
    let (status, _, answer) = post(api, "/v1/chat/completions", "sk-gold", &body).await;
    assert_eq!(status, 200, "{answer}");
    let metrics = support::metrics_text(admin).await;
    assert!(
        metrics.contains(
            r#"kinference_gateway_flow_saturated{pool="default/flow-model",reason="queue"} 0"#
        ),
        "{metrics}"
    );
    assert!(
        !metrics.contains("kinference_gateway_flow_shed_total{"),
        "{metrics}"
    );
}

/// `post` with more headers.
async fn post_with(api: u16, key: &str, headers: &[(&str, &str)]) -> (u16, String, String) {
    let bearer = format!("Bearer {key}");
    let mut all = vec![("authorization", bearer.as_str())];
    all.extend_from_slice(headers);
    support::call(
        "127.0.0.1",
        api,
        "POST",
        "/v1/chat/completions",
        &all,
        &chat_body(),
    )
    .await
}

#[tokio::test]
async fn a_ttft_objective_no_worker_meets_is_refused_at_once_where_the_tenant_says_refuse() {
    let worker = canned_worker().await;
    let scratch = support::TempDir::new("flow-objective");
    // Nothing is served before the tight objectives are asked for: the estimate is the prior's
    // (20 ms and more), well above 1 ms and well below a minute.
    let (_gw, api, admin) = gateway_with(
        &scratch.0,
        worker,
        &["--flow-retry-after-seconds=7"],
        "",
        &[
            (
                "strict",
                "Medium",
                "  flowControl:\n    objectives: {onMiss: Refuse}\n",
            ),
            (
                "lenient",
                "Medium",
                "  flowControl:\n    objectives: {onMiss: Serve}\n",
            ),
            (
                "floored",
                "Medium",
                "  flowControl:\n    objectives: {minTtftMs: 60000, onMiss: Refuse}\n",
            ),
        ],
    )
    .await;
    let tight = [("x-kinference-ttft-objective-ms", "1")];
    let started = Instant::now();
    let (status, head, answer) = post_with(api, "sk-strict", &tight).await;
    assert_eq!(status, 503, "{answer}");
    assert!(head.contains("retry-after: 7"), "{head}");
    assert!(answer.contains(r#""code":"objective_unmet""#), "{answer}");
    assert!(started.elapsed() < Duration::from_millis(500), "at once");
    // In the Anthropic protocol too.
    let bearer = "sk-strict";
    let anthropic = format!(
        r#"{{"model":"{MODEL}","max_tokens":2,"messages":[{{"role":"user","content":"hello"}}]}}"#
    );
    let (status, _, answer) = support::call(
        "127.0.0.1",
        api,
        "POST",
        "/v1/messages",
        &[
            ("x-api-key", bearer),
            ("x-kinference-ttft-objective-ms", "1"),
        ],
        &anthropic,
    )
    .await;
    assert_eq!(status, 503, "{answer}");
    assert!(answer.contains(r#""type":"overloaded_error""#), "{answer}");
    // The tenant's floor: an objective tighter than 60 s is held to 60 s, which the worker meets.
    let (status, _, answer) = post_with(api, "sk-floored", &tight).await;
    assert_eq!(status, 200, "{answer}");
    // `Serve` serves anyway; a tenant without objectives ignores the header.
    let (status, _, answer) = post_with(api, "sk-lenient", &tight).await;
    assert_eq!(status, 200, "{answer}");
    let (status, _, answer) = post_with(api, "sk-gold", &tight).await;
    assert_eq!(status, 200, "{answer}");
    // A generous objective is met.
    let (status, _, answer) = post_with(
        api,
        "sk-strict",
        &[("x-kinference-ttft-objective-ms", "60000")],
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let metrics = support::metrics_text(admin).await;
    let line = r#"kinference_gateway_flow_shed_total{band="medium",tenant="strict",reason="objective_unmet"} 2"#;
    assert!(metrics.contains(line), "{line} in\n{metrics}");
}

#[tokio::test]
async fn workers_with_priority_scheduling_are_sent_the_band_as_priority_and_others_none() {
    let (worker, bodies) = recording_worker().await;
    let scratch = support::TempDir::new("flow-engine-priority");
    let (_gw, api, _) = gateway_with(
        &scratch.0,
        worker,
        &[],
        "scheduling_policy: priority\n",
        &[],
    )
    .await;
    let recorded = &bodies;
    let sent = |key: &'static str, headers: &'static [(&'static str, &'static str)]| async move {
        let before = recorded.lock().len();
        let (status, _, answer) = post_with(api, key, headers).await;
        assert_eq!(status, 200, "{answer}");
        let got = recorded.lock()[before..].to_vec();
        assert_eq!(got.len(), 1, "{got:?}");
        serde_json::from_str::<serde_json::Value>(&got[0]).expect("json body")["priority"].clone()
    };
    assert_eq!(sent("sk-gold", &[]).await, serde_json::json!(-1));
    assert_eq!(sent("sk-bulk", &[]).await, serde_json::json!(1));
    // Gold may lower itself; bulk may not raise itself.
    let low = &[("x-kinference-priority", "low")];
    assert_eq!(sent("sk-gold", low).await, serde_json::json!(1));
    let high = &[("x-kinference-priority", "high")];
    assert_eq!(sent("sk-bulk", high).await, serde_json::json!(1));

    // Without priority scheduling: no `priority` at all (vLLM refuses one other than 0 then).
    let (worker, bodies) = recording_worker().await;
    let scratch = support::TempDir::new("flow-engine-fcfs");
    let (_gw, api, _) = gateway(&scratch.0, worker, &[]).await;
    let (status, _, answer) = post_with(api, "sk-gold", &[]).await;
    assert_eq!(status, 200, "{answer}");
    let got = bodies.lock().clone();
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(!got[0].contains("priority"), "{}", got[0]);
}
