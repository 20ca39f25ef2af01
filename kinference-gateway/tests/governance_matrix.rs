//! One governed path, proven over everything it covers: every endpoint of the gateway's route table
//! (`pipeline::ROUTES`, the table the server dispatches on, so an endpoint added there is a row here
//! without anyone remembering it) through every front door (HTTP; Envoy's ext_proc with a buffered
//! and with a streamed request body), each cell checked against real processes:
//!
//! - no API key: 401 in the endpoint's protocol;
//! - a model outside the tenant's `allowedModels`: 403 (the model list: not shown);
//! - the tenant at its request limit: 429 with `Retry-After`;
//! - personal data, tagged to go to a `Remote` pool or to burst to a provider: answered, and 0 bytes
//!   reach either (a control request without personal data reaches the Remote pool, so the counter
//!   is seen to work);
//! - the usage record carries the tokens the worker reported: whole, streamed with the usage chunk
//!   asked for (and passed to the client), streamed without (the chunk asked for by the gateway and
//!   kept from the client); through Envoy without the response phase, billed its reservation, never
//!   zero;
//! - the gateway at its in-flight limit: 503 with `Retry-After`;
//! - salted: on every endpoint whose worker keeps a prefix cache (`Endpoint::reaches_prefix_cache`),
//!   the worker is sent the tenant's `cache_salt`, never the client's own, and another tenant's
//!   differs (seen in the bodies the Remote stand-in receives);
//! - flow control, on a third gateway whose local pool is saturated the way a busy one is: its
//!   worker (a stand-in) holds a request before its first token for the whole run, and a 1 ms TTFT
//!   target makes a worker with a first token on its way full (nothing is ever answered there, so
//!   the estimate stays the prior's): a request waits and is shed at its band's deadline, 503 `queue_deadline` with `Retry-After` in its protocol; a request naming
//!   a TTFT objective no worker is estimated to meet, from a tenant whose `onMiss` is `Refuse`, is
//!   refused at once, 503 `objective_unmet` with `Retry-After`;
//! - prioritized: the Remote pool runs priority scheduling (`schedulingPolicy: Priority`), so every
//!   body it receives on a prefix-cache endpoint carries the request's band as `priority` (a request
//!   lowering itself to `low`: 1);
//! - every answer echoes its `x-request-id`; every request has one access line and one root span.
//!
//! The local pool is a real `vllm-sim`; the Remote pool and the provider are in-test HTTP stand-ins
//! that count every body byte they receive; the ext_proc door is driven by `support::envoy`, which
//! replays Envoy's message sequence and forwards to the destination itself. The matrix (its size
//! and every cell) is printed; `SECURITY.md` has it.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kinference_gateway::pipeline::routes::Billing;
use kinference_gateway::pipeline::{Endpoint, ROUTES};
use serde_json::{Value, json};
use testkit::{ChildGuard, free_port, tokenizer_dir};

mod support;

use support::envoy::{self, BodyMode, Envoy, ResponsePhase};
use support::otlp::Receiver;
use support::policies;

const MODEL: &str = "qwen2-sim";
const ACME: &str = "sk-matrix-acme-0123456789abcdef";
const NARROW: &str = "sk-matrix-narrow-0123456789abcdef";
/// A second tenant of the model, whose requests must be salted apart from `acme`'s.
const OTHER: &str = "sk-matrix-other-0123456789abcdef";
/// The `cache_salt` a client sends, hoping a worker uses it as it is.
const CLIENT_SALT: &str = "client-chosen-salt";
const PROVIDER_KEY_ENV: &str = "KINFERENCE_TEST_MATRIX_PROVIDER_KEY";
/// Personal data a detector finds (a card number and an e-mail address).
const PERSONAL: &str = "charge 4111 1111 1111 1111 and mail jane.doe@example.com";

/// [`PERSONAL`] as the model's token ids (asked of the local worker's `/tokenize` at the start).
static PERSONAL_IDS: std::sync::OnceLock<Vec<u64>> = std::sync::OnceLock::new();

/// A front door.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Door {
    Http,
    ExtProcBuffered,
    ExtProcStreamed,
}

const DOORS: [Door; 3] = [Door::Http, Door::ExtProcBuffered, Door::ExtProcStreamed];

impl Door {
    fn name(self) -> &'static str {
        match self {
            Door::Http => "HTTP",
            Door::ExtProcBuffered => "ext_proc BUFFERED",
            Door::ExtProcStreamed => "ext_proc STREAMED",
        }
    }
}

/// A stand-in backend (Remote pool or provider) that counts the body bytes it receives and answers
/// each endpoint's shape with a usage.
#[derive(Default)]
struct Counter {
    bytes: AtomicU64,
    received: parking_lot::Mutex<Vec<String>>,
}

