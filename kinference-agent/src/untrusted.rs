//! Every parser in the agent that takes bytes from outside its trust boundary, each behind one entry
//! point that checks what must hold whatever the bytes. The fuzz targets (`kinference-agent/fuzz/`) and
//! the corpus replay test (`tests/fuzz_corpus.rs`) both call these, so a crash a fuzzer saved is
//! replayed by the normal `cargo test`.
//!
//! | entry | bytes from | parser |
//! |---|---|---|
//! | [`kv_batch`] | a worker's KV-event payload (both vLLM formats) | [`crate::kv_events::decode_batch`] |
//! | [`zmtp_stream`] | any ZeroMQ peer (KV-event and replay sockets) | [`crate::zmq_guard::Inspector`] |
//! | [`zmq_frames`] | a worker's live and replay messages | [`crate::subscriber`] frame parsers |
//! | [`vllm_metrics`] | a worker's `/metrics` | [`crate::scrape::parse`] |

use bytes::Bytes;

use crate::kv_events::decode_batch;
use crate::kv_events::encode::{EncodeOptions, EventFormat, encode_batch};
use crate::subscriber::{ReplayReply, parse_live_message, parse_replay_reply};
use crate::worker_state::WorkerState;
use crate::zmq_guard::{Inspector, Limits};

/// The names of the entries, as the fuzz targets and corpus folders are named.
pub const TARGETS: [&str; 4] = ["kv_batch", "zmtp_stream", "zmq_frames", "vllm_metrics"];

/// Runs the entry called `target` (one of [`TARGETS`]) on `data`.
pub fn run(target: &str, data: &[u8]) {
    match target {
        "kv_batch" => kv_batch(data),
        "zmtp_stream" => zmtp_stream(data),
        "zmq_frames" => zmq_frames(data),
        "vllm_metrics" => vllm_metrics(data),
        other => panic!("no fuzz entry called {other:?}"),
    }
}

/// Decodes a KV-event batch; whatever decodes must apply to a worker's state, and must decode to the
/// same batch after re-encoding in either vLLM format.
pub fn kv_batch(data: &[u8]) {
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    let mut state = WorkerState::new("fuzz", 1 << 12);
    state.apply_all(&batch.events);
    let _ = state.take_delta();
    for format in [EventFormat::Map, EventFormat::Array] {
        for bin_hashes in [false, true] {
            let bytes = encode_batch(&batch, EncodeOptions { format, bin_hashes });
            let again = decode_batch(&bytes).expect("an encoded batch decodes");
            assert_eq!(again.events, batch.events, "{format:?} round trip");
            assert_eq!(again.data_parallel_rank, batch.data_parallel_rank);
            assert!(
                again.ts == batch.ts || (again.ts.is_nan() && batch.ts.is_nan()),
                "timestamp round trip"
            );
        }
    }
}

/// Limits small enough for a fuzzer to cross them.
const FUZZ_LIMITS: Limits = Limits {
    max_frame: 4096,
    max_message: 8192,
    max_command: 512,
};

/// Inspects a peer's byte stream whole and in pieces (cut where the first byte says): both must reach
/// the same verdict, the same handshake and the same message count.
pub fn zmtp_stream(data: &[u8]) {
    let mut whole = Inspector::new(FUZZ_LIMITS);
    let whole_result = whole.feed(data);
    let step = usize::from(data.first().copied().unwrap_or(1) % 13) + 1;
    let mut pieces = Inspector::new(FUZZ_LIMITS);
    let mut pieces_result = Ok((false, 0));
    for chunk in data.chunks(step) {
        match pieces.feed(chunk) {
            Ok(p) => {
                if let Ok((done, messages)) = &mut pieces_result {
                    *done |= p.handshake_done;
                    *messages += p.messages;
                }
            }
            Err(v) => {
                pieces_result = Err(v);
                break;
            }
        }
    }
    let whole_result = whole_result.map(|p| (p.handshake_done, p.messages));
    assert_eq!(
        whole_result, pieces_result,
        "the verdict depends on read sizes"
    );
    assert_eq!(whole.handshake_done(), pieces.handshake_done());
}

/// Splits `data` into frames (each a 2-byte big-endian length, then that many bytes) and runs the live
/// and replay message parsers on them, decoding any payload they find.
pub fn zmq_frames(data: &[u8]) {
    let frames = split_frames(data);
    if let Ok(live) = parse_live_message(&frames) {
        let _ = decode_batch(live.payload);
    }
    if let Ok(ReplayReply::Batch { payload, .. }) = parse_replay_reply(&frames) {
        let _ = decode_batch(payload);
    }
}

/// The frames [`zmq_frames`] reads from fuzz input (a short last frame takes what is left).
pub fn split_frames(mut data: &[u8]) -> Vec<Bytes> {
    let mut frames = Vec::new();
    while data.len() >= 2 {
        let len = usize::from(u16::from_be_bytes([data[0], data[1]])).min(data.len() - 2);
        frames.push(Bytes::copy_from_slice(&data[2..2 + len]));
        data = &data[2 + len..];
    }
    frames
}

/// The inverse of [`split_frames`] (frames over 65,535 bytes are cut), to build its corpus.
pub fn join_frames(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in frames {
        let f = &f[..f.len().min(usize::from(u16::MAX))];
        out.extend((f.len() as u16).to_be_bytes());
        out.extend_from_slice(f);
    }
    out
}

/// Parses a `/metrics` body as the scraper does (lossy UTF-8 first).
pub fn vllm_metrics(data: &[u8]) {
    let load = crate::scrape::parse(&String::from_utf8_lossy(data));
    if let Some(bs) = load.block_size {
        assert!(bs > 0, "a zero block size is never reported");
    }
    for v in [load.running, load.waiting, load.kv_usage]
        .into_iter()
        .flatten()
    {
        assert!(v.is_finite(), "load figures are finite: {load:?}");
    }
    if let Some(started) = load.process_start_s {
        assert!(
            started.is_finite() && started > 0.0,
            "a start time is a finite, positive instant: {load:?}"
        );
    }
    // Each engine once, in order, below the bound, with finite figures.
    assert!(load.engines.windows(2).all(|w| w[0].engine < w[1].engine));
    for e in &load.engines {
        assert!(e.engine < kinference_api::vllm::metrics::MAX_ENGINES);
        assert!(e.running.is_finite() && e.waiting.is_finite() && e.kv_usage.is_finite());
    }
}
