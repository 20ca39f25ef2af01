//! The ext_proc inference handler driven exactly as Envoy drives it: one `Process` stream per HTTP
//! request, `request_headers` then `request_body` (and the response phase), with a tonic client built
//! from the `envoy-types` crate.
//!
//! - The real `kinference-gateway` binary with `--extproc-listen`, in front of real `vllm-sim` workers
//!   (from `$KINFERENCE_BIN_DIR` or the target directory; an in-test HTTP worker when it is not built):
//!   for the same request and the same cluster state the handler picks the worker the gateway's own
//!   HTTP path picks, in both directions (a prefix warmed by either is found by the other); past
//!   its in-flight limit it answers 503 with `Retry-After` and admits a high-priority tenant's
//!   request before a low-priority one queued earlier; with traces exported to an OTLP receiver on
//!   loopback, the request's span continues the client's trace with the HTTP path's stage spans,
//!   the worker's `traceparent` names it, and the JSON access line carries the request id.
//! - In-process, on one router: 503 without a ready worker, 400 for a malformed body, 404 for an
//!   unknown model, 429 when shedding, streamed bodies, and the in-flight ticket released by the
//!   response's end or by the stream's end (never leaked); the `x-request-id` honoured or made and
//!   set for the worker and the client; the pass-through endpoints routed and billed as over HTTP.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as PReq;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as PResp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use envoy_types::pb::google::protobuf::value::Kind;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kinference_gateway::extproc::{self, Settings};
use kinference_gateway::gateway::{Gateway, Parts};
use kinference_gateway::policy::stage::PolicyStage;
use kinference_gateway::routing::sessions::{Answers, Held, Owner, SessionKey};
use kinference_gateway::routing::{ModelConfig, Router, RoutingConfig, WorkerConfig};
use kinference_gateway::tenancy::{Tenancy, TenancyConfig};
use serde_json::{Value, json};
use testkit::{ChildGuard, free_port, tokenizer_dir};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

mod support;

const MODEL: &str = "qwen2-sim";

// ---------------------------------------------------------------------------------------------
// Harness

