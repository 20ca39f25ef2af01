//! A stream whose worker breaks it before any output is sent again to another worker and continues
//! from there (under policies, of the plan's next pool when its own pool has no other); one that
//! breaks after output has reached the client ends with an error event.
//!
//! The real gateway binary in front of a real `vllm-sim` worker and a worker that answers 200, sends
//! the opening chunk of a stream (the assistant's role, no text) and, in the second test, one chunk
//! of text, then drops the connection: what a crashed or restarted vLLM does to the requests it
//! holds. Routing is round-robin, so the breaking worker gets its share of requests for sure.

mod support;

use std::time::Duration;

use support::raw_worker::read_request;
use testkit::ChildGuard;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

const MODEL: &str = "resend-model";

/// One test at a time: each starts a simulator and a gateway on ports found free a moment before
/// they bind, and two tests of this file at once can draw the same one.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A worker that answers `/health` and breaks every stream: after the role chunk, and after one
/// chunk of text when `text_first`; a Messages stream after its opening events.
async fn breaking_worker(listener: TcpListener, text_first: bool) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            return;
        };
        tokio::spawn(async move {
            while let Some((path, _)) = read_request(&mut s).await {
                let events: Vec<String> = match path.as_str() {
                    "/v1/chat/completions" => {
                        let mut chunks = vec![
                            r#"{"id":"chatcmpl-broken","object":"chat.completion.chunk","created":1,"model":"resend-model","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
                        ];
                        if text_first {
                            chunks.push(r#"{"id":"chatcmpl-broken","object":"chat.completion.chunk","created":1,"model":"resend-model","choices":[{"index":0,"delta":{"content":"half"},"finish_reason":null}]}"#);
                        }
                        chunks.iter().map(|c| format!("data: {c}\n\n")).collect()
                    }
                    // Its own Messages API: the opening events, and no text.
                    "/v1/messages" => [
                        (
                            "message_start",
                            r#"{"type":"message_start","message":{"id":"msg_broken","type":"message","role":"assistant","content":[],"model":"resend-model","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":9,"output_tokens":0}}}"#,
                        ),
                        (
                            "content_block_start",
                            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
                        ),
                        ("ping", r#"{"type":"ping"}"#),
                    ]
                    .iter()
                    .map(|(name, data)| format!("event: {name}\ndata: {data}\n\n"))
                    .collect(),
                    _ => {
                        let ok = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if s.write_all(ok.as_bytes()).await.is_err() {
                            return;
                        }
                        continue;
                    }
                };
                let mut out = String::from(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
                );
                for event in events {
                    out.push_str(&format!("{:x}\r\n{event}\r\n", event.len()));
                }
                let _ = s.write_all(out.as_bytes()).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
                // Gone mid-stream: no last chunk, no [DONE].
                return;
            }
        });
    }
}

struct Fleet {
    _sim: ChildGuard,
    _gateway: ChildGuard,
    _dir: support::TempDir,
    api: u16,
    admin: u16,
    sim_port: u16,
    breaker_port: u16,
}

/// The simulator and the breaking worker, both answering: the simulator's process and port, and
/// the breaking worker's port. `None` without the simulator's binary.
async fn workers(text_first: bool) -> Option<(ChildGuard, u16, u16)> {
    let sim = support::vllm_sim_binary()?;
    let (sim_child, sim_port) = support::spawn_vllm_sim(&sim, MODEL);
    support::wait_until_ok(sim_port, "/health").await;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let breaker_port = listener.local_addr().expect("addr").port();
    tokio::spawn(breaking_worker(listener, text_first));
    Some((sim_child, sim_port, breaker_port))
}

