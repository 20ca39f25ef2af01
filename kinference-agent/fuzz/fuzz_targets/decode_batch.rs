//! Fuzzes the vLLM KV event decoder, then feeds whatever decodes into a worker's block-key state:
//! neither may panic, whatever the bytes. Run: `cargo +nightly fuzz run decode_batch` (from kinference-agent/).
#![no_main]

use kinference_agent::kv_events::decode_batch;
use kinference_agent::worker_state::WorkerState;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(batch) = decode_batch(data) {
        let mut state = WorkerState::new("fuzz", 1 << 16);
        state.apply_all(&batch.events);
        let _ = state.take_delta();
    }
});
