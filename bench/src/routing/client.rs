//! The load generator: `C` virtual users, each sending the next session of the sequence, streaming.
//!
//! TTFT is measured from the moment a virtual user issues a request (so the router's own time, gateway
//! or oracle, is part of it) to the first chunk with non-empty content; end-to-end latency to the end of
//! the stream. The client is the harness's pooled HTTP/1.1 client over loopback
//! ([`crate::harness::http::HttpClient`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use http::Method;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;

use super::oracle::Oracle;
use super::stats::RequestOutcome;
use super::workload::{ChatRequest, Workload};
use crate::harness::http::HttpClient;

#[cfg(test)]
mod tests;

/// Response header naming the worker the gateway routed to.
pub const WORKER_HEADER: &str = "x-kinference-worker";
/// Response header with the gateway's per-candidate estimates (when the request asks for it).
pub const DECISION_HEADER: &str = "x-kinference-decision";
/// Request header asking the gateway to explain its decision.
pub const DEBUG_HEADER: &str = "x-kinference-debug";

/// Where the virtual users send their requests.
#[derive(Clone)]
pub enum Route {
    /// A gateway (or a single worker): `POST {base}/v1/chat/completions`.
    Endpoint(String),
    /// A router that wants an API key (LiteLLM's master key): `Authorization: Bearer {api_key}`.
    Authorized {
        /// Base URL.
        base: String,
        /// The key.
        api_key: String,
    },
    /// The client-side oracle picks a worker per request.
    Oracle(Arc<Oracle>),
    /// Several gateway replicas behind a random front, as a Kubernetes Service spreads connections:
    /// each request goes to one of `bases`, drawn by [`front_pick`] from `seed` and the request's
    /// session and turn, so every run of the same sequence sends each request to the same replica.
    Front {
        /// The replicas' base URLs.
        bases: Vec<String>,
        /// Seed of the draw.
        seed: u64,
    },
}

