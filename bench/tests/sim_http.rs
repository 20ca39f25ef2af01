//! The real `vllm-sim` binary on loopback: the OpenAI API (stream and not), cached tokens, /tokenize,
//! /metrics, errors; KV events received by a ZeroMQ SUB and replayed through a DEALER in both formats.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{Value, json};
use testkit::{ChildGuard, free_port, tokenizer_dir};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// A running simulator, killed on drop (also when a test panics).
struct Sim {
    _child: ChildGuard,
    port: u16,
}

impl Sim {
    fn start(extra: &[&str]) -> Sim {
        let port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--model", "qwen2-sim", "--preset", "fast"])
            .arg("--tokenizer-dir")
            .arg(tokenizer_dir())
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn vllm-sim");
        let sim = Sim {
            _child: ChildGuard(child),
            port,
        };
        let deadline = Instant::now() + Duration::from_secs(90);
        while Instant::now() < deadline {
            if let Ok((200, _)) = sim.try_call("GET", "/health", None) {
                return sim;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("vllm-sim did not become ready");
    }

    fn try_call(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> std::io::Result<(u16, String)> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let body = body.unwrap_or("");
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        let raw = String::from_utf8_lossy(&raw).into_owned();
        let (head, rest) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(rest)
        } else {
            rest.to_owned()
        };
        Ok((status, body))
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, String) {
        let b = body.map(|v| v.to_string());
        self.try_call(method, path, b.as_deref())
            .expect("http call")
    }

    fn post_json(&self, path: &str, body: Value) -> (u16, Value) {
        let (status, text) = self.call("POST", path, Some(body));
        let v = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        (status, v)
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

#[test]
fn openai_api_tokenize_metrics_and_errors() {
    let sim = Sim::start(&["--block-size", "16"]);

    // Models.
    let (status, models) = sim.call("GET", "/v1/models", None);
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).expect("json");
    assert_eq!(models["data"][0]["id"], "qwen2-sim");

    // Tokenize equals live vLLM.
    let (status, t) = sim.post_json(
        "/tokenize",
        json!({"prompt": "Hello world, this is a test."}),
    );
    assert_eq!(status, 200);
    assert_eq!(
        t["tokens"],
        json!([9707, 1879, 11, 419, 374, 264, 1273, 13])
    );
    let (_, t) = sim.post_json(
        "/tokenize",
        json!({"model": "qwen2-sim", "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(
        t["tokens"],
        json!([151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198])
    );

    // Completion, non-streaming, then the same prompt again: full blocks come from the cache.
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(8);
    let (status, a) = sim.post_json(
        "/v1/completions",
        json!({"model": "qwen2-sim", "prompt": prompt, "max_tokens": 5}),
    );
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["object"], "text_completion");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(a["usage"]["completion_tokens"], 5);
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let n_prompt = a["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
    let (_, b) = sim.post_json(
        "/v1/completions",
        json!({"model": "qwen2-sim", "prompt": prompt, "max_tokens": 5}),
    );
    assert_eq!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some((n_prompt - 1) / 16 * 16)
    );
    assert_eq!(
        a["choices"][0]["text"], b["choices"][0]["text"],
        "deterministic output"
    );

    // The estimate sees the cache too.
    let (_, est) = sim.post_json("/sim/estimate", json!({"prompt": prompt}));
    assert_eq!(
        est["cached_tokens"],
        b["usage"]["prompt_tokens_details"]["cached_tokens"]
    );
    assert_eq!(est["prompt_tokens"].as_u64(), Some(n_prompt));
    assert!(est["estimated_ttft_s"].as_f64().expect("ttft") > 0.0);

    // Chat, streaming with usage.
    let (status, body) = sim.call(
        "POST",
        "/v1/chat/completions",
        Some(
            json!({"model": "qwen2-sim", "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    assert_eq!(status, 200);
    let events = sse_events(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect();
    assert_eq!(chunks.len(), 1 + 4 + 1, "role chunk, 4 tokens, usage chunk");
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    let usage = &chunks[5];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["prompt_tokens"], 9);
    assert_eq!(usage["usage"]["completion_tokens"], 4);

    // Completion, streaming without usage.
    let (_, body) = sim.call(
        "POST",
        "/v1/completions",
        Some(json!({"prompt": "Hello", "max_tokens": 3, "stream": true})),
    );
    let events = sse_events(&body);
    assert_eq!(events.len(), 4, "3 tokens and [DONE]: {events:?}");
    let last: Value = serde_json::from_str(&events[2]).expect("json");
    assert_eq!(last["choices"][0]["finish_reason"], "length");

    // Chat, non-streaming, with content parts.
    let (status, c) = sim.post_json(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 2}),
    );
    assert_eq!(status, 200);
    assert_eq!(c["object"], "chat.completion");
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    assert_eq!(c["usage"]["prompt_tokens"], 9);

    // Errors.
    let (status, e) = sim.post_json("/v1/completions", json!({"model": "nope", "prompt": "x"}));
    assert_eq!(status, 404);
    assert_eq!(e["error"]["type"], "NotFoundError");
    let (status, e) = sim.post_json(
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": "many"}),
    );
    assert_eq!(status, 400);
    assert_eq!(e["error"]["type"], "BadRequestError");
    assert_eq!(e["error"]["code"], 400);
    let (status, e) = sim.post_json("/v1/chat/completions", json!({"messages": []}));
    assert_eq!(status, 400, "{e}");
    let (status, e) = sim.post_json(
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 40000}),
    );
    assert_eq!(status, 400);
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("maximum context length")
    );
    let (status, text) = sim
        .try_call("POST", "/v1/completions", Some("{not json"))
        .expect("call");
    assert_eq!(status, 400, "{text}");
    let (status, _) = sim.call("GET", "/nowhere", None);
    assert_eq!(status, 404);

    // Metrics after all that.
    let (status, metrics) = sim.call("GET", "/metrics", None);
    assert_eq!(status, 200);
    for name in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:prefix_cache_queries_total{",
        "vllm:prefix_cache_hits_total{",
        "vllm:prompt_tokens_total{",
        "vllm:generation_tokens_total{",
        "vllm:prompt_tokens_cached_total{",
        "vllm:request_success_total{",
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:inter_token_latency_seconds_bucket{",
        "vllm:e2e_request_latency_seconds_bucket{",
        "vllm:cache_config_info{",
    ] {
        assert!(metrics.contains(name), "missing {name}");
    }
    assert!(metrics.contains("block_size=\"16\""));
    // Its capacity as the node agent reads it (vLLM's label; the default --num-blocks).
    let load = kinference_api::vllm::metrics::parse(&metrics);
    assert_eq!(
        (load.block_size, load.num_gpu_blocks),
        (Some(16), Some(4096))
    );
    assert!(metrics.contains(
        "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"qwen2-sim\"} 5.0"
    ));
}

#[test]
fn prompt_tokens_details_can_be_turned_off() {
    let sim = Sim::start(&["--no-prompt-tokens-details"]);
    let (_, a) = sim.post_json(
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 1}),
    );
    assert!(a["usage"]["prompt_tokens_details"].is_null(), "{a}");
}

/// `--slowdown` starts a worker slower than its preset and `POST /sim/slowdown` changes it at run time:
/// the estimate of an idle worker scales by exactly the factor, and bad factors are refused.
#[test]
fn slowdown_flag_and_endpoint_scale_model_time() {
    let sim = Sim::start(&["--slowdown", "4"]);
    let (_, state) = sim.call("GET", "/sim/state", None);
    let state: Value = serde_json::from_str(&state).expect("state JSON");
    assert_eq!(state["slowdown"], 4.0, "{state}");
    let prompt = "word ".repeat(2000);
    let estimate = |sim: &Sim| {
        let (status, est) = sim.post_json("/sim/estimate", json!({"prompt": prompt}));
        assert_eq!(status, 200, "{est}");
        est["estimated_ttft_s"].as_f64().expect("estimate")
    };
    let slow = estimate(&sim);

    let (status, answer) = sim.post_json("/sim/slowdown", json!({"factor": 1.0}));
    assert_eq!((status, answer), (200, json!({"slowdown": 1.0})));
    let fast = estimate(&sim);
    assert!(fast > 0.0);
    assert!(
        (slow / fast - 4.0).abs() < 1e-6,
        "an idle worker's estimate is model time x scale x slowdown: {slow} vs {fast}"
    );

    for bad in [
        json!({"factor": 0}),
        json!({"factor": -2}),
        json!({"factor": "x"}),
        json!({}),
    ] {
        let (status, body) = sim.post_json("/sim/slowdown", bad.clone());
        assert_eq!(status, 400, "{bad}: {body}");
        assert_eq!(body["error"]["type"], "BadRequestError", "{body}");
    }
    assert_eq!(sim.call("GET", "/sim/slowdown", None).0, 405);
    let (_, state) = sim.call("GET", "/sim/state", None);
    let state: Value = serde_json::from_str(&state).expect("state JSON");
    assert_eq!(state["slowdown"], 1.0, "a refused factor changes nothing");
}

/// Frames of one ZMQ message.
fn frames(m: ZmqMessage) -> Vec<Bytes> {
    m.into_vec()
}

/// Sends 6 sequential requests of 40 token ids (2 full blocks of 16 each) to a 7-block cache, so
/// blocks get evicted; returns nothing, the events tell.
fn fill_cache(sim: &Sim) {
    for i in 0..6u32 {
        let prompt: Vec<u32> = (i * 1000 + 100..i * 1000 + 140).collect();
        let (status, r) = sim.post_json(
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 4}),
        );
        assert_eq!(status, 200, "{r}");
    }
}