/// Waits until the gateway on `admin` counts both workers healthy (before the first request, so
/// that routing reaches each).
async fn wait_both_healthy(admin: u16) {
    support::wait_for("both workers healthy", || async move {
        let (_, _, body) =
            support::call("127.0.0.1", admin, "GET", "/healthz/workers", &[], "").await;
        body.contains(r#""healthy":2"#)
    })
    .await;
}

/// The fleet; `serves_messages`: the workers' own `/v1/messages` takes Anthropic requests.
async fn fleet(text_first: bool, serves_messages: bool) -> Option<Fleet> {
    let (sim_child, sim_port, breaker_port) = workers(text_first).await?;
    let dir = support::TempDir::new("stream-resend");
    let config = dir.0.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - name: {MODEL}\n    serves_messages: {serves_messages}\nworkers:\n  - url: http://127.0.0.1:{breaker_port}\n    model: {MODEL}\n  - url: http://127.0.0.1:{sim_port}\n    model: {MODEL}\nrouting: round-robin\n"
        ),
    )
    .expect("config");
    let (gateway, api, admin) = support::start_gateway(&config, &[]).await;
    wait_both_healthy(admin).await;
    Some(Fleet {
        _sim: sim_child,
        _gateway: gateway,
        _dir: dir,
        api,
        admin,
        sim_port,
        breaker_port,
    })
}

/// Streamed request `n` to `path` (`/v1/chat/completions` or `/v1/messages`: the body reads the same
/// to both); asserts its 200 and returns the stream.
async fn stream(api: u16, path: &str, n: usize) -> String {
    let body = format!(
        r#"{{"model":"{MODEL}","stream":true,"max_tokens":4,"messages":[{{"role":"user","content":"request {n} of the resend test"}}]}}"#
    );
    let (status, _, body) = support::call("127.0.0.1", api, "POST", path, &[], &body).await;
    assert_eq!(status, 200, "{body}");
    body
}

async fn stream_chat(api: u16, n: usize) -> String {
    stream(api, "/v1/chat/completions", n).await
}

