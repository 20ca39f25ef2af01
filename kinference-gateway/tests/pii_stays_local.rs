//! Personal data stays local, as a property: generated requests carry personal data (what
//! `policy::classify::pii` detects: e-mail addresses, phone numbers, cards, IBANs, IPs, SSNs, UK
//! NINOs) anywhere a backend would receive it (system prompts, earlier turns, content blocks, tool
//! calls and results, tools' descriptions and schemas, `response_format`, `prediction`, `user`,
//! `suffix`, `metadata`, stop sequences, token-id prompts, text data URLs), several pieces spread
//! across turns, in both protocols, streamed and not.
//!
//! They go through the real `kinference-gateway` binary whose policies would send every request
//! off the premises (a header-selected route to a remote pool, or a burst to a provider). The
//! remote pool and the provider are in-test HTTP stand-ins that count every body byte they
//! receive; the local pool is a real `vllm-sim`. Control requests without personal data reach the
//! stand-ins (so the counters work); after them, the counters must not move for any generated case,
//! and `vllm-sim` must have served every one.
//!
//! Seeded: `KINFERENCE_PII_SEED` replays a run, `KINFERENCE_PII_CASES` sets the count (default 1,000).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use futures::StreamExt as _;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kinference_gateway::policy::classify::pii;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use testkit::{ChildGuard, free_port, tokenizer_dir};

mod support;

use support::policies;

const MODEL: &str = "qwen2-sim";
const KEY_ENV: &str = "KINFERENCE_TEST_PII_PROVIDER_KEY";
/// Requests in flight at once.
const CONCURRENCY: usize = 16;

/// A stand-in backend (remote pool or provider) that counts the body bytes it receives.
#[derive(Default)]
struct Counter {
    bytes: AtomicU64,
    /// What was received (path and body), for the failure message.
    received: parking_lot::Mutex<Vec<String>>,
}

/// Serves OpenAI chat and completion answers (and `/health`, an empty `/metrics`), counting bytes.
async fn standin(name: &'static str, counter: Arc<Counter>) -> SocketAddr {
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
                        let answer = if path.ends_with("/chat/completions") {
                            json!({"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
                                "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": format!("from the {name}")}}],
                                "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})
                            .to_string()
                        } else if path.ends_with("/completions") {
                            json!({"id": "x", "object": "text_completion", "created": 0, "model": MODEL,
                                "choices": [{"index": 0, "finish_reason": "stop", "text": format!("from the {name}")}],
                                "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})
                            .to_string()
                        } else {
                            String::new()
                        };
                        Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from(answer))))
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

/// Policies that send every request away unless it must stay local: the header tag `to-remote`
/// routes to the remote pool, `to-provider` bursts to the provider (the condition watches the
/// `ghost` pool, whose only worker never answers, so it always holds).
fn write_config(dir: &Path, sim: u16, remote: SocketAddr, provider: SocketAddr) -> PathBuf {
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
            policies::pool(
                "local",
                MODEL,
                "Local",
                "sim",
                &url(format!("127.0.0.1:{sim}")),
            ),
            policies::pool(
                "remote",
                MODEL,
                "Remote",
                "rented",
                &url(remote.to_string()),
            ),
            policies::pool(
                "ghost",
                MODEL,
                "Local",
                "none",
                &url(format!("127.0.0.1:{}", free_port())),
            ),
            policies::standin_provider(provider, KEY_ENV, MODEL),
            rules.to_string(),
        ],
    );
    let config = dir.join("gateway.yaml");
    std::fs::write(&config, policies::gateway_yaml(&policy_dir, 200)).unwrap();
    config
}

/// Personal data of every kind `pii.rs` detects, varied by the generator.
struct Pii<'a>(&'a mut StdRng);

