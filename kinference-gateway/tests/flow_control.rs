//! Flow control through the real `kinference-gateway` binary (`--flow-control`): a request to a
//! saturated pool waits in the gateway and is shed past its band's deadline with 503 and
//! `Retry-After` in its own protocol; a tenant with its share of the queue waiting gets 429; an
//! unsaturated pool serves at once; the shed and saturation metrics say why. The worker is a canned
//! loopback server (nothing here needs a real engine: the saturation signal is forced through the
//! TTFT target).

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
                let body = format!(
                    r#"{{"id":"c","object":"chat.completion","created":0,"model":"{MODEL}","choices":[{{"index":0,"message":{{"role":"assistant","content":"hi"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}}}"#
                );
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
            });
        }
    });
    port
}

/// A gateway with tenants `bulk` (low priority) and `gold` (high) in front of `worker`, with
/// `flags`: (process, API port, admin port).
async fn gateway(
    dir: &std::path::Path,
    worker: u16,
    flags: &[&str],
) -> (testkit::ChildGuard, u16, u16) {
    for (name, priority) in [("bulk", "Low"), ("gold", "High")] {
        let secret = dir.join("secrets").join(name);
        std::fs::create_dir_all(&secret).expect("secret dir");
        std::fs::write(secret.join("api-key"), format!("sk-{name}")).expect("key");
        std::fs::write(
            dir.join(format!("{name}.yaml")),
            format!(
                "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {{name: {name}}}\nspec:\n  apiKeys: [{{secretRef: {{name: {name}, key: api-key}}}}]\n  priority: {priority}\n"
            ),
        )
        .expect("tenant");
    }
    let tenants = dir.join("tenants");
    std::fs::create_dir_all(&tenants).expect("tenants dir");
    for name in ["bulk", "gold"] {
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
            "models:\n  - name: {MODEL}\nworkers:\n  - url: http://127.0.0.1:{worker}\n    model: {MODEL}\nrouting: least-outstanding\ntenancy:\n  tenants_dir: {}\n  secrets_dir: {}\n  usage_journal: {}\n",
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
    let worker = canned_worker().await;
    let scratch = support::TempDir::new("flow-saturated");
    // A TTFT target of 1 ms: every worker is full (est_ttft), the pool stays saturated.
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