async fn standin(counter: Arc<Counter>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let counter = Arc::clone(&counter);
                    async move {
                        let path = req.uri().path().to_string();
                        let body = req.into_body().collect().await.map(|b| b.to_bytes());
                        let body = body.unwrap_or_default();
                        counter.bytes.fetch_add(body.len() as u64, Ordering::SeqCst);
                        if !body.is_empty() {
                            counter
                                .received
                                .lock()
                                .push(format!("{path} {}", String::from_utf8_lossy(&body)));
                        }
                        let usage =
                            json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5});
                        let answer = match path.trim_start_matches("/v1") {
                            "/chat/completions" => json!({"id": "x", "object": "chat.completion",
                                "created": 0, "model": MODEL, "usage": usage,
                                "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": "remote"}}]}),
                            "/completions" => json!({"id": "x", "object": "text_completion",
                                "created": 0, "model": MODEL, "usage": usage,
                                "choices": [{"index": 0, "finish_reason": "stop", "text": "remote"}]}),
                            "/embeddings" => json!({"object": "list", "model": MODEL,
                                "data": [{"object": "embedding", "index": 0, "embedding": [0.1]}],
                                "usage": {"prompt_tokens": 3, "total_tokens": 3}}),
                            "/responses" => {
                                json!({"id": "r", "object": "response", "status": "completed",
                                "output": [], "usage": {"input_tokens": 3, "output_tokens": 2}})
                            }
                            "/tokenize" => {
                                json!({"tokens": [1, 2, 3], "count": 3, "max_model_len": 4096})
                            }
                            "/detokenize" => json!({"prompt": "remote"}),
                            _ => json!({}),
                        };
                        let mut response =
                            hyper::Response::new(Full::new(Bytes::from(answer.to_string())));
                        response
                            .headers_mut()
                            .insert("content-type", "application/json".parse().unwrap());
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

/// A worker that never answers a POST (it holds each one before its first token, counting them)
/// and answers anything else (the gateway's health probes) with 200 `{}`.
async fn holder(held: Arc<AtomicU64>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let held = Arc::clone(&held);
            tokio::spawn(async move {
                let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let held = Arc::clone(&held);
                    async move {
                        if req.method() == hyper::Method::POST {
                            held.fetch_add(1, Ordering::SeqCst);
                            std::future::pending::<()>().await;
                        }
                        Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from("{}"))))
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

/// Every request goes away (a header tag sends it to the Remote pool or bursts it to the provider)
/// unless it must stay local; tenants: `acme`, `narrow` (another model only), and one tenant with
/// one request a minute per cell (`rl-<n>`).
fn write_config(
    dir: &Path,
    sim: u16,
    remote: SocketAddr,
    provider: SocketAddr,
    cells: usize,
) -> PathBuf {
    let rules = r#"apiVersion: kinference.ai/v1alpha1
kind: InferencePolicy
metadata: {name: data-protection}
spec:
  priority: 0
  rules:
    - name: pii-stays-local
      match: {tags: [pii]}
      action: {requireLocal: {message: personal data stays local}}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePolicy
metadata: {name: send-away}
spec:
  priority: 10
  rules:
    - name: remote
      match: {tags: [to-remote]}
      action: {route: {targets: [{pool: remote}]}}
    - name: provider
      match: {tags: [to-provider]}
      action:
        burst:
          providers: [standin]
          when: {pools: [ghost], queueDepthAbove: 0}
"#;
    let url = |addr: String| policies::endpoint(&format!("http://{addr}"));
    let policy_dir = policies::write(
        dir,
        &[
            policies::model(MODEL, Some(&tokenizer_dir())),
            // The one model tenant `narrow` may use (no pool serves it).
            policies::model("another-model", None),
            policies::pool(
                "local",
                MODEL,
                "Local",
                "sim",
                &url(format!("127.0.0.1:{sim}")),
            ),
            // Its workers run vLLM's `--scheduling-policy priority`: they are sent the band.
            policies::pool(
                "remote",
                MODEL,
                "Remote",
                "rented",
                &url(remote.to_string()),
            ) + "  schedulingPolicy: Priority\n",
            policies::pool(
                "ghost",
                MODEL,
                "Local",
                "none",
                &url(format!("127.0.0.1:{}", free_port())),
            ),
            policies::standin_provider(provider, PROVIDER_KEY_ENV, MODEL),
            rules.to_string(),
        ],
    );
    let mut tenants = vec![
        tenant(
            dir,
            "acme",
            ACME,
            "  flowControl:\n    objectives: {minTtftMs: 1, onMiss: Refuse}\n",
        ),
        tenant(dir, "narrow", NARROW, "  allowedModels: [another-model]\n"),
        tenant(dir, "other", OTHER, ""),
    ];
    for n in 0..cells {
        tenants.push(tenant(
            dir,
            &format!("rl-{n}"),
            &rate_limited_key(n),
            "  limits: {requestsPerMinute: 1}\n",
        ));
    }
    // Beside the policies: the policy engine knows the tenants too (and checks their models).
    std::fs::write(policy_dir.join("tenants.yaml"), tenants.join("---\n")).unwrap();
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "{}tenancy:\n  tenants_dir: {}\n  secrets_dir: {}\n  usage_journal: {}\n",
            policies::gateway_yaml(&policy_dir, 200),
            policy_dir.display(),
            dir.join("secrets").display(),
            dir.join("usage.jsonl").display(),
        ),
    )
    .unwrap();
    config
}

fn tenant(dir: &Path, name: &str, key: &str, extra: &str) -> String {
    let secrets = dir.join("secrets").join(name);
    std::fs::create_dir_all(&secrets).unwrap();
    std::fs::write(secrets.join("api-key"), key).unwrap();
    format!(
        "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {{name: {name}}}\nspec:\n  apiKeys:\n    - secretRef: {{name: {name}, key: api-key}}\n{extra}"
    )
}

fn rate_limited_key(n: usize) -> String {
    format!("sk-matrix-rl-{n:04}-0123456789abcdef")
}

