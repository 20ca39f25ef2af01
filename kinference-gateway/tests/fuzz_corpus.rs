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
}
