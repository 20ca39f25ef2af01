//! Kinference as the endpoint picker of a Gateway API Inference Extension `InferencePool`, seen
//! from the proxy: the ext_proc handler on loopback gRPC, driven by `support::envoy` (Envoy's
//! message sequences per processing mode, replayed from its ext_proc protos and docs), in front of
//! in-test HTTP workers that record what they receive.
//!
//! The protocol matrix (mode x phase x outcome):
//! - `FULL_DUPLEX_STREAMED` (the picker's mode): the headers are answered with the route once the
//!   body is read, the body goes back as streamed chunks (rewritten: the model an alias resolved
//!   to, `stream_options.include_usage`), the answer's chunks come back through the relay (the
//!   usage chunk the client did not ask for taken out) and the stream is billed its real usage; a
//!   body ended by trailers, a body larger than one streamed chunk, and both response settings;
//! - `BUFFERED` and `STREAMED`, the same request to the same outcome; trailers after a `BUFFERED`
//!   body still route; after a `STREAMED` body they cannot (a local 500 says how to configure it),
//!   as with body mode `NONE`;
//! - the subset hint (only its endpoints; none eligible or an empty list: 503), the fallback list
//!   walked by the proxy when the first endpoint is down, the served endpoint reported back;
//! - failure modes: a processor that cannot be reached is Envoy's 500 under `FailClose` and the
//!   proxy's own endpoint under `FailOpen`; a refusal is an answer, not a failure, so `FailOpen`
//!   never bypasses it;
//! - a client that goes away mid-body or mid-answer: its slot, ticket and body room come back.
//!
//! Ported from the standard's conformance suite (the picker's side of each): `GatewayFollowingEPPRouting`
//! (the proxy goes where the header and metadata say, the same value in both),
//! `GatewayDestinationEndpointServed` (the served endpoint is read back), `EppUnAvailableFailOpen`.
//! The others check a Gateway's own status and HTTPRoute handling, which needs a Gateway.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as PReq;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as PResp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Struct, Value as ProtoValue};
use http_body_util::{BodyExt, Full};
use kinference_gateway::extproc::{self, Settings};
use kinference_gateway::gateway::{Gateway, Parts};
use kinference_gateway::policy::stage::PolicyStage;
use kinference_gateway::routing::{ModelConfig, Router, RoutingConfig, RoutingMode, WorkerConfig};
use kinference_gateway::tenancy::{Tenancy, TenancyConfig};
use serde_json::{Value, json};
use testkit::{free_port, tokenizer_dir};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

mod support;

use support::envoy::{BodyMode, Envoy, FailureMode, ResponsePhase};

const MODEL: &str = "qwen2-sim";
const KEY: &str = "sk-acme-picker-0123456789abcdef";

// ---------------------------------------------------------------------------------------------
// Harness

/// An in-test worker: answers chat completions (a stream of two words then, when asked, the
/// usage chunk; or one JSON answer) and keeps the body of every request (POST) it received.
struct Worker {
    port: u16,
    received: Arc<Mutex<Vec<Value>>>,
}

impl Worker {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let received = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&received);
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let seen = Arc::clone(&seen);
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let seen = Arc::clone(&seen);
                        async move { Ok::<_, std::convert::Infallible>(answer(req, &seen).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
                });
            }
        });
        Worker { port, received }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn last(&self) -> Option<Value> {
        self.received.lock().unwrap().last().cloned()
    }
}

