//! Every parser in the gateway that takes bytes from outside its trust boundary, each behind one entry
//! point that checks what must hold whatever the bytes. The fuzz targets (`kinference-gateway/fuzz/`)
//! and the corpus replay test (`tests/fuzz_corpus.rs`) both call these, so an input a fuzzer saved is
//! replayed by the normal `cargo test`.
//!
//! | entry | bytes from | parser |
//! |---|---|---|
//! | [`openai_request`] | a client (`/v1/chat/completions`, `/v1/completions`) | [`crate::api::openai`] |
//! | [`anthropic_request`] | a client (`/v1/messages`) | [`crate::api::anthropic`] |
//! | [`sse_stream`] | a worker's or an OpenAI-style provider's stream | [`crate::backend::sse`] |
//! | [`anthropic_stream`] | an Anthropic-style provider's stream | [`crate::backend::provider::translate`] |
//! | [`policy_file`] | a policy file (Git, a mounted ConfigMap) | [`crate::policy::source::parse_file`] |
//! | [`worker_metrics`] | a worker's `/metrics` (policy pool state) | [`crate::policy::worker_load`] |
//! | [`pii_scan`] | a client's prompt text | [`crate::policy::classify::pii`] |
//! | [`sse_capped`] | a worker's or provider's stream, past the line and event limits | [`crate::backend::sse`] with [`SseLimits`] |
//! | [`body_walk`] | a client's request body, read for the PII scan | [`crate::policy::classify::body::extract`] |
//! | [`passthrough_request`] | a client's pass-through body, and the worker's answer's usage | [`crate::api::openai::passthrough`] |
//! | [`journal_replay`] | the usage journal's files read back at start (a damaged disk) | [`crate::tenancy::store::journal`] |
//! | [`extproc_session`] | a proxy's ext_proc messages, in any order, phases missing, bodies split | [`crate::extproc::session`] |
//! | [`usage_at_end`] | the tail of an answer a proxy relays (the ext_proc door's billing) | [`crate::extproc::session::usage_at_end`] |
//! | [`replica_batch`] | another gateway replica (`POST /internal/replicas`, behind the admin key) | [`crate::routing::replicas::Batch`] |

use std::path::Path;

use bytes::BytesMut;

use crate::api::anthropic::{MessagesRequest, StreamTranslator};
use crate::api::openai::{self, ChatCompletionRequest, CompletionRequest, StreamChunk};
use crate::backend::provider::translate::AnthropicStream;
use crate::backend::sse::{SseLimits, SseParser};

/// The names of the entries, as the fuzz targets and corpus folders are named.
pub const TARGETS: [&str; 14] = [
    "openai_request",
    "anthropic_request",
    "sse_stream",
    "anthropic_stream",
    "policy_file",
    "worker_metrics",
    "pii_scan",
    "sse_capped",
    "body_walk",
    "passthrough_request",
    "journal_replay",
    "extproc_session",
    "usage_at_end",
    "replica_batch",
];

/// Runs the entry called `target` (one of [`TARGETS`]) on `data`.
pub fn run(target: &str, data: &[u8]) {
    match target {
        "openai_request" => openai_request(data),
        "anthropic_request" => anthropic_request(data),
        "sse_stream" => sse_stream(data),
        "anthropic_stream" => anthropic_stream(data),
        "pii_scan" => pii_scan(data),
        "policy_file" => policy_file(data),
        "worker_metrics" => worker_metrics(data),
        "sse_capped" => sse_capped(data),
        "body_walk" => body_walk(data),
        "passthrough_request" => passthrough_request(data),
        "journal_replay" => journal_replay(data),
        "extproc_session" => extproc_session(data),
        "usage_at_end" => usage_at_end(data),
        "replica_batch" => replica_batch(data),
        other => panic!("no fuzz entry called {other:?}"),
    }
}

