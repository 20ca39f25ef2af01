//! vLLM KV-cache event batches: the payload of each ZMQ message a worker publishes.
//!
//! A batch is always the msgpack array `[ts, [events...], data_parallel_rank]`. Each event is either a
//! positional array tagged by its first element (vLLM <= 0.23) or a map with a `"type"` key (>= 0.24).
//! Both are accepted, with any header width, extra or unknown fields skipped, and block hashes given
//! either as integers or as byte strings (whose last 8 bytes, big-endian, are the 64-bit hash vLLM would
//! publish as an int). See `docs/vllm-interfaces.md` section 1.2.
//!
//! A `BlockStored` also keeps what vLLM hashed into its blocks besides the tokens: the LoRA adapter
//! (`lora_name`, or the older `lora_id`) and each block's `extra_keys` (multimodal identifiers, cache
//! salt, the adapter's name again), so a block computed for an adapter or an image is never taken for
//! the same tokens of the base model (section 2.4).

pub mod encode;
mod msgpack;

use msgpack::{Int, Reader};

/// A decoded KV event batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EventBatch {
    /// Publisher wall-clock time, seconds since the Unix epoch.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
}

/// Where a block lives. vLLM publishes `"GPU"` for its device pool; offload tiers use other names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Medium {
    /// `"GPU"`, or absent (vLLM <= 0.10.1 had no medium field).
    #[default]
    Gpu,
    Cpu,
    Other,
}

impl Medium {
    fn from_name(name: &[u8]) -> Self {
        match name {
            b"GPU" | b"gpu" => Medium::Gpu,
            b"CPU" | b"cpu" => Medium::Cpu,
            _ => Medium::Other,
        }
    }
}

/// One KV-cache event.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    /// Full blocks newly cached, in chain order.
    BlockStored {
        /// The engine's hash of each block (u64, or the low 8 bytes of a digest).
        block_hashes: Vec<u64>,
        /// The engine hash of the block before the first one; `None` at the start of a sequence.
        parent_block_hash: Option<u64>,
        /// The tokens of all the blocks, concatenated.
        token_ids: Vec<u32>,
        block_size: u32,
        medium: Medium,
        /// The LoRA adapter the blocks were computed with (`None`: the base model).
        lora: Option<Lora>,
        /// Each block's extra keys, in block order (an empty list: none). Empty when no block has any.
        extra_keys: Vec<Vec<ExtraKey>>,
    },
    /// Blocks evicted.
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Medium,
    },
    /// The whole prefix cache was reset.
    AllBlocksCleared,
    /// An event type this agent does not know (a newer vLLM); ignored: [`decode_batch`] checks its
    /// structure and keeps nothing of it (two bytes of a message must not become a 120-byte event).
    Unknown,
}

/// A LoRA adapter as a `BlockStored` names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Lora {
    /// `lora_name` (vLLM >= 0.14): the name clients put in `"model"` and `/v1/models` lists.
    Name(String),
    /// Only `lora_id` (older vLLM): the engine's number for the adapter, which no client request names.
    Id(i64),
}

/// One element of a block's `extra_keys`, as vLLM publishes it (untagged, section 2.4): a string
/// (an adapter's name, a cache salt, a multimodal hash) or any other value (a multimodal
/// `(identifier, offset)` pair, a digest), kept as its msgpack bytes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ExtraKey {
    Str(String),
    Raw(Vec<u8>),
}

impl KvEvent {
    /// Block events carried: blocks stored or removed (a clear counts as one).
    pub fn block_events(&self) -> usize {
        match self {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes.len(),
            KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.len(),
            KvEvent::AllBlocksCleared => 1,
            KvEvent::Unknown => 0,
        }
    }
}

/// Why a payload could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("payload ends early (at byte {pos})")]
    Eof { pos: usize },
    #[error("expected {expected} at byte {pos}, found marker 0x{marker:02x}")]
    Unexpected {
        expected: &'static str,
        marker: u8,
        pos: usize,
    },
    #[error("integer out of range at byte {pos}")]
    OutOfRange { pos: usize },
    #[error("malformed event: {0}")]
    BadEvent(&'static str),
}