/// The body of a request to `endpoint` whose text is `text`; `stream` and `usage` for the endpoints
/// that stream (the usage chunk asked for, or not).
fn body(endpoint: Endpoint, text: &str, stream: bool, usage: bool) -> Vec<u8> {
    let messages = json!([{"role": "user", "content": text}]);
    let mut v = match endpoint {
        Endpoint::ChatCompletions => json!({"model": MODEL, "messages": messages, "max_tokens": 5}),
        Endpoint::Completions => json!({"model": MODEL, "prompt": text, "max_tokens": 5}),
        Endpoint::Messages => json!({"model": MODEL, "messages": messages, "max_tokens": 5}),
        Endpoint::CountTokens => json!({"model": MODEL, "messages": messages}),
        Endpoint::Embeddings => json!({"model": MODEL, "input": text}),
        Endpoint::Responses => json!({"model": MODEL, "input": text, "max_output_tokens": 5}),
        Endpoint::Tokenize => json!({"model": MODEL, "prompt": text}),
        // Token ids a worker turns into text: the personal text's own ids, when it is asked for.
        Endpoint::Detokenize => {
            let ids = match PERSONAL_IDS.get() {
                Some(ids) if text == PERSONAL => json!(ids),
                _ => json!([9707, 11, 1879]),
            };
            json!({"model": MODEL, "tokens": ids})
        }
        Endpoint::Models => return Vec::new(),
    };
    if stream {
        v["stream"] = json!(true);
        if usage
            && endpoint.protocol() == kinference_gateway::errors::Protocol::OpenAi
            && endpoint != Endpoint::Responses
        {
            v["stream_options"] = json!({"include_usage": true});
        }
    }
    v.to_string().into_bytes()
}

/// The running fleet and the clients of each door.
struct Fleet {
    api: u16,
    envoy: Envoy,
    tight_api: u16,
    tight_envoy: Envoy,
    tight_xp: SocketAddr,
    /// The gateway whose local pool is saturated (flow control).
    saturated_api: u16,
    saturated_envoy: Envoy,
    http: Client<HttpConnector, Full<Bytes>>,
    remote: Arc<Counter>,
    provider: Arc<Counter>,
    journal: PathBuf,
    log: PathBuf,
    receiver: Receiver,
    next_id: AtomicU64,
    /// Every request id sent to the traced gateway, with its trace id.
    sent: parking_lot::Mutex<Vec<(String, String)>>,
    _children: Vec<ChildGuard>,
    _dir: support::TempDir,
}

/// One answer as the client saw it, and the request id it was sent with.
struct Seen {
    status: u16,
    headers: http::HeaderMap,
    body: String,
    id: String,
}

impl Seen {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
}

impl Fleet {
    /// One request as `call` says (a fresh `x-request-id` and `traceparent`); fails the cell
    /// unless the id is echoed.
    async fn send(&self, call: Call<'_>) -> Result<Seen, String> {
        let Call {
            door,
            tight,
            saturated,
            endpoint,
            key,
            tags,
            extra,
            body,
            phase,
        } = call;
        let n = self.next_id.fetch_add(1, Ordering::SeqCst);
        let id = format!("matrix-{n:05}");
        let trace = format!("{n:032x}");
        let traceparent = format!("00-{trace}-00f067aa0ba902b7-01");
        let bearer = key.map(|k| format!("Bearer {k}"));
        let mut headers: Vec<(&str, &str)> =
            vec![("x-request-id", &id), ("traceparent", &traceparent)];
        if let Some(b) = &bearer {
            // Anthropic clients send `x-api-key`, OpenAI clients a bearer token.
            match endpoint.protocol() {
                kinference_gateway::errors::Protocol::Anthropic => {
                    headers.push(("x-api-key", key.unwrap_or_default()))
                }
                kinference_gateway::errors::Protocol::OpenAi => headers.push(("authorization", b)),
            }
        }
        if let Some(t) = tags {
            headers.push(("x-kinference-tags", t));
        }
        headers.extend(extra.iter().copied());
        if !tight && !saturated {
            self.sent.lock().push((id.clone(), trace));
        }
        let method = endpoint.method().to_string();
        let (status, got, text) = match door {
            Door::Http => {
                let port = match (tight, saturated) {
                    (true, _) => self.tight_api,
                    (_, true) => self.saturated_api,
                    _ => self.api,
                };
                let mut req = hyper::Request::builder()
                    .method(method.as_str())
                    .uri(format!("http://127.0.0.1:{port}{}", endpoint.path()))
                    .header("content-type", "application/json");
                for (k, v) in &headers {
                    req = req.header(*k, *v);
                }
                let response = tokio::time::timeout(
                    Duration::from_secs(60),
                    self.http
                        .request(req.body(Full::new(Bytes::copy_from_slice(body))).unwrap()),
                )
                .await
                .map_err(|_| "no answer in 60 s".to_string())?
                .map_err(|e| e.to_string())?;
                let status = response.status().as_u16();
                let got = response.headers().clone();
                let bytes = response
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                (status, got, String::from_utf8_lossy(&bytes).into_owned())
            }
            Door::ExtProcBuffered | Door::ExtProcStreamed => {
                let mut envoy = match (tight, saturated) {
                    (true, _) => self.tight_envoy.clone(),
                    (_, true) => self.saturated_envoy.clone(),
                    _ => self.envoy.clone(),
                };
                envoy.body_mode = if door == Door::ExtProcStreamed {
                    BodyMode::Streamed
                } else {
                    BodyMode::Buffered
                };
                envoy.response_phase = phase;
                let answer: envoy::Answer = envoy
                    .request(&method, endpoint.path(), &headers, body)
                    .await;
                (
                    answer.status,
                    answer.headers,
                    String::from_utf8_lossy(&answer.body).into_owned(),
                )
            }
        };
        // Through Envoy a routed answer's id is set on the response headers by the handler; a
        // local reply carries it itself.
        let echoed = got.get("x-request-id").and_then(|v| v.to_str().ok());
        if echoed != Some(id.as_str()) && !(door != Door::Http && phase == ResponsePhase::Skipped) {
            return Err(format!(
                "x-request-id not echoed ({echoed:?}): {status} {text}"
            ));
        }
        Ok(Seen {
            status,
            headers: got,
            body: text,
            id,
        })
    }

