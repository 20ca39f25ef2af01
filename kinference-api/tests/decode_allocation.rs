//! What decoding a hostile KV-event payload allocates, measured by a counting global allocator (this
//! file is its own test binary, so nothing else allocates through it while a measurement runs).
//!
//! A payload reaches the decoder after the agent's ZeroMQ guard, so it is at most 16 MiB
//! (`--zmq-max-message-bytes`). What the decoder reserves must be bounded by what those bytes can
//! hold, never by a count the peer wrote in a header.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use kinference_api::vllm::kv_events::{KvEvent, decode_batch};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// One measurement at a time (the test harness runs tests on several threads).
static MEASURING: Mutex<()> = Mutex::new(());

/// The most bytes live at once while `f` ran, beyond what was live before it.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let _one = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let out = f();
    (out, PEAK.load(Ordering::Relaxed).saturating_sub(before))
}

const MIB: usize = 1 << 20;

/// `[0, [<2^32-1 events declared>], ...]` padded with `filler` to 16 MiB.
fn declared_events(filler: u8) -> Vec<u8> {
    let mut p = vec![0x93, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
    p.resize(16 * MIB, filler);
    p
}

#[test]
fn a_declared_event_count_reserves_no_more_than_the_bytes_can_hold() {
    // Junk after the header: decoding fails at the first event, having reserved what it reserved.
    for filler in [0xc1u8, 0x00] {
        let payload = declared_events(filler);
        let (result, peak) = peak_during(|| decode_batch(&payload).map(|b| b.events.len()));
        assert!(result.is_err(), "filler {filler:#04x}: {result:?}");
        eprintln!(
            "filler {filler:#04x}: peak {peak} bytes for a {} MiB payload (KvEvent is {} bytes)",
            payload.len() / MIB,
            size_of::<KvEvent>()
        );
        assert!(
            peak <= MIB,
            "a 16 MiB payload declaring 2^32-1 events made the decoder hold {peak} bytes at once"
        );
    }
}

#[test]
fn declared_hash_and_token_counts_reserve_no_more_than_the_bytes_can_hold() {
    // One BlockStored whose hash list and token list each declare 2^32-1 entries.
    for field in ["block_hashes", "token_ids"] {
        let mut p = vec![0x93, 0x00, 0x91, 0x81, 0xa0 | field.len() as u8];
        p.extend(field.as_bytes());
        p.extend([0xdd, 0xff, 0xff, 0xff, 0xff]);
        p.resize(16 * MIB, 0xc1);
        let (result, peak) = peak_during(|| decode_batch(&p).map(|b| b.events.len()));
        assert!(result.is_err(), "{field}: {result:?}");
        eprintln!("{field}: peak {peak} bytes");
        assert!(peak <= MIB, "{field}: {peak} bytes held at once");
    }
}

/// A batch of `n` copies of `event` (msgpack bytes).
fn batch_of(n: usize, event: &[u8]) -> Vec<u8> {
    let mut p = vec![0x93, 0x00, 0xdd];
    p.extend((n as u32).to_be_bytes());
    for _ in 0..n {
        p.extend(event);
    }
    p.push(0xc0);
    p
}

/// What a valid batch of the smallest events costs once decoded. An event of an unknown type
/// (`[""]`, 2 bytes) keeps nothing: it once became a 120-byte `KvEvent` (a 90x amplification, 1.4 GB
/// at the peak for one 16 MiB message). The smallest event kept, an empty `BlockRemoved` (15
/// bytes), is measured so that a change to the event type or the decoder shows here.
#[test]
fn valid_small_events_decode_within_a_known_factor_of_their_bytes() {
    let unknown = batch_of((MIB - 16) / 2, &[0x91, 0xa0]);
    let (result, peak) = peak_during(|| decode_batch(&unknown).map(|b| b.events.len()));
    assert_eq!(result, Ok(0));
    let factor = peak as f64 / unknown.len() as f64;
    eprintln!(
        "{} bytes of unknown events: peak {peak} bytes ({factor:.2}x)",
        unknown.len()
    );
    assert!(factor <= 1.0, "{factor:.2}x");

    let mut removed = vec![0x92, 0xac];
    removed.extend(b"BlockRemoved");
    removed.push(0x90);
    let n = (MIB - 16) / removed.len();
    let p = batch_of(n, &removed);
    let (result, peak) = peak_during(|| decode_batch(&p).map(|b| b.events.len()));
    assert_eq!(result, Ok(n));
    let factor = peak as f64 / p.len() as f64;
    eprintln!(
        "{n} empty BlockRemoved in {} bytes: peak {peak} bytes ({factor:.1}x)",
        p.len()
    );
    // 120 bytes per 15-byte event (8x), and up to three times that while the vector grows (its
    // doubled buffer and the old one at once).
    assert!(factor <= 24.0, "{factor:.1}x");
}
