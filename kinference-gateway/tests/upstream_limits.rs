//! Bytes from upstream are bounded: a worker (a Remote pool, a provider: third parties) that answers
//! with more than the gateway holds for one answer gets a 502 in the client's protocol, counted
//! against its health, and the gateway's memory does not follow the worker's bytes.
//!
//! The real gateway binary in front of a worker on loopback that answers `/health` and then every
//! request with a 96 MiB body: a whole JSON answer, or a stream whose first line never ends.

mod support;

use support::raw_worker::read_request;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

const MODEL: &str = "flood-model";
const MIB: usize = 1 << 20;
/// What the worker sends for every answer: more than any default limit.
const FLOOD: usize = 96 * MIB;
/// The gateway's limits in this test: small, so that a cut-off shows against its memory at once.
const LIMITS: [&str; 5] = [
    "--upstream-max-body-bytes=4194304",
    "--upstream-max-event-bytes=1048576",
    "--upstream-max-line-bytes=524288",
    // Every answer is two outcomes (headers fine, body over the limit): 4 answers eject it.
    "--outlier-min-requests=8",
    "--outlier-max-ejected-percent=100",
];

/// Writes `total` bytes of `fill` after `head` as HTTP/1.1 chunks of 1 MiB; stops when the reader
/// hangs up.
async fn send_chunked(s: &mut TcpStream, content_type: &str, head: &[u8], fill: u8, total: usize) {
    let start = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n"
    );
    if s.write_all(start.as_bytes()).await.is_err() {
        return;
    }
    let mut first = head.to_vec();
    first.resize(MIB, fill);
    let rest = vec![fill; MIB];
    for i in 0..total / MIB {
        let piece = if i == 0 { &first } else { &rest };
        let framed = [format!("{:x}\r\n", piece.len()).as_bytes(), piece, b"\r\n"].concat();
        if s.write_all(&framed).await.is_err() {
            return;
        }
    }
    let _ = s.write_all(b"0\r\n\r\n").await;
}

/// A worker that is healthy and answers every completion with [`FLOOD`] bytes.
async fn flooding_worker(listener: TcpListener) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            return;
        };
        tokio::spawn(async move {
            while let Some((path, body)) = read_request(&mut s).await {
                if !path.starts_with("/v1/") {
                    let ok = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    if s.write_all(ok.as_bytes()).await.is_err() {
                        return;
                    }
                    continue;
                }
                if body.contains("\"stream\":true") {
                    send_chunked(&mut s, "text/event-stream", b"data: {\"x\":\"", b'a', FLOOD)
                        .await;
                } else {
                    let head = br#"{"id":"c","object":"chat.completion","model":"flood-model","choices":[{"index":0,"message":{"role":"assistant","content":""#;
                    send_chunked(&mut s, "application/json", head, b'a', FLOOD).await;
                }
                // The rest of a cut-off answer would never parse as the next response: close.
                return;
            }
        });
    }
}

fn resident(pid: u32, field: &str) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<usize>().ok())
        .map(|kb| kb * 1024)
        .expect("memory figure")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_answering_past_the_limits_gets_a_502_counted_against_its_health() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(flooding_worker(listener));
    let dir = support::TempDir::new("upstream-limits");
    let config = dir.0.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - name: {MODEL}\nworkers:\n  - url: http://127.0.0.1:{port}\n    model: {MODEL}\nrouting: round-robin\n"
        ),
    )
    .expect("config");
    let (gateway, api, admin) = support::start_gateway(&config, &LIMITS).await;
    let pid = gateway.0.id();
    support::wait_for("the worker healthy", || async move {
        let (_, _, body) =
            support::call("127.0.0.1", admin, "GET", "/healthz/workers", &[], "").await;
        body.contains(r#""healthy":1"#)
    })
    .await;
    let before = resident(pid, "VmRSS");
    let ask = |path: &'static str, stream: bool| async move {
        let body = format!(
            r#"{{"model":"{MODEL}","stream":{stream},"max_tokens":4,"messages":[{{"role":"user","content":"hi"}}]}}"#
        );
        let started = std::time::Instant::now();
        let (status, _, answer) = support::call("127.0.0.1", api, "POST", path, &[], &body).await;
        (status, answer, started.elapsed())
    };

    // A whole answer: 502 in each client's protocol, as soon as the limit is passed.
    let (status, answer, took) = ask("/v1/chat/completions", false).await;
    eprintln!(
        "OpenAI, whole: {status} after {took:?}, {} bytes",
        answer.len()
    );
    assert_eq!(status, 502, "{}", &answer[..answer.len().min(300)]);
    let error: serde_json::Value = serde_json::from_str(&answer).expect("OpenAI error JSON");
    // What was wrong stays in the gateway's log: the client learns it was the worker.
    assert_eq!(error["error"]["code"], "bad_upstream", "{error}");
    let (status, answer, _) = ask("/v1/messages", false).await;
    assert_eq!(status, 502, "{}", &answer[..answer.len().min(300)]);
    let error: serde_json::Value = serde_json::from_str(&answer).expect("Anthropic error JSON");
    assert_eq!(error["type"], "error", "{error}");

    // A stream whose first line never ends: the stream ends with an error event.
    let (status, answer, took) = ask("/v1/chat/completions", true).await;
    eprintln!(
        "OpenAI, streamed: {status} after {took:?}, {} bytes",
        answer.len()
    );
    assert_eq!(status, 200);
    assert!(
        answer.contains("data: {\"error\"") && !answer.contains("[DONE]"),
        "{}",
        &answer[..answer.len().min(300)]
    );
    let (_, answer, _) = ask("/v1/messages", true).await;
    assert!(
        answer.contains("event: error"),
        "{}",
        &answer[..answer.len().min(300)]
    );

    let peak = resident(pid, "VmHWM");
    eprintln!(
        "gateway RSS {} MiB before, peak {} MiB after four {} MiB answers",
        before / MIB,
        peak / MIB,
        FLOOD / MIB
    );
    assert!(
        peak.saturating_sub(before) <= 32 * MIB,
        "the gateway's memory grew by {} MiB",
        peak.saturating_sub(before) / MIB
    );
    // Each answer counted against the worker: it is out as an outlier.
    let (_, _, health) =
        support::call("127.0.0.1", admin, "GET", "/healthz/workers", &[], "").await;
    assert!(health.contains(r#""state":"outlier""#), "{health}");
    drop(gateway);
}