/// The replica of `replicas` that a random front gives request (`session`, `turn`): a seeded hash
/// (splitmix64), uniform and the same in every run, with no affinity between a session's turns.
pub fn front_pick(seed: u64, session: usize, turn: usize, replicas: usize) -> usize {
    let mut z = seed
        .wrapping_add((session as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add((turn as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % replicas.max(1) as u64) as usize
}

/// What a run may do beyond sending its sessions as fast as its virtual users can.
#[derive(Default)]
pub struct RunExtras<'a> {
    /// Wall seconds per simulated second: turns sessions' `arrival_s` into wall-clock times.
    pub time_scale: f64,
    /// Started once, when a virtual user takes the session of this index, and run beside the users
    /// (e.g. slowing a worker down, or restarting one, halfway through the run); the run ends when
    /// both the users and the event are done. It does not start when the run ends before that session.
    pub event: Option<(usize, BoxFuture<'a, ()>)>,
}

/// Everything measured in one run.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// One outcome per request, in completion order.
    pub outcomes: Vec<RequestOutcome>,
    /// Wall-clock time from the first request sent to the last one finished.
    pub wall: Duration,
}

/// The load generator.
#[derive(Clone)]
pub struct LoadClient {
    http: HttpClient,
    model: String,
    debug: bool,
    timeout: Duration,
    /// Name each conversation in `x-session-id` (unique per run), as a chat client that keeps
    /// conversations would.
    session_header: bool,
}

/// The header a client names its conversation in (the gateway's sessions).
pub const SESSION_HEADER: &str = "x-session-id";

/// Runs of this process so far: each run's conversations get names of their own.
static RUNS: AtomicUsize = AtomicUsize::new(0);

impl LoadClient {
    /// A client for `model`; `debug` asks the gateway for its decision header; `timeout` bounds one
    /// request (wall clock).
    pub fn new(http: HttpClient, model: &str, debug: bool, timeout: Duration) -> Self {
        Self {
            http,
            model: model.to_string(),
            debug,
            timeout,
            session_header: false,
        }
    }

    /// The same client, naming each conversation in `x-session-id` when `on`.
    pub fn with_session_header(mut self, on: bool) -> Self {
        self.session_header = on;
        self
    }

    /// Runs `workload` with `concurrency` virtual users through `route`.
    pub async fn run(&self, route: &Route, workload: &Workload, concurrency: usize) -> RunResult {
        self.run_with(route, workload, concurrency, RunExtras::default())
            .await
    }

    /// [`LoadClient::run`] with an arrival schedule and a mid-run event ([`RunExtras`]).
    pub async fn run_with(
        &self,
        route: &Route,
        workload: &Workload,
        concurrency: usize,
        extras: RunExtras<'_>,
    ) -> RunResult {
        let next = AtomicUsize::new(0);
        let (event_at, event) = match extras.event {
            Some((at, event)) => (Some(at), Some(event)),
            None => (None, None),
        };
        let fire = tokio::sync::Notify::new();
        let users_done = tokio::sync::Notify::new();
        let start = Instant::now();
        let run = RUNS.fetch_add(1, Ordering::Relaxed);
        let users = (0..concurrency.max(1)).map(|_| async {
            let mut outcomes = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(session) = workload.sessions.get(i) else {
                    break;
                };
                if event_at == Some(i) {
                    fire.notify_one();
                }
                // An open-loop arrival: wait for it, and count the request's time from it even when
                // this user took the session late (every user was busy: the client's own queue).
                let arrival = session.arrival_s.map(|s| {
                    start + Duration::from_secs_f64(s.max(0.0) * extras.time_scale.max(0.0))
                });
                if let Some(at) = arrival {
                    tokio::time::sleep_until(at.into()).await;
                }
                for (turn, request) in session.requests.iter().enumerate() {
                    let issued = arrival.filter(|_| turn == 0).unwrap_or_else(Instant::now);
                    let session = self.session_header.then(|| {
                        format!("run{run}-{}-session{}", std::process::id(), request.session)
                    });
                    outcomes.push(
                        self.send_issued(route, request, start, issued, session.as_deref())
                            .await,
                    );
                }
            }
            outcomes
        });
        let users = async {
            let outcomes = futures::future::join_all(users).await;
            users_done.notify_one();
            outcomes
        };
        let event = async {
            let Some(event) = event else { return };
            tokio::select! {
                biased;
                _ = fire.notified() => event.await,
                _ = users_done.notified() => {}
            }
        };
        let (outcomes, ()) = futures::join!(users, event);
        let outcomes: Vec<RequestOutcome> = outcomes.into_iter().flatten().collect();
        RunResult {
            outcomes,
            wall: start.elapsed(),
        }
    }

    /// Sends one request and measures it.
    pub async fn send(
        &self,
        route: &Route,
        request: &ChatRequest,
        run_start: Instant,
    ) -> RequestOutcome {
        self.send_issued(route, request, run_start, Instant::now(), None)
            .await
    }

    /// [`LoadClient::send`] with its latencies counted from `issued` (an arrival that may be earlier
    /// than now).
    async fn send_issued(
        &self,
        route: &Route,
        request: &ChatRequest,
        run_start: Instant,
        issued: Instant,
        session: Option<&str>,
    ) -> RequestOutcome {
        let mut outcome = RequestOutcome {
            session: request.session,
            turn: request.turn,
            sent_at: issued - run_start,
            ..RequestOutcome::default()
        };
        let body = request.body(&self.model, true);
        let measured = tokio::time::timeout(self.timeout, async {
            let response = match route {
                Route::Endpoint(base) => {
                    let url = format!("{base}/v1/chat/completions");
                    self.start_stream(&url, &body, None, session).await
                }
                Route::Front { bases, seed } => {
                    let r = front_pick(*seed, request.session, request.turn, bases.len());
                    let url = format!("{}/v1/chat/completions", bases[r]);
                    self.start_stream(&url, &body, None, session).await
                }
                Route::Authorized { base, api_key } => {
                    let url = format!("{base}/v1/chat/completions");
                    self.start_stream(&url, &body, Some(api_key), session).await
                }
                Route::Oracle(oracle) => {
                    // The decision and the admission by the worker happen under one lock, so the next
                    // decision sees this request in the worker's queue: the oracle's view stays exact.
                    let _turn = oracle.decision_lock().await;
                    match oracle.pick(&body).await {
                        Ok(choice) => {
                            outcome.worker = Some(choice.worker.clone());
                            outcome.decision = Some(choice.explain);
                            let url = format!("{}/v1/chat/completions", choice.worker);
                            self.start_stream(&url, &body, None, None).await
                        }
                        Err(e) => Err(e.to_string()),
                    }
                }
            };
            match response {
                Ok(response) => self.read_stream(response, issued, &mut outcome).await,
                Err(e) => outcome.error = Some(e),
            }
        })
        .await;
        if measured.is_err() {
            outcome.error = Some(format!("timed out after {:?}", self.timeout));
            outcome.e2e = None;
        }
        outcome
    }

    async fn start_stream(
        &self,
        url: &str,
        body: &Value,
        api_key: Option<&str>,
        session: Option<&str>,
    ) -> Result<http::Response<Incoming>, String> {
        let bearer = api_key.map(|k| format!("Bearer {k}"));
        let mut headers: Vec<(&str, &str)> = Vec::with_capacity(3);
        if let Some(s) = session {
            headers.push((SESSION_HEADER, s));
        }
        if self.debug {
            headers.push((DEBUG_HEADER, "1"));
        }
        if let Some(b) = &bearer {
            headers.push(("authorization", b));
        }
        self.http
            .send(Method::POST, url, &headers, Bytes::from(body.to_string()))
            .await
            .map_err(|e| e.to_string())
    }

    async fn read_stream(
        &self,
        response: http::Response<Incoming>,
        issued: Instant,
        outcome: &mut RequestOutcome,
    ) {
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        if let Some(worker) = header(WORKER_HEADER) {
            outcome.worker = Some(worker);
        }
        if let Some(decision) = header(DECISION_HEADER) {
            outcome.decision = Some(decision);
        }
        let status = response.status();
        let mut body = response.into_body();
        let mut sse = SseParser::default();
        let mut error_text = String::new();
        while let Some(frame) = body.frame().await {
            let frame = match frame {
                Ok(frame) => frame,
                Err(e) => {
                    outcome.error = Some(format!("stream broke: {e}"));
                    return;
                }
            };
            let Some(data) = frame.data_ref() else {
                continue;
            };
            if !status.is_success() {
                error_text.push_str(&String::from_utf8_lossy(data));
                continue;
            }
            for event in sse.push(data) {
                match event {
                    SseEvent::Done => {}
                    SseEvent::Chunk(chunk) => {
                        if outcome.ttft.is_none() && has_content(&chunk) {
                            outcome.ttft = Some(issued.elapsed());
                        }
                        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
                            outcome.prompt_tokens = usage["prompt_tokens"].as_u64();
                            outcome.completion_tokens = usage["completion_tokens"].as_u64();
                            outcome.cached_tokens =
                                usage["prompt_tokens_details"]["cached_tokens"].as_u64();
                        }
                        if let Some(err) = chunk.get("error") {
                            outcome.error = Some(format!("error event: {err}"));
                        }
                    }
                }
            }
        }
        if !status.is_success() {
            error_text.truncate(300);
            outcome.error = Some(format!("status {status}: {error_text}"));
            return;
        }
        if outcome.ttft.is_none() && outcome.error.is_none() {
            outcome.error = Some("stream ended without content".to_string());
            return;
        }
        outcome.e2e = Some(issued.elapsed());
    }
}