impl Pii<'_> {
    fn any(&mut self) -> String {
        let value = match self.0.random_range(0..8) {
            0 | 1 => self.email(),
            2 => self.phone(),
            3 => self.card(),
            4 => self.iban(),
            5 => format!("203.0.113.{}", self.0.random_range(1..255)),
            6 => format!(
                "{:03}-{:02}-{:04}",
                self.0.random_range(1..666),
                self.0.random_range(1..100),
                self.0.random_range(1..10000)
            ),
            _ => format!(
                "JK {:02} {:02} {:02} {}",
                self.0.random_range(0..100),
                self.0.random_range(0..100),
                self.0.random_range(0..100),
                ["A", "B", "C", "D"][self.0.random_range(0..4)]
            ),
        };
        assert!(
            !pii::scan(&value).is_empty(),
            "generator bug: {value} is not detected"
        );
        value
    }

    fn email(&mut self) -> String {
        let names = ["jane.doe", "j.smith", "max+billing", "o_brien", "li.wei"];
        let domains = ["example.com", "mail.example.org", "corp.example.net"];
        format!(
            "{}{}@{}",
            names[self.0.random_range(0..names.len())],
            self.0.random_range(0..100),
            domains[self.0.random_range(0..domains.len())]
        )
    }

    fn phone(&mut self) -> String {
        match self.0.random_range(0..3) {
            0 => format!("+44 20 7946 {:04}", self.0.random_range(0..10000)),
            1 => format!("+1 415-555-{:04}", self.0.random_range(0..10000)),
            _ => format!("(212) 555-{:04}", self.0.random_range(0..10000)),
        }
    }

    /// A Visa number with a valid Luhn digit, grouped or not.
    fn card(&mut self) -> String {
        let mut digits: Vec<u32> = vec![4];
        digits.extend((0..14).map(|_| self.0.random_range(0..10)));
        let sum: u32 = digits
            .iter()
            .rev()
            .enumerate()
            .map(|(i, d)| {
                if i % 2 == 0 {
                    let d2 = d * 2;
                    if d2 > 9 { d2 - 9 } else { d2 }
                } else {
                    *d
                }
            })
            .sum();
        digits.push((10 - sum % 10) % 10);
        let plain: String = digits
            .iter()
            .map(|d| char::from_digit(*d, 10).unwrap())
            .collect();
        let sep = [" ", "-", ""][self.0.random_range(0..3)];
        plain
            .as_bytes()
            .chunks(4)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect::<Vec<_>>()
            .join(sep)
    }

    /// A German IBAN with valid check digits.
    fn iban(&mut self) -> String {
        let bban: String = (0..18)
            .map(|_| char::from_digit(self.0.random_range(0..10), 10).unwrap())
            .collect();
        // mod 97 of BBAN + "DE00" (D=13, E=14).
        let rearranged = format!("{bban}131400");
        let rem = rearranged
            .chars()
            .fold(0u32, |r, c| (r * 10 + c.to_digit(10).unwrap()) % 97);
        format!("DE{:02}{bban}", 98 - rem)
    }
}

/// One generated request.
struct Case {
    path: &'static str,
    body: Value,
    /// The `x-kinference-tags` value that would send it away: `to-remote` or `to-provider`.
    route: &'static str,
    /// Where the pieces went, for failure messages (`chat:3,chat:7`).
    what: String,
}

/// The texts a case places: its pieces of personal data first, then harmless filler.
struct Texts(Vec<String>);

impl Texts {
    fn next(&mut self, rng: &mut StdRng) -> String {
        match self.0.pop() {
            Some(p) => {
                let frames = [
                    "Please contact {} about the order.",
                    "{}",
                    "Notes: {} (from the CRM)",
                    "send it to {} today",
                ];
                frames[rng.random_range(0..frames.len())].replace("{}", &p)
            }
            None => [
                "What is the capital of France?",
                "Summarize the text.",
                "ok",
            ][rng.random_range(0..3)]
            .to_string(),
        }
    }

    /// The next text with every piece not placed yet.
    fn rest(&mut self, rng: &mut StdRng) -> String {
        let mut text = self.next(rng);
        while !self.0.is_empty() {
            text = format!("{text} {}", self.next(rng));
        }
        text
    }
}