/// An OpenAI request body, parsed and validated as both endpoints do; a stream's body gets the usage
/// option spliced in, and the result must still be JSON of the same request.
pub fn openai_request(data: &[u8]) {
    if let Ok(mut chat) = openai::parse_body::<ChatCompletionRequest>(data) {
        let _ = chat.validate();
        let _ = openai::force_include_usage(&mut chat.stream_options);
        let _ = serde_json::to_vec(&chat).expect("a parsed request serializes");
    }
    if let Ok(completion) = openai::parse_body::<CompletionRequest>(data) {
        let _ = completion.validate();
        let _ = completion.prompt_text();
        // Token-id prompts route on their ids (`Prompt::Ids`).
        let _ = completion.routing_prompt().estimated_tokens();
    }
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(data)
        && value.is_object()
        && value.get("stream_options").is_none()
        && let Some(spliced) = openai::splice_include_usage(data)
    {
        let again: serde_json::Value =
            serde_json::from_slice(&spliced).expect("a spliced object is JSON");
        assert_eq!(again["stream_options"]["include_usage"], true);
    }
}

/// An Anthropic Messages body, parsed and translated to the worker's chat request.
pub fn anthropic_request(data: &[u8]) {
    let Ok(request) = openai::parse_body::<MessagesRequest>(data) else {
        return;
    };
    if let Ok(chat) = request.to_chat_request() {
        let _ = serde_json::to_vec(&chat).expect("a translated request serializes");
    }
}

/// An SSE stream fed in two pieces split at the first byte's value; every event's data is read as a
/// chat chunk and translated for an Anthropic client. Splitting must not change the events.
pub fn sse_stream(data: &[u8]) {
    let whole = events(&[data]);
    let cut = data.first().map_or(0, |b| usize::from(*b)).min(data.len());
    let split = events(&[&data[..cut], &data[cut..]]);
    assert_eq!(whole, split, "the events depend on how the bytes arrived");
    let mut translator = StreamTranslator::new("fuzz", "msg_fuzz".into());
    let mut out = BytesMut::new();
    translator.start(&mut out, 0);
    for data in &whole {
        if let Ok(chunk) = serde_json::from_slice::<StreamChunk>(data) {
            let _ = chunk.has_text();
            translator.chunk(&mut out, &chunk);
        }
    }
    translator.finish(&mut out);
}

fn events(pieces: &[&[u8]]) -> Vec<Vec<u8>> {
    let mut parser = SseParser::new();
    let mut out = Vec::new();
    for piece in pieces {
        parser.feed(piece);
        while let Some(event) = parser.next_event() {
            out.push(event.data.to_vec());
        }
    }
    out
}

/// An Anthropic provider's stream: each SSE event through the translator to OpenAI chunks.
pub fn anthropic_stream(data: &[u8]) {
    let mut stream = AnthropicStream::new();
    for event in events(&[data]) {
        let step = stream.event(&event);
        for chunk in &step.chunks {
            let _ = serde_json::to_vec(chunk).expect("a chunk serializes");
        }
    }
}

/// A policy file: parsed into manifests and problems, never a panic.
pub fn policy_file(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = crate::policy::source::parse_file(Path::new("fuzz.yaml"), text);
}

/// A worker's `/metrics` text as the policy stage reads it: figures, if any, are sane.
pub fn worker_metrics(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Some((_running, _waiting, Some(kv))) = crate::policy::worker_load::parse_metrics(text) {
        assert!(
            !kv.is_nan(),
            "a NaN KV-cache usage reached the policy facts"
        );
    }
}

/// A prompt's text through the PII detectors: every match is a range of the text on character
/// boundaries, and each phone number, card number or IBAN it reports passes the check it was found by.
pub fn pii_scan(data: &[u8]) {
    use crate::policy::classify::pii::{PiiKind, card_valid, iban_valid, phone_valid, scan};
    let text = String::from_utf8_lossy(data);
    for m in scan(&text) {
        assert!(
            m.start < m.end
                && m.end <= text.len()
                && text.is_char_boundary(m.start)
                && text.is_char_boundary(m.end),
            "{m:?} is no range of the text"
        );
        let found = &text[m.start..m.end];
        match m.kind {
            PiiKind::Phone => assert!(phone_valid(found), "phone {found:?}"),
            PiiKind::PaymentCard => assert!(card_valid(found), "card {found:?}"),
            PiiKind::Iban => assert!(iban_valid(found), "IBAN {found:?}"),
            _ => {}
        }
    }
}

