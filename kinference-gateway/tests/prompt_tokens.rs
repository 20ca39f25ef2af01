//! The prompt under policies, against the real `kinference-gateway` binary: tokenized once per
//! request, and never sent to a remote pool while the request may have to stay local.
//!
//! The model has no tokenizer in the gateway, so every tokenization is a worker's `POST /tokenize`.
//! The local pool's worker is a real `vllm-sim` behind a loopback tap that counts those calls; the
//! remote pool's worker is a stand-in that answers like vLLM and counts every byte of every request
//! it receives besides the health, load and adapter-list probes (`GET /health`, `GET /metrics`,
//! `GET /v1/models`, which carry nothing of a request). The remote pool comes first in the worker
//! table, so a stage that asked "any worker of the model" would pick it.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use testkit::ChildGuard;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod support;

use support::policies;

const MODEL: &str = "sim";
const TOKENIZE: &[u8] = b"POST /tokenize ";

/// A TCP tap in front of `upstream`: passes every byte both ways and counts the `/tokenize` calls.
async fn tap(upstream: u16, tokenize: Arc<AtomicUsize>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let tokenize = Arc::clone(&tokenize);
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    return;
                };
                let (mut client_rx, mut client_tx) = client.into_split();
                let (mut server_rx, mut server_tx) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut server_rx, &mut client_tx).await;
                });
                // The last bytes of the previous read, so a request line split across reads counts.
                let mut seen: Vec<u8> = Vec::new();
                let mut buf = vec![0u8; 16 * 1024];
                while let Ok(n) = client_rx.read(&mut buf).await {
                    if n == 0 || server_tx.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    let hits = seen
                        .windows(TOKENIZE.len())
                        .filter(|w| *w == TOKENIZE)
                        .count();
                    tokenize.fetch_add(hits, Ordering::SeqCst);
                    let keep = seen.len().min(TOKENIZE.len() - 1);
                    seen.drain(..seen.len() - keep);
                }
            });
        }
    });
    port
}

/// What the remote stand-in received.
#[derive(Default)]
struct Received {
    /// Bytes of every request but the probes (method, path, headers, body).
    bytes: AtomicUsize,
    /// `/tokenize` calls among them.
    tokenize: AtomicUsize,
}

/// A worker of the remote pool: healthy, answers `/tokenize` and chat like vLLM, counts what it gets.
async fn remote_worker(received: Arc<Received>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let received = Arc::clone(&received);
            tokio::spawn(async move {
                let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let received = Arc::clone(&received);
                    async move {
                        // The health, load and adapter-list probes carry nothing of a request.
                        let probe = req.method() == http::Method::GET
                            && matches!(req.uri().path(), "/health" | "/metrics" | "/v1/models");
                        let path = req.uri().path().to_string();
                        let head = req.method().as_str().len()
                            + path.len()
                            + req
                                .headers()
                                .iter()
                                .map(|(k, v)| k.as_str().len() + v.len())
                                .sum::<usize>();
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        if probe {
                            return Ok::<_, Infallible>(hyper::Response::new(Full::new(
                                Bytes::new(),
                            )));
                        }
                        received
                            .bytes
                            .fetch_add(head + body.len(), Ordering::SeqCst);
                        let answer = if path == "/tokenize" {
                            received.tokenize.fetch_add(1, Ordering::SeqCst);
                            json!({"count": 3, "max_model_len": 4096, "tokens": [1, 2, 3]})
                        } else {
                            json!({"id": "chatcmpl-remote", "object": "chat.completion", "created": 0,
                                "model": MODEL,
                                "choices": [{"index": 0, "message": {"role": "assistant", "content": "remote"},
                                             "finish_reason": "stop"}],
                                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
                        };
                        Ok(hyper::Response::new(Full::new(Bytes::from(
                            answer.to_string(),
                        ))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    port
}

/// The model (no tokenizer), the remote pool `edge` and the local pool `local` (`local_workers`:
/// its endpoints, or `None` for a pool found by selector).
fn write_policies(dir: &Path, remote: u16, local_workers: Option<u16>) -> PathBuf {
    let local = match local_workers {
        Some(port) => policies::endpoint(&format!("http://127.0.0.1:{port}")),
        None => "selector: {matchLabels: {app: sim}, targetPort: 8000}".to_string(),
    };
    // Its own prices, cheaper than the local pool's.
    let edge = format!(
        r#"apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {{name: edge}}
spec:
  models: [{MODEL}]
  gpuClass: rented
  locality: Remote
  endpoints: [{{url: "http://127.0.0.1:{remote}"}}]
  prices: {{cachedInputPerMillion: 0.001, uncachedInputPerMillion: 0.01, outputPerMillion: 0.02}}
"#
    );
    policies::write(
        dir,
        &[
            policies::model(MODEL, None),
            edge,
            policies::pool("local", MODEL, "Local", "sim", &local),
        ],
    )
}

/// The gateway with the policies, and `workers` from `gateway.yaml` (how a selector pool's workers
/// are found here: the router's workers of the model).
fn write_config(dir: &Path, policy_dir: &Path, workers: &[u16]) -> PathBuf {
    let mut yaml = policies::gateway_yaml(policy_dir, 100);
    if !workers.is_empty() {
        yaml.push_str(&format!("models:\n  - name: {MODEL}\nworkers:\n"));
        for port in workers {
            yaml.push_str(&format!(
                "  - url: http://127.0.0.1:{port}\n    model: {MODEL}\n"
            ));
        }
    }
    let config = dir.join("gateway.yaml");
    std::fs::write(&config, yaml).unwrap();
    config
}

/// A real `vllm-sim` serving [`MODEL`], answering: the process and its port (`None` without the
/// binary).
async fn start_sim() -> Option<(ChildGuard, u16)> {
    let (child, port) = support::spawn_vllm_sim(&support::vllm_sim_binary()?, MODEL);
    support::wait_until_ok(port, "/health").await;
    Some((child, port))
}

/// POSTs `body` to the gateway: the status and the whole answer.
async fn post(
    client: &Client<HttpConnector, Full<Bytes>>,
    port: u16,
    path: &str,
    body: &Value,
) -> (http::StatusCode, String) {
    let request = hyper::Request::post(format!("http://127.0.0.1:{port}{path}"))
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// Requests with personal data (an e-mail address) in each protocol and place, streamed or not.
fn personal_requests() -> Vec<(&'static str, Value)> {
    let email = "jane.doe@example.com";
    vec![
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": 4,
                   "messages": [{"role": "user", "content": format!("Write to {email} today")}]}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": 4, "stream": true,
                   "messages": [{"role": "system", "content": format!("The user is {email}.")},
                                {"role": "user", "content": "Say hello"}]}),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "max_tokens": 4, "prompt": format!("Reply to {email}:")}),
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 4,
                   "messages": [{"role": "user", "content": [{"type": "text", "text": format!("Mail {email}")}]}]}),
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 4, "stream": true, "system": format!("Contact: {email}"),
                   "messages": [{"role": "user", "content": "Hi"}]}),
        ),
    ]
}