/// Places 1 to 3 pieces of personal data in a request of a random protocol, shape (up to four
/// places, the rest in the last turn) and streaming mode.
fn generate(rng: &mut StdRng, tokenizer: &tokenizers::Tokenizer) -> Case {
    let n = rng.random_range(1..=3);
    let mut texts = Texts((0..n).map(|_| Pii(rng).any()).collect());
    let route = if rng.random_bool(0.5) {
        "to-remote"
    } else {
        "to-provider"
    };
    let mut what = Vec::new();
    let (path, mut body) = match rng.random_range(0..3) {
        0 => {
            let mut body = json!({"model": MODEL, "max_tokens": 4});
            let mut messages = Vec::new();
            for _ in 0..rng.random_range(1..=4) {
                let shape = rng.random_range(0..CHAT_SHAPES);
                what.push(format!("chat:{shape}"));
                let text = texts.next(rng);
                chat_piece(rng, shape, text, &mut messages, &mut body);
            }
            messages.push(json!({"role": "user", "content": texts.rest(rng)}));
            body["messages"] = Value::Array(messages);
            ("/v1/chat/completions", body)
        }
        1 => {
            let shape = rng.random_range(0..5);
            what.push(format!("completions:{shape}"));
            let text = texts.rest(rng);
            let mut body = json!({"model": MODEL, "max_tokens": 4});
            match shape {
                0 => body["prompt"] = json!(text),
                // A prompt list (of one: the simulator refuses batches).
                1 => body["prompt"] = json!([text]),
                2 => {
                    body["prompt"] = json!("Complete the form");
                    body["suffix"] = json!(text);
                }
                3 => {
                    body["prompt"] = json!("Complete the form");
                    body["user"] = json!(text);
                }
                _ => {
                    let ids = tokenizer.encode(text.as_str(), false).unwrap();
                    body["prompt"] = json!(ids.get_ids());
                }
            }
            ("/v1/completions", body)
        }
        _ => {
            let mut body = json!({"model": MODEL, "max_tokens": 4});
            let mut messages = Vec::new();
            for _ in 0..rng.random_range(1..=4) {
                let shape = rng.random_range(0..MESSAGES_SHAPES);
                what.push(format!("messages:{shape}"));
                let text = texts.next(rng);
                messages_piece(shape, text, &mut messages, &mut body);
            }
            messages.push(json!({"role": "user", "content": texts.rest(rng)}));
            body["messages"] = Value::Array(messages);
            ("/v1/messages", body)
        }
    };
    if rng.random_bool(0.5) {
        body["stream"] = json!(true);
        what.push("stream".into());
    }
    Case {
        path,
        body,
        route,
        what: what.join(","),
    }
}

const CHAT_SHAPES: u32 = 13;
const MESSAGES_SHAPES: u32 = 10;

/// OpenAI chat: one piece in one of 13 places.
fn chat_piece(
    rng: &mut StdRng,
    shape: u32,
    text: String,
    messages: &mut Vec<Value>,
    body: &mut Value,
) {
    match shape {
        0 => messages.insert(0, json!({"role": "system", "content": text})),
        1 => {
            // An earlier turn, answered.
            messages.push(json!({"role": "user", "content": text}));
            messages.push(json!({"role": "assistant", "content": "Noted."}));
        }
        2 => messages.push(json!({"role": "user", "content": [
            {"type": "text", "text": "Look at this:"}, {"type": "text", "text": text}]})),
        3 => {
            // A tool call whose arguments carry the data (sometimes with escapes) and its result.
            let mut arguments = json!({"note": text}).to_string();
            if rng.random_bool(0.5) {
                arguments = arguments.replace('@', "\\u0040");
            }
            messages.push(json!({"role": "user", "content": "Look it up."}));
            messages.push(
                json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                "type": "function", "function": {"name": "lookup", "arguments": arguments}}]}),
            );
            messages.push(json!({"role": "tool", "tool_call_id": "call_1", "content": "found"}));
        }
        4 => {
            messages.push(json!({"role": "user", "content": "Look it up."}));
            messages.push(
                json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_2",
                "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]}),
            );
            messages.push(json!({"role": "tool", "tool_call_id": "call_2", "content": text}));
        }
        5 => push(
            body,
            "tools",
            json!({"type": "function", "function": {"name": "notify",
            "description": text, "parameters": {"type": "object", "properties": {}}}}),
        ),
        6 => push(
            body,
            "tools",
            json!({"type": "function", "function": {"name": "notify",
            "parameters": {"type": "object", "properties": {"to": {"type": "string", "default": text}}}}}),
        ),
        7 => set_once(
            body,
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "answer",
                "schema": {"type": "object", "description": text}}}),
            messages,
        ),
        8 => set_once(
            body,
            "prediction",
            json!({"type": "content", "content": text}),
            messages,
        ),
        9 => set_once(body, "user", json!(text), messages),
        10 => set_once(body, "metadata", json!({"note": text}), messages),
        // A text data URL as the whole content (the worker reads it as text; the scan decodes it).
        11 => messages.push(json!({"role": "user",
            "content": format!("data:text/plain;base64,{}", b64(&text))})),
        _ => push(body, "stop", json!(text)),
    }
}