fn http_client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A worker: `vllm-sim` when built, else a tiny in-test OpenAI server (the routing does not depend on
/// what the worker answers, only on the gateway's view).
enum Worker {
    Sim(#[allow(dead_code)] ChildGuard),
    InTest(#[allow(dead_code)] tokio::task::JoinHandle<()>),
}

/// A worker on a free loopback port, and its port, once it answers.
async fn start_worker() -> (Worker, u16) {
    if let Some(sim) = support::vllm_sim_binary() {
        let (child, port) = support::spawn_vllm_sim(&sim, MODEL);
        support::wait_until_ok(port, "/health").await;
        (Worker::Sim(child), port)
    } else {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind worker");
        let port = listener.local_addr().expect("worker address").port();
        eprintln!("vllm-sim not built: using an in-test worker on port {port}");
        (Worker::InTest(tokio::spawn(tiny_worker(listener))), port)
    }
}

async fn tiny_worker(listener: tokio::net::TcpListener) {
    use hyper::service::service_fn;
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        tokio::spawn(async move {
            let svc = service_fn(|req: hyper::Request<hyper::body::Incoming>| async move {
                let body = if req.uri().path() == "/health" {
                    String::new()
                } else {
                    json!({"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                     "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                    .to_string()
                };
                Ok::<_, std::convert::Infallible>(
                    hyper::Response::builder()
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from(body)))
                        .expect("response"),
                )
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn header(key: &str, value: &str) -> HeaderValue {
    HeaderValue {
        key: key.to_string(),
        raw_value: value.as_bytes().to_vec(),
        ..Default::default()
    }
}

fn request_headers(path: &str) -> ProcessingRequest {
    request_headers_with(path, &[])
}

/// Request headers with `extra` ones (an API key, policy tags).
fn request_headers_with(path: &str, extra: &[(&str, &str)]) -> ProcessingRequest {
    let mut headers = vec![
        header(":method", "POST"),
        header(":path", path),
        header(":authority", "inference.example"),
        header("content-type", "application/json"),
    ];
    headers.extend(extra.iter().map(|(k, v)| header(k, v)));
    ProcessingRequest {
        request: Some(PReq::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn request_body(body: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(PReq::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// One ext_proc stream kept open by the test (Envoy keeps it for the request's lifetime).
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Stream {
    async fn open(client: &mut ExternalProcessorClient<Channel>) -> Self {
        let (tx, rx) = mpsc::channel(8);
        let rx = client
            .process(ReceiverStream::new(rx))
            .await
            .expect("Process")
            .into_inner();
        Self { tx, rx }
    }

    async fn send(&mut self, msg: ProcessingRequest) -> ProcessingResponse {
        self.push(msg).await;
        self.next().await
    }

    /// Sends `msg` without waiting for its answer.
    async fn push(&mut self, msg: ProcessingRequest) {
        self.tx.send(msg).await.expect("send");
    }

    /// The next answer.
    async fn next(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(30), self.rx.message())
            .await
            .expect("answer within 30 s")
            .expect("stream ok")
            .expect("an answer")
    }
}

/// What the handler decided for one request.
#[derive(Debug)]
enum Outcome {
    Routed {
        endpoint: String,
        worker: String,
        /// The body Envoy is to send instead of the client's, when the gateway rewrote it.
        body: Option<Value>,
    },
    Local {
        status: i32,
        body: Value,
    },
}

/// Sends headers then the body (one buffered chunk) and reads the decision from the body answer.
/// (The headers may already be answered: a caller refused before its body is sent.)
async fn decide_on(stream: &mut Stream, path: &str, body: &[u8]) -> Outcome {
    decide_with(stream, path, &[], body).await
}

fn outcome(answer: ProcessingResponse) -> Outcome {
    match answer.response {
        Some(PResp::RequestBody(b)) => {
            use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
            let common = b.response.unwrap_or_default();
            let rewritten = match common.body_mutation.and_then(|m| m.mutation) {
                Some(Mutation::Body(bytes)) => {
                    Some(serde_json::from_slice(&bytes).expect("a JSON body"))
                }
                _ => None,
            };
            let set = common
                .header_mutation
                .map(|m| m.set_headers)
                .unwrap_or_default();
            let get = |k: &str| {
                set.iter()
                    .filter_map(|h| h.header.as_ref())
                    .find(|h| h.key == k)
                    .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
            };
            let endpoint = get("x-gateway-destination-endpoint").expect("destination header");
            // The same endpoint in the envoy.lb dynamic metadata.
            let md = answer.dynamic_metadata.expect("dynamic metadata");
            let Some(Kind::StructValue(lb)) =
                md.fields.get("envoy.lb").and_then(|v| v.kind.clone())
            else {
                panic!("envoy.lb metadata missing")
            };
            assert_eq!(
                lb.fields
                    .get("x-gateway-destination-endpoint")
                    .and_then(|v| v.kind.clone()),
                Some(Kind::StringValue(endpoint.clone()))
            );
            Outcome::Routed {
                endpoint,
                worker: get("x-kinference-worker").unwrap_or_default(),
                body: rewritten,
            }
        }
        Some(PResp::ImmediateResponse(ir)) => Outcome::Local {
            status: ir.status.map(|s| s.code).unwrap_or_default(),
            body: serde_json::from_slice(&ir.body).expect("JSON error body"),
        },
        other => panic!("unexpected answer {other:?}"),
    }
}

async fn ask(client: &mut ExternalProcessorClient<Channel>, path: &str, body: &[u8]) -> Outcome {
    let mut s = Stream::open(client).await;
    decide_on(&mut s, path, body).await
}

/// Like [`decide_on`], with `extra` request headers.
async fn decide_with(
    stream: &mut Stream,
    path: &str,
    extra: &[(&str, &str)],
    body: &[u8],
) -> Outcome {
    let first = stream.send(request_headers_with(path, extra)).await;
    match first.response {
        Some(PResp::RequestHeaders(_)) => {}
        Some(PResp::ImmediateResponse(_)) => return outcome(first),
        _ => panic!("headers are acknowledged or answered: {first:?}"),
    }
    outcome(stream.send(request_body(body, true)).await)
}

async fn connect(addr: SocketAddr) -> ExternalProcessorClient<Channel> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match ExternalProcessorClient::connect(format!("http://{addr}")).await {
            Ok(c) => return c,
            Err(e) => {
                assert!(Instant::now() < deadline, "ext_proc not up: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A long, distinctive conversation: thousands of tokens, so a cached prefix dominates the estimate.
fn chat_body(tag: &str) -> Vec<u8> {
    let words: Vec<String> = (0..600)
        .map(|i| format!("{tag}{}", (i * 7919) % 1009))
        .collect();
    json!({
        "model": MODEL,
        "max_tokens": 2,
        "messages": [
            {"role": "system", "content": words.join(" ")},
            {"role": "user", "content": format!("summarise {tag}")}
        ]
    })
    .to_string()
    .into_bytes()
}

async fn gateway_pick(http: &Client<HttpConnector, Full<Bytes>>, api: u16, body: &[u8]) -> String {
    let req = hyper::Request::post(format!("http://127.0.0.1:{api}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::copy_from_slice(body)))
        .expect("request");
    let resp = http.request(req).await.expect("gateway answers");
    let status = resp.status();
    let worker = resp
        .headers()
        .get("x-kinference-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    assert!(
        status.is_success(),
        "gateway: {status} {}",
        String::from_utf8_lossy(&body)
    );
    worker.expect("x-kinference-worker")
}

fn endpoint(url: &str) -> String {
    extproc::endpoint_of(url).expect("worker url")
}

// ---------------------------------------------------------------------------------------------
// Same decision as the HTTP gateway (real binary, real workers)

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extproc_picks_what_the_gateway_picks() {
    let mut workers = Vec::new();
    let mut ports = Vec::new();
    for _ in 0..3 {
        let (worker, port) = start_worker().await;
        workers.push(worker);
        ports.push(port);
    }
    let scratch = support::TempDir::new("extproc");
    let config = scratch.0.join("gateway.yaml");
    let worker_lines: String = ports
        .iter()
        .map(|p| format!("  - {{url: \"http://127.0.0.1:{p}\", model: {MODEL}}}\n"))
        .collect();
    std::fs::write(
        &config,
        format!(
            "models:\n  - name: {MODEL}\n    tokenizer_dir: {}\nworkers:\n{worker_lines}routing: kinference\n",
            tokenizer_dir().display()
        ),
    )
    .expect("write config");
    let xp = free_port();
    let (gateway, api, _admin) =
        support::start_gateway(&config, &[&format!("--extproc-listen=127.0.0.1:{xp}")]).await;
    let mut client = connect(SocketAddr::from(([127, 0, 0, 1], xp))).await;
    let http = http_client();

    for round in 0..3 {
        // Warmed through the HTTP gateway: the handler finds the same worker.
        let body = chat_body(&format!("http{round}x"));
        let by_gateway = gateway_pick(&http, api, &body).await;
        let Outcome::Routed {
            endpoint: ep,
            worker,
            ..
        } = ask(&mut client, "/v1/chat/completions", &body).await
        else {
            panic!("ext_proc did not route")
        };
        assert_eq!(
            ep,
            endpoint(&by_gateway),
            "round {round}: gateway then ext_proc"
        );
        assert_eq!(worker, by_gateway);

        // Warmed through the handler: the HTTP gateway finds the same worker.
        let body = chat_body(&format!("xp{round}y"));
        let Outcome::Routed { endpoint: ep, .. } =
            ask(&mut client, "/v1/chat/completions", &body).await
        else {
            panic!("ext_proc did not route")
        };
        let by_gateway = gateway_pick(&http, api, &body).await;
        assert_eq!(
            ep,
            endpoint(&by_gateway),
            "round {round}: ext_proc then gateway"
        );
    }
    drop(gateway);
    drop(workers);
}

// ---------------------------------------------------------------------------------------------
// Refusals, streaming bodies and the ticket (in-process, one router)

struct Handler {
    router: Arc<Router>,
    client: ExternalProcessorClient<Channel>,
    _server: tokio::task::JoinHandle<()>,
    worker_urls: Vec<String>,
}

async fn in_process(workers: usize, settings: Settings) -> Handler {
    in_process_with(workers, settings, |_| Governance::default()).await
}

/// The gateway's governance for an in-process handler.
#[derive(Default)]
struct Governance {
    tenancy: Option<Arc<Tenancy>>,
    policy: Option<Arc<PolicyStage>>,
}

async fn in_process_with(
    workers: usize,
    settings: Settings,
    governance: impl FnOnce(&[String]) -> Governance,
) -> Handler {
    let worker_urls: Vec<String> = (0..workers)
        .map(|_| format!("http://127.0.0.1:{}", free_port()))
        .collect();
    let router = Arc::new(
        Router::new(RoutingConfig {
            workers: worker_urls
                .iter()
                .map(|u| WorkerConfig {
                    url: u.clone(),
                    model: MODEL.into(),
                    role: Default::default(),
                })
                .collect(),
            models: vec![ModelConfig {
                name: MODEL.into(),
                tokenizer_dir: Some(tokenizer_dir()),
                serves_messages: false,
                profile: None,
            }],
            ..Default::default()
        })
        .expect("router"),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let gov = governance(&worker_urls);
    let gw = Gateway::assemble(
        Arc::clone(&router),
        Parts {
            tenancy: gov.tenancy,
            policy: gov.policy,
            models: vec![MODEL.into()],
            ..Parts::default()
        },
    )
    .expect("gateway");
    // The router's own view of health (the tests mark workers down themselves): no prober runs.
    let handler = extproc::Handler::new(gw, settings);
    let server = tokio::spawn(async move {
        let _ = extproc::serve_handler(listener, handler, std::future::pending()).await;
    });
    let client = connect(addr).await;
    Handler {
        router,
        client,
        _server: server,
        worker_urls,
    }
}

fn in_flight(router: &Router) -> usize {
    router.workers().iter().map(|w| w.in_flight).sum()
}

async fn until_in_flight(router: &Router, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while in_flight(router) != n {
        assert!(
            Instant::now() < deadline,
            "in flight {} != {n}",
            in_flight(router)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn no_ready_worker_is_503() {
    let mut h = in_process(2, Settings::default()).await;
    for u in &h.worker_urls {
        h.router.set_healthy(u, false);
    }
    match ask(&mut h.client, "/v1/chat/completions", &chat_body("a")).await {
        Outcome::Local { status, body } => {
            assert_eq!(status, 503);
            assert_eq!(body["error"]["code"], "no_healthy_worker");
        }
        other => panic!("expected 503, got {other:?}"),
    }
    // Anthropic clients get Anthropic's error shape.
    let anthropic = json!({"model": MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    match ask(&mut h.client, "/v1/messages", anthropic.as_bytes()).await {
        Outcome::Local { status, body } => {
            assert_eq!(status, 503);
            assert_eq!(body["type"], "error");
            assert_eq!(body["error"]["type"], "overloaded_error");
        }
        other => panic!("expected 503, got {other:?}"),
    }
}

#[tokio::test]
async fn malformed_body_is_400_and_unknown_model_404() {
    let mut h = in_process(1, Settings::default()).await;
    for bad in [
        &b"{\"model\": \"qwen2-sim\", \"messages\": [{"[..],
        br#"{"model":"qwen2-sim","messages":"not a list"}"#,
        br#"{"model":"qwen2-sim"}"#,
    ] {
        match ask(&mut h.client, "/v1/chat/completions", bad).await {
            Outcome::Local { status, body } => {
                assert_eq!(status, 400, "{body}");
                assert_eq!(body["error"]["type"], "invalid_request_error");
            }
            other => panic!("expected 400, got {other:?}"),
        }
    }
    let unknown = json!({"model": "nope", "prompt": "hi"}).to_string();
    match ask(&mut h.client, "/v1/completions", unknown.as_bytes()).await {
        Outcome::Local { status, body } => {
            assert_eq!(status, 404);
            assert_eq!(body["error"]["code"], "model_not_found");
        }
        other => panic!("expected 404, got {other:?}"),
    }
    assert_eq!(in_flight(&h.router), 0, "refusals hold no ticket");
}

#[tokio::test]
async fn streamed_body_chunks_are_accumulated() {
    let mut h = in_process(2, Settings::default()).await;
    let body = chat_body("chunks");
    let mut s = Stream::open(&mut h.client).await;
    let first = s.send(request_headers("/v1/chat/completions")).await;
    assert!(matches!(first.response, Some(PResp::RequestHeaders(_))));
    let third = body.len() / 3;
    for chunk in [&body[..third], &body[third..2 * third]] {
        let answer = s.send(request_body(chunk, false)).await;
        let Some(PResp::RequestBody(b)) = answer.response else {
            panic!("body chunk acknowledged")
        };
        assert!(
            b.response.and_then(|c| c.header_mutation).is_none(),
            "no decision before the end of the body"
        );
        assert!(answer.dynamic_metadata.is_none());
    }
    let Outcome::Routed { endpoint: ep, .. } =
        outcome(s.send(request_body(&body[2 * third..], true)).await)
    else {
        panic!("routed at the end of the body")
    };
    assert!(h.worker_urls.iter().any(|u| endpoint(u) == ep));
}

#[tokio::test]
async fn ticket_lives_until_the_response_ends_or_the_stream_closes() {
    let mut h = in_process(1, Settings::default()).await;
    let body = chat_body("ticket");

    // Response phase seen: the end of the response body releases the ticket.
    let mut s = Stream::open(&mut h.client).await;
    assert!(matches!(
        decide_on(&mut s, "/v1/chat/completions", &body).await,
        Outcome::Routed { .. }
    ));
    assert_eq!(in_flight(&h.router), 1);
    let headers = ProcessingRequest {
        request: Some(PReq::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":status", "200"),
                    header("content-type", "text/event-stream"),
                ],
            }),
            ..Default::default()
        })),
        ..Default::default()
    };
    assert!(matches!(
        s.send(headers).await.response,
        Some(PResp::ResponseHeaders(_))
    ));
    let chunk = |data: &str, eos: bool| ProcessingRequest {
        request: Some(PReq::ResponseBody(HttpBody {
            body: data.as_bytes().to_vec(),
            end_of_stream: eos,
            ..Default::default()
        })),
        ..Default::default()
    };
    let a = s
        .send(chunk(
            "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
            false,
        ))
        .await;
    assert!(matches!(a.response, Some(PResp::ResponseBody(_))));
    assert_eq!(in_flight(&h.router), 1, "still generating");
    s.send(chunk(
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11}}\n\ndata: [DONE]\n\n",
        true,
    ))
    .await;
    assert_eq!(
        in_flight(&h.router),
        0,
        "released at the end of the response"
    );

    // No response phase: Envoy closing the stream releases it.
    let mut s = Stream::open(&mut h.client).await;
    decide_on(&mut s, "/v1/chat/completions", &body).await;
    assert_eq!(in_flight(&h.router), 1);
    drop(s);
    until_in_flight(&h.router, 0).await;
}

#[tokio::test]
async fn sheds_with_429_when_every_worker_is_at_the_limit() {
    let settings = Settings {
        shed_in_flight: Some(1),
        ..Settings::default()
    };
    let mut h = in_process(1, settings).await;
    let mut held = Stream::open(&mut h.client).await;
    assert!(matches!(
        decide_on(&mut held, "/v1/chat/completions", &chat_body("one")).await,
        Outcome::Routed { .. }
    ));
    match ask(&mut h.client, "/v1/chat/completions", &chat_body("two")).await {
        Outcome::Local { status, body } => {
            assert_eq!(status, 429);
            assert_eq!(body["error"]["type"], "rate_limit_error");
        }
        other => panic!("expected 429, got {other:?}"),
    }
    drop(held);
    until_in_flight(&h.router, 0).await;
    assert!(matches!(
        ask(&mut h.client, "/v1/chat/completions", &chat_body("three")).await,
        Outcome::Routed { .. }
    ));
}

// ---------------------------------------------------------------------------------------------
// Governance: the HTTP pipeline's stages (API key, tenant limits, policies) through ext_proc

const ACME_KEY: &str = "sk-acme-extproc-0123456789abcdef";

/// Tenant `acme` with `requests` requests per minute, its key in a mounted-secret layout.
fn tenancy_with(dir: &std::path::Path, requests: u32) -> Arc<Tenancy> {
    let tenants = dir.join("tenants.yaml");
    std::fs::write(
        &tenants,
        format!("apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {{name: acme}}\nspec:\n  apiKeys:\n    - secretRef: {{name: acme, key: api-key}}\n  limits:\n    requestsPerMinute: {requests}\n"),
    )
    .expect("tenants");
    let secrets = dir.join("secrets");
    std::fs::create_dir_all(secrets.join("acme")).expect("secrets");
    std::fs::write(secrets.join("acme/api-key"), ACME_KEY).expect("key");
    let config = TenancyConfig {
        tenants_dir: Some(tenants),
        secrets_dir: Some(secrets),
        usage_journal: Some(dir.join("usage.jsonl")),
        ..TenancyConfig::default()
    };
    let mut registry = prometheus_client::registry::Registry::default();
    Tenancy::start(
        config,
        &dir.join("gateway.yaml"),
        None,
        vec![MODEL.into()],
        &mut registry,
    )
    .expect("tenancy")
}

/// An in-process handler over `workers` workers, governed by tenant `acme` ([`tenancy`]) set up in a
/// fresh directory named after `name`: the handler, the tenancy (for its usage report) and the
/// directory (its usage journal; kept until the test ends).
async fn acme_handler(name: &str, workers: usize) -> (Handler, Arc<Tenancy>, support::TempDir) {
    acme_handler_with(name, workers, 1).await
}

/// [`acme_handler`] with `requests` requests per minute.
async fn acme_handler_with(
    name: &str,
    workers: usize,
    requests: u32,
) -> (Handler, Arc<Tenancy>, support::TempDir) {
    let scratch = support::TempDir::new(name);
    let tenancy = tenancy_with(&scratch.0, requests);
    let t = Arc::clone(&tenancy);
    let handler = in_process_with(workers, Settings::default(), move |_| Governance {
        tenancy: Some(t),
        policy: None,
    })
    .await;
    (handler, tenancy, scratch)
}

/// Tenant `acme`'s usage report once it counts `requests` requests (after a generous wait, the
/// report as it is, for the caller's assertion to show).
async fn settled_report(tenancy: &Tenancy, requests: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let report = tenancy
            .usage_report("tenant=acme", None)
            .await
            .expect("report");
        if report["total"]["requests"] == requests || Instant::now() > deadline {
            return report;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn response_end(usage: &str) -> [ProcessingRequest; 2] {
    [
        ProcessingRequest {
            request: Some(PReq::ResponseHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: vec![
                        header(":status", "200"),
                        header("content-type", "application/json"),
                    ],
                }),
                ..Default::default()
            })),
            ..Default::default()
        },
        ProcessingRequest {
            request: Some(PReq::ResponseBody(HttpBody {
                body: format!("{{\"choices\":[],\"usage\":{usage}}}").into_bytes(),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        },
    ]
}

#[tokio::test]
async fn api_key_is_401_and_tenant_limit_429_and_usage_is_settled() {
    let (mut h, tenancy, _scratch) = acme_handler("extproc-tenancy", 1).await;
    let body = chat_body("tenant");
    let path = "/v1/chat/completions";

    // No key, a wrong key: 401 in the client's protocol, nothing routed.
    let mut s = Stream::open(&mut h.client).await;
    match decide_with(&mut s, path, &[], &body).await {
        Outcome::Local { status, body } => {
            assert_eq!(status, 401, "{body}");
            assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
        }
        other => panic!("expected 401, got {other:?}"),
    }
    let mut s = Stream::open(&mut h.client).await;
    let anthropic = json!({"model": MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    match decide_with(
        &mut s,
        "/v1/messages",
        &[("x-api-key", "sk-wrong")],
        anthropic.as_bytes(),
    )
    .await
    {
        Outcome::Local { status, body } => {
            assert_eq!(status, 401, "{body}");
            assert_eq!(body["type"], "error");
            assert_eq!(body["error"]["type"], "authentication_error", "{body}");
        }
        other => panic!("expected 401, got {other:?}"),
    }
    assert_eq!(in_flight(&h.router), 0, "refusals hold no ticket");

    // The key: routed; the response's end settles the tenant's usage.
    let bearer = format!("Bearer {ACME_KEY}");
    let auth = [("authorization", bearer.as_str())];
    let mut s = Stream::open(&mut h.client).await;
    assert!(matches!(
        decide_with(&mut s, path, &auth, &body).await,
        Outcome::Routed { .. }
    ));
    for msg in response_end(r#"{"prompt_tokens":700,"completion_tokens":2,"total_tokens":702}"#) {
        s.send(msg).await;
    }
    until_in_flight(&h.router, 0).await;
    let report = settled_report(&tenancy, 1).await;
    assert_eq!(report["total"]["requests"], 1, "{report}");
    assert_eq!(report["total"]["output_tokens"], 2, "{report}");

    // One request per minute: the next one is refused with 429 and Retry-After.
    let mut s = Stream::open(&mut h.client).await;
    match decide_with(&mut s, path, &auth, &body).await {
        Outcome::Local { status, body } => {
            assert_eq!(status, 429, "{body}");
            assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
        }
        other => panic!("expected 429, got {other:?}"),
    }
    assert_eq!(in_flight(&h.router), 0);
}

#[tokio::test]
async fn policies_run_before_the_pick_and_personal_data_stays_on_workers() {
    let scratch = support::TempDir::new("extproc-policy");
    let policy_dir = scratch.0.join("policies");
    std::fs::create_dir_all(&policy_dir).expect("policy dir");
    let tokenizer = tokenizer_dir();
    let mut h = in_process_with(2, Settings::default(), |workers| {
        let endpoints: Vec<String> = workers
            .iter()
            .map(|u| format!("{{url: \"{u}\"}}"))
            .collect();
        let files = format!(
            "apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {{name: {MODEL}}}
spec:
  servedName: {MODEL}
  aliases: [sim-alias]
  classes: [general]
  tokenizer: {{dir: \"{tok}\"}}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {{name: local}}
spec:
  models: [{MODEL}]
  gpuClass: sim
  locality: Local
  endpoints: [{endpoints}]
  prices: {{cachedInputPerMillion: 0.01, uncachedInputPerMillion: 0.1, outputPerMillion: 0.4}}
---
apiVersion: kinference.ai/v1alpha1
kind: InferenceProvider
metadata: {{name: cloud}}
spec:
  baseUrl: http://127.0.0.1:9/v1
  apiStyle: OpenAI
  credentials: {{env: KINFERENCE_EXTPROC_TEST_NO_KEY}}
  models:
    - name: cloud-model
      substitutes: [{MODEL}]
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePolicy
metadata: {{name: gate}}
spec:
  priority: 0
  rules:
    - name: blocked
      match: {{tags: [blocked]}}
      action:
        reject: {{status: 403, message: blocked by policy}}
    - name: pii-stays-local
      match: {{tags: [pii]}}
      action:
        requireLocal: {{message: personal data must not leave our infrastructure}}
    - name: always-burst
      action:
        burst:
          providers: [cloud]
          when: {{queueDepthAbove: 0}}
",
            tok = tokenizer.display(),
            endpoints = endpoints.join(", "),
        );
        std::fs::write(policy_dir.join("all.yaml"), files).expect("policies");
        let source = kinference_gateway::config_source::files::start(
            policy_dir.clone(),
            Duration::from_secs(60),
        )
        .expect("policy directory");
        let stage = PolicyStage::start(source.into_policy_sets(), Duration::from_secs(60));
        Governance {
            tenancy: None,
            policy: Some(stage),
        }
    })
    .await;
    let path = "/v1/chat/completions";

    // A policy refusal is the local reply.
    let mut s = Stream::open(&mut h.client).await;
    match decide_with(
        &mut s,
        path,
        &[("x-kinference-tags", "blocked")],
        &chat_body("b"),
    )
    .await
    {
        Outcome::Local { status, body } => {
            assert_eq!(status, 403, "{body}");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("blocked by policy")),
                "{body}"
            );
        }
        other => panic!("expected 403, got {other:?}"),
    }

    // Personal data: a local worker, never the provider (Envoy can only reach workers anyway, and the
    // plan holds no provider).
    let pii = json!({"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "Please email jane.doe@example.com the contract draft."}]})
    .to_string();
    let mut s = Stream::open(&mut h.client).await;
    match decide_with(&mut s, path, &[], pii.as_bytes()).await {
        Outcome::Routed {
            endpoint: ep,
            worker,
            ..
        } => {
            assert!(h.worker_urls.contains(&worker), "{worker}");
            assert_eq!(ep, endpoint(&worker));
        }
        other => panic!("expected a worker, got {other:?}"),
    }
    // A burst plan: the provider is passed over, the pool's worker takes it.
    let mut s2 = Stream::open(&mut h.client).await;
    assert!(matches!(
        decide_with(&mut s2, path, &[], &chat_body("burst")).await,
        Outcome::Routed { .. }
    ));
    drop((s, s2));
    until_in_flight(&h.router, 0).await;

    // An alias or a class resolves as over HTTP: the body Envoy sends names the served model, on
    // chat as on the other endpoints.
    for model in ["sim-alias", "general"] {
        let embeddings = json!({"model": model, "input": "hello"}).to_string();
        let chat = json!({"model": model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hello"}]})
        .to_string();
        for (endpoint, request) in [("/v1/embeddings", embeddings), (path, chat)] {
            let mut s = Stream::open(&mut h.client).await;
            match decide_with(&mut s, endpoint, &[], request.as_bytes()).await {
                Outcome::Routed { body, worker, .. } => {
                    assert!(h.worker_urls.contains(&worker), "{worker}");
                    let body = body.expect("the body rewritten");
                    assert_eq!(body["model"], MODEL, "{endpoint} {model}: {body}");
                }
                other => panic!("{endpoint} {model}: expected a worker, got {other:?}"),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Telemetry: the request id and the trace context, as over HTTP

/// The headers an answer sets (on the request to the worker, or on the response to the client).
fn set_by(answer: &ProcessingResponse) -> HashMap<String, String> {
    let mutation = match &answer.response {
        Some(PResp::RequestHeaders(h) | PResp::ResponseHeaders(h)) => {
            h.response.as_ref().and_then(|c| c.header_mutation.clone())
        }
        Some(PResp::RequestBody(b) | PResp::ResponseBody(b)) => {
            b.response.as_ref().and_then(|c| c.header_mutation.clone())
        }
        Some(PResp::ImmediateResponse(ir)) => ir.headers.clone(),
        _ => None,
    };
    mutation
        .map(|m| m.set_headers)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|h| h.header)
        .map(|h| (h.key, String::from_utf8_lossy(&h.raw_value).into_owned()))
        .collect()
}

/// The response headers Envoy sends when the worker answers `status`.
fn response_headers(status: u16) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(PReq::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":status", &status.to_string()),
                    header("content-type", "application/json"),
                ],
            }),
            ..Default::default()
        })),
        ..Default::default()
    }
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[tokio::test]
async fn the_request_id_is_honoured_or_made_and_set_for_the_worker_and_the_client() {
    let mut h = in_process(1, Settings::default()).await;
    let path = "/v1/chat/completions";

    // The client's id and trace context: on the request to the worker and on the response.
    let mut s = Stream::open(&mut h.client).await;
    let client = [("x-request-id", "xp-req-1"), ("traceparent", TRACEPARENT)];
    let headers = s.send(request_headers_with(path, &client)).await;
    assert_eq!(set_by(&headers)["x-request-id"], "xp-req-1");
    let routed = s.send(request_body(&chat_body("id"), true)).await;
    let set = set_by(&routed);
    assert!(
        set.contains_key("x-gateway-destination-endpoint"),
        "{set:?}"
    );
    assert_eq!(set["x-request-id"], "xp-req-1", "{set:?}");
    // Traces are not exported here: the client's own trace context goes on unchanged.
    assert_eq!(set["traceparent"], TRACEPARENT, "{set:?}");
    let response = s.send(response_headers(200)).await;
    assert_eq!(set_by(&response)["x-request-id"], "xp-req-1");

    // No id, or one unsafe to log: a new one, the same for the worker and the client.
    for sent in [None, Some("not safe; <script>")] {
        let mut s = Stream::open(&mut h.client).await;
        let extra: Vec<(&str, &str)> = sent.map(|id| ("x-request-id", id)).into_iter().collect();
        s.send(request_headers_with(path, &extra)).await;
        let routed = set_by(&s.send(request_body(&chat_body("new-id"), true)).await);
        let id = routed["x-request-id"].clone();
        assert_eq!(id.len(), 32, "{id}");
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        assert!(!routed.contains_key("traceparent"), "{routed:?}");
        let response = s.send(response_headers(200)).await;
        assert_eq!(set_by(&response)["x-request-id"], id);
    }

    // A local reply carries it too.
    let mut s = Stream::open(&mut h.client).await;
    s.send(request_headers_with(
        path,
        &[("x-request-id", "xp-refused")],
    ))
    .await;
    let refused = s
        .send(request_body(br#"{"model":"nope","prompt":"x"}"#, true))
        .await;
    assert!(matches!(
        refused.response,
        Some(PResp::ImmediateResponse(_))
    ));
    assert_eq!(set_by(&refused)["x-request-id"], "xp-refused");
}

// ---------------------------------------------------------------------------------------------
// The pass-through endpoints, routed as the HTTP gateway routes them

/// The worker a request was routed to; panics on a local reply.
fn routed_worker(outcome: Outcome) -> String {
    match outcome {
        Outcome::Routed { worker, .. } => worker,
        other => panic!("expected a worker, got {other:?}"),
    }
}

#[tokio::test]
async fn pass_through_endpoints_go_to_the_least_loaded_worker_and_bill_the_tenant() {
    // Three requests a minute: every request counts, tokenizing too.
    let (mut h, tenancy, scratch) = acme_handler_with("extproc-passthrough", 2, 3).await;
    let bearer = format!("Bearer {ACME_KEY}");
    let auth = [("authorization", bearer.as_str())];

    // An embedding: a worker of the model; its usage settled from the worker's answer.
    let embedding = json!({"model": MODEL, "input": "hello there"}).to_string();
    let mut first = Stream::open(&mut h.client).await;
    let with_id = [auth[0], ("x-request-id", "xp-embed-1")];
    let first_worker = routed_worker(
        decide_with(&mut first, "/v1/embeddings", &with_id, embedding.as_bytes()).await,
    );
    assert!(h.worker_urls.contains(&first_worker), "{first_worker}");

    // Tokenizing bills no tokens but is a request (the second of three) and, with the first
    // request still in flight, goes to the other, less loaded, worker.
    let tokenize = json!({"model": MODEL, "prompt": "hello there"}).to_string();
    let mut second = Stream::open(&mut h.client).await;
    let second_worker =
        routed_worker(decide_with(&mut second, "/tokenize", &auth, tokenize.as_bytes()).await);
    assert_ne!(second_worker, first_worker, "least loaded");
    let detokenize = json!({"model": MODEL, "tokens": [1, 2, 3]}).to_string();
    let mut s = Stream::open(&mut h.client).await;
    routed_worker(decide_with(&mut s, "/detokenize", &auth, detokenize.as_bytes()).await);
    drop(s);

    for msg in response_end(r#"{"prompt_tokens":5,"total_tokens":5}"#) {
        first.send(msg).await;
    }
    // The embedding and the detokenizing (its stream closed: settled) recorded; the tokenizing
    // request is still open. Tokenizing bills no tokens: the embedding's 5 input tokens only.
    let report = settled_report(&tenancy, 2).await;
    assert_eq!(report["total"]["requests"], 2, "{report}");
    assert_eq!(report["total"]["input_uncached_tokens"], 5, "{report}");
    // The usage record, written a moment later, carries the request's id.
    let journal = scratch.0.join("usage.jsonl");
    let read = || std::fs::read_to_string(&journal).unwrap_or_default();
    support::wait_for("the usage record", || {
        let written = read().contains("request_id");
        async move { written }
    })
    .await;
    assert!(
        read().contains(r#""request_id":"xp-embed-1""#),
        "{}",
        read()
    );

    // Past the tenant's three requests a minute: 429, a response and tokenizing alike.
    let responses = json!({"model": MODEL, "input": "hi", "max_output_tokens": 4}).to_string();
    let mut s = Stream::open(&mut h.client).await;
    match decide_with(&mut s, "/v1/responses", &auth, responses.as_bytes()).await {
        Outcome::Local { status, body } => {
            assert_eq!(status, 429, "{body}");
            assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
        }
        other => panic!("expected 429, got {other:?}"),
    }
    // A body the HTTP gateway refuses is refused the same way, in OpenAI's shape.
    let mut s = Stream::open(&mut h.client).await;
    let no_input = json!({"model": MODEL}).to_string();
    match decide_with(&mut s, "/v1/embeddings", &auth, no_input.as_bytes()).await {
        Outcome::Local { status, body } => {
            assert_eq!(status, 400, "{body}");
            assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        }
        other => panic!("expected 400, got {other:?}"),
    }
    drop((first, second));
    until_in_flight(&h.router, 0).await;
}

#[tokio::test]
async fn a_streamed_response_settles_the_usage_of_its_completed_event() {
    // Room for the follow-ups below.
    let (mut h, tenancy, _scratch) = acme_handler_with("extproc-responses", 2, 10).await;
    let bearer = format!("Bearer {ACME_KEY}");
    let auth = [("authorization", bearer.as_str())];
    let body = json!({"model": MODEL, "input": "tell me about ext_proc", "stream": true});
    let mut s = Stream::open(&mut h.client).await;
    let worker = routed_worker(
        decide_with(&mut s, "/v1/responses", &auth, body.to_string().as_bytes()).await,
    );
    assert!(h.worker_urls.contains(&worker), "{worker}");
    assert_eq!(in_flight(&h.router), 1);
    s.send(response_headers(200)).await;
    let completed = "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"ok\"}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_xp1\",\"usage\":{\"input_tokens\":6,\"output_tokens\":2}}}\n\n";
    s.send(ProcessingRequest {
        request: Some(PReq::ResponseBody(HttpBody {
            body: completed.as_bytes().to_vec(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await;
    until_in_flight(&h.router, 0).await;
    let report = settled_report(&tenancy, 1).await;
    assert_eq!(report["total"]["input_uncached_tokens"], 6, "{report}");
    assert_eq!(report["total"]["output_tokens"], 2, "{report}");

    // The answer's id was read on this door too: acme's follow-ups go to the worker holding it
    // (whatever the estimate says), and no other tenant's request may continue it.
    let asks = |tenant| Answers {
        owner: Some(Owner::of(tenant)),
        continues: SessionKey::answer("resp_xp1"),
    };
    assert!(matches!(h.router.answer_held(&asks("acme")), Held::By(_)));
    assert_eq!(h.router.answer_held(&asks("other")), Held::Foreign);
    let follow_up = json!({"model": MODEL, "input": "go on", "previous_response_id": "resp_xp1"});
    for _ in 0..4 {
        let mut s = Stream::open(&mut h.client).await;
        let routed = routed_worker(
            decide_with(
                &mut s,
                "/v1/responses",
                &auth,
                follow_up.to_string().as_bytes(),
            )
            .await,
        );
        assert_eq!(routed, worker, "a follow-up goes where its answer is held");
    }
}

// ---------------------------------------------------------------------------------------------
// The real gateway: overload admission and traces through ext_proc

/// A gateway.yaml for one worker on `port` (and `extra` YAML after it) in `dir`.
fn one_worker_config(dir: &std::path::Path, port: u16, extra: &str) -> std::path::PathBuf {
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - name: {MODEL}\n    tokenizer_dir: {}\nworkers:\n  - {{url: \"http://127.0.0.1:{port}\", model: {MODEL}}}\n{extra}",
            tokenizer_dir().display()
        ),
    )
    .expect("write config");
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_in_flight_limit_ext_proc_sheds_with_503_and_admits_high_priority_first() {
    let (_worker, port) = start_worker().await;
    let scratch = support::TempDir::new("extproc-overload");
    let dir = &scratch.0;
    let mut tenants = Vec::new();
    for (name, priority) in [("gold", "High"), ("bronze", "Low")] {
        tenants.push(format!(
            "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {{name: {name}}}\nspec:\n  apiKeys:\n    - secretRef: {{name: {name}, key: api-key}}\n  priority: {priority}\n"
        ));
        let secret = dir.join("secrets").join(name);
        std::fs::create_dir_all(&secret).expect("secret dir");
        std::fs::write(secret.join("api-key"), format!("sk-{name}-extproc")).expect("key");
    }
    std::fs::write(dir.join("tenants.yaml"), tenants.join("---\n")).expect("tenants");
    let tenancy = format!(
        "tenancy:\n  tenants_dir: {}\n  secrets_dir: {}\n  usage_journal: {}\n",
        dir.join("tenants.yaml").display(),
        dir.join("secrets").display(),
        dir.join("usage.jsonl").display()
    );
    let config = one_worker_config(dir, port, &tenancy);
    let xp = free_port();
    // One slot, two places in the queue, and a queue wait far longer than the test.
    let (_gateway, _api, admin) = support::start_gateway(
        &config,
        &[
            &format!("--extproc-listen=127.0.0.1:{xp}"),
            "--max-in-flight=1",
            "--priority-reserve-percent=0",
            "--overload-queue=2",
            "--overload-queue-timeout-ms=60000",
            "--overload-retry-after-seconds=2",
        ],
    )
    .await;
    let mut client = connect(SocketAddr::from(([127, 0, 0, 1], xp))).await;
    let path = "/v1/chat/completions";
    let gold = [("authorization", "Bearer sk-gold-extproc")];
    let bronze = [("authorization", "Bearer sk-bronze-extproc")];
    let queued = || support::metric(admin, "kinference_gateway_overload_queued");

    // A gold request holds the only slot while its stream is open.
    let mut holder = Stream::open(&mut client).await;
    routed_worker(decide_with(&mut holder, path, &gold, &chat_body("holder")).await);

    // A bronze, then a gold request wait for it: admission runs on their headers, before Envoy
    // sends their bodies.
    let mut waiting = Vec::new();
    for (n, key) in [bronze, gold].iter().enumerate() {
        let mut s = Stream::open(&mut client).await;
        s.push(request_headers_with(path, key)).await;
        support::wait_for("the request waiting for a slot", || async {
            queued().await == (n + 1) as f64
        })
        .await;
        waiting.push(s);
    }
    let (mut gold_waiting, mut bronze_waiting) = (waiting.pop().unwrap(), waiting.pop().unwrap());

    // The queue is full: the next request is shed at once, 503 with Retry-After, in its protocol.
    let mut shed = Stream::open(&mut client).await;
    let answer = shed.send(request_headers_with(path, &gold)).await;
    let set = set_by(&answer);
    assert_eq!(
        set.get("retry-after").map(String::as_str),
        Some("2"),
        "{set:?}"
    );
    assert!(set.contains_key("x-request-id"), "{set:?}");
    match outcome(answer) {
        Outcome::Local { status, body } => {
            assert_eq!(status, 503, "{body}");
            assert_eq!(body["error"]["code"], "overloaded", "{body}");
        }
        other => panic!("expected 503, got {other:?}"),
    }

    // The slot given back: the gold request, queued after the bronze one, is admitted first; the
    // bronze one waits on until the gold one ends.
    drop(holder);
    let admitted = gold_waiting.next().await;
    assert!(
        matches!(admitted.response, Some(PResp::RequestHeaders(_))),
        "{admitted:?}"
    );
    routed_worker(outcome(
        gold_waiting
            .send(request_body(&chat_body("waiting1"), true))
            .await,
    ));
    assert!(
        tokio::time::timeout(Duration::from_millis(500), bronze_waiting.rx.message())
            .await
            .is_err(),
        "the bronze request has no slot while the gold one holds it"
    );
    drop(gold_waiting);
    let admitted = bronze_waiting.next().await;
    assert!(
        matches!(admitted.response, Some(PResp::RequestHeaders(_))),
        "{admitted:?}"
    );
    routed_worker(outcome(
        bronze_waiting
            .send(request_body(&chat_body("waiting0"), true))
            .await,
    ));
    let metrics = support::metrics_text(admin).await;
    assert!(
        metrics.contains(r#"kinference_gateway_shed_total{reason="queue_full",priority="high"} 1"#),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routed_request_exports_the_http_paths_spans_and_the_worker_continues_the_trace() {
    use support::otlp::{Receiver, attributes, hex};
    let (_worker, port) = start_worker().await;
    let receiver = Receiver::default();
    let endpoint = receiver.start().await;
    let scratch = support::TempDir::new("extproc-trace");
    let config = one_worker_config(&scratch.0, port, "routing: kinference\n");
    let (api, admin, xp) = (free_port(), free_port(), free_port());
    let log = scratch.0.join("gateway.log");
    let mut gateway = ChildGuard(
        support::gateway_command(&config, api, admin)
            .arg(format!("--extproc-listen=127.0.0.1:{xp}"))
            .args(["--log-format", "json"])
            .env_remove("RUST_LOG")
            .stdout(std::fs::File::create(&log).expect("log file"))
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
            .env("OTEL_BSP_SCHEDULE_DELAY", "100")
            .env_remove("OTEL_EXPORTER_OTLP_PROTOCOL")
            .spawn()
            .expect("starting kinference-gateway"),
    );
    support::wait_until_ready(&mut gateway, admin).await;
    let mut client = connect(SocketAddr::from(([127, 0, 0, 1], xp))).await;

    let mut s = Stream::open(&mut client).await;
    let client_headers = [("traceparent", TRACEPARENT), ("x-request-id", "xp-trace-1")];
    s.send(request_headers_with(
        "/v1/chat/completions",
        &client_headers,
    ))
    .await;
    let routed = set_by(&s.send(request_body(&chat_body("trace"), true)).await);
    assert_eq!(routed["x-request-id"], "xp-trace-1");
    for msg in response_end(r#"{"prompt_tokens":700,"completion_tokens":2,"total_tokens":702}"#) {
        s.send(msg).await;
    }

    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let root_name = "POST /v1/chat/completions";
    // The pipeline's stages with a span through Envoy (`pipeline::STAGES`: no body read here).
    let stages = ["authenticate", "admit", "parse", "limit", "routing"];
    let mut spans = Vec::new();
    support::wait_for("the request's spans at the receiver", || {
        spans = receiver.spans(trace_id);
        let all = std::iter::once(&root_name)
            .chain(stages.iter())
            .all(|name| spans.iter().any(|s| s.name == *name));
        async move { all }
    })
    .await;
    let by_name = |name: &str| {
        let found: Vec<_> = spans.iter().filter(|s| s.name == name).collect();
        assert_eq!(found.len(), 1, "one {name} span: {spans:#?}");
        found[0].clone()
    };
    let root = by_name(root_name);
    assert_eq!(
        hex(&root.parent_span_id),
        "00f067aa0ba902b7",
        "the client's span is the parent"
    );
    assert_eq!(
        attributes(&root).get("request_id").map(String::as_str),
        Some("xp-trace-1")
    );
    let mut previous_end = root.start_time_unix_nano;
    for name in stages {
        let span = by_name(name);
        assert_eq!(
            span.parent_span_id, root.span_id,
            "{name} is a child of the request span"
        );
        assert!(
            span.start_time_unix_nano >= previous_end,
            "{name} starts after the stage before it ended: {spans:#?}"
        );
        assert!(
            span.end_time_unix_nano <= root.end_time_unix_nano,
            "{name}: {spans:#?}"
        );
        previous_end = span.end_time_unix_nano;
    }
    let routing = attributes(&by_name("routing"));
    assert_eq!(
        routing.get("worker").map(String::as_str),
        Some(format!("http://127.0.0.1:{port}").as_str()),
        "{routing:?}"
    );
    for estimate in ["reason", "prompt_tokens", "cached_tokens", "est_ttft_s"] {
        assert!(routing.contains_key(estimate), "{estimate}: {routing:?}");
    }
    // The worker continues the trace under the request span (Envoy makes the upstream call).
    assert_eq!(
        routed["traceparent"],
        format!("00-{trace_id}-{}-01", hex(&root.span_id)),
        "{routed:?}"
    );

    // One JSON access line, as over HTTP, with the request id.
    let access_line = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|l| l["target"] == "kinference_gateway::access_log")
    };
    support::wait_for("the access line", || {
        let written = access_line().is_some();
        async move { written }
    })
    .await;
    let access = access_line().expect("the access line");
    let fields = &access["fields"];
    assert_eq!(fields["request_id"], "xp-trace-1", "{access}");
    assert_eq!(fields["status"], 200, "{access}");
    assert_eq!(fields["path"], "/v1/chat/completions", "{access}");
    assert_eq!(fields["model"], MODEL, "{access}");
    assert_eq!(
        fields["backend"],
        format!("http://127.0.0.1:{port}").as_str(),
        "{access}"
    );
    assert_eq!(fields["output_tokens"], 2, "{access}");
    assert_eq!(access["span"]["request_id"], "xp-trace-1", "{access}");
}

/// A routed stream a proxy leaves open and silent gives its in-flight slot back after the idle
/// timeout, and the port holds no more connections than its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_is_closed_and_its_slot_given_back() {
    let (_worker, port) = start_worker().await;
    let scratch = support::TempDir::new("extproc-idle");
    let config = one_worker_config(&scratch.0, port, "");
    let xp = free_port();
    let (_gateway, _api, admin) = support::start_gateway(
        &config,
        &[
            &format!("--extproc-listen=127.0.0.1:{xp}"),
            "--max-in-flight=1",
            "--overload-queue=0",
            "--extproc-idle-timeout-seconds=2",
            "--extproc-max-connections=2",
        ],
    )
    .await;
    let addr = SocketAddr::from(([127, 0, 0, 1], xp));
    let mut client = connect(addr).await;
    let path = "/v1/chat/completions";

    // Routed, then silent: it holds the only slot, so the next request is shed.
    let mut silent = Stream::open(&mut client).await;
    routed_worker(decide_on(&mut silent, path, &chat_body("silent")).await);
    match ask(&mut client, path, &chat_body("shed")).await {
        Outcome::Local { status, .. } => assert_eq!(status, 503),
        other => panic!("expected 503 while the slot is held, got {other:?}"),
    }
    // Past the idle timeout the handler closes it: the slot is free again.
    let closed = tokio::time::timeout(Duration::from_secs(10), silent.rx.message())
        .await
        .expect("closed within the idle timeout");
    assert!(closed.is_err() || matches!(closed, Ok(None)), "{closed:?}");
    support::wait_for("the slot given back", || async {
        support::metric(admin, "kinference_gateway_overload_in_flight").await == 0.0
    })
    .await;
    routed_worker(ask(&mut client, path, &chat_body("after")).await);

    // Two connections at most: a third is closed by the handler (its call fails).
    let _second = connect(addr).await;
    let third = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await;
    let refused = match third {
        Err(_) => true,
        Ok(channel) => {
            let mut c = ExternalProcessorClient::new(channel);
            let (tx, rx) = mpsc::channel(1);
            drop(tx);
            c.process(ReceiverStream::new(rx)).await.is_err()
        }
    };
    assert!(
        refused,
        "a connection past --extproc-max-connections is closed"
    );
}

/// Through Envoy, a worker started with vLLM's `--api-key` gets the gateway's worker key in place of
/// the client's own credentials, which never reach it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_gets_the_pools_key_never_the_clients() {
    let Some(sim) = support::vllm_sim_binary() else {
        return;
    };
    let (_worker, port) = support::spawn_vllm_sim_with(
        &sim,
        MODEL,
        &["--preset", "fast", "--api-key", "sk-worker-only"],
    );
    support::wait_until_ok(port, "/health").await;
    let scratch = support::TempDir::new("extproc-worker-key");
    std::fs::write(scratch.0.join("worker.key"), "sk-worker-only\n").expect("key file");
    let config = one_worker_config(
        &scratch.0,
        port,
        &format!(
            "worker_api_key: {{file: \"{}\"}}\n",
            scratch.0.join("worker.key").display()
        ),
    );
    let xp = free_port();
    let (_gateway, _api, _admin) =
        support::start_gateway(&config, &[&format!("--extproc-listen=127.0.0.1:{xp}")]).await;
    let mut envoy = support::envoy::Envoy::connect(SocketAddr::from(([127, 0, 0, 1], xp))).await;
    let body = json!({"model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hello"}]})
    .to_string();
    // The client sends its own credentials (a tenant key a gateway without tenants ignores).
    let answer = envoy
        .request(
            "POST",
            "/v1/chat/completions",
            &[
                ("authorization", "Bearer sk-client-secret"),
                ("x-api-key", "sk-client-secret"),
            ],
            body.as_bytes(),
        )
        .await;
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
}