/// The fewest bytes of an event that is kept: `["BlockRemoved", []]` (an event of an unknown type,
/// `[""]`, is 2 bytes, but nothing is kept of it).
const MIN_EVENT_BYTES: usize = 15;

/// Most elements of a list reserved before any is decoded; a longer list grows as its elements
/// actually decode.
const MAX_RESERVED: usize = 4096;

/// The capacity to reserve for a list that declares `declared` elements of at least `min_bytes`
/// bytes each: no more than the rest of the payload can hold, and at most [`MAX_RESERVED`]. A peer
/// writes the count; reserving it as written let a 16 MiB message declaring 2^32-1 events hold
/// 1.9 GB (16 Mi x a 120-byte `KvEvent`) before the first event failed to decode.
fn capacity(r: &Reader<'_>, declared: usize, min_bytes: usize) -> usize {
    declared
        .min(r.remaining() / min_bytes.max(1))
        .min(MAX_RESERVED)
}

/// Decodes one batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let n = r.array_len()?;
    if n < 2 {
        return Err(DecodeError::BadEvent("batch has fewer than 2 elements"));
    }
    let ts = if r.nil()? { 0.0 } else { r.f64()? };
    let n_events = r.array_len()?;
    let mut events = Vec::with_capacity(capacity(&r, n_events, MIN_EVENT_BYTES));
    for _ in 0..n_events {
        match decode_event(&mut r)? {
            KvEvent::Unknown => {}
            event => events.push(event),
        }
    }
    let mut data_parallel_rank = None;
    if n >= 3 {
        if !r.nil()? {
            data_parallel_rank = Some(match r.int()? {
                Int::U(v) => i64::try_from(v).unwrap_or(i64::MAX),
                Int::I(v) => v,
            });
        }
        for _ in 3..n {
            r.skip()?;
        }
    }
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