    /// The usage record of request `id` (waits for the journal).
    async fn record(&self, id: &str) -> Result<Value, String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = std::fs::read_to_string(&self.journal).unwrap_or_default();
            if let Some(r) = text
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|r| r["request_id"] == id)
            {
                return Ok(r);
            }
            if Instant::now() > deadline {
                return Err(format!("no usage record for {id}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// One request of a check: where it goes and what it carries.
struct Call<'a> {
    door: Door,
    /// To the gateway held at its in-flight limit.
    tight: bool,
    /// To the gateway whose pool is always saturated.
    saturated: bool,
    endpoint: Endpoint,
    key: Option<&'a str>,
    tags: Option<&'a str>,
    /// More headers.
    extra: &'a [(&'a str, &'a str)],
    body: &'a [u8],
    phase: ResponsePhase,
}

impl<'a> Call<'a> {
    /// `body` to `endpoint` through `door` of the traced gateway, with `key`.
    fn new(door: Door, endpoint: Endpoint, key: Option<&'a str>, body: &'a [u8]) -> Self {
        Call {
            door,
            tight: false,
            saturated: false,
            endpoint,
            key,
            tags: None,
            extra: &[],
            body,
            phase: ResponsePhase::Streamed,
        }
    }

    fn tagged(self, tags: &'a str) -> Self {
        Call {
            tags: Some(tags),
            ..self
        }
    }
}

/// What a cell's check found: passed, not applicable, or failed (why).
#[derive(Debug, Clone)]
enum Cell {
    Pass,
    Na,
    Fail(String),
}

fn expect_status(seen: &Seen, status: u16, what: &str) -> Result<(), String> {
    if seen.status != status {
        return Err(format!(
            "{what}: {} instead of {status}: {}",
            seen.status, seen.body
        ));
    }
    Ok(())
}

/// The error body's shape is the endpoint's protocol's.
fn in_protocol(endpoint: Endpoint, seen: &Seen) -> Result<(), String> {
    let v = seen.json();
    let ok = match endpoint.protocol() {
        kinference_gateway::errors::Protocol::OpenAi => v["error"]["message"].is_string(),
        kinference_gateway::errors::Protocol::Anthropic => {
            v["type"] == "error" && v["error"]["type"].is_string()
        }
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "not an {:?} error: {}",
            endpoint.protocol(),
            seen.body
        ))
    }
}

fn retry_after(seen: &Seen) -> Result<(), String> {
    match seen.headers.get("retry-after") {
        Some(_) => Ok(()),
        None => Err(format!("no Retry-After: {:?}", seen.headers)),
    }
}

async fn no_key(f: &Fleet, door: Door, e: Endpoint) -> Result<(), String> {
    let seen = f
        .send(Call::new(door, e, None, &body(e, "hello", false, false)))
        .await?;
    expect_status(&seen, 401, "no key")?;
    in_protocol(e, &seen)
}

async fn not_allowed(f: &Fleet, door: Door, e: Endpoint) -> Result<(), String> {
    let seen = f
        .send(Call::new(
            door,
            e,
            Some(NARROW),
            &body(e, "hello", false, false),
        ))
        .await?;
    if e == Endpoint::Models {
        expect_status(&seen, 200, "model list")?;
        if seen.body.contains(MODEL) {
            return Err(format!(
                "a tenant held to another model is shown it: {}",
                seen.body
            ));
        }
        return Ok(());
    }
    expect_status(&seen, 403, "model outside allowedModels")?;
    in_protocol(e, &seen)
}

async fn at_limit(f: &Fleet, door: Door, e: Endpoint, cell: usize) -> Result<(), String> {
    let key = rate_limited_key(cell);
    let first = f
        .send(Call::new(
            door,
            e,
            Some(&key),
            &body(e, "hello", false, false),
        ))
        .await?;
    if first.status == 429 {
        return Err(format!(
            "the first request of a fresh tenant was refused: {}",
            first.body
        ));
    }
    let seen = f
        .send(Call::new(
            door,
            e,
            Some(&key),
            &body(e, "hello", false, false),
        ))
        .await?;
    expect_status(&seen, 429, "at the tenant's limit")?;
    retry_after(&seen)?;
    in_protocol(e, &seen)
}

async fn personal_data(f: &Fleet, door: Door, e: Endpoint) -> Result<(), String> {
    let (remote, provider) = (
        f.remote.bytes.load(Ordering::SeqCst),
        f.provider.bytes.load(Ordering::SeqCst),
    );
    for tag in ["to-remote", "to-provider"] {
        let seen = f
            .send(Call::new(door, e, Some(ACME), &body(e, PERSONAL, false, false)).tagged(tag))
            .await?;
        if !(200..300).contains(&seen.status) {
            return Err(format!(
                "personal data ({tag}) not served locally: {} {}",
                seen.status, seen.body
            ));
        }
    }
    let moved = (
        f.remote.bytes.load(Ordering::SeqCst) - remote,
        f.provider.bytes.load(Ordering::SeqCst) - provider,
    );
    if moved != (0, 0) {
        let received = f.remote.received.lock().last().cloned().unwrap_or_default();
        return Err(format!(
            "bytes of personal data left: {moved:?} (remote, provider); last: {received}"
        ));
    }
    if !e.reaches_backend() {
        return Ok(());
    }
    // The control: without personal data the same request reaches the Remote pool.
    let seen = f
        .send(
            Call::new(door, e, Some(ACME), &body(e, "hello there", false, false))
                .tagged("to-remote"),
        )
        .await?;
    expect_status(&seen, 200, "control to the Remote pool")?;
    if f.remote.bytes.load(Ordering::SeqCst) == remote {
        return Err("the control request did not reach the Remote pool".into());
    }
    Ok(())
}