async fn answer(
    req: hyper::Request<hyper::body::Incoming>,
    seen: &Mutex<Vec<Value>>,
) -> hyper::Response<Full<Bytes>> {
    let post = req.method() == hyper::Method::POST;
    let bytes = req.into_body().collect().await.expect("body").to_bytes();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if post {
        // Requests only (the gateway may also probe `GET /health`).
        seen.lock().unwrap().push(body.clone());
    }
    let usage = json!({"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12});
    if body["stream"] == true {
        let mut sse = String::new();
        for word in ["hello", " there"] {
            let chunk = json!({"id": "c", "object": "chat.completion.chunk", "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": null}]});
            sse.push_str(&format!("data: {chunk}\n\n"));
        }
        if body["stream_options"]["include_usage"] == true {
            let chunk = json!({"id": "c", "object": "chat.completion.chunk", "model": MODEL,
                "choices": [], "usage": usage});
            sse.push_str(&format!("data: {chunk}\n\n"));
        }
        sse.push_str("data: [DONE]\n\n");
        return hyper::Response::builder()
            .header("content-type", "text/event-stream")
            .body(Full::new(Bytes::from(sse)))
            .expect("response");
    }
    let whole = json!({"id": "c", "object": "chat.completion", "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello there"},
                     "finish_reason": "stop"}], "usage": usage});
    hyper::Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(whole.to_string())))
        .expect("response")
}

/// The picker: an in-process handler on loopback over `workers` (their URLs, which a pool names),
/// governed by tenant `acme` and a model with alias `sim-alias`.
struct Picker {
    addr: SocketAddr,
    gw: Arc<Gateway>,
    tenancy: Arc<Tenancy>,
    _scratch: support::TempDir,
}

async fn picker(name: &str, workers: &[String], settings: Settings, mode: RoutingMode) -> Picker {
    let scratch = support::TempDir::new(name);
    let dir = &scratch.0;
    // Tenant `acme`, generous limits.
    std::fs::write(
        dir.join("tenants.yaml"),
        "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {name: acme}\nspec:\n  apiKeys:\n    - secretRef: {name: acme, key: api-key}\n  limits:\n    requestsPerMinute: 1000\n",
    )
    .expect("tenants");
    std::fs::create_dir_all(dir.join("secrets/acme")).expect("secrets");
    std::fs::write(dir.join("secrets/acme/api-key"), KEY).expect("key");
    let mut registry = prometheus_client::registry::Registry::default();
    let tenancy = Tenancy::start(
        TenancyConfig {
            tenants_dir: Some(dir.join("tenants.yaml")),
            secrets_dir: Some(dir.join("secrets")),
            usage_journal: Some(dir.join("usage.jsonl")),
            ..TenancyConfig::default()
        },
        &dir.join("gateway.yaml"),
        None,
        vec![MODEL.into()],
        &mut registry,
    )
    .expect("tenancy");
    // The model (with an alias) and a pool of the workers.
    let endpoints: Vec<String> = workers
        .iter()
        .map(|u| format!("{{url: \"{u}\"}}"))
        .collect();
    let policies = dir.join("policies");
    std::fs::create_dir_all(&policies).expect("policies");
    std::fs::write(
        policies.join("all.yaml"),
        format!(
            "apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {{name: {MODEL}}}
spec:
  servedName: {MODEL}
  aliases: [sim-alias]
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
",
            tok = tokenizer_dir().display(),
            endpoints = endpoints.join(", "),
        ),
    )
    .expect("policy");
    let source = kinference_gateway::config_source::files::start(policies, Duration::from_secs(60))
        .expect("policy directory");
    let policy = PolicyStage::start(source.into_policy_sets(), Duration::from_secs(60));
    let router = Router::new(RoutingConfig {
        workers: workers
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
        mode,
        ..Default::default()
    })
    .expect("router");
    let gw = Gateway::assemble(
        Arc::new(router),
        Parts {
            tenancy: Some(Arc::clone(&tenancy)),
            policy: Some(policy),
            models: vec![MODEL.into()],
            ..Parts::default()
        },
    )
    .expect("gateway");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let handler = extproc::Handler::new(Arc::clone(&gw), settings);
    tokio::spawn(async move {
        let _ = extproc::serve_handler(listener, handler, std::future::pending()).await;
    });
    Picker {
        addr,
        gw,
        tenancy,
        _scratch: scratch,
    }
}