/// A gateway in front of both pools, and what their workers received.
struct Setup {
    api: u16,
    client: Client<HttpConnector, Full<Bytes>>,
    /// `/tokenize` calls that reached the local pool's `vllm-sim`.
    local_tokenize: Arc<AtomicUsize>,
    /// What reached the remote pool's worker.
    remote: Arc<Received>,
    _processes: (ChildGuard, ChildGuard),
    _dir: support::TempDir,
}

/// `vllm-sim` behind its tap, the remote stand-in, and the gateway; the local pool lists its
/// worker (`selector: false`), or is found by selector while `gateway.yaml` gives the router both
/// workers of the model. `None` without `vllm-sim`.
async fn setup(selector: bool) -> Option<Setup> {
    let (sim, sim_port) = start_sim().await?;
    let local_tokenize = Arc::new(AtomicUsize::new(0));
    let local = tap(sim_port, Arc::clone(&local_tokenize)).await;
    let received = Arc::new(Received::default());
    let remote = remote_worker(Arc::clone(&received)).await;
    let dir = support::TempDir::new(if selector {
        "prompt-tokens-selector"
    } else {
        "prompt-tokens-endpoints"
    });
    let (policy_dir, workers) = if selector {
        (write_policies(&dir.0, remote, None), vec![local, remote])
    } else {
        (write_policies(&dir.0, remote, Some(local)), vec![])
    };
    let (gateway, api, admin) =
        support::spawn_gateway(&write_config(&dir.0, &policy_dir, &workers));
    support::wait_until_ok(admin, "/healthz").await;
    let client = Client::builder(TokioExecutor::new()).build_http();
    Some(Setup {
        api,
        client,
        local_tokenize,
        remote: received,
        _processes: (sim, gateway),
        _dir: dir,
    })
}

#[tokio::test]
async fn the_prompt_is_tokenized_once_and_personal_data_never_reaches_the_remote_pool() {
    let Some(s) = setup(false).await else {
        return;
    };
    // Personal data: served by the local pool, tokenized once there, not a byte to the remote pool.
    let requests = personal_requests();
    for (path, body) in &requests {
        let (status, answer) = post(&s.client, s.api, path, body).await;
        assert_eq!(status, http::StatusCode::OK, "{path}: {answer}");
        assert!(!answer.contains("remote"), "{path}: {answer}");
    }
    assert_eq!(s.remote.bytes.load(Ordering::SeqCst), 0);
    assert_eq!(s.local_tokenize.load(Ordering::SeqCst), requests.len());

    // Without personal data either pool may serve and tokenize, still once per request.
    let plain = 4;
    for i in 0..plain {
        let body = json!({"model": MODEL, "max_tokens": 4,
                          "messages": [{"role": "user", "content": format!("Count to {i}")}]});
        let (status, answer) = post(&s.client, s.api, "/v1/chat/completions", &body).await;
        assert_eq!(status, http::StatusCode::OK, "{answer}");
    }
    let tokenized =
        s.local_tokenize.load(Ordering::SeqCst) + s.remote.tokenize.load(Ordering::SeqCst);
    assert_eq!(tokenized, requests.len() + plain);
}

#[tokio::test]
async fn a_local_pool_found_by_selector_never_falls_back_to_a_remote_worker() {
    let Some(s) = setup(true).await else {
        return;
    };
    let requests = personal_requests();
    for _ in 0..2 {
        for (path, body) in &requests {
            let (status, answer) = post(&s.client, s.api, path, body).await;
            assert_eq!(status, http::StatusCode::OK, "{path}: {answer}");
        }
    }
    assert_eq!(s.remote.bytes.load(Ordering::SeqCst), 0);
    assert_eq!(s.local_tokenize.load(Ordering::SeqCst), 2 * requests.len());
}
