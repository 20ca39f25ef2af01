//! Fuzzes [`kinference_gateway::untrusted::usage_at_end`]; its saved corpus is replayed by `tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kinference_gateway::untrusted::usage_at_end(data));
