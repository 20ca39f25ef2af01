//! Replays every saved fuzz input (`fuzz/corpus/<target>/`) through the same entry points the fuzz
//! targets call ([`kinference_gateway::untrusted`]), in the normal `cargo test`: an input a fuzzer once
//! found, minimised and saved there, stays fixed.
//!
//! The seeds are real requests in both protocols, a worker's and a provider's streams, the example
//! policies of `deploy/examples/policies/` and a real vLLM 0.32 `/metrics` capture.

use std::path::Path;

use kinference_gateway::untrusted::{self, TARGETS};

#[test]
fn every_saved_fuzz_input_replays_without_a_panic() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    testkit::replay_corpus(&corpus, &TARGETS, 2, untrusted::run);
}

/// The seeds are real inputs, not only noise: each well-formed seed gets through its parser.
#[test]
fn the_seeds_parse() {
    use kinference_gateway::api::anthropic::MessagesRequest;
    use kinference_gateway::api::openai::{self, ChatCompletionRequest};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    let chat = std::fs::read(root.join("openai_request/chat.json")).unwrap();
    openai::parse_body::<ChatCompletionRequest>(&chat)
        .expect("chat seed parses")
        .validate()
        .expect("chat seed is valid");
    let messages = std::fs::read(root.join("anthropic_request/tools.json")).unwrap();
    openai::parse_body::<MessagesRequest>(&messages).expect("messages seed parses");
    let policy = std::fs::read_to_string(root.join("policy_file/00-data-protection.yaml")).unwrap();
    let parsed = kinference_gateway::policy::source::parse_file(
        Path::new("00-data-protection.yaml"),
        &policy,
    );
    assert!(!parsed.manifests.is_empty() && parsed.problems.is_empty());
    let metrics = std::fs::read_to_string(root.join("worker_metrics/vllm-0.32.txt")).unwrap();
    assert!(kinference_gateway::policy::worker_load::parse_metrics(&metrics).is_some());
    let prompt = std::fs::read_to_string(root.join("pii_scan/every-kind.txt")).unwrap();
    let kinds: std::collections::BTreeSet<_> =
        kinference_gateway::policy::classify::pii::scan(&prompt)
            .into_iter()
            .map(|m| m.kind)
            .collect();
    assert_eq!(
        kinds.len(),
        7,
        "every kind of personal data in the seed is found: {kinds:?}"
    );
    use kinference_gateway::api::openai::passthrough::{PassthroughRequest, Route, usage_of};
    let embeddings = std::fs::read(root.join("passthrough_request/embeddings.json")).unwrap();
    assert_eq!(
        PassthroughRequest::parse(Route::Embeddings, &embeddings)
            .expect("embeddings seed parses")
            .text(),
        "a\nb"
    );
    let completed =
        std::fs::read(root.join("passthrough_request/responses-completed.json")).unwrap();
    assert_eq!(
        usage_of(Route::Responses, &completed).map(|u| u.total_tokens),
        Some(12)
    );
    let data_urls = std::fs::read(root.join("body_walk/data-urls.json")).unwrap();
    let read = kinference_gateway::policy::classify::body::extract(
        &serde_json::from_slice(&data_urls).unwrap(),
    );
    assert!(read.text.contains("+44 20 7946 0000") && read.text.contains("percent encoded@"));
    assert_eq!(read.binary, ["image/png"]);
}

/// Seeds as large as the gateway's limits let in, too large to commit: `testkit/fuzz/run.sh` writes
/// them into `$KINFERENCE_FUZZ_LARGE_SEEDS/<target>/` before fuzzing, so that every run starts from
/// the paths past the stream limits (4 MiB lines, 8 MiB events) and at the 4 MiB body limit, under
/// the RSS limit.
#[test]
#[ignore = "run by testkit/fuzz/run.sh"]
fn write_large_seeds() {
    // Each seed is written, and replayed through its entry as the fuzzer will start with it.
    let seeds = testkit::LargeSeeds::from_env(untrusted::run);
    let write = |target: &str, name: &str, bytes: &[u8]| seeds.write(target, name, bytes);
    const MIB: usize = 1 << 20;
    // A stream whose first line passes the 4 MiB line limit, and one whose event passes 8 MiB in
    // short lines, each followed by an event that must not come out.
    let mut line = b"data: {\"x\":\"".to_vec();
    line.resize(4 * MIB + 100, b'a');
    line.extend(b"\"}\n\ndata: [DONE]\n\n");
    write("sse_stream", "line-over-4mib", &line);
    let mut event = b"data: x\n".repeat(8 * MIB / 8 + 10);
    event.extend(b"\ndata: [DONE]\n\n");
    write("sse_stream", "event-over-8mib", &event);
    // Bodies at the 4 MiB limit: strings holding escaped JSON three deep (read decoded), and many
    // inputs of a pass-through request.
    let mut inner = String::from("{\"a\":\"x\\u0040y\"}");
    for _ in 0..2 {
        inner = serde_json::to_string(&serde_json::json!({ "t": inner })).unwrap();
    }
    let args: Vec<String> = std::iter::repeat_n(inner, 4 * MIB / 80).collect();
    let body = serde_json::json!({"model": "m", "messages": [{"role": "tool", "content": args}]});
    write(
        "body_walk",
        "escaped-json-4mib",
        body.to_string().as_bytes(),
    );
    // 1 MiB of inputs: a 4 MiB one takes most of a 10 s budget to run at all under the sanitizer.
    let inputs: Vec<String> = (0..MIB / 20).map(|i| format!("input number {i}")).collect();
    let body = serde_json::json!({"model": "m", "input": inputs});
    write(
        "passthrough_request",
        "embeddings-1mib",
        body.to_string().as_bytes(),
    );
}
