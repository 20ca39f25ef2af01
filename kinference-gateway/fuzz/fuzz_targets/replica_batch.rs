//! Fuzzes [`kinference_gateway::untrusted::replica_batch`]; its saved corpus is replayed by `tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kinference_gateway::untrusted::replica_batch(data));
