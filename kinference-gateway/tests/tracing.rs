//! Request ids, logs and traces end to end: the real `kinference-gateway` binary in front of a real
//! `vllm-sim` worker, reached through a loopback TCP relay that keeps the bytes the worker was sent.
//!
//! - with `OTEL_EXPORTER_OTLP_ENDPOINT` set, one streamed request exports its trace to an OTLP/gRPC
//!   receiver in this test (and, with `--otlp-protocol http`, to an OTLP/HTTP one): the client's trace id, the root span the child of the client's span, the
//!   stages (authenticate, admit, read, parse, limit, routing with its estimate, upstream, stream) its children in
//!   order, and the worker's `traceparent` naming the upstream span;
//! - the client's `x-request-id` is echoed, reaches the worker, and is in the JSON access line and
//!   the usage record;
//! - without an endpoint the client's `traceparent` reaches the worker unchanged, and an unsafe
//!   `x-request-id` is replaced by one the gateway makes.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::trace::v1::Span;
use testkit::{ChildGuard, free_port, tokenizer_dir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod support;

use support::otlp::{Receiver, attributes, hex};

const MODEL: &str = "trace-model";
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
/// The root span's name (`otel.name`).
const ROOT: &str = "POST /v1/chat/completions";

/// A loopback relay to `upstream` that keeps every byte sent through it (the requests the worker got).
async fn recording_relay(upstream: u16) -> (u16, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let record = Arc::clone(&record);
            tokio::spawn(async move {
                let Ok(mut worker) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    return;
                };
                let (mut client_read, mut client_write) = client.split();
                let (mut worker_read, mut worker_write) = worker.split();
                let up = async {
                    let mut buf = [0u8; 8192];
                    loop {
                        match client_read.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                record.lock().unwrap().extend_from_slice(&buf[..n]);
                                if worker_write.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    let _ = worker_write.shutdown().await;
                };
                let down = async {
                    let _ = tokio::io::copy(&mut worker_read, &mut client_write).await;
                    let _ = client_write.shutdown().await;
                };
                tokio::join!(up, down);
            });
        }
    });
    (port, seen)
}

/// A started gateway in front of one `vllm-sim` worker reached through a recording relay, its
/// config, log and usage journal in a fresh directory.
struct Setup {
    /// The gateway, stopped (dropped) before its directory is removed.
    _gateway: ChildGuard,
    /// The gateway's API port.
    api: u16,
    /// The relay's port: the worker's URL in the gateway's config.
    relay: u16,
    /// The bytes the worker got.
    seen: Arc<Mutex<Vec<u8>>>,
    dir: support::TempDir,
    _sim: ChildGuard,
}

impl Setup {
    /// Starts the worker, its relay and the gateway (with `envs` and `flags`, in directory `name`),
    /// and waits until they serve.
    async fn start(sim: &Path, name: &str, envs: &[(&str, &str)], flags: &[&str]) -> Setup {
        let (sim, port) = support::spawn_vllm_sim(sim, MODEL);
        support::wait_until_ok(port, "/health").await;
        let (relay, seen) = recording_relay(port).await;
        let dir = support::TempDir::new(name);
        let config = write_config(&dir.0, relay);
        let (gateway, api) = gateway(&config, envs, flags, &dir.0.join("gateway.log")).await;
        Setup {
            _gateway: gateway,
            api,
            relay,
            seen,
            dir,
            _sim: sim,
        }
    }

    /// The file of the gateway's log lines (its standard output).
    fn log(&self) -> PathBuf {
        self.dir.0.join("gateway.log")
    }

    /// Everything the worker was sent so far, lower-cased (header names and values).
    fn sent(&self) -> String {
        String::from_utf8_lossy(&self.seen.lock().unwrap()).to_ascii_lowercase()
    }

    /// Waits until the usage journal has a record of `request_id`.
    async fn usage_record_of(&self, request_id: &str) {
        let record = format!(r#""request_id":"{request_id}""#);
        eventually(
            &format!("the usage record with request id {request_id}"),
            || {
                std::fs::read_to_string(self.dir.0.join("usage.jsonl"))
                    .ok()?
                    .contains(&record)
                    .then_some(())
            },
        )
        .await;
    }
}

fn write_config(dir: &Path, worker: u16) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - name: {MODEL}\n    tokenizer_dir: {tokenizer}\nworkers:\n  - url: http://127.0.0.1:{worker}\n    model: {MODEL}\ntenancy:\n  usage_journal: {journal}\n",
            tokenizer = tokenizer_dir().display(),
            journal = dir.join("usage.jsonl").display(),
        ),
    )
    .unwrap();
    config
}