fn decode_event(r: &mut Reader<'_>) -> Result<KvEvent, DecodeError> {
    match r.peek()? {
        0x80..=0x8f | 0xde | 0xdf => decode_map_event(r),
        _ => decode_array_event(r),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn tag(name: &[u8]) -> Tag {
    match name {
        b"BlockStored" => Tag::Stored,
        b"BlockRemoved" => Tag::Removed,
        b"AllBlocksCleared" => Tag::Cleared,
        _ => Tag::Unknown,
    }
}

/// `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]`.
fn decode_array_event(r: &mut Reader<'_>) -> Result<KvEvent, DecodeError> {
    let n = r.array_len()?;
    if n == 0 {
        return Err(DecodeError::BadEvent("empty event array"));
    }
    let t = tag(r.bytes()?);
    let mut read = 1;
    let event = match t {
        Tag::Stored => {
            if n < 5 {
                return Err(DecodeError::BadEvent(
                    "BlockStored array has fewer than 5 elements",
                ));
            }
            let block_hashes = hashes(r)?;
            let parent_block_hash = opt_hash(r)?;
            let token_ids = tokens(r)?;
            let block_size = r.u32()?;
            read = 5;
            let mut medium = Medium::Gpu;
            let mut lora_id = None;
            let mut lora_name = None;
            let mut extra_keys = Vec::new();
            if n >= 6 {
                lora_id = opt_int(r)?;
                read = 6;
            }
            if n >= 7 {
                medium = opt_medium(r)?;
                read = 7;
            }
            if n >= 8 {
                lora_name = opt_str(r)?;
                read = 8;
            }
            if n >= 9 {
                extra_keys = block_extra_keys(r)?;
                read = 9;
            }
            check_extra_keys(&block_hashes, &extra_keys)?;
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora: lora(lora_name, lora_id),
                extra_keys,
            }
        }
        Tag::Removed => {
            if n < 2 {
                return Err(DecodeError::BadEvent(
                    "BlockRemoved array has no block_hashes",
                ));
            }
            let block_hashes = hashes(r)?;
            read = 2;
            let mut medium = Medium::Gpu;
            if n >= 3 {
                medium = opt_medium(r)?;
                read = 3;
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            }
        }
        Tag::Cleared => KvEvent::AllBlocksCleared,
        Tag::Unknown => KvEvent::Unknown,
    };
    for _ in read..n {
        r.skip()?;
    }
    Ok(event)
}

/// `{"type": "BlockStored", "block_hashes": ..., ...}`, fields in any order.
fn decode_map_event(r: &mut Reader<'_>) -> Result<KvEvent, DecodeError> {
    let n = r.map_len()?;
    let mut t = None;
    let mut block_hashes = None;
    let mut parent_block_hash = None;
    let mut token_ids = None;
    let mut block_size = None;
    let mut medium = Medium::Gpu;
    let mut lora_id = None;
    let mut lora_name = None;
    let mut extra_keys = Vec::new();
    for _ in 0..n {
        let key = match r.peek()? {
            0xa0..=0xbf | 0xd9 | 0xda | 0xdb => r.bytes()?,
            _ => {
                r.skip()?;
                r.skip()?;
                continue;
            }
        };
        match key {
            b"type" => t = Some(tag(r.bytes()?)),
            b"block_hashes" => block_hashes = Some(hashes(r)?),
            b"parent_block_hash" => parent_block_hash = opt_hash(r)?,
            b"token_ids" => token_ids = Some(tokens(r)?),
            b"block_size" => block_size = Some(r.u32()?),
            b"medium" => medium = opt_medium(r)?,
            b"lora_id" => lora_id = opt_int(r)?,
            b"lora_name" => lora_name = opt_str(r)?,
            b"extra_keys" => extra_keys = block_extra_keys(r)?,
            _ => r.skip()?,
        }
    }
    match t.ok_or(DecodeError::BadEvent("event map has no \"type\""))? {
        Tag::Stored => Ok(KvEvent::BlockStored {
            block_hashes: block_hashes
                .ok_or(DecodeError::BadEvent("BlockStored without block_hashes"))
                .and_then(|hashes| check_extra_keys(&hashes, &extra_keys).map(|()| hashes))?,
            parent_block_hash,
            token_ids: token_ids.ok_or(DecodeError::BadEvent("BlockStored without token_ids"))?,
            block_size: block_size
                .ok_or(DecodeError::BadEvent("BlockStored without block_size"))?,
            medium,
            lora: lora(lora_name, lora_id),
            extra_keys,
        }),
        Tag::Removed => Ok(KvEvent::BlockRemoved {
            block_hashes: block_hashes
                .ok_or(DecodeError::BadEvent("BlockRemoved without block_hashes"))?,
            medium,
        }),
        Tag::Cleared => Ok(KvEvent::AllBlocksCleared),
        Tag::Unknown => Ok(KvEvent::Unknown),
    }
}

/// A block hash: an int (taken as its 64-bit two's-complement value) or bytes (last 8, big-endian).
fn hash(r: &mut Reader<'_>) -> Result<u64, DecodeError> {
    match r.peek()? {
        0xa0..=0xbf | 0xc4..=0xc6 | 0xd9..=0xdb => {
            let b = r.bytes()?;
            let tail = &b[b.len().saturating_sub(8)..];
            Ok(tail.iter().fold(0u64, |acc, &x| (acc << 8) | x as u64))
        }
        _ => Ok(match r.int()? {
            Int::U(v) => v,
            Int::I(v) => v as u64,
        }),
    }
}

fn opt_hash(r: &mut Reader<'_>) -> Result<Option<u64>, DecodeError> {
    if r.nil()? {
        Ok(None)
    } else {
        hash(r).map(Some)
    }
}

fn hashes(r: &mut Reader<'_>) -> Result<Vec<u64>, DecodeError> {
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(capacity(r, n, 1));
    for _ in 0..n {
        out.push(hash(r)?);
    }
    Ok(out)
}

fn tokens(r: &mut Reader<'_>) -> Result<Vec<u32>, DecodeError> {
    let n = r.array_len()?;
    // A prefill's blocks carry thousands of tokens: more reserved than for other lists (256 KiB at
    // most), still no more than the bytes can hold (a token takes at least one).
    let mut out = Vec::with_capacity(n.min(r.remaining()).min(1 << 16));
    for _ in 0..n {
        out.push(r.u32()?);
    }
    Ok(out)
}

fn opt_int(r: &mut Reader<'_>) -> Result<Option<i64>, DecodeError> {
    if r.nil()? {
        return Ok(None);
    }
    Ok(Some(match r.int()? {
        Int::U(v) => i64::try_from(v).unwrap_or(i64::MAX),
        Int::I(v) => v,
    }))
}

fn opt_str(r: &mut Reader<'_>) -> Result<Option<String>, DecodeError> {
    if r.nil()? {
        return Ok(None);
    }
    Ok(Some(String::from_utf8_lossy(r.bytes()?).into_owned()))
}

/// The adapter of a `BlockStored`: its name when vLLM sent one, else its number. An empty name is no
/// adapter (vLLM never names one so).
fn lora(name: Option<String>, id: Option<i64>) -> Option<Lora> {
    match (name, id) {
        (Some(name), _) if !name.is_empty() => Some(Lora::Name(name)),
        (_, Some(id)) if id > 0 => Some(Lora::Id(id)),
        _ => None,
    }
}

/// vLLM sends one `extra_keys` entry per block: with any other count, which key belongs to which block
/// cannot be told, and the event is refused rather than keyed wrongly.
fn check_extra_keys<H>(
    block_hashes: &[H],
    extra_keys: &[Vec<ExtraKey>],
) -> Result<(), DecodeError> {
    if extra_keys.is_empty() || extra_keys.len() == block_hashes.len() {
        Ok(())
    } else {
        Err(DecodeError::BadEvent(
            "BlockStored has a different number of extra_keys entries than block_hashes",
        ))
    }
}

/// `extra_keys`: `nil`, or one entry per block, each `nil` or a tuple of keys (a lone value is taken
/// as a one-key tuple). Empty when no block has a key, so plain events carry nothing.
fn block_extra_keys(r: &mut Reader<'_>) -> Result<Vec<Vec<ExtraKey>>, DecodeError> {
    if r.nil()? {
        return Ok(Vec::new());
    }
    let n = r.array_len()?;
    let mut blocks = Vec::with_capacity(capacity(r, n, 1));
    for _ in 0..n {
        let keys = match r.peek()? {
            0xc0 => {
                r.nil()?;
                Vec::new()
            }
            0x90..=0x9f | 0xdc | 0xdd => {
                let k = r.array_len()?;
                let mut keys = Vec::with_capacity(capacity(r, k, 1).min(64));
                for _ in 0..k {
                    keys.push(extra_key(r)?);
                }
                keys
            }
            _ => vec![extra_key(r)?],
        };
        blocks.push(keys);
    }
    if blocks.iter().all(Vec::is_empty) {
        blocks.clear();
    }
    Ok(blocks)
}

fn extra_key(r: &mut Reader<'_>) -> Result<ExtraKey, DecodeError> {
    match r.peek()? {
        0xa0..=0xbf | 0xd9..=0xdb => Ok(ExtraKey::Str(
            String::from_utf8_lossy(r.bytes()?).into_owned(),
        )),
        _ => Ok(ExtraKey::Raw(r.raw()?.to_vec())),
    }
}

fn opt_medium(r: &mut Reader<'_>) -> Result<Medium, DecodeError> {
    if r.nil()? {
        return Ok(Medium::Gpu);
    }
    match r.peek()? {
        0xa0..=0xbf | 0xd9..=0xdb => Ok(Medium::from_name(r.bytes()?)),
        _ => {
            r.skip()?;
            Ok(Medium::Other)
        }
    }
}

#[cfg(test)]
mod tests;