impl Picker {
    /// Tenant `acme`'s usage report once it counts `requests` requests.
    async fn report(&self, requests: u64) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let report = self
                .tenancy
                .usage_report("tenant=acme", None)
                .await
                .expect("report");
            if report["total"]["requests"] == requests || Instant::now() > deadline {
                return report;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until nothing is held: no router ticket, no admission slot, no body room.
    async fn until_idle(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let tickets: usize = self.gw.router.workers().iter().map(|w| w.in_flight).sum();
            let held = (
                tickets,
                self.gw.overload.in_flight(),
                self.gw.overload.body_bytes_held(),
            );
            if held == (0, 0, 0) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "still held (tickets, slots, body bytes): {held:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn auth() -> String {
    format!("Bearer {KEY}")
}

fn chat(model: &str, stream: bool, text: &str) -> Vec<u8> {
    json!({"model": model, "stream": stream, "max_tokens": 8,
        "messages": [{"role": "user", "content": text}]})
    .to_string()
    .into_bytes()
}

/// An Envoy in `mode` (response phase shown) in front of the picker at `addr`.
async fn envoy(addr: SocketAddr, mode: BodyMode) -> Envoy {
    let mut envoy = Envoy::connect(addr).await;
    envoy.body_mode = mode;
    envoy
}

// ---------------------------------------------------------------------------------------------
// The picker's mode

#[tokio::test]
async fn full_duplex_routes_rewrites_the_body_and_bills_the_stream() {
    let workers = [Worker::start().await, Worker::start().await];
    let urls: Vec<String> = workers.iter().map(Worker::url).collect();
    let p = picker(
        "picker-duplex",
        &urls,
        Settings::default(),
        RoutingMode::Kinference,
    )
    .await;
    let mut envoy = envoy(p.addr, BodyMode::FullDuplex).await;
    let bearer = auth();
    let headers = [("authorization", bearer.as_str())];

    // An alias, a stream that does not ask for its usage, a prompt longer than one streamed chunk.
    let long = "parcel route depot ".repeat(4_000);
    let body = chat("sim-alias", true, &long);
    assert!(body.len() > extproc::reply::STREAMED_CHUNK_BYTES);
    let answer = envoy
        .request("POST", "/v1/chat/completions", &headers, &body)
        .await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let destination = answer.destination.clone().expect("routed");
    let worker = workers
        .iter()
        .find(|w| w.endpoint() == destination)
        .expect("the destination is a worker of the pool");
    assert_eq!(answer.served.as_deref(), Some(destination.as_str()));
    // What the worker got: the served model, the usage asked for, the prompt whole.
    let sent = worker.last().expect("the worker got the request");
    assert_eq!(sent["model"], MODEL, "{sent}");
    assert_eq!(sent["stream_options"]["include_usage"], true, "{sent}");
    assert_eq!(sent["messages"][0]["content"], long.as_str());
    // What the client got: the words, not the usage chunk it never asked for.
    let text = String::from_utf8_lossy(&answer.body);
    assert!(text.contains("hello") && text.contains(" there"), "{text}");
    assert!(!text.contains("\"usage\""), "{text}");
    assert!(answer.headers.contains_key("x-request-id"));
    // Billed the usage the worker reported, not an estimate.
    p.until_idle().await;
    let report = p.report(1).await;
    assert_eq!(report["total"]["requests"], 1, "{report}");
    assert_eq!(report["total"]["output_tokens"], 3, "{report}");

    // The same, ended by trailers (a client that sends them), and without the response phase.
    envoy.trailers = true;
    envoy.response_phase = ResponsePhase::Skipped;
    let answer = envoy
        .request(
            "POST",
            "/v1/chat/completions",
            &headers,
            &chat(MODEL, false, "hi"),
        )
        .await;
    assert_eq!(answer.status, 200);
    let destination = answer.destination.expect("routed");
    let sent = workers
        .iter()
        .find(|w| w.endpoint() == destination)
        .and_then(Worker::last)
        .expect("the worker got it");
    assert_eq!(sent["messages"][0]["content"], "hi", "{sent}");
    p.until_idle().await;
    let report = p.report(2).await;
    assert_eq!(report["total"]["requests"], 2, "{report}");
}

#[tokio::test]
async fn every_body_mode_gives_the_same_outcome() {
    let worker = Worker::start().await;
    let p = picker(
        "picker-modes",
        &[worker.url()],
        Settings::default(),
        RoutingMode::Kinference,
    )
    .await;
    let bearer = auth();
    let headers = [("authorization", bearer.as_str())];
    let mut billed = 0;
    for mode in [BodyMode::Buffered, BodyMode::Streamed, BodyMode::FullDuplex] {
        for phase in [ResponsePhase::Streamed, ResponsePhase::Skipped] {
            for stream in [false, true] {
                let mut envoy = envoy(p.addr, mode).await;
                envoy.response_phase = phase;
                let answer = envoy
                    .request(
                        "POST",
                        "/v1/chat/completions",
                        &headers,
                        &chat("sim-alias", stream, "route me"),
                    )
                    .await;
                let case = format!("{mode:?} {phase:?} stream={stream}");
                assert_eq!(answer.status, 200, "{case}");
                assert_eq!(
                    answer.destination.as_deref(),
                    Some(worker.endpoint().as_str()),
                    "{case}"
                );
                let sent = worker.last().expect("received");
                assert_eq!(sent["model"], MODEL, "{case}: {sent}");
                assert_eq!(sent["messages"][0]["content"], "route me", "{case}");
                if stream {
                    assert_eq!(sent["stream_options"]["include_usage"], true, "{case}");
                }
                assert!(
                    String::from_utf8_lossy(&answer.body).contains("hello"),
                    "{case}"
                );
                billed += 1;
                p.until_idle().await;
                let report = p.report(billed).await;
                assert_eq!(report["total"]["requests"], billed, "{case}: {report}");
            }
        }
    }
    // A refusal is the same local reply in every mode, before the body is read.
    for mode in [BodyMode::Buffered, BodyMode::Streamed, BodyMode::FullDuplex] {
        let mut envoy = envoy(p.addr, mode).await;
        let answer = envoy
            .request(
                "POST",
                "/v1/chat/completions",
                &[],
                &chat(MODEL, false, "x"),
            )
            .await;
        assert_eq!(answer.status, 401, "{mode:?}");
        assert_eq!(answer.destination, None);
    }
    p.until_idle().await;
}

// ---------------------------------------------------------------------------------------------
// Subset hint, fallback list, served endpoint

#[tokio::test]
async fn the_subset_hint_bounds_the_pick_and_an_empty_one_is_503() {
    let workers = [
        Worker::start().await,
        Worker::start().await,
        Worker::start().await,
    ];
    let urls: Vec<String> = workers.iter().map(Worker::url).collect();
    let p = picker(
        "picker-subset",
        &urls,
        Settings::default(),
        RoutingMode::RoundRobin,
    )
    .await;
    let mut envoy = envoy(p.addr, BodyMode::FullDuplex).await;
    let bearer = auth();
    let headers = [("authorization", bearer.as_str())];
    let path = "/v1/chat/completions";

    // Round robin would visit every worker; the subset keeps it on the one named.
    envoy.subset = Some(vec![workers[1].endpoint()]);
    for i in 0..4 {
        let answer = envoy
            .request(
                "POST",
                path,
                &headers,
                &chat(MODEL, false, &format!("q{i}")),
            )
            .await;
        assert_eq!(answer.status, 200);
        assert_eq!(
            answer.destination,
            Some(workers[1].endpoint()),
            "request {i}"
        );
    }
    // Two of three named (one as `ip:port`, one not in the pool): only the named pool member.
    envoy.subset = Some(vec![workers[2].endpoint(), "10.9.9.9:8000".into()]);
    for i in 0..3 {
        let answer = envoy
            .request(
                "POST",
                path,
                &headers,
                &chat(MODEL, false, &format!("r{i}")),
            )
            .await;
        assert_eq!(
            answer.destination,
            Some(workers[2].endpoint()),
            "request {i}"
        );
    }
    // None eligible, or an empty list: the standard's 503, nothing held.
    for subset in [vec!["10.9.9.9:8000".to_string()], vec![]] {
        envoy.subset = Some(subset.clone());
        let answer = envoy
            .request("POST", path, &headers, &chat(MODEL, false, "none"))
            .await;
        assert_eq!(answer.status, 503, "{subset:?}: {:?}", answer.body);
        assert_eq!(answer.destination, None);
    }
    p.until_idle().await;
}

#[tokio::test]
async fn the_proxy_walks_the_fallback_list_when_the_first_endpoint_is_down() {
    let alive = Worker::start().await;
    // A worker the router believes healthy whose port takes no connection.
    let down = format!("http://127.0.0.1:{}", free_port());
    let settings = Settings {
        fallback_endpoints: 1,
        ..Settings::default()
    };
    let p = picker(
        "picker-fallback",
        &[alive.url(), down.clone()],
        settings,
        RoutingMode::LeastOutstanding,
    )
    .await;
    let bearer = auth();
    let headers = [("authorization", bearer.as_str())];

    // A request held open on the live worker (the subset hint puts it there) makes the down one
    // the least loaded: chosen first.
    let mut hold = raw_stream(p.addr).await;
    let mut held = headers_message(
        BodySendMode::FullDuplexStreamed,
        &[("authorization", &bearer)],
    );
    held.metadata_context = Some(Metadata {
        filter_metadata: HashMap::from([(
            "envoy.lb.subset_hint".to_string(),
            Struct {
                fields: HashMap::from([(
                    "x-gateway-destination-endpoint-subset".to_string(),
                    ProtoValue {
                        kind: Some(Kind::StringValue(alive.endpoint())),
                    },
                )]),
            },
        )]),
        ..Default::default()
    });
    hold.tx.send(held).await.unwrap();
    hold.tx
        .send(body_message(&chat(MODEL, false, "hold"), true))
        .await
        .unwrap();
    let routed = hold.next().await.expect("the held request is routed");
    assert!(matches!(routed.response, Some(PResp::RequestHeaders(_))));

    let mut envoy = envoy(p.addr, BodyMode::FullDuplex).await;
    let answer = envoy
        .request(
            "POST",
            "/v1/chat/completions",
            &headers,
            &chat(MODEL, false, "fallback"),
        )
        .await;
    let list = answer.destination.clone().expect("routed");
    let down_endpoint = down.trim_start_matches("http://").to_string();
    assert_eq!(list, format!("{down_endpoint},{}", alive.endpoint()));
    // Envoy's retry went down the list: the live worker served, and said so in the response phase.
    assert_eq!(answer.status, 200);
    assert_eq!(answer.served, Some(alive.endpoint()));
    drop(hold);
    p.until_idle().await;
}

// ---------------------------------------------------------------------------------------------
// Failure modes

#[tokio::test]
async fn fail_open_forwards_without_the_picker_and_fail_close_is_500() {
    let worker = Worker::start().await;
    // No picker listens here.
    let nowhere = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut envoy = Envoy::lazy(nowhere);
    let body = chat(MODEL, false, "no picker");
    let answer = envoy
        .request("POST", "/v1/chat/completions", &[], &body)
        .await;
    assert!(answer.processor_failed);
    assert_eq!(answer.status, 500, "FailClose drops the request");
    assert!(worker.last().is_none());

    envoy.failure_mode = FailureMode::FailOpen(worker.endpoint());
    let answer = envoy
        .request("POST", "/v1/chat/completions", &[], &body)
        .await;
    assert!(answer.processor_failed);
    assert_eq!(
        answer.status, 200,
        "FailOpen forwards to the proxy's own pick"
    );
    assert_eq!(worker.last().expect("forwarded")["model"], MODEL);

    // With the picker up, a refusal is its answer, not a failure: FailOpen does not get past it.
    let p = picker(
        "picker-failopen",
        &[worker.url()],
        Settings::default(),
        RoutingMode::Kinference,
    )
    .await;
    let mut envoy = Envoy::lazy(p.addr);
    envoy.failure_mode = FailureMode::FailOpen(worker.endpoint());
    let before = worker.received.lock().unwrap().len();
    let answer = envoy
        .request("POST", "/v1/chat/completions", &[], &body)
        .await;
    assert!(!answer.processor_failed);
    assert_eq!(answer.status, 401);
    assert_eq!(worker.received.lock().unwrap().len(), before);
}

// ---------------------------------------------------------------------------------------------
// Raw sequences: what the client above cannot say

/// One `Process` stream, driven message by message.
struct Raw {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Raw {
    async fn next(&mut self) -> Option<ProcessingResponse> {
        tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("an answer within 10 s")
            .expect("the stream holds")
    }
}

async fn raw_stream(addr: SocketAddr) -> Raw {
    let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let (tx, rx) = mpsc::channel(16);
    let rx = client
        .process(ReceiverStream::new(rx))
        .await
        .expect("Process")
        .into_inner();
    Raw { tx, rx }
}

fn headers_message(mode: BodySendMode, extra: &[(&str, &str)]) -> ProcessingRequest {
    let mut headers = vec![
        pb(":method", "POST"),
        pb(":path", "/v1/chat/completions"),
        pb(":authority", "inference.example"),
        pb("content-type", "application/json"),
    ];
    headers.extend(extra.iter().map(|(k, v)| pb(k, v)));
    ProcessingRequest {
        request: Some(PReq::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream: false,
            ..Default::default()
        })),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: mode as i32,
            send_body_without_waiting_for_header_response: mode == BodySendMode::FullDuplexStreamed,
        }),
        ..Default::default()
    }
}