/// Reads `body` to its end and returns the latency since `start` that counts for an overhead
/// measurement: to the first non-empty body frame when `stream` (to the end when none came), to the
/// end of the body otherwise.
pub async fn latency_that_counts<B>(
    mut body: B,
    start: Instant,
    stream: bool,
) -> Result<Duration, B::Error>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    let mut first = None;
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        if first.is_none() && frame.data_ref().is_some_and(|d| !d.is_empty()) {
            first = Some(start.elapsed());
        }
    }
    let whole = start.elapsed();
    Ok(if stream {
        first.unwrap_or(whole)
    } else {
        whole
    })
}

/// Whether an OpenAI stream chunk carries generated text (the first chunk only has the role).
fn has_content(chunk: &Value) -> bool {
    chunk["choices"].as_array().is_some_and(|choices| {
        choices.iter().any(|c| {
            c["delta"]["content"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
                || c["text"].as_str().is_some_and(|s| !s.is_empty())
        })
    })
}

/// One server-sent event of an OpenAI stream.
#[derive(Debug, PartialEq)]
enum SseEvent {
    /// A `data: {json}` event.
    Chunk(Value),
    /// `data: [DONE]`.
    Done,
}

/// Splits a byte stream into SSE events (they may be cut anywhere by the transport).
#[derive(Default)]
struct SseParser {
    buffer: Vec<u8>,
}

impl SseParser {
    fn push(&mut self, data: &[u8]) -> Vec<SseEvent> {
        self.buffer.extend_from_slice(data);
        let mut events = Vec::new();
        while let Some(end) = find_event_end(&self.buffer) {
            let (event_len, sep_len) = end;
            let raw: Vec<u8> = self.buffer.drain(..event_len + sep_len).collect();
            let text = String::from_utf8_lossy(&raw[..event_len]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|line| line.strip_prefix("data:"))
                .map(str::trim_start)
                .collect();
            if data.is_empty() {
                continue;
            }
            let payload = data.join("\n");
            if payload.trim() == "[DONE]" {
                events.push(SseEvent::Done);
            } else if let Ok(value) = serde_json::from_str(&payload) {
                events.push(SseEvent::Chunk(value));
            }
        }
        events
    }
}

/// Position and separator length of the first complete event (`\n\n` or `\r\n\r\n`).
fn find_event_end(buffer: &[u8]) -> Option<(usize, usize)> {
    let lf = buffer.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buffer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}