/// The `cache_salt` a worker receives for `e` from `acme` and from `other`, both sending the same
/// client salt: the tenant's (64 hex digits), not the client's, and not the same for both.
async fn salted(f: &Fleet, door: Door, e: Endpoint) -> Result<(), String> {
    let mut salts = Vec::new();
    for key in [ACME, OTHER] {
        let mut b: Value = serde_json::from_slice(&body(e, "hello there", false, false))
            .map_err(|e| e.to_string())?;
        b["cache_salt"] = json!(CLIENT_SALT);
        let b = b.to_string();
        let before = f.remote.received.lock().len();
        let seen = f
            .send(Call::new(door, e, Some(key), b.as_bytes()).tagged("to-remote"))
            .await?;
        expect_status(&seen, 200, "to the Remote pool")?;
        let received = f.remote.received.lock()[before..].to_vec();
        let [one] = received.as_slice() else {
            return Err(format!("{} bodies reached the worker", received.len()));
        };
        let (path, sent) = one.split_once(' ').unwrap_or_default();
        let sent: Value = serde_json::from_str(sent).map_err(|e| format!("{path}: {e}"))?;
        let salt = sent["cache_salt"].as_str().unwrap_or_default().to_string();
        if salt.len() != 64 || !salt.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(format!(
                "{path} was sent cache_salt {:?}",
                sent["cache_salt"]
            ));
        }
        salts.push(salt);
    }
    if salts[0] == salts[1] {
        return Err("two tenants were sent the same cache_salt".into());
    }
    Ok(())
}

/// On the saturated gateway: the request waits, then is shed at its band's deadline (503
/// `queue_deadline`, `Retry-After`, in its protocol).
async fn flow_shed(f: &Fleet, door: Door, e: Endpoint) -> Result<(), String> {
    let seen = f
        .send(Call {
            saturated: true,
            ..Call::new(door, e, Some(ACME), &body(e, "hello", false, false))
        })
        .await?;
    expect_status(&seen, 503, "a saturated pool past the queue deadline")?;
    retry_after(&seen)?;
    if !seen.body.contains("queue_deadline") {
        return Err(format!("not shed for its deadline: {}", seen.body));
    }
    in_protocol(e, &seen)
}

/// On the saturated gateway: a TTFT objective no worker is estimated to meet, from a tenant whose
/// `onMiss` is `Refuse`, is refused at once (503 `objective_unmet`, `Retry-After`, in its protocol).
async fn objective(f: &Fleet, door: Door, e: Endpoint) -> Result<(), String> {
    let started = Instant::now();
    let seen = f
        .send(Call {
            saturated: true,
            extra: &[("x-kinference-ttft-objective-ms", "1")],
            ..Call::new(door, e, Some(ACME), &body(e, "hello", false, false))
        })
        .await?;
    expect_status(&seen, 503, "an objective no worker meets")?;
    retry_after(&seen)?;
    if !seen.body.contains("objective_unmet") {
        return Err(format!("not refused for its objective: {}", seen.body));
    }
    // Refused before it waits: the queue deadline there is 100 ms.
    if started.elapsed() > Duration::from_millis(90) && door == Door::Http {
        return Err(format!(
            "refused after {:?}, not at once",
            started.elapsed()
        ));
    }
    in_protocol(e, &seen)
}

/// The Remote pool runs priority scheduling: a request lowered to the `low` band reaches it with
/// `"priority": 1`.
async fn prioritized(f: &Fleet, door: Door, e: Endpoint) -> Result<(), String> {
    let before = f.remote.received.lock().len();
    let seen = f
        .send(Call {
            extra: &[("x-kinference-priority", "low")],
            ..Call::new(door, e, Some(ACME), &body(e, "hello there", false, false))
                .tagged("to-remote")
        })
        .await?;
    expect_status(&seen, 200, "to the Remote pool")?;
    let received = f.remote.received.lock()[before..].to_vec();
    let [one] = received.as_slice() else {
        return Err(format!("{} bodies reached the worker", received.len()));
    };
    let (path, sent) = one.split_once(' ').unwrap_or_default();
    let sent: Value = serde_json::from_str(sent).map_err(|e| format!("{path}: {e}"))?;
    if sent["priority"] != json!(1) {
        return Err(format!("{path} was sent priority {:?}", sent["priority"]));
    }
    Ok(())
}