/// Applies decoded batches to a set of live block hashes; returns (stored, removed) counts.
fn apply(events: &[rmpv::Value], array: bool, live: &mut BTreeSet<u64>) -> (usize, usize) {
    let (mut stored, mut removed) = (0, 0);
    for e in events {
        let (kind, hashes) = if array {
            let a = e.as_array().expect("array event");
            (a[0].as_str().unwrap_or("").to_owned(), a.get(1).cloned())
        } else {
            let m = e.as_map().expect("map event");
            let get = |k: &str| {
                m.iter()
                    .find(|(key, _)| key.as_str() == Some(k))
                    .map(|(_, v)| v.clone())
            };
            (
                get("type")
                    .and_then(|t| t.as_str().map(str::to_owned))
                    .unwrap_or_default(),
                get("block_hashes"),
            )
        };
        let hashes: Vec<u64> = hashes
            .and_then(|h| {
                h.as_array()
                    .map(|a| a.iter().filter_map(rmpv::Value::as_u64).collect())
            })
            .unwrap_or_default();
        match kind.as_str() {
            "BlockStored" => {
                stored += 1;
                live.extend(hashes);
            }
            "BlockRemoved" => {
                removed += 1;
                for h in hashes {
                    live.remove(&h);
                }
            }
            "AllBlocksCleared" => live.clear(),
            other => panic!("unknown event {other}"),
        }
    }
    (stored, removed)
}