/// Anthropic messages: one piece in one of 10 places.
fn messages_piece(shape: u32, text: String, messages: &mut Vec<Value>, body: &mut Value) {
    let tool_use = |input: Value, result: Value| {
        [
            json!({"role": "user", "content": "Look it up."}),
            json!({"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                "name": "lookup", "input": input}]}),
            json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                "content": result}]}),
            json!({"role": "assistant", "content": "Done."}),
        ]
    };
    match shape {
        0 => append_system(body, json!(text)),
        1 => append_system(body, json!([{"type": "text", "text": text}])),
        2 => {
            messages.push(json!({"role": "user", "content": text}));
            messages.push(json!({"role": "assistant", "content": "Noted."}));
        }
        3 => {
            messages.push(json!({"role": "user", "content": [{"type": "text", "text": text}]}));
            messages.push(
                json!({"role": "assistant", "content": [{"type": "text", "text": "Noted."}]}),
            );
        }
        4 => messages.extend(tool_use(json!({"note": text}), json!("found"))),
        5 => messages.extend(tool_use(json!({}), json!(text))),
        6 => messages.extend(tool_use(json!({}), json!([{"type": "text", "text": text}]))),
        7 => push(
            body,
            "tools",
            json!({"name": "notify", "description": text,
            "input_schema": {"type": "object", "properties": {}}}),
        ),
        8 => set_once(body, "metadata", json!({"user_id": text}), messages),
        _ => push(body, "stop_sequences", json!(text)),
    }
}

/// Sets a field that holds one value; when a piece is there already, the new one goes into a user
/// turn instead (so no piece is ever overwritten).
fn set_once(body: &mut Value, key: &str, value: Value, messages: &mut Vec<Value>) {
    if body.get(key).is_some() {
        let text = value.to_string();
        messages.push(json!({"role": "user", "content": text}));
        messages.push(json!({"role": "assistant", "content": "Noted."}));
    } else {
        body[key] = value;
    }
}

fn append_system(body: &mut Value, system: Value) {
    body["system"] = match (body.get("system").cloned(), system) {
        (None, s) => s,
        (Some(Value::String(a)), Value::String(b)) => json!(format!("{a}\n{b}")),
        (Some(Value::String(a)), Value::Array(b)) => {
            let mut blocks = vec![json!({"type": "text", "text": a})];
            blocks.extend(b);
            Value::Array(blocks)
        }
        (Some(Value::Array(mut a)), Value::String(b)) => {
            a.push(json!({"type": "text", "text": b}));
            Value::Array(a)
        }
        (Some(Value::Array(mut a)), Value::Array(b)) => {
            a.extend(b);
            Value::Array(a)
        }
        (Some(_), s) => s,
    };
}

fn push(body: &mut Value, key: &str, item: Value) {
    match body.get_mut(key).and_then(Value::as_array_mut) {
        Some(items) => items.push(item),
        None => body[key] = json!([item]),
    }
}

fn b64(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// Sends `body` with the routing tag; the status and the whole answer (a stream read to its end).
async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    base: &str,
    path: &str,
    route: &str,
    body: &Value,
) -> (u16, String) {
    let request = hyper::Request::post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .header("x-kinference-tags", route)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    match client.request(request).await {
        Ok(response) => {
            let status = response.status().as_u16();
            let bytes = response
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            (status, String::from_utf8_lossy(&bytes).into_owned())
        }
        Err(e) => (0, e.to_string()),
    }
}