/// The stream parser with limits small enough for a fuzzer to cross (the first two bytes choose
/// them), fed whole and in pieces of the third byte's size: the same events and the same verdict
/// either way, no event or line past a limit comes out, and between pieces the parser holds no
/// more than the event limit.
pub fn sse_capped(data: &[u8]) {
    let [a, b, c, stream @ ..] = data else {
        return;
    };
    let max_line = usize::from(*a) * 4 + 1;
    let limits = SseLimits {
        max_line,
        max_event: max_line + usize::from(*b) * 8,
    };
    let step = usize::from(*c).max(1);
    let run = |pieces: &mut dyn Iterator<Item = &[u8]>| {
        let mut parser = SseParser::with_limits(limits);
        let mut events = Vec::new();
        for piece in pieces {
            parser.feed(piece);
            while let Some(event) = parser.next_event() {
                events.push(event);
            }
            // What is left is an unfinished event within the limit (and the start of its blank
            // line), or nothing once a limit was passed.
            assert!(
                parser.pending() <= limits.max_event + 3,
                "{} bytes held over a {}-byte event limit",
                parser.pending(),
                limits.max_event
            );
        }
        (events, parser.overflow().is_some())
    };
    let (whole, whole_over) = run(&mut std::iter::once(stream));
    let (pieces, pieces_over) = run(&mut stream.chunks(step));
    assert_eq!(whole, pieces, "the events depend on how the bytes arrived");
    assert_eq!(
        whole_over, pieces_over,
        "the verdict depends on how the bytes arrived"
    );
    for event in &whole {
        assert!(
            event.data.len() <= limits.max_event,
            "an event over the limit came out"
        );
        assert!(
            event
                .event
                .as_ref()
                // In characters: name bytes that are not UTF-8 come out as U+FFFD (3 bytes each).
                .is_none_or(|e| e.chars().count() <= limits.max_line),
            "an event name over the line limit came out"
        );
    }
}

/// A request body as the PII scan reads it: every key of the top-level object and every plain
/// string value there is in the text (what cannot be read is reported, never dropped), and the text
/// is at most a fixed multiple of the body (JSON inside strings is read decoded, to a bounded depth).
pub fn body_walk(data: &[u8]) {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let read = crate::policy::classify::body::extract(&value);
    assert!(
        read.text.len() <= 16 * data.len() + 64,
        "{} bytes of text from a {}-byte body",
        read.text.len(),
        data.len()
    );
    assert!(read.token_prompts.iter().map(Vec::len).sum::<usize>() <= data.len());
    if let serde_json::Value::Object(map) = &value {
        for (key, v) in map {
            assert!(read.text.contains(key.as_str()), "key {key:?} not read");
            if let serde_json::Value::String(s) = v
                && !s.get(..5).is_some_and(|p| p.eq_ignore_ascii_case("data:"))
            {
                assert!(read.text.contains(s.as_str()), "value of {key:?} not read");
            }
        }
    }
}

/// A pass-through body for each route, and the same bytes as the worker's answer: what parses
/// names a model, streams only where the route does, continues only a string id, and its text is
/// no larger than the body; an answer's id is bounded and only a response's.
pub fn passthrough_request(data: &[u8]) {
    use crate::api::openai::passthrough::{PassthroughRequest, Route, answer_id_of, usage_of};
    for route in [
        Route::Embeddings,
        Route::Responses,
        Route::Tokenize,
        Route::Detokenize,
    ] {
        if let Ok(request) = PassthroughRequest::parse(route, data) {
            assert!(!request.model.is_empty());
            assert!(route == Route::Responses || !request.stream());
            let text = request.text();
            assert!(text.len() <= 2 * data.len(), "{} bytes of text", text.len());
            if let Some(id) = request.previous_response_id() {
                assert!(route == Route::Responses || !id.is_empty());
            }
        }
        if let Some(id) = answer_id_of(route, data) {
            assert!(route == Route::Responses && !id.is_empty() && id.len() <= 256);
        }
        if let Some(usage) = usage_of(route, data) {
            assert!(usage.total_tokens >= usage.prompt_tokens.max(usage.completion_tokens));
        }
    }
}

