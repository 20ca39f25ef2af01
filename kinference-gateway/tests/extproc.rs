//! The ext_proc inference handler driven exactly as Envoy drives it: one `Process` stream per HTTP
//! request, `request_headers` then `request_body` (and the response phase), with a tonic client built
//! from the `envoy-types` crate.
//!
//! - The real `kinference-gateway` binary with `--extproc-listen`, in front of real `vllm-sim` workers
//!   (from `$KINFERENCE_BIN_DIR` or the target directory; an in-test HTTP worker when it is not built):
//!   for the same request and the same cluster state the handler picks the worker the gateway's own
//!   HTTP path picks, in both directions (a prefix warmed by either is found by the other).
//! - In-process, on one router: 503 without a ready worker, 400 for a malformed body, 404 for an
//!   unknown model, 429 when shedding, streamed bodies, and the in-flight ticket released by the
//!   response's end or by the stream's end (never leaked).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
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
use kinference_gateway::policy::stage::{PolicyStage, StageSettings};
use kinference_gateway::routing::{ModelConfig, Router, RoutingConfig, WorkerConfig};
use kinference_gateway::tenancy::{Tenancy, TenancyConfig};
use serde_json::{Value, json};
use testkit::{ChildGuard, free_port, tokenizer_dir};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

const MODEL: &str = "qwen2-sim";

// ---------------------------------------------------------------------------------------------
// Harness

/// `vllm-sim` from `$KINFERENCE_BIN_DIR`, else next to this package's binaries; without it the in-test
/// worker stands in (under `CI=true` that is a failure: the real simulator must run there).
fn vllm_sim() -> Option<PathBuf> {
    let p = testkit::bin_dir().join("vllm-sim");
    testkit::require(
        p.exists(),
        "vllm-sim",
        format_args!("{} not built; an in-test worker stands in", p.display()),
    )
    .then_some(p)
}

async fn wait_http(url: &str, timeout: Duration) {
    let client = http_client();
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(uri) = url.parse::<http::Uri>()
            && let Ok(r) = client.get(uri).await
            && r.status().is_success()
        {
            return;
        }
        assert!(Instant::now() < deadline, "{url} not up within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn http_client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A worker: `vllm-sim` when built, else a tiny in-test OpenAI server (the routing does not depend on
/// what the worker answers, only on the gateway's view).
enum Worker {
    Sim(#[allow(dead_code)] ChildGuard),
    InTest(#[allow(dead_code)] tokio::task::JoinHandle<()>),
}

async fn start_worker(port: u16) -> Worker {
    if let Some(bin) = vllm_sim() {
        let child = Command::new(bin)
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--model",
                MODEL,
            ])
            .args(["--preset", "fast", "--tokenizer-dir"])
            .arg(tokenizer_dir())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start vllm-sim");
        let guard = ChildGuard(child);
        wait_http(
            &format!("http://127.0.0.1:{port}/health"),
            Duration::from_secs(60),
        )
        .await;
        Worker::Sim(guard)
    } else {
        eprintln!("vllm-sim not built: using an in-test worker on port {port}");
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind worker");
        Worker::InTest(tokio::spawn(tiny_worker(listener)))
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
        self.tx.send(msg).await.expect("send");
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
    Routed { endpoint: String, worker: String },
    Local { status: i32, body: Value },
}

/// Sends headers then the body (one buffered chunk) and reads the decision from the body answer.
async fn decide_on(stream: &mut Stream, path: &str, body: &[u8]) -> Outcome {
    let first = stream.send(request_headers(path)).await;
    assert!(
        matches!(first.response, Some(PResp::RequestHeaders(_))),
        "headers are acknowledged: {first:?}"
    );
    outcome(stream.send(request_body(body, true)).await)
}

fn outcome(answer: ProcessingResponse) -> Outcome {
    match answer.response {
        Some(PResp::RequestBody(b)) => {
            let set = b
                .response
                .and_then(|c| c.header_mutation)
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
    assert!(
        matches!(first.response, Some(PResp::RequestHeaders(_))),
        "headers are acknowledged: {first:?}"
    );
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
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut workers = Vec::new();
    for p in &ports {
        workers.push(start_worker(*p).await);
    }
    let dir = std::env::temp_dir().join(format!("kinference-extproc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let config = dir.join("gateway.yaml");
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
    let (api, admin, xp) = (free_port(), free_port(), free_port());
    let gateway = ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_kinference-gateway"))
            .arg(format!("--listen=127.0.0.1:{api}"))
            .arg(format!("--admin-listen=127.0.0.1:{admin}"))
            .arg(format!("--extproc-listen=127.0.0.1:{xp}"))
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .expect("start gateway"),
    );
    wait_http(
        &format!("http://127.0.0.1:{admin}/readyz"),
        Duration::from_secs(60),
    )
    .await;
    let mut client = connect(SocketAddr::from(([127, 0, 0, 1], xp))).await;
    let http = http_client();

    for round in 0..3 {
        // Warmed through the HTTP gateway: the handler finds the same worker.
        let body = chat_body(&format!("http{round}x"));
        let by_gateway = gateway_pick(&http, api, &body).await;
        let Outcome::Routed {
            endpoint: ep,
            worker,
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
    let _ = std::fs::remove_dir_all(dir);
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
                })
                .collect(),
            models: vec![ModelConfig {
                name: MODEL.into(),
                tokenizer_dir: Some(tokenizer_dir()),
                serves_messages: false,
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
    let handler = extproc::Handler::new(Arc::clone(&router), settings)
        .with_governance(gov.tenancy, gov.policy);
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

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kinference-extproc-{tag}-{}-{:x}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Tenant `acme` (one request per minute) with its key in a mounted-secret layout.
fn tenancy(dir: &std::path::Path) -> Arc<Tenancy> {
    let tenants = dir.join("tenants.yaml");
    std::fs::write(
        &tenants,
        "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {name: acme}\nspec:\n  apiKeys:\n    - secretRef: {name: acme, key: api-key}\n  limits:\n    requestsPerMinute: 1\n",
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
    let scratch = Scratch::new("tenancy");
    let tenancy = tenancy(&scratch.0);
    let t = Arc::clone(&tenancy);
    let mut h = in_process_with(1, Settings::default(), move |_| Governance {
        tenancy: Some(t),
        policy: None,
    })
    .await;
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
    let deadline = Instant::now() + Duration::from_secs(5);
    let report = loop {
        let report = tenancy
            .usage_report("tenant=acme", None)
            .await
            .expect("report");
        if report["total"]["requests"] == 1 || Instant::now() > deadline {
            break report;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
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
    let scratch = Scratch::new("policy");
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
        let stage = PolicyStage::start(&StageSettings {
            dir: policy_dir.clone(),
            reload_interval: Duration::from_secs(60),
            load_interval: Duration::from_secs(60),
            connect_timeout: Duration::from_millis(200),
        })
        .expect("policy stage");
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
}
