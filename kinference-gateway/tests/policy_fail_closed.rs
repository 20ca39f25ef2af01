//! PII fail-closed against the real `kinference-gateway` binary, with an in-test stand-in provider
//! (an OpenAI-compatible HTTP server on loopback that counts every request it receives).
//!
//! The only local pool points at a port where nothing listens, and a burst policy sends requests to the
//! provider while the local pools are saturated (a pool without a healthy worker counts as saturated).
//! A request without personal data reaches the provider; requests with personal data (OpenAI chat and
//! completions, Anthropic messages; streamed or not) are refused with `local_processing_required` in
//! the client's protocol, and the provider's count does not move.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use testkit::{ChildGuard, free_port, tokenizer_dir};

mod support;

use support::policies;

const MODEL: &str = "qwen2-sim";
const KEY_ENV: &str = "KINFERENCE_TEST_STANDIN_KEY";
const KEY: &str = "sk-fail-closed-test";

/// An OpenAI-compatible stand-in: counts requests, checks the key, answers one fixed completion.
async fn standin(count: Arc<AtomicUsize>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let count = Arc::clone(&count);
            tokio::spawn(async move {
                let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let count = Arc::clone(&count);
                    async move {
                        count.fetch_add(1, Ordering::SeqCst);
                        let authorized = req
                            .headers()
                            .get("authorization")
                            .is_some_and(|v| v.as_bytes() == format!("Bearer {KEY}").as_bytes());
                        let body = if authorized {
                            json!({"id": "chatcmpl-standin", "object": "chat.completion", "created": 0,
                                "model": "standin-model",
                                "choices": [{"index": 0, "message": {"role": "assistant", "content": "from the provider"},
                                             "finish_reason": "stop"}],
                                "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})
                        } else {
                            json!({"error": {"message": "bad key"}})
                        };
                        let mut response =
                            hyper::Response::new(Full::new(Bytes::from(body.to_string())));
                        if !authorized {
                            *response.status_mut() = http::StatusCode::UNAUTHORIZED;
                        }
                        Ok::<_, Infallible>(response)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// The model, a local pool whose only worker never answers, the stand-in provider, and a policy
/// that bursts to it while the local pool is saturated.
fn write_config(dir: &std::path::Path, provider: SocketAddr) -> PathBuf {
    let dead = format!("http://127.0.0.1:{}", free_port());
    let burst = r#"apiVersion: kinference.ai/v1alpha1
kind: InferencePolicy
metadata: {name: cloud-burst}
spec:
  priority: 20
  rules:
    - name: saturated
      action:
        burst:
          providers: [standin]
          when: {queueDepthAbove: 0}
"#;
    let policy_dir = policies::write(
        dir,
        &[
            policies::model(MODEL, Some(&tokenizer_dir())),
            policies::pool("local", MODEL, "Local", "sim", &policies::endpoint(&dead)),
            policies::standin_provider(provider, KEY_ENV, MODEL),
            burst.to_string(),
        ],
    );
    let config = dir.join("gateway.yaml");
    std::fs::write(&config, policies::gateway_yaml(&policy_dir, 100)).unwrap();
    config
}

async fn post(
    client: &Client<HttpConnector, Full<Bytes>>,
    url: &str,
    body: &Value,
) -> (http::StatusCode, Value) {
    let request = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes)
            .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into_owned())),
    )
}

#[tokio::test]
async fn personal_data_is_refused_and_never_reaches_the_provider() {
    let count = Arc::new(AtomicUsize::new(0));
    let provider = standin(Arc::clone(&count)).await;
    let dir = support::TempDir::new("fail-closed");
    let config = write_config(&dir.0, provider);
    let (port, admin) = (free_port(), free_port());
    let _gateway = ChildGuard(
        support::gateway_command(&config, port, admin)
            .env(KEY_ENV, KEY)
            .spawn()
            .expect("start kinference-gateway"),
    );
    support::wait_until_ok(admin, "/healthz").await;
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let base = format!("http://127.0.0.1:{port}/v1");

    // Without personal data: burst to the provider (the path is live).
    let (status, body) = post(
        &client,
        &format!("{base}/chat/completions"),
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "from the provider"
    );
    assert_eq!(count.load(Ordering::SeqCst), 1);

    let pii = "Send the invoice to jane.doe@example.com, card 4111 1111 1111 1111.";
    let cases = [
        (
            "chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": pii}]}),
        ),
        (
            "chat/completions",
            json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": pii}]}),
        ),
        ("completions", json!({"model": MODEL, "prompt": pii})),
        (
            "completions",
            json!({"model": MODEL, "prompt": pii, "stream": true}),
        ),
        (
            "messages",
            json!({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": pii}]}),
        ),
        (
            "messages",
            json!({"model": MODEL, "max_tokens": 8, "stream": true, "system": pii,
                            "messages": [{"role": "user", "content": "Summarize the above."}]}),
        ),
    ];
    for (path, body) in cases {
        let (status, answer) = post(&client, &format!("{base}/{path}"), &body).await;
        assert_eq!(status, 503, "{path}: {answer}");
        if path == "messages" {
            assert_eq!(answer["type"], "error", "{answer}");
            assert_eq!(answer["error"]["type"], "overloaded_error", "{answer}");
            assert!(
                answer["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("personal data")
            );
        } else {
            assert_eq!(
                answer["error"]["code"], "local_processing_required",
                "{answer}"
            );
            assert!(
                answer["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("personal data")
            );
        }
    }
    assert_eq!(
        count.load(Ordering::SeqCst),
        1,
        "a request with personal data reached the provider"
    );
}