/// Bytes read back as the usage journal's current segment and as its compacted totals (a damaged
/// disk, a hand edit): whole lines end at a newline, a torn tail is exactly the bytes after them,
/// each record id is kept once, and every record kept survives its own round trip.
pub fn journal_replay(data: &[u8]) {
    let read = crate::tenancy::store::journal::replay_bytes(data).expect("reading memory");
    let whole = usize::try_from(read.whole_len).expect("a length");
    assert!(whole <= data.len());
    assert!(whole == 0 || data[whole - 1] == b'\n');
    if let Some(torn) = &read.torn {
        assert_eq!(
            torn.as_slice(),
            &data[whole..],
            "the torn tail is what follows the lines"
        );
        assert!(!read.unterminated);
    }
    if whole == data.len() {
        assert!(read.torn.is_none() && !read.unterminated);
    }
    let mut ids = std::collections::HashSet::new();
    for record in &read.records {
        assert!(
            ids.insert(record.id.as_str()),
            "record {} kept twice",
            record.id
        );
        let line = serde_json::to_vec(record).expect("a record serializes");
        let again: crate::tenancy::usage::UsageRecord =
            serde_json::from_slice(&line).expect("a written record reads back");
        assert_eq!(&again, record);
    }
    let lines = data.iter().filter(|&&b| b == b'\n').count();
    assert!(
        read.corrupt <= lines,
        "{} corrupt of {lines} lines",
        read.corrupt
    );
    assert!(
        read.rows.len() <= lines,
        "{} rows from {lines} lines",
        read.rows.len()
    );
    // A mark read means a first line that is a header (an empty file has none: mark 0).
    if read.header.is_ok() && !data.is_empty() {
        assert!(data.first() == Some(&b'{') || data.first().is_some_and(u8::is_ascii_whitespace));
    }
}

/// The tail of an answer as the ext_proc door reads it for billing, for every pass-through route and
/// for chat/completions (first byte picks): what it finds adds up.
pub fn usage_at_end(data: &[u8]) {
    use crate::api::openai::passthrough::Route;
    let Some((&pick, tail)) = data.split_first() else {
        return;
    };
    let route = match pick % 5 {
        0 => Some(Route::Embeddings),
        1 => Some(Route::Responses),
        2 => Some(Route::Tokenize),
        3 => Some(Route::Detokenize),
        _ => None,
    };
    if let Some(usage) = crate::extproc::session::usage_at_end(route, tail) {
        let fields = usage.prompt_tokens.max(usage.completion_tokens);
        assert!(
            usage.total_tokens >= fields || route.is_none(),
            "{usage:?} from {route:?}"
        );
    }
}

/// The one gateway the session entry drives (an open gateway with an in-flight limit, one model
/// `m` whose worker is never reached: Envoy, not the gateway, forwards), and the runtime it runs on.
fn extproc_handler() -> &'static (tokio::runtime::Runtime, crate::extproc::Handler) {
    static HANDLER: std::sync::OnceLock<(tokio::runtime::Runtime, crate::extproc::Handler)> =
        std::sync::OnceLock::new();
    HANDLER.get_or_init(|| {
        use crate::gateway::{Gateway, Parts};
        use crate::overload::OverloadSettings;
        use crate::routing::{Router, RoutingConfig, RoutingMode, WorkerConfig};
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let handler = runtime.block_on(async {
            let router = Router::new(RoutingConfig {
                workers: vec![WorkerConfig {
                    url: "http://127.0.0.1:9".into(),
                    model: "m".into(),
                    role: Default::default(),
                }],
                models: vec![],
                agents: vec![],
                mode: RoutingMode::LeastOutstanding,
            })
            .expect("a router");
            let gw = Gateway::assemble(
                std::sync::Arc::new(router),
                Parts {
                    overload: Some(OverloadSettings {
                        max_in_flight: 64,
                        overload_queue_timeout_ms: 1,
                        ..OverloadSettings::default()
                    }),
                    models: vec!["m".into()],
                    ..Parts::default()
                },
            )
            .expect("a gateway");
            crate::extproc::Handler::new(gw, crate::extproc::Settings::default())
        });
        (runtime, handler)
    })
}