fn body_message(body: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(PReq::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn trailers_message() -> ProcessingRequest {
    ProcessingRequest {
        request: Some(PReq::RequestTrailers(HttpTrailers::default())),
        ..Default::default()
    }
}

fn pb(key: &str, value: &str) -> HeaderValue {
    HeaderValue {
        key: key.to_string(),
        raw_value: value.as_bytes().to_vec(),
        ..Default::default()
    }
}

fn immediate_status(answer: &ProcessingResponse) -> Option<i32> {
    match &answer.response {
        Some(PResp::ImmediateResponse(ir)) => ir.status.as_ref().map(|s| s.code),
        _ => None,
    }
}

#[tokio::test]
async fn modes_that_cannot_carry_the_route_are_refused_and_trailers_end_a_buffered_body() {
    let worker = Worker::start().await;
    let p = picker(
        "picker-raw",
        &[worker.url()],
        Settings::default(),
        RoutingMode::Kinference,
    )
    .await;
    let bearer = auth();
    let key = [("authorization", bearer.as_str())];
    let body = chat(MODEL, false, "raw");

    // Body mode NONE: the body never comes; refused at the headers (500, the proxy's setting).
    let mut s = raw_stream(p.addr).await;
    s.tx.send(headers_message(BodySendMode::None, &key))
        .await
        .unwrap();
    let answer = s.next().await.expect("answer");
    assert_eq!(immediate_status(&answer), Some(500), "{answer:?}");

    // BUFFERED, trailers after the body: the one body message is the whole body; routed on it.
    let mut s = raw_stream(p.addr).await;
    s.tx.send(headers_message(BodySendMode::Buffered, &key))
        .await
        .unwrap();
    assert!(matches!(
        s.next().await.and_then(|a| a.response),
        Some(PResp::RequestHeaders(_))
    ));
    s.tx.send(body_message(&body, false)).await.unwrap();
    let routed = s.next().await.expect("answer");
    assert!(
        matches!(routed.response, Some(PResp::RequestBody(_))) && routed.dynamic_metadata.is_some(),
        "{routed:?}"
    );
    s.tx.send(trailers_message()).await.unwrap();
    assert!(matches!(
        s.next().await.and_then(|a| a.response),
        Some(PResp::RequestTrailers(_))
    ));
    drop(s);

    // STREAMED, trailers after chunks: the chunks are answered already; a 500 says so.
    let mut s = raw_stream(p.addr).await;
    s.tx.send(headers_message(BodySendMode::Streamed, &key))
        .await
        .unwrap();
    s.next().await.expect("headers answered");
    s.tx.send(body_message(&body[..10], false)).await.unwrap();
    s.next().await.expect("chunk taken");
    s.tx.send(body_message(&body[10..], false)).await.unwrap();
    s.next().await.expect("chunk taken");
    s.tx.send(trailers_message()).await.unwrap();
    let answer = s.next().await.expect("answer");
    assert_eq!(immediate_status(&answer), Some(500), "{answer:?}");

    // FULL_DUPLEX, a request that ends before its body (an empty last chunk): the client's 400.
    let mut s = raw_stream(p.addr).await;
    s.tx.send(headers_message(BodySendMode::FullDuplexStreamed, &key))
        .await
        .unwrap();
    s.tx.send(body_message(b"", true)).await.unwrap();
    let answer = s.next().await.expect("answer");
    assert_eq!(immediate_status(&answer), Some(400), "{answer:?}");
    drop(s);
    p.until_idle().await;
}

#[tokio::test]
async fn a_client_gone_mid_body_or_mid_answer_gives_everything_back() {
    let worker = Worker::start().await;
    let p = picker(
        "picker-gone",
        &[worker.url()],
        Settings::default(),
        RoutingMode::Kinference,
    )
    .await;
    let bearer = auth();
    let key = [("authorization", bearer.as_str())];
    let body = chat(MODEL, true, "going away");

    // Mid-body: headers and half the body, then Envoy closes the stream (the client reset).
    let s = raw_stream(p.addr).await;
    s.tx.send(headers_message(BodySendMode::FullDuplexStreamed, &key))
        .await
        .unwrap();
    s.tx.send(body_message(&body[..body.len() / 2], false))
        .await
        .unwrap();
    // Full duplex answers nothing before the body ends; the admission slot is held meanwhile.
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.gw.overload.in_flight() == 0 {
        assert!(Instant::now() < deadline, "the request was never admitted");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(s);
    p.until_idle().await;

    // Mid-answer: routed, the response begun, then the stream closes.
    let mut s = raw_stream(p.addr).await;
    s.tx.send(headers_message(BodySendMode::FullDuplexStreamed, &key))
        .await
        .unwrap();
    s.tx.send(body_message(&body, true)).await.unwrap();
    let routed = s.next().await.expect("routed");
    assert!(matches!(routed.response, Some(PResp::RequestHeaders(_))));
    s.next().await.expect("the body chunk");
    let tickets: usize = p.gw.router.workers().iter().map(|w| w.in_flight).sum();
    assert_eq!(tickets, 1, "the routed request holds its ticket");
    s.tx.send(ProcessingRequest {
        request: Some(PReq::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    pb(":status", "200"),
                    pb("content-type", "text/event-stream"),
                ],
            }),
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    s.next().await.expect("response headers answered");
    s.tx.send(ProcessingRequest {
        request: Some(PReq::ResponseBody(HttpBody {
            body: b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n"
                .to_vec(),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    let chunk = s.next().await.expect("the chunk passed on");
    assert!(matches!(chunk.response, Some(PResp::ResponseBody(_))));
    drop(s);
    p.until_idle().await;
}