/// The tokens a worker reported in an answer as the client saw it (for a stream, its usage chunk
/// or event), as (input, output).
fn reported(e: Endpoint, body: &str) -> Option<(u64, u64)> {
    let read = |v: &Value| -> Option<(u64, u64)> {
        let u = v.get("usage").or_else(|| v.pointer("/response/usage"))?;
        let input = u.get("prompt_tokens").or(u.get("input_tokens"))?.as_u64()?;
        let output = u
            .get("completion_tokens")
            .or(u.get("output_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(0);
        Some((input, output))
    };
    if let Ok(v) = serde_json::from_str::<Value>(body) {
        return read(&v);
    }
    let mut found = None;
    let mut anthropic_in = None;
    for data in body
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim)
    {
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        if e == Endpoint::Messages {
            if let Some(n) = v
                .pointer("/message/usage/input_tokens")
                .and_then(Value::as_u64)
            {
                anthropic_in = Some(n);
            }
            if let Some(n) = v.pointer("/usage/output_tokens").and_then(Value::as_u64) {
                found = Some((anthropic_in.unwrap_or(0), n));
            }
        } else if let Some(u) = read(&v) {
            found = Some(u);
        }
    }
    found
}

async fn billed(f: &Fleet, door: Door, e: Endpoint) -> Result<(), String> {
    let check = |record: &Value, expected: (u64, u64), what: &str| -> Result<(), String> {
        let input = record["input_uncached"].as_u64().unwrap_or(0)
            + record["input_cached"].as_u64().unwrap_or(0);
        let output = record["output"].as_u64().unwrap_or(0);
        if (input, output) != expected {
            return Err(format!(
                "{what}: recorded ({input}, {output}), the worker reported {expected:?}: {record}"
            ));
        }
        // (`estimated` is written only when true.)
        if record["estimated"] == true {
            return Err(format!(
                "{what}: the worker's usage was not read (estimated): {record}"
            ));
        }
        Ok(())
    };
    // Whole.
    let seen = f
        .send(Call::new(
            door,
            e,
            Some(ACME),
            &body(e, "count me in", false, false),
        ))
        .await?;
    expect_status(&seen, 200, "whole")?;
    let record = f.record(&seen.id).await?;
    let whole = match e.billing() {
        Billing::RequestOnly => (0, 0),
        _ => reported(e, &seen.body)
            .ok_or_else(|| format!("no usage in the answer: {}", seen.body))?,
    };
    check(&record, whole, "whole")?;
    if !e.streams() {
        return Ok(());
    }
    // Streamed, the usage chunk asked for: passed to the client, and recorded.
    let asked =
        e.protocol() == kinference_gateway::errors::Protocol::OpenAi && e != Endpoint::Responses;
    if asked {
        let seen = f
            .send(Call::new(
                door,
                e,
                Some(ACME),
                &body(e, "count me in", true, true),
            ))
            .await?;
        expect_status(&seen, 200, "stream with usage")?;
        let got = reported(e, &seen.body)
            .ok_or_else(|| format!("the usage chunk asked for is missing: {}", seen.body))?;
        check(&f.record(&seen.id).await?, got, "stream with usage")?;
    }
    // Streamed without asking: recorded all the same (the same prompt and limit as the whole
    // request, so the worker generated as much), and an OpenAI client does not get the chunk.
    let seen = f
        .send(Call::new(
            door,
            e,
            Some(ACME),
            &body(e, "count me in", true, false),
        ))
        .await?;
    expect_status(&seen, 200, "stream without usage")?;
    if asked && seen.body.contains("\"usage\"") {
        return Err(format!(
            "a usage chunk the client did not ask for: {}",
            seen.body
        ));
    }
    check(&f.record(&seen.id).await?, whole, "stream without usage")?;
    // Through Envoy without the response phase: never zero (the prompt and the reservation).
    if door != Door::Http {
        let seen = f
            .send(Call {
                phase: ResponsePhase::Skipped,
                ..Call::new(door, e, Some(ACME), &body(e, "count me in", true, false))
            })
            .await?;
        expect_status(&seen, 200, "stream, response phase skipped")?;
        let record = f.record(&seen.id).await?;
        let output = record["output"].as_u64().unwrap_or(0);
        if output != 5 || record["estimated"] != true {
            return Err(format!(
                "an answer the gateway never saw: billed {output} (the reservation is 5): {record}"
            ));
        }
    }
    Ok(())
}

async fn overload(f: &Fleet, door: Door, e: Endpoint) -> Result<(), String> {
    let seen = f
        .send(Call {
            tight: true,
            ..Call::new(door, e, Some(ACME), &body(e, "hello", false, false))
        })
        .await?;
    expect_status(&seen, 503, "at the in-flight limit")?;
    retry_after(&seen)?;
    in_protocol(e, &seen)
}

/// The tight gateway's only in-flight slot, held: a request routed through ext_proc whose stream
/// stays open (dropped: given back).
struct Held {
    _requests:
        tokio::sync::mpsc::Sender<envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest>,
    _answers: tonic::Streaming<envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse>,
}

async fn hold_the_slot(xp: SocketAddr) -> Held {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as PReq;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as PResp;
    use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest};
    let mut client = ExternalProcessorClient::connect(format!("http://{xp}"))
        .await
        .expect("connect");
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut answers = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("Process")
        .into_inner();
    let h = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    };
    let bearer = format!("Bearer {ACME}");
    tx.send(ProcessingRequest {
        request: Some(PReq::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    h(":path", "/v1/chat/completions"),
                    h(":method", "POST"),
                    h("authorization", &bearer),
                ],
            }),
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    answers.message().await.unwrap().unwrap();
    tx.send(ProcessingRequest {
        request: Some(PReq::RequestBody(HttpBody {
            body: body(Endpoint::ChatCompletions, "hold", false, false),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    let routed = answers.message().await.unwrap().unwrap();
    assert!(
        matches!(routed.response, Some(PResp::RequestBody(_))),
        "the holder is routed: {routed:?}"
    );
    Held {
        _requests: tx,
        _answers: answers,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_endpoint_through_every_door_is_governed_the_same() {
    let Some(sim) = support::vllm_sim_binary() else {
        return;
    };
    let cells = ROUTES.len() * DOORS.len();
    let dir = support::TempDir::new("matrix");
    let remote = Arc::new(Counter::default());
    let provider = Arc::new(Counter::default());
    let remote_addr = standin(Arc::clone(&remote)).await;
    let provider_addr = standin(Arc::clone(&provider)).await;
    let (sim_child, sim_port) = support::spawn_vllm_sim(&sim, MODEL);
    support::wait_until_ok(sim_port, "/health").await;
    let config = write_config(&dir.0, sim_port, remote_addr, provider_addr, cells);
    let (status, _, tokenized) = support::call(
        "127.0.0.1",
        sim_port,
        "POST",
        "/tokenize",
        &[],
        &json!({"model": MODEL, "prompt": PERSONAL}).to_string(),
    )
    .await;
    assert_eq!(status, 200, "{tokenized}");
    let ids: Vec<u64> = serde_json::from_str::<Value>(&tokenized).unwrap()["tokens"]
        .as_array()
        .expect("token ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    let _ = PERSONAL_IDS.set(ids);

    let receiver = Receiver::default();
    let otlp = receiver.start().await;
    let log = dir.0.join("gateway.log");
    let (api, admin, xp) = (free_port(), free_port(), free_port());
    let mut gateway = ChildGuard(
        support::gateway_command(&config, api, admin)
            .arg(format!("--extproc-listen=127.0.0.1:{xp}"))
            .args(["--log-format", "json"])
            .env_remove("RUST_LOG")
            .env(PROVIDER_KEY_ENV, "sk-standin")
            .stdout(std::fs::File::create(&log).expect("log file"))
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp)
            .env("OTEL_BSP_SCHEDULE_DELAY", "100")
            .env_remove("OTEL_EXPORTER_OTLP_PROTOCOL")
            .spawn()
            .expect("starting kinference-gateway"),
    );
    support::wait_until_ready(&mut gateway, admin).await;
    // The same configuration, one request in flight at most and no queue.
    let tight_dir = support::TempDir::new("matrix-tight");
    let tight_config = write_config(&tight_dir.0, sim_port, remote_addr, provider_addr, 0);
    let (tight_api, tight_admin, tight_xp) = (free_port(), free_port(), free_port());
    let mut tight = ChildGuard(
        support::gateway_command(&tight_config, tight_api, tight_admin)
            .arg(format!("--extproc-listen=127.0.0.1:{tight_xp}"))
            .args([
                "--max-in-flight=1",
                "--overload-queue=0",
                "--overload-retry-after-seconds=3",
            ])
            .spawn()
            .expect("starting the tight gateway"),
    );
    support::wait_until_ready(&mut tight, tight_admin).await;
    let tight_xp = SocketAddr::from(([127, 0, 0, 1], tight_xp));
    // The same configuration with a worker that holds what it is sent as the local pool, flow
    // control on and a 1 ms TTFT target: once a request is held there, the pool is saturated.
    let holding = Arc::new(AtomicU64::new(0));
    let holder_port = holder(Arc::clone(&holding)).await.port();
    let saturated_dir = support::TempDir::new("matrix-saturated");
    let saturated_config =
        write_config(&saturated_dir.0, holder_port, remote_addr, provider_addr, 0);
    let (saturated_api, saturated_admin, saturated_xp) = (free_port(), free_port(), free_port());
    let mut saturated = ChildGuard(
        support::gateway_command(&saturated_config, saturated_api, saturated_admin)
            .arg(format!("--extproc-listen=127.0.0.1:{saturated_xp}"))
            .args([
                "--flow-control",
                "--flow-ttft-target-ms=1",
                "--flow-deadline-ms=100",
                "--flow-retry-after-seconds=4",
            ])
            .spawn()
            .expect("starting the saturated gateway"),
    );
    support::wait_until_ready(&mut saturated, saturated_admin).await;
    // An idle worker takes a request whatever its estimate; this one never sees its first token.
    let waiting_for_ever = tokio::spawn(async move {
        let body = body(Endpoint::ChatCompletions, "hold", false, false);
        support::call(
            "127.0.0.1",
            saturated_api,
            "POST",
            Endpoint::ChatCompletions.path(),
            &[("authorization", &format!("Bearer {OTHER}"))],
            std::str::from_utf8(&body).unwrap(),
        )
        .await
    });
    let holding = &holding;
    support::wait_for(
        "a request held by the saturated gateway's worker",
        || async move { holding.load(Ordering::SeqCst) == 1 },
    )
    .await;
    let fleet = Fleet {
        api,
        envoy: Envoy::connect(SocketAddr::from(([127, 0, 0, 1], xp))).await,
        tight_api,
        tight_envoy: Envoy::connect(tight_xp).await,
        tight_xp,
        saturated_api,
        saturated_envoy: Envoy::connect(SocketAddr::from(([127, 0, 0, 1], saturated_xp))).await,
        http: Client::builder(TokioExecutor::new()).build_http(),
        remote,
        provider,
        journal: dir.0.join("usage.jsonl"),
        log: log.clone(),
        receiver,
        next_id: AtomicU64::new(0),
        sent: Default::default(),
        _children: vec![sim_child],
        _dir: dir,
    };
    // Every pool's worker answering (the Remote stand-in is probed healthy like the sim).
    support::wait_for("the gateway sees its workers healthy", || async {
        let (status, _, body) =
            support::call("127.0.0.1", admin, "GET", "/healthz/workers", &[], "").await;
        status == 200
            && serde_json::from_str::<Value>(&body).is_ok_and(|v| v["healthy"].as_u64() >= Some(2))
    })
    .await;

    const CHECKS: [&str; 10] = [
        "no key",
        "not allowed",
        "at limit",
        "personal data",
        "billed",
        "overload",
        "salted",
        "flow shed",
        "objective",
        "prioritized",
    ];
    let mut matrix: BTreeMap<(usize, Door), Vec<Cell>> = BTreeMap::new();
    // The OTLP exporter connects with the first span it sends: one request first, not counted.
    let warm = body(Endpoint::ChatCompletions, "warm up", false, false);
    fleet
        .send(Call::new(
            Door::Http,
            Endpoint::ChatCompletions,
            Some(ACME),
            &warm,
        ))
        .await
        .expect("a first request");
    fleet.sent.lock().clear();
    let held = hold_the_slot(fleet.tight_xp).await;
    for (i, endpoint) in ROUTES.iter().copied().enumerate() {
        for (j, door) in DOORS.iter().copied().enumerate() {
            let cell = i * DOORS.len() + j;
            let run = |r: Result<(), String>| match r {
                Ok(()) => Cell::Pass,
                Err(why) => Cell::Fail(why),
            };
            let row = vec![
                run(no_key(&fleet, door, endpoint).await),
                run(not_allowed(&fleet, door, endpoint).await),
                run(at_limit(&fleet, door, endpoint, cell).await),
                if endpoint.has_body() {
                    run(personal_data(&fleet, door, endpoint).await)
                } else {
                    // No body, no personal data (the model list).
                    Cell::Na
                },
                if endpoint.reaches_backend() {
                    run(billed(&fleet, door, endpoint).await)
                } else {
                    // Answered by the gateway (token counts, the model list): nothing to bill.
                    Cell::Na
                },
                run(overload(&fleet, door, endpoint).await),
                if endpoint.reaches_prefix_cache() {
                    run(salted(&fleet, door, endpoint).await)
                } else {
                    // No prefix cache behind it: tokenizing, or answered by the gateway.
                    Cell::Na
                },
                if endpoint.reaches_backend() {
                    run(flow_shed(&fleet, door, endpoint).await)
                } else {
                    // Answered by the gateway: no pool to wait for.
                    Cell::Na
                },
                if endpoint.reaches_backend() {
                    run(objective(&fleet, door, endpoint).await)
                } else {
                    Cell::Na
                },
                if endpoint.reaches_prefix_cache() {
                    run(prioritized(&fleet, door, endpoint).await)
                } else {
                    // Tokenizing and the gateway's own answers have no engine queue.
                    Cell::Na
                },
            ];
            matrix.insert((i, door), row);
        }
    }
    drop(held);
    waiting_for_ever.abort();

    // One access line and one root span per request sent to the traced gateway (waited for a while:
    // spans are exported in batches).
    let sent = fleet.sent.lock().clone();
    let count_lines = || {
        let mut lines: HashMap<String, usize> = HashMap::new();
        for l in std::fs::read_to_string(&fleet.log)
            .unwrap_or_default()
            .lines()
        {
            let Ok(v) = serde_json::from_str::<Value>(l) else {
                continue;
            };
            if v["target"] == "kinference_gateway::access_log" {
                *lines
                    .entry(
                        v["fields"]["request_id"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string(),
                    )
                    .or_default() += 1;
            }
        }
        lines
    };
    let count_roots = || {
        sent.iter()
            .map(|(id, trace)| {
                let spans = fleet.receiver.spans(trace);
                let n = spans
                    .iter()
                    .filter(|s| hex(&s.parent_span_id) == "00f067aa0ba902b7")
                    .count();
                (id.clone(), n)
            })
            .collect::<HashMap<String, usize>>()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let (lines, roots) = loop {
        let (lines, roots) = (count_lines(), count_roots());
        let all = sent
            .iter()
            .all(|(id, _)| lines.contains_key(id) && roots.get(id).is_some_and(|n| *n > 0));
        if all || Instant::now() > deadline {
            break (lines, roots);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let once = |what: &str, counts: &HashMap<String, usize>| -> Vec<String> {
        sent.iter()
            .filter(|(id, _)| counts.get(id).copied() != Some(1))
            .map(|(id, _)| format!("{id}: {} {what}", counts.get(id).copied().unwrap_or(0)))
            .collect()
    };
    let access_failures = once("access lines", &lines);
    let span_failures = once("root spans", &roots);

    // The matrix, printed (SECURITY.md has it).
    let mut table = format!(
        "| endpoint | door | {} | x-request-id, access line, span |\n|---|---|{}---|\n",
        CHECKS.join(" | "),
        "---|".repeat(CHECKS.len())
    );
    let mut failures = Vec::new();
    for ((i, door), row) in &matrix {
        let e = ROUTES[*i];
        let mut line = format!("| {} {} | {} |", e.method(), e.path(), door.name());
        for (check, cell) in CHECKS.iter().zip(row) {
            line.push_str(match cell {
                Cell::Pass => " pass |",
                Cell::Na => " n/a |",
                Cell::Fail(_) => " **FAIL** |",
            });
            if let Cell::Fail(why) = cell {
                failures.push(format!(
                    "{} {} / {}: {check}: {why}",
                    e.path(),
                    door.name(),
                    check
                ));
            }
        }
        line.push_str(if access_failures.is_empty() && span_failures.is_empty() {
            " pass |\n"
        } else {
            " see below |\n"
        });
        table.push_str(&line);
    }
    println!(
        "governance matrix: {} endpoints x {} doors x {} checks (+ request id, access line, span) = {} cells, {} requests\n{table}",
        ROUTES.len(),
        DOORS.len(),
        CHECKS.len(),
        ROUTES.len() * DOORS.len() * (CHECKS.len() + 1),
        sent.len()
    );
    failures.extend(access_failures);
    failures.extend(span_failures);
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
