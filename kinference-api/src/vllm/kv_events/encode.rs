//! Encodes event batches exactly as vLLM's publisher does, in either event format.
//!
//! The simulator in `bench/` publishes with it; the agent's tests, benchmarks and fuzz seeds use it to
//! produce the real wire bytes (msgspec's field order, nils for required-but-empty fields, the smallest
//! integer width, so hashes of 2^63 or more are `uint64`) rather than a convenient variant.

use super::{EventBatch, ExtraKey, KvEvent, Lora, Medium};

/// How events inside a batch are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EventFormat {
    /// Maps with a `"type"` key (vLLM >= 0.24).
    #[default]
    Map,
    /// Positional arrays tagged by their first element (vLLM <= 0.23).
    Array,
}

/// Encoding knobs that vary between vLLM versions and settings.
#[derive(Clone, Copy, Debug, Default)]
pub struct EncodeOptions {
    pub format: EventFormat,
    /// Hashes as 32-byte `bin` digests (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) instead of u64.
    pub bin_hashes: bool,
}

/// Encodes one batch payload.
pub fn encode_batch(batch: &EventBatch, opts: EncodeOptions) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 8 * batch.events.len() * 40);
    array_len(&mut out, 3);
    out.push(0xcb);
    out.extend_from_slice(&batch.ts.to_be_bytes());
    array_len(&mut out, batch.events.len() as u32);
    for ev in &batch.events {
        encode_event(&mut out, ev, opts);
    }
    match batch.data_parallel_rank {
        Some(r) => int(&mut out, r),
        None => out.push(0xc0),
    }
    out
}

fn encode_event(out: &mut Vec<u8>, ev: &KvEvent, opts: EncodeOptions) {
    match (ev, opts.format) {
        (
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora,
                extra_keys,
            },
            EventFormat::Map,
        ) => {
            // vLLM 0.32 sends 11 entries; the ones with defaults appear only when not default.
            map_len(out, 11);
            kv_str(out, "type", "BlockStored");
            str(out, "block_hashes");
            hash_list(out, block_hashes, opts);
            str(out, "parent_block_hash");
            opt_hash(out, *parent_block_hash, opts);
            str(out, "token_ids");
            tokens(out, token_ids);
            str(out, "block_size");
            int(out, *block_size as i64);
            str(out, "lora_id");
            lora_id(out, lora.as_ref());
            kv_str(out, "medium", medium_name(*medium));
            str(out, "lora_name");
            lora_name(out, lora.as_ref());
            str(out, "extra_keys");
            block_extra_keys(out, block_hashes.len(), extra_keys);
            str(out, "group_idx");
            int(out, 0);
            kv_str(out, "kv_cache_spec_kind", "full_attention");
        }
        (
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora,
                extra_keys,
            },
            EventFormat::Array,
        ) => {
            array_len(out, 12);
            str(out, "BlockStored");
            hash_list(out, block_hashes, opts);
            opt_hash(out, *parent_block_hash, opts);
            tokens(out, token_ids);
            int(out, *block_size as i64);
            lora_id(out, lora.as_ref());
            str(out, medium_name(*medium));
            lora_name(out, lora.as_ref());
            block_extra_keys(out, block_hashes.len(), extra_keys);
            int(out, 0); // group_idx
            str(out, "full_attention");
            out.push(0xc0); // kv_cache_spec_sliding_window
        }
        (
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            },
            EventFormat::Map,
        ) => {
            map_len(out, 4);
            kv_str(out, "type", "BlockRemoved");
            str(out, "block_hashes");
            hash_list(out, block_hashes, opts);
            kv_str(out, "medium", medium_name(*medium));
            str(out, "group_idx");
            int(out, 0);
        }
        (
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            },
            EventFormat::Array,
        ) => {
            array_len(out, 4);
            str(out, "BlockRemoved");
            hash_list(out, block_hashes, opts);
            str(out, medium_name(*medium));
            int(out, 0);
        }
        (KvEvent::AllBlocksCleared, EventFormat::Map) => {
            map_len(out, 1);
            kv_str(out, "type", "AllBlocksCleared");
        }
        (KvEvent::AllBlocksCleared, EventFormat::Array) => {
            array_len(out, 1);
            str(out, "AllBlocksCleared");
        }
        (KvEvent::Unknown, EventFormat::Map) => {
            map_len(out, 1);
            kv_str(out, "type", "SomethingNew");
        }
        (KvEvent::Unknown, EventFormat::Array) => {
            array_len(out, 1);
            str(out, "SomethingNew");
        }
    }
}