fn decode_batch(payload: &[u8]) -> Vec<rmpv::Value> {
    let v = rmpv::decode::read_value(&mut &payload[..]).expect("msgpack");
    let a = v.as_array().expect("batch array");
    assert_eq!(a.len(), 3, "[ts, events, dp_rank]");
    assert!(a[0].is_f64());
    assert_eq!(a[2].as_u64(), Some(0));
    a[1].as_array().expect("events").clone()
}

async fn recv_timeout<S: SocketRecv>(s: &mut S) -> Option<ZmqMessage> {
    tokio::time::timeout(Duration::from_secs(5), s.recv())
        .await
        .ok()?
        .ok()
}

async fn events_round_trip(connect_mode: bool, array: bool, replay_v025: bool) {
    let pub_port = free_port();
    let replay_port = free_port();
    let topic = "kv@w1@qwen2-sim";
    let mut sub = zeromq::SubSocket::new();
    let endpoint = if connect_mode {
        // llm-d's pattern: the subscriber binds, the worker connects.
        sub.bind(&format!("tcp://127.0.0.1:{pub_port}"))
            .await
            .expect("bind sub");
        format!("tcp://127.0.0.1:{pub_port}")
    } else {
        format!("tcp://*:{pub_port}")
    };
    sub.subscribe("").await.expect("subscribe");
    let mut args = vec![
        "--block-size".to_owned(),
        "16".into(),
        "--num-blocks".into(),
        "8".into(),
        "--kv-events-endpoint".into(),
        endpoint,
        "--kv-replay-endpoint".into(),
        format!("tcp://*:{replay_port}"),
        "--kv-topic".into(),
        topic.into(),
    ];
    if array {
        args.extend(["--kv-event-format".into(), "array".into()]);
    }
    if replay_v025 {
        args.extend(["--replay-format".into(), "v0.25".into()]);
    }
    let sim = tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        Sim::start(&refs)
    })
    .await
    .expect("start");
    if !connect_mode {
        sub.connect(&format!("tcp://127.0.0.1:{pub_port}"))
            .await
            .expect("connect sub");
    }
    // Let the subscription reach the publisher (PUB drops messages for unknown subscribers).
    tokio::time::sleep(Duration::from_millis(500)).await;

    let sim = tokio::task::spawn_blocking(move || {
        fill_cache(&sim);
        sim
    })
    .await
    .expect("requests");

    // Live events.
    let mut live = BTreeSet::new();
    let (mut stored, mut removed) = (0, 0);
    let mut seqs = Vec::new();
    while let Some(m) = recv_timeout(&mut sub).await {
        let f = frames(m);
        assert_eq!(f.len(), 3, "topic, seq, payload");
        assert_eq!(&f[0][..], topic.as_bytes());
        seqs.push(u64::from_be_bytes(f[1][..].try_into().expect("8-byte seq")));
        let (s, r) = apply(&decode_batch(&f[2]), array, &mut live);
        stored += s;
        removed += r;
        if removed > 0 && seqs.len() >= 6 {
            // Give trailing batches a moment, then stop on the first quiet period.
            if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(500), sub.recv()).await {
                let f = frames(m);
                seqs.push(u64::from_be_bytes(f[1][..].try_into().expect("seq")));
                apply(&decode_batch(&f[2]), array, &mut live);
                continue;
            }
            break;
        }
    }
    assert!(stored >= 6, "BlockStored events: {stored}");
    assert!(removed >= 1, "BlockRemoved events: {removed}");
    assert_eq!(
        seqs,
        (0..seqs.len() as u64).collect::<Vec<_>>(),
        "seq from 0, no gaps"
    );

    // The live view equals the cache.
    let (sim, state) = tokio::task::spawn_blocking(move || {
        let (_, state) = sim.call("GET", "/sim/state", None);
        (sim, state)
    })
    .await
    .expect("state");
    let state: Value = serde_json::from_str(&state).expect("state json");
    let cached: BTreeSet<u64> = state["block_hashes"]
        .as_array()
        .expect("hashes")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert_eq!(
        live, cached,
        "events replayed onto an empty set = the cache's hashes"
    );

    // Replay from seq 2 through a DEALER.
    let mut dealer = zeromq::DealerSocket::new();
    dealer
        .connect(&format!("tcp://127.0.0.1:{replay_port}"))
        .await
        .expect("connect dealer");
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&2u64.to_be_bytes()),
    ])
    .expect("message");
    dealer.send(req).await.expect("send replay request");
    let mut replayed = Vec::new();
    loop {
        let f = frames(recv_timeout(&mut dealer).await.expect("replay reply"));
        assert!(f[0].is_empty(), "DEALER sees the empty delimiter first");
        let body = &f[1..];
        let (seq, payload) = if replay_v025 {
            assert_eq!(body.len(), 2, "[seq, payload]");
            (&body[0], &body[1])
        } else {
            assert_eq!(body.len(), 3, "[topic, seq, payload]");
            if body[1][..] != [0xff; 8] {
                assert_eq!(&body[0][..], topic.as_bytes());
            }
            (&body[1], &body[2])
        };
        if seq[..] == [0xff; 8] {
            assert!(payload.is_empty());
            if !replay_v025 {
                assert!(body[0].is_empty(), "end marker [b\"\", ff*8, b\"\"]");
            }
            break;
        }
        replayed.push(u64::from_be_bytes(seq[..].try_into().expect("seq")));
        decode_batch(payload);
    }
    assert_eq!(
        replayed,
        seqs[2..].to_vec(),
        "every buffered batch from seq 2"
    );
    drop(sim);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_map_format_connect_mode_and_v026_replay() {
    events_round_trip(true, false, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_array_format_bind_mode_and_v025_replay() {
    events_round_trip(false, true, true).await;
}

/// What peer routers (vllm-router, smg, sglang-router) ask a worker besides generation: `/version`, the
/// `render` routes in vLLM 0.32's `GenerateRequest` shape (one object for chat, a list for completions,
/// the same token ids as `/tokenize`), and 404 for the routes vLLM does not serve.
#[test]
fn render_routes_version_and_peer_probes() {
    let sim = Sim::start(&[]);
    let (status, v) = sim.call("GET", "/version", None);
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&v).expect("json");
    assert_eq!(v["version"], "0.32.0");

    let messages = json!([{"role": "user", "content": "Hi"}]);
    let (status, chat) = sim.post_json(
        "/v1/chat/completions/render",
        json!({"model": "qwen2-sim", "messages": messages, "max_tokens": 7}),
    );
    assert_eq!(status, 200, "{chat}");
    assert!(chat.is_object(), "chat render is one object: {chat}");
    assert_eq!(
        chat["token_ids"],
        json!([151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198])
    );
    assert!(
        chat["request_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("chatcmpl-"))
    );
    assert_eq!(chat["model"], "qwen2-sim");
    assert_eq!(chat["sampling_params"]["max_tokens"], 7);
    assert!(chat["features"].is_null());

    let (status, list) = sim.post_json(
        "/v1/completions/render",
        json!({"model": "qwen2-sim", "prompt": "Hello world, this is a test."}),
    );
    assert_eq!(status, 200, "{list}");
    let items = list.as_array().expect("completions render is a list");
    assert_eq!(items.len(), 1);
    assert_eq!(
        items[0]["token_ids"],
        json!([9707, 1879, 11, 419, 374, 264, 1273, 13])
    );
    assert!(
        items[0]["request_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("cmpl-"))
    );

    // Errors keep vLLM's shape: unknown model 404, bad body 400.
    let (status, e) = sim.post_json(
        "/v1/chat/completions/render",
        json!({"model": "nope", "messages": messages}),
    );
    assert_eq!(status, 404);
    assert_eq!(e["error"]["type"], "NotFoundError");
    let (status, _) = sim.post_json("/v1/completions/render", json!({"model": "qwen2-sim"}));
    assert_eq!(status, 400);

    // Not served by vLLM 0.32 (without dev mode): routers that probe them must tolerate 404.
    for path in [
        "/server_info",
        "/model_info",
        "/get_model_info",
        "/kv_event_sources",
    ] {
        let (status, _) = sim.call("GET", path, None);
        assert_eq!(status, 404, "{path}");
    }
}

/// The worker's `name` counter (summed over its series).
fn counter(sim: &Sim, name: &str) -> f64 {
    let (_, text) = sim.call("GET", "/metrics", None);
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn kv_connectors_hand_a_prefill_over_in_vllms_and_sglangs_protocols() {
    let producer = Sim::start(&["--kv-role", "kv_producer"]);
    let consumer = Sim::start(&["--kv-role", "kv_consumer"]);
    let prompt = "parcel route depot truck invoice customs pallet ".repeat(40);
    let messages = json!([{"role": "user", "content": prompt}]);

    // vLLM's: the prefill answers with kv_transfer_params naming its transfer; the decode pulls it.
    let (status, text) = producer.call(
        "POST",
        "/v1/chat/completions",
        Some(
            json!({"model": "qwen2-sim", "messages": messages, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}}),
        ),
    );
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    let params = answer["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{answer}");
    assert_eq!(params["remote_port"], producer.port);
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    let blocks = params["remote_block_ids"].as_array().unwrap().len() as u64;
    assert_eq!(blocks, prompt_tokens / 16);
    let (status, text) = consumer.call(
        "POST",
        "/v1/chat/completions",
        Some(
            json!({"model": "qwen2-sim", "messages": messages, "max_tokens": 6,
            "kv_transfer_params": params}),
        ),
    );
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 6);
    assert_eq!(
        counter(&consumer, "kinference_sim_kv_pulled_blocks_total"),
        blocks as f64
    );
    // The consumer computed one prompt token, not the prompt.
    assert_eq!(
        answer["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt_tokens - 1
    );
    // A transfer is pulled once: the same params again make the consumer compute the prompt.
    let (status, _) = consumer.call(
        "POST",
        "/v1/chat/completions",
        Some(
            json!({"model": "qwen2-sim", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1, "kv_transfer_params": answer["kv_transfer_params"].clone()}),
        ),
    );
    assert_eq!(status, 200);

    // SGLang's: the same request to both at once; the consumer waits for the room, then pulls.
    let body = json!({"model": "qwen2-sim", "messages": [{"role": "user", "content": format!("{prompt} again")}],
        "max_tokens": 5, "bootstrap_host": "127.0.0.1", "bootstrap_port": producer.port,
        "bootstrap_room": 42u64});
    let decode = std::thread::scope(|s| {
        let decode = s.spawn(|| consumer.call("POST", "/v1/chat/completions", Some(body.clone())));
        std::thread::sleep(Duration::from_millis(200));
        let (status, text) = producer.call("POST", "/v1/chat/completions", Some(body.clone()));
        assert_eq!(status, 200, "{text}");
        let prefill: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            prefill["usage"]["completion_tokens"], 1,
            "the prefill side stops at one token"
        );
        decode.join().unwrap()
    });
    assert_eq!(decode.0, 200, "{}", decode.1);
    let answer: Value = serde_json::from_str(&decode.1).unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 5);
    assert_eq!(counter(&consumer, "kinference_sim_kv_pulls_total"), 2.0);
    assert_eq!(
        counter(&producer, "kinference_sim_kv_prefills_handed_total"),
        2.0
    );
    // Without a connector, transfer fields are ignored (vLLM without --kv-transfer-config).
    let plain = Sim::start(&[]);
    let (status, text) = plain.call(
        "POST",
        "/v1/completions",
        Some(
            json!({"model": "qwen2-sim", "prompt": "hello", "max_tokens": 3,
            "kv_transfer_params": {"do_remote_decode": true}}),
        ),
    );
    assert_eq!(status, 200);
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 3);
    assert!(answer["kv_transfer_params"].is_null(), "{answer}");
}
