//! Fuzzes [`kinference_agent::untrusted::vllm_metrics`]; its saved corpus is replayed by `tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kinference_agent::untrusted::vllm_metrics(data));
