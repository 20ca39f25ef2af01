//! msgpack encoding of KV event batches, byte-compatible with vLLM's `msgspec.msgpack.Encoder()`:
//! the batch is always the 3-element array `[ts (float64), [events], data_parallel_rank]`; events are
//! maps (`omit_defaults`: `kv_cache_spec_sliding_window` etc. left out when None; vLLM >= 0.24) or
//! positional arrays with every field present (`array_like=True`, vLLM <= 0.23). Integers use the
//! smallest msgpack width, so hashes of 2^63 or more are `uint64` (0xcf), as msgspec writes them.

use rmp::encode::{
    ValueWriteError, write_array_len, write_f64, write_map_len, write_nil, write_sint, write_str,
    write_uint,
};

use crate::sim::cache::KvCacheEvent;

/// The on-wire shape of one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EventFormat {
    /// msgpack maps keyed by field name (vLLM >= 0.24, the default).
    #[default]
    Map,
    /// Positional arrays with the tag first (vLLM 0.10 - 0.23).
    Array,
}

/// vLLM's `MEDIUM_GPU`.
const MEDIUM_GPU: &str = "GPU";
/// The attention kind vLLM reports for a full-attention model.
const SPEC_KIND: &str = "full_attention";

type EncResult = Result<(), ValueWriteError>;

/// Encodes one batch (`KVEventBatch`) as msgspec would.
pub fn encode_batch(
    ts: f64,
    events: &[KvCacheEvent],
    dp_rank: i64,
    format: EventFormat,
) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64 + events.len() * 64);
    // Writing into a Vec cannot fail; the Result only exists for io::Write sinks.
    let _ = write_batch(&mut buf, ts, events, dp_rank, format);
    buf
}

fn write_batch(
    buf: &mut Vec<u8>,
    ts: f64,
    events: &[KvCacheEvent],
    dp_rank: i64,
    format: EventFormat,
) -> EncResult {
    write_array_len(buf, 3)?;
    write_f64(buf, ts)?;
    write_array_len(buf, events.len() as u32)?;
    for e in events {
        match format {
            EventFormat::Map => write_event_map(buf, e)?,
            EventFormat::Array => write_event_array(buf, e)?,
        }
    }
    write_sint(buf, dp_rank)?;
    Ok(())
}

fn write_u64s(buf: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) -> EncResult {
    write_array_len(buf, values.len() as u32)?;
    for v in values {
        write_uint(buf, v)?;
    }
    Ok(())
}

fn write_opt_u64(buf: &mut Vec<u8>, v: Option<u64>) -> EncResult {
    match v {
        Some(v) => write_uint(buf, v).map(drop),
        None => write_nil(buf).map_err(ValueWriteError::InvalidMarkerWrite),
    }
}

fn nil(buf: &mut Vec<u8>) -> EncResult {
    write_nil(buf).map_err(ValueWriteError::InvalidMarkerWrite)
}

/// `extra_keys`: one untagged `None` per block for a plain (no LoRA, no multimodal) request.
fn write_extra_keys(buf: &mut Vec<u8>, n: usize) -> EncResult {
    write_array_len(buf, n as u32)?;
    for _ in 0..n {
        nil(buf)?;
    }
    Ok(())
}

fn write_event_map(buf: &mut Vec<u8>, e: &KvCacheEvent) -> EncResult {
    match e {
        KvCacheEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
        } => {
            // Key order = struct field order, tag first, as the live 0.32 capture shows.
            write_map_len(buf, 11)?;
            write_str(buf, "type")?;
            write_str(buf, "BlockStored")?;
            write_str(buf, "block_hashes")?;
            write_u64s(buf, block_hashes.iter().copied())?;
            write_str(buf, "parent_block_hash")?;
            write_opt_u64(buf, *parent_block_hash)?;
            write_str(buf, "token_ids")?;
            write_u64s(buf, token_ids.iter().map(|&t| u64::from(t)))?;
            write_str(buf, "block_size")?;
            write_uint(buf, *block_size as u64)?;
            write_str(buf, "lora_id")?;
            nil(buf)?;
            write_str(buf, "medium")?;
            write_str(buf, MEDIUM_GPU)?;
            write_str(buf, "lora_name")?;
            nil(buf)?;
            write_str(buf, "extra_keys")?;
            write_extra_keys(buf, block_hashes.len())?;
            write_str(buf, "group_idx")?;
            write_uint(buf, 0)?;
            write_str(buf, "kv_cache_spec_kind")?;
            write_str(buf, SPEC_KIND)?;
        }
        KvCacheEvent::BlockRemoved { block_hashes } => {
            write_map_len(buf, 4)?;
            write_str(buf, "type")?;
            write_str(buf, "BlockRemoved")?;
            write_str(buf, "block_hashes")?;
            write_u64s(buf, block_hashes.iter().copied())?;
            write_str(buf, "medium")?;
            write_str(buf, MEDIUM_GPU)?;
            write_str(buf, "group_idx")?;
            write_uint(buf, 0)?;
        }
        KvCacheEvent::AllBlocksCleared => {
            write_map_len(buf, 1)?;
            write_str(buf, "type")?;
            write_str(buf, "AllBlocksCleared")?;
        }
    }
    Ok(())
}

/// vLLM 0.23's positional layout: every field up to `kv_cache_spec_sliding_window` (BlockStored) and
/// `group_idx` (BlockRemoved), trailing defaults included as nil.
fn write_event_array(buf: &mut Vec<u8>, e: &KvCacheEvent) -> EncResult {
    match e {
        KvCacheEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
        } => {
            write_array_len(buf, 12)?;
            write_str(buf, "BlockStored")?;
            write_u64s(buf, block_hashes.iter().copied())?;
            write_opt_u64(buf, *parent_block_hash)?;
            write_u64s(buf, token_ids.iter().map(|&t| u64::from(t)))?;
            write_uint(buf, *block_size as u64)?;
            nil(buf)?; // lora_id
            write_str(buf, MEDIUM_GPU)?;
            nil(buf)?; // lora_name
            write_extra_keys(buf, block_hashes.len())?;
            write_uint(buf, 0)?; // group_idx
            write_str(buf, SPEC_KIND)?;
            nil(buf)?; // kv_cache_spec_sliding_window
        }
        KvCacheEvent::BlockRemoved { block_hashes } => {
            write_array_len(buf, 4)?;
            write_str(buf, "BlockRemoved")?;
            write_u64s(buf, block_hashes.iter().copied())?;
            write_str(buf, MEDIUM_GPU)?;
            write_uint(buf, 0)?;
        }
        KvCacheEvent::AllBlocksCleared => {
            write_array_len(buf, 1)?;
            write_str(buf, "AllBlocksCleared")?;
        }
    }
    Ok(())
}
