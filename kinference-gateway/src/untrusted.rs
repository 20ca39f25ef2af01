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

use std::path::Path;

use bytes::BytesMut;

use crate::api::anthropic::{MessagesRequest, StreamTranslator};
use crate::api::openai::{self, ChatCompletionRequest, CompletionRequest, StreamChunk};
use crate::backend::provider::translate::AnthropicStream;
use crate::backend::sse::SseParser;

/// The names of the entries, as the fuzz targets and corpus folders are named.
pub const TARGETS: [&str; 7] = [
    "openai_request",
    "anthropic_request",
    "sse_stream",
    "anthropic_stream",
    "policy_file",
    "worker_metrics",
    "pii_scan",
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