/// Requests `vllm-sim` finished, from its `/metrics`.
async fn served_by_sim(sim: u16) -> f64 {
    let text = support::metrics_text(sim).await;
    text.lines()
        .filter(|l| l.starts_with("vllm:request_success_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A running gateway in front of `vllm-sim` (local pool), the stand-in remote pool and provider.
struct Rig {
    client: Client<HttpConnector, Full<Bytes>>,
    /// `http://127.0.0.1:<api port>`.
    base: String,
    admin: u16,
    sim: u16,
    remote: Arc<Counter>,
    provider: Arc<Counter>,
    dir: PathBuf,
    _sim: ChildGuard,
    _gateway: ChildGuard,
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Rig {
    /// Starts everything; `extra_yaml` is appended to `gateway.yaml`. `None` (after
    /// `testkit::require`) without a built `vllm-sim`.
    async fn start(extra_yaml: &str) -> Option<Rig> {
        let (sim_child, sim) = support::spawn_vllm_sim(&support::vllm_sim_binary()?, MODEL);
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build_http();
        // Up before the gateway starts: its first health probe decides whether the local pool
        // can serve at all.
        support::wait_until_ok(sim, "/health").await;
        let remote = Arc::new(Counter::default());
        let provider = Arc::new(Counter::default());
        let remote_addr = standin("remote pool", Arc::clone(&remote)).await;
        let provider_addr = standin("provider", Arc::clone(&provider)).await;
        let dir = std::env::temp_dir().join(format!(
            "kinference-pii-local-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let config = write_config(&dir, sim, remote_addr, provider_addr);
        let mut yaml = std::fs::read_to_string(&config).unwrap();
        yaml.push_str(extra_yaml);
        std::fs::write(&config, yaml).unwrap();
        let (api, admin) = (free_port(), free_port());
        let log = std::fs::File::create(dir.join("gateway.log")).unwrap();
        let gateway = ChildGuard(
            support::gateway_command(&config, api, admin)
                .env(KEY_ENV, "sk-standin")
                .env("RUST_LOG", "warn")
                .env("NO_COLOR", "1")
                .stdout(log)
                .spawn()
                .expect("start kinference-gateway"),
        );
        support::wait_until_ok(admin, "/healthz").await;
        Some(Rig {
            client,
            base: format!("http://127.0.0.1:{api}"),
            admin,
            sim,
            remote,
            provider,
            dir,
            _sim: sim_child,
            _gateway: gateway,
        })
    }

    /// The gateway's log so far.
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("gateway.log")).unwrap_or_default()
    }

    /// The admin port's `/metrics`.
    async fn metrics(&self) -> String {
        support::metrics_text(self.admin).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn personal_data_placed_anywhere_never_leaves_and_is_served_locally() {
    let seed: u64 = std::env::var("KINFERENCE_PII_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let count: usize = std::env::var("KINFERENCE_PII_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let Some(rig) = Rig::start("").await else {
        return;
    };
    let (client, base, sim) = (&rig.client, &rig.base, rig.sim);
    let (remote_count, provider_count) = (&rig.remote, &rig.provider);

    // Controls: without personal data every route leaves the premises, so the counters can move.
    let controls = [
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "max_tokens": 4, "prompt": "Once upon a time"}),
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 4, "system": "Be brief.",
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
        ),
    ];
    // A token-id prompt without personal data leaves too: the gateway decoded it with the model's
    // tokenizer (undecoded ids would have kept it local).
    let tokenizer = tokenizers::Tokenizer::from_file(tokenizer_dir().join("tokenizer.json"))
        .expect("tokenizer");
    let ids = tokenizer.encode("Once upon a time", false).unwrap();
    let controls = [
        controls.to_vec(),
        vec![(
            "/v1/completions",
            json!({"model": MODEL, "max_tokens": 4, "prompt": ids.get_ids()}),
        )],
    ]
    .concat();
    for (path, body) in &controls {
        for (route, counter, marker) in [
            ("to-remote", &remote_count, "from the remote pool"),
            ("to-provider", &provider_count, "from the provider"),
        ] {
            let before = counter.bytes.load(Ordering::SeqCst);
            let (status, answer) = send(client, base, path, route, body).await;
            assert_eq!(status, 200, "control {path} {route}: {answer}");
            assert!(answer.contains(marker), "control {path} {route}: {answer}");
            assert!(counter.bytes.load(Ordering::SeqCst) > before);
        }
    }
    let remote_before = remote_count.bytes.load(Ordering::SeqCst);
    let provider_before = provider_count.bytes.load(Ordering::SeqCst);
    let sim_before = served_by_sim(sim).await;

    let mut rng = StdRng::seed_from_u64(seed);
    let cases: Vec<Case> = (0..count).map(|_| generate(&mut rng, &tokenizer)).collect();
    let started = Instant::now();
    let failures: Vec<String> = futures::stream::iter(cases.iter().enumerate())
        .map(|(i, case)| async move {
            let (status, answer) = send(client, base, case.path, case.route, &case.body).await;
            let streamed = case.body.get("stream").is_some();
            let complete =
                !streamed || answer.contains("[DONE]") || answer.contains("message_stop");
            let served_locally = status == 200
                && complete
                && !answer.contains("from the remote pool")
                && !answer.contains("from the provider");
            (!served_locally).then(|| {
                format!(
                    "case {i} ({} {} via {}): {status} {}",
                    case.path,
                    case.what,
                    case.route,
                    answer.chars().take(300).collect::<String>()
                )
            })
        })
        .buffer_unordered(CONCURRENCY)
        .filter_map(|f| async move { f })
        .collect()
        .await;
    let elapsed = started.elapsed();
    let sim_served = served_by_sim(sim).await - sim_before;
    println!(
        "pii property: {count} cases (seed {seed}) in {:.2} s ({:.0} ms per 100 cases); \
         remote pool and provider received {} and {} bytes; vllm-sim served {sim_served}",
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1000.0 * 100.0 / count as f64,
        remote_count.bytes.load(Ordering::SeqCst) - remote_before,
        provider_count.bytes.load(Ordering::SeqCst) - provider_before,
    );
    for (name, counter, before) in [
        ("remote pool", &remote_count, remote_before),
        ("provider", &provider_count, provider_before),
    ] {
        let received = counter.received.lock();
        assert_eq!(
            counter.bytes.load(Ordering::SeqCst),
            before,
            "personal data reached the {name} (seed {seed}):\n{}",
            received[controls.len()..].join("\n")
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {count} cases were not served locally (seed {seed}), e.g.:\n{}",
        failures.len(),
        failures[..failures.len().min(8)].join("\n")
    );
    assert_eq!(sim_served as usize, count, "vllm-sim served every case");
}

/// An external classifier on loopback: text with `stall` is answered after 3 s, `broken` with
/// HTTP 500, `project-x` with the `pii` tag, anything else with no tags. Keeps the texts it got.
async fn classifier(texts: Arc<parking_lot::Mutex<Vec<String>>>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let texts = Arc::clone(&texts);
            tokio::spawn(async move {
                let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let texts = Arc::clone(&texts);
                    async move {
                        let body = req.into_body().collect().await.map(|b| b.to_bytes());
                        let asked: Value =
                            serde_json::from_slice(&body.unwrap_or_default()).unwrap_or_default();
                        let text = asked["text"].as_str().unwrap_or("").to_string();
                        texts.lock().push(text.clone());
                        let mut response = hyper::Response::new(Full::new(Bytes::from(
                            if text.contains("project-x") {
                                r#"{"tags": ["pii"]}"#
                            } else {
                                r#"{"tags": []}"#
                            },
                        )));
                        if text.contains("stall") {
                            tokio::time::sleep(STALL).await;
                        } else if text.contains("broken") {
                            *response.status_mut() = http::StatusCode::INTERNAL_SERVER_ERROR;
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

/// The gateway's wait for the external classifier: long enough that a busy test machine answers
/// within it, far shorter than the stalled classifier's answer.
const CLASSIFIER_TIMEOUT: Duration = Duration::from_millis(1500);
/// How long the stand-in classifier takes to answer a text that asks it to stall.
const STALL: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_or_failing_external_classifier_keeps_requests_local() {
    let texts = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let external = classifier(Arc::clone(&texts)).await;
    let yaml = format!(
        "classifier:\n  external:\n    url: http://{external}/classify\n    timeout_ms: {}\n",
        CLASSIFIER_TIMEOUT.as_millis()
    );
    let Some(rig) = Rig::start(&yaml).await else {
        return;
    };
    let ask = |content: &str| json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]});
    let chat = "/v1/chat/completions";
    // Answered without tags: the burst policy sends it to the provider.
    let (status, answer) = send(
        &rig.client,
        &rig.base,
        chat,
        "to-provider",
        &ask("What is the capital of France?"),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("from the provider"), "{answer}");
    assert!(texts.lock()[0].contains("What is the capital of France?"));
    let provider_bytes = rig.provider.bytes.load(Ordering::SeqCst);

    // Stalled past the timeout, failed, or tagged pii by the classifier: served locally.
    for content in [
        "stall: what is the capital of France?",
        "broken: what is the capital of France?",
        "What is the status of project-x?",
    ] {
        let started = Instant::now();
        let (status, answer) =
            send(&rig.client, &rig.base, chat, "to-provider", &ask(content)).await;
        assert_eq!(status, 200, "{content}: {answer}");
        assert!(!answer.contains("from the provider"), "{content}: {answer}");
        assert!(
            started.elapsed() < STALL,
            "{content}: waited for the classifier"
        );
    }
    assert_eq!(rig.provider.bytes.load(Ordering::SeqCst), provider_bytes);
    assert_eq!(
        texts.lock().len(),
        4,
        "the classifier is asked for every request"
    );

    let metrics = rig.metrics().await;
    for line in [
        "kinference_gateway_classifier_external_requests_total{outcome=\"ok\"} 2",
        "kinference_gateway_classifier_external_requests_total{outcome=\"timeout\"} 1",
        "kinference_gateway_classifier_external_requests_total{outcome=\"error\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} missing from /metrics");
    }
    let log = rig.log();
    assert_eq!(
        log.matches("external classifier unavailable").count(),
        2,
        "{log}"
    );
}