/// Starts the gateway with `envs`, its log lines in `log`; waits until it serves.
async fn gateway(
    config: &Path,
    envs: &[(&str, &str)],
    flags: &[&str],
    log: &Path,
) -> (ChildGuard, u16) {
    let (api, admin) = (free_port(), free_port());
    let mut command = support::gateway_command(config, api, admin);
    command
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_PROTOCOL")
        .env_remove("KINFERENCE_LOG_FORMAT")
        .env_remove("RUST_LOG")
        .stdout(Stdio::from(std::fs::File::create(log).unwrap()));
    for (name, value) in envs {
        command.env(name, value);
    }
    let mut child = ChildGuard(
        command
            .args(flags)
            .spawn()
            .expect("starting kinference-gateway"),
    );
    support::wait_until_ready(&mut child, admin).await;
    (child, api)
}

/// A streamed chat request with `headers`: (status, lower-cased head, body).
async fn stream_chat(api: u16, headers: &[(&str, &str)]) -> (u16, String, String) {
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"tell me about traces"}}],"max_tokens":4,"stream":true}}"#
    );
    support::call(
        "127.0.0.1",
        api,
        "POST",
        "/v1/chat/completions",
        headers,
        &body,
    )
    .await
}

/// Waits (generously) until `ready` holds.
async fn eventually<T>(what: &str, mut ready: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(value) = ready() {
            return value;
        }
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_streamed_request_exports_its_stages_in_the_clients_trace_and_the_worker_continues_it() {
    exports_the_trace(Protocol::Grpc).await;
}

#[tokio::test]
async fn over_otlp_http_the_same_trace_is_exported() {
    exports_the_trace(Protocol::Http).await;
}

/// How the gateway sends its spans to the receiver.
#[derive(Debug, Clone, Copy)]
enum Protocol {
    /// The default: OTLP/gRPC.
    Grpc,
    /// `--otlp-protocol http`: OTLP/HTTP with protobuf bodies.
    Http,
}

/// One streamed request's trace, exported over `protocol` to a receiver in this test: the stages in
/// order in the client's trace, the worker continuing it, the request id in the logs and usage.
async fn exports_the_trace(protocol: Protocol) {
    let Some(sim) = support::vllm_sim_binary() else {
        return;
    };
    let receiver = Receiver::default();
    let (endpoint, flags) = match protocol {
        Protocol::Grpc => (receiver.start().await, vec!["--log-format", "json"]),
        Protocol::Http => (
            receiver.start_http().await,
            vec!["--log-format", "json", "--otlp-protocol", "http"],
        ),
    };
    let setup = Setup::start(
        &sim,
        &format!("tracing-{protocol:?}"),
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
        &flags,
    )
    .await;

    let traceparent = format!("00-{TRACE_ID}-{CLIENT_SPAN}-01");
    let (status, head, body) = stream_chat(
        setup.api,
        &[
            ("traceparent", &traceparent),
            ("x-request-id", "trace-test-1"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("data: [DONE]"), "{body}");
    assert!(head.contains("x-request-id: trace-test-1"), "{head}");

    // The pipeline's stages with a span (`pipeline::STAGES`), in order; forwarding is the router's
    // and the backend's.
    let names = [
        "authenticate",
        "admit",
        "read",
        "parse",
        "limit",
        "routing",
        "upstream",
        "stream",
    ];
    let spans = eventually("the request's spans at the receiver", || {
        let spans = receiver.spans(TRACE_ID);
        let all = [ROOT]
            .iter()
            .chain(names.iter())
            .all(|name| spans.iter().any(|s| s.name == *name));
        all.then_some(spans)
    })
    .await;
    let by_name = |name: &str| -> &Span {
        let found: Vec<&Span> = spans.iter().filter(|s| s.name == name).collect();
        assert_eq!(found.len(), 1, "one {name} span: {spans:#?}");
        found[0]
    };
    let root = by_name(ROOT);
    assert_eq!(
        hex(&root.parent_span_id),
        CLIENT_SPAN,
        "the client's span is the parent"
    );
    assert_eq!(
        attributes(root).get("request_id").map(String::as_str),
        Some("trace-test-1")
    );
    let mut previous_end = root.start_time_unix_nano;
    let stream = by_name("stream");
    assert!(stream.start_time_unix_nano < root.end_time_unix_nano);
    for name in names {
        let span = by_name(name);
        assert_eq!(
            span.parent_span_id, root.span_id,
            "{name} is a child of the request span"
        );
        assert!(
            span.start_time_unix_nano >= previous_end,
            "{name} starts after the stage before it ended: {spans:#?}"
        );
        // The request span ends when the request is settled (its access line), inside the relay's
        // last poll: only the stream span goes on a moment after it.
        if name != "stream" {
            assert!(
                span.end_time_unix_nano <= root.end_time_unix_nano,
                "{name} ends inside the request span: {spans:#?}"
            );
        }
        previous_end = span.end_time_unix_nano;
    }
    let routing = attributes(by_name("routing"));
    let worker_url = format!("http://127.0.0.1:{}", setup.relay);
    assert_eq!(routing.get("worker"), Some(&worker_url), "{routing:?}");
    for estimate in ["reason", "prompt_tokens", "cached_tokens", "est_ttft_s"] {
        assert!(routing.contains_key(estimate), "{estimate}: {routing:?}");
    }
    let stream = attributes(by_name("stream"));
    assert_eq!(stream.get("status").map(String::as_str), Some("200"));
    assert!(stream.contains_key("first_token_ms"), "{stream:?}");

    // The worker's request continues the trace under the upstream span, with the request id.
    let upstream = hex(&by_name("upstream").span_id);
    let sent = setup.sent();
    assert!(
        sent.contains(&format!("traceparent: 00-{TRACE_ID}-{upstream}-01")),
        "{sent}"
    );
    assert!(sent.contains("x-request-id: trace-test-1"), "{sent}");

    // The JSON access line and the usage record carry the request id.
    let access = eventually("the access line", || {
        std::fs::read_to_string(setup.log())
            .ok()?
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|l| l["target"] == "kinference_gateway::access_log")
    })
    .await;
    let fields = &access["fields"];
    assert_eq!(fields["request_id"], "trace-test-1", "{access}");
    assert_eq!(fields["status"], 200, "{access}");
    assert_eq!(fields["path"], "/v1/chat/completions", "{access}");
    assert_eq!(fields["model"], MODEL, "{access}");
    assert_eq!(fields["backend"], worker_url.as_str(), "{access}");
    assert!(fields["output_tokens"].as_u64() > Some(0), "{access}");
    assert_eq!(access["span"]["request_id"], "trace-test-1", "{access}");
    setup.usage_record_of("trace-test-1").await;
}

#[tokio::test]
async fn without_an_endpoint_the_clients_traceparent_passes_unchanged_and_a_bad_request_id_is_replaced()
 {
    let Some(sim) = support::vllm_sim_binary() else {
        return;
    };
    let setup = Setup::start(&sim, "tracing-off", &[], &[]).await;
    let api = setup.api;

    let traceparent = format!("00-{TRACE_ID}-{CLIENT_SPAN}-01");
    let (status, head, body) = stream_chat(
        api,
        &[
            ("traceparent", &traceparent),
            ("x-request-id", "not safe; <script>"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let id = head
        .lines()
        .find_map(|l| l.strip_prefix("x-request-id: "))
        .map(str::trim)
        .expect("an x-request-id in the answer");
    assert_eq!(id.len(), 32, "{id}");
    assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
    let sent = setup.sent();
    assert!(
        sent.contains(&format!("traceparent: {traceparent}")),
        "{sent}"
    );
    assert!(sent.contains(&format!("x-request-id: {id}")), "{sent}");
    // Every endpoint's answer carries one, a refusal's too.
    for path in ["/v1/models", "/v1/nowhere"] {
        let (_, head, _) = support::call(
            "127.0.0.1",
            api,
            "GET",
            path,
            &[("x-request-id", "other-endpoint-1")],
            "",
        )
        .await;
        assert!(
            head.contains("x-request-id: other-endpoint-1"),
            "{path}: {head}"
        );
    }
    // A pass-through endpoint: the worker gets the id, the usage record carries it.
    let (status, head, body) = support::call(
        "127.0.0.1",
        api,
        "POST",
        "/v1/embeddings",
        &[("x-request-id", "embed-1")],
        &format!(r#"{{"model":"{MODEL}","input":"hello"}}"#),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(head.contains("x-request-id: embed-1"), "{head}");
    let sent = setup.sent();
    assert!(sent.contains("x-request-id: embed-1"), "{sent}");
    setup.usage_record_of("embed-1").await;
}