/// A proxy's ext_proc messages to one session, as the bytes spell them: each message is a kind
/// byte (request or response headers, body or trailers), a flags byte (end of stream), a length
/// byte and that many bytes (a header block: a path picked from the gateway's routes, then
/// `name: value` lines; a body: the bytes). Whatever the order, the phases missing or the bodies
/// split, every message is answered or ends the session, and once the session is gone it holds
/// no in-flight slot and no body bytes.
pub fn extproc_session(data: &[u8]) {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as PReq;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest,
    };
    let (runtime, handler) = extproc_handler();
    let header_block = |bytes: &[u8], request: bool| {
        let mut headers = Vec::new();
        let mut text = bytes;
        if request && let Some((&pick, rest)) = bytes.split_first() {
            let routes = crate::pipeline::ROUTES;
            let route = routes[usize::from(pick) % routes.len()];
            headers.push((":path".to_string(), route.path().as_bytes().to_vec()));
            headers.push((
                ":method".to_string(),
                route.method().as_str().as_bytes().to_vec(),
            ));
            text = rest;
        }
        for line in text.split(|&b| b == b'\n') {
            if let Some(colon) = line.iter().position(|&b| b == b':') {
                let name = String::from_utf8_lossy(&line[..colon]).to_ascii_lowercase();
                headers.push((name, line[colon + 1..].trim_ascii().to_vec()));
            }
        }
        HeaderMap {
            headers: headers
                .into_iter()
                .map(|(key, raw_value)| HeaderValue {
                    key,
                    raw_value,
                    ..Default::default()
                })
                .collect(),
        }
    };
    runtime.block_on(async {
        let gw = handler.gateway();
        {
            let mut session = crate::extproc::session::Session::new(handler);
            let mut rest = data;
            while let [kind, flags, len, tail @ ..] = rest {
                let n = usize::from(*len).min(tail.len());
                let (payload, after) = tail.split_at(n);
                rest = after;
                let end_of_stream = flags & 1 == 1;
                let request = match kind % 6 {
                    0 => PReq::RequestHeaders(HttpHeaders {
                        headers: Some(header_block(payload, true)),
                        end_of_stream,
                        ..Default::default()
                    }),
                    1 => PReq::RequestBody(HttpBody {
                        body: payload.to_vec(),
                        end_of_stream,
                        ..Default::default()
                    }),
                    2 => PReq::RequestTrailers(HttpTrailers::default()),
                    3 => PReq::ResponseHeaders(HttpHeaders {
                        headers: Some(header_block(payload, false)),
                        end_of_stream,
                        ..Default::default()
                    }),
                    4 => PReq::ResponseBody(HttpBody {
                        body: payload.to_vec(),
                        end_of_stream,
                        ..Default::default()
                    }),
                    _ => PReq::ResponseTrailers(HttpTrailers::default()),
                };
                let message = ProcessingRequest {
                    request: Some(request),
                    ..Default::default()
                };
                if session.on_message(message).await.is_empty() {
                    break;
                }
            }
        }
        assert_eq!(gw.overload.in_flight(), 0, "a slot outlived its session");
        assert_eq!(
            gw.overload.body_bytes_held(),
            0,
            "body bytes outlived their session"
        );
    });
}

/// A batch from another replica, applied to a router of two workers: whatever it says, once its
/// sender has gone silent past the bound no request of it is held, and every worker is idle again.
pub fn replica_batch(data: &[u8]) {
    use crate::routing::replicas::{Batch, MAX_BATCH_BYTES};
    use crate::routing::{ModelConfig, Router, RoutingConfig, RoutingMode, WorkerConfig};
    use std::time::{Duration, Instant};
    if data.len() > MAX_BATCH_BYTES {
        return;
    }
    let Ok(batch) = serde_json::from_slice::<Batch>(data) else {
        return;
    };
    let router = Router::new(RoutingConfig {
        workers: ["http://w1", "http://w2"]
            .iter()
            .map(|url| WorkerConfig {
                url: url.to_string(),
                model: "m".into(),
                role: Default::default(),
            })
            .collect(),
        models: vec![ModelConfig {
            name: "m".into(),
            tokenizer_dir: None,
            serves_messages: false,
            profile: None,
        }],
        agents: vec![],
        mode: RoutingMode::Kinference,
    })
    .expect("a router of two workers");
    router.apply_replica_batch(batch);
    router.forget_silent_replicas(
        Instant::now() + Duration::from_secs(3600),
        Duration::from_secs(1),
    );
    assert_eq!(router.replica_requests_in_flight(), 0);
    assert!(router.workers().iter().all(|w| w.in_flight == 0));
}