/// `lora_id`: vLLM sends the adapter's number beside its name; a named adapter here is number 1.
fn lora_id(out: &mut Vec<u8>, lora: Option<&Lora>) {
    match lora {
        None => out.push(0xc0),
        Some(Lora::Id(id)) => int(out, *id),
        Some(Lora::Name(_)) => int(out, 1),
    }
}

fn lora_name(out: &mut Vec<u8>, lora: Option<&Lora>) {
    match lora {
        Some(Lora::Name(name)) => str(out, name),
        _ => out.push(0xc0),
    }
}

/// `extra_keys`: one entry per block, an untagged `None` for a block without keys (a plain request's
/// blocks are all `None`), else the tuple of its keys.
fn block_extra_keys(out: &mut Vec<u8>, blocks: usize, extra_keys: &[Vec<ExtraKey>]) {
    array_len(out, blocks as u32);
    for i in 0..blocks {
        match extra_keys.get(i) {
            Some(keys) if !keys.is_empty() => {
                array_len(out, keys.len() as u32);
                for key in keys {
                    match key {
                        ExtraKey::Str(s) => str(out, s),
                        ExtraKey::Raw(bytes) => out.extend_from_slice(bytes),
                    }
                }
            }
            _ => out.push(0xc0),
        }
    }
}

fn medium_name(m: Medium) -> &'static str {
    match m {
        Medium::Gpu => "GPU",
        Medium::Cpu => "CPU",
        Medium::Other => "STORAGE",
    }
}

fn hash_list(out: &mut Vec<u8>, hashes: &[u64], opts: EncodeOptions) {
    array_len(out, hashes.len() as u32);
    for &h in hashes {
        hash(out, h, opts);
    }
}

fn hash(out: &mut Vec<u8>, h: u64, opts: EncodeOptions) {
    if opts.bin_hashes {
        // A 32-byte digest whose last 8 bytes are the published u64.
        out.extend_from_slice(&[0xc4, 32]);
        out.extend_from_slice(&h.rotate_left(17).to_be_bytes());
        out.extend_from_slice(&[0xab; 16]);
        out.extend_from_slice(&h.to_be_bytes());
    } else {
        uint(out, h);
    }
}

fn opt_hash(out: &mut Vec<u8>, h: Option<u64>, opts: EncodeOptions) {
    match h {
        Some(h) => hash(out, h, opts),
        None => out.push(0xc0),
    }
}

fn tokens(out: &mut Vec<u8>, tokens: &[u32]) {
    array_len(out, tokens.len() as u32);
    for &t in tokens {
        uint(out, t as u64);
    }
}

fn kv_str(out: &mut Vec<u8>, k: &str, v: &str) {
    str(out, k);
    str(out, v);
}

/// msgpack str, minimal header.
pub(crate) fn str(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if n < 256 {
        out.extend_from_slice(&[0xd9, n as u8]);
    } else if n < 65536 {
        out.push(0xda);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

/// msgpack unsigned int, minimal width (as msgspec writes it).
pub(crate) fn uint(out: &mut Vec<u8>, v: u64) {
    if v < 128 {
        out.push(v as u8);
    } else if v < 256 {
        out.extend_from_slice(&[0xcc, v as u8]);
    } else if v < 65536 {
        out.push(0xcd);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= u32::MAX as u64 {
        out.push(0xce);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// msgpack int, minimal width.
pub(crate) fn int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        uint(out, v as u64);
    } else if v >= -32 {
        out.push(v as i8 as u8);
    } else {
        out.push(0xd3);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// msgpack array header, minimal width.
pub(crate) fn array_len(out: &mut Vec<u8>, n: u32) {
    if n < 16 {
        out.push(0x90 | n as u8);
    } else if n < 65536 {
        out.push(0xdc);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdd);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

/// msgpack map header, minimal width.
pub(crate) fn map_len(out: &mut Vec<u8>, n: u32) {
    if n < 16 {
        out.push(0x80 | n as u8);
    } else if n < 65536 {
        out.push(0xde);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdf);
        out.extend_from_slice(&n.to_be_bytes());
    }
}