/// Requests counted as served (200) by the worker on `port`, from the gateway's metrics `text`.
fn served_by(text: &str, port: u16) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("kinference_gateway_requests_total{"))
        .filter(|l| l.contains(&format!("127.0.0.1:{port}")))
        .filter(|l| l.contains("status=\"200\""))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn a_stream_broken_before_any_output_continues_from_another_worker() {
    let _serial = SERIAL.lock().await;
    let Some(fleet) = fleet(false, false).await else {
        return;
    };
    for n in 0..4 {
        let body = stream_chat(fleet.api, n).await;
        assert!(
            body.contains("data: [DONE]") && !body.contains("\"error\""),
            "request {n}: {body}"
        );
        // One opening chunk only, though the broken worker had sent its own.
        assert_eq!(
            body.matches(r#""role":"assistant""#).count(),
            1,
            "request {n}: {body}"
        );
    }
    let openai_retries =
        support::metric(fleet.admin, "kinference_gateway_upstream_retries_total").await;
    assert!(openai_retries >= 1.0, "no stream was sent again");
    // An Anthropic client's stream (translated from the workers' chat chunks) continues the same way.
    for n in 4..6 {
        let body = stream(fleet.api, "/v1/messages", n).await;
        assert!(
            body.contains("event: message_stop") && !body.contains("event: error"),
            "request {n}: {body}"
        );
        assert_eq!(body.matches("event: message_start").count(), 1, "{body}");
    }
    let metrics = support::metrics_text(fleet.admin).await;
    let retries = support::metric(fleet.admin, "kinference_gateway_upstream_retries_total").await;
    assert!(
        retries > openai_retries,
        "no Anthropic stream was sent again:\n{metrics}"
    );
    // Every request is counted once, served (200) by the simulator; none under the broken worker.
    assert_eq!(served_by(&metrics, fleet.sim_port), 6.0, "{metrics}");
    assert!(
        !metrics
            .lines()
            .any(|l| l.starts_with("kinference_gateway_requests_total{")
                && l.contains(&format!("127.0.0.1:{}", fleet.breaker_port))),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_stream_broken_after_output_ends_with_an_error_event() {
    let _serial = SERIAL.lock().await;
    let Some(fleet) = fleet(true, false).await else {
        return;
    };
    let mut broken = 0;
    for n in 0..2 {
        let body = stream_chat(fleet.api, n).await;
        if body.contains("\"half\"") {
            broken += 1;
            assert!(
                body.contains("\"error\"") && !body.contains("data: [DONE]"),
                "request {n}: {body}"
            );
        } else {
            assert!(body.contains("data: [DONE]"), "request {n}: {body}");
        }
    }
    assert_eq!(broken, 1, "round-robin sends one of two to each worker");
    let retries = support::metric(fleet.admin, "kinference_gateway_upstream_retries_total").await;
    assert_eq!(
        retries, 0.0,
        "output had reached the client: nothing is sent again"
    );
}

#[tokio::test]
async fn a_passed_through_anthropic_stream_broken_before_any_output_continues_too() {
    let _serial = SERIAL.lock().await;
    // The workers serve `/v1/messages` themselves: the client gets their events as they are. The
    // broken worker sent `message_start`, `content_block_start` and `ping` before it went; the
    // client gets one of each opening event, then the other worker's text.
    let Some(fleet) = fleet(false, true).await else {
        return;
    };
    for n in 0..4 {
        let body = stream(fleet.api, "/v1/messages", n).await;
        assert!(
            body.contains("event: message_stop") && !body.contains("event: error"),
            "request {n}: {body}"
        );
        assert!(body.contains("event: content_block_delta"), "{body}");
        for opening in ["event: message_start", "event: content_block_start"] {
            assert_eq!(body.matches(opening).count(), 1, "{opening}: {body}");
        }
    }
    let metrics = support::metrics_text(fleet.admin).await;
    let retries = support::metric(fleet.admin, "kinference_gateway_upstream_retries_total").await;
    assert!(retries >= 1.0, "no stream was sent again:\n{metrics}");
    assert_eq!(served_by(&metrics, fleet.sim_port), 4.0, "{metrics}");
}

/// Under a policy whose plan lists a pool of the breaking worker alone, then a pool of the breaking
/// worker and the simulator: a stream broken before any output continues on the second pool, on the
/// simulator (not on the worker that broke it, which the second pool holds too), and is counted
/// there.
#[tokio::test]
async fn a_stream_broken_before_any_output_continues_on_the_plans_next_pool() {
    let _serial = SERIAL.lock().await;
    let Some((_sim, sim_port, breaker_port)) = workers(false).await else {
        return;
    };
    let dir = support::TempDir::new("stream-resend-plan");
    let url = |port: u16| support::policies::endpoint(&format!("http://127.0.0.1:{port}"));
    let both = format!(
        "endpoints: [{{url: \"http://127.0.0.1:{breaker_port}\"}}, {{url: \"http://127.0.0.1:{sim_port}\"}}]"
    );
    let rules = format!(
        "apiVersion: kinference.ai/v1alpha1\nkind: InferencePolicy\nmetadata: {{name: fallback}}\nspec:\n  priority: 0\n  rules:\n    - name: first-then-second\n      match: {{models: [{MODEL}]}}\n      action: {{route: {{targets: [{{pool: first}}, {{pool: second}}]}}}}\n"
    );
    let policy_dir = support::policies::write(
        &dir.0,
        &[
            support::policies::model(MODEL, None),
            support::policies::pool("first", MODEL, "Local", "breaks", &url(breaker_port)),
            support::policies::pool("second", MODEL, "Local", "mixed", &both),
            rules,
        ],
    );
    let config = dir.0.join("gateway.yaml");
    std::fs::write(&config, support::policies::gateway_yaml(&policy_dir, 200)).expect("config");
    let (_gateway, api, admin) = support::start_gateway(&config, &[]).await;
    wait_both_healthy(admin).await;

    let body = stream_chat(api, 0).await;
    assert!(
        body.contains("data: [DONE]") && !body.contains("\"error\""),
        "{body}"
    );
    assert_eq!(body.matches(r#""role":"assistant""#).count(), 1, "{body}");
    let metrics = support::metrics_text(admin).await;
    let sent_to = |pool: &str| {
        metrics
            .lines()
            .filter(|l| l.starts_with("kinference_gateway_policy_backend_requests_total{"))
            .filter(|l| l.contains(&format!("backend=\"pool/{pool}\"")))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert_eq!(sent_to("first"), 1.0, "{metrics}");
    assert_eq!(sent_to("second"), 1.0, "{metrics}");
    assert!(
        support::metric(admin, "kinference_gateway_upstream_retries_total").await >= 1.0,
        "{metrics}"
    );
    // Counted once, served (200) by the simulator.
    assert_eq!(served_by(&metrics, sim_port), 1.0, "{metrics}");
}
