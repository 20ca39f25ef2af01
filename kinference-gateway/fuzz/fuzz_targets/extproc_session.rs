//! Fuzzes [`kinference_gateway::untrusted::extproc_session`]; its saved corpus is replayed by `tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kinference_gateway::untrusted::extproc_session(data));
