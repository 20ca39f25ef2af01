//! KV event batches as vLLM's `msgspec.msgpack.Encoder()` writes them. The encoder is vLLM's wire format
//! module, [`kinference_api::vllm::kv_events::encode`], the same one the agent's decoder is tested
//! against; this maps the simulator's cache events onto it.

use kinference_api::vllm::kv_events::encode::{self, EncodeOptions};
use kinference_api::vllm::kv_events::{EventBatch, ExtraKey, KvEvent, Lora, Medium};

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

impl From<EventFormat> for encode::EventFormat {
    fn from(f: EventFormat) -> Self {
        match f {
            EventFormat::Map => encode::EventFormat::Map,
            EventFormat::Array => encode::EventFormat::Array,
        }
    }
}

/// Encodes one batch (`KVEventBatch`) as msgspec would.
pub fn encode_batch(
    ts: f64,
    events: &[KvCacheEvent],
    dp_rank: i64,
    format: EventFormat,
) -> Vec<u8> {
    let batch = EventBatch {
        ts,
        events: events.iter().map(to_wire).collect(),
        data_parallel_rank: Some(dp_rank),
    };
    encode::encode_batch(
        &batch,
        EncodeOptions {
            format: format.into(),
            bin_hashes: false,
        },
    )
}

/// A simulated cache event as vLLM publishes it (every simulated block lives on the GPU).
fn to_wire(e: &KvCacheEvent) -> KvEvent {
    match e {
        KvCacheEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora,
            salt,
        } => KvEvent::BlockStored {
            block_hashes: block_hashes.clone(),
            parent_block_hash: *parent_block_hash,
            token_ids: token_ids.clone(),
            block_size: u32::try_from(*block_size).unwrap_or(u32::MAX),
            medium: Medium::Gpu,
            // As vLLM 0.31+: the adapter's name, and again as each block's (untagged) extra key; the
            // salt after it, on the prompt's first block (`to_event_extra_keys`). vLLM 0.32 sends a
            // list with a null per block even when no block has a key.
            lora: lora.as_ref().map(|l| Lora::Name(l.name.clone())),
            extra_keys: match (lora, salt) {
                (None, None) => Vec::new(),
                _ => (0..block_hashes.len())
                    .map(|i| {
                        let mut keys: Vec<ExtraKey> =
                            lora.iter().map(|l| ExtraKey::Str(l.name.clone())).collect();
                        keys.extend(
                            salt.iter()
                                .filter(|_| i == 0)
                                .map(|s| ExtraKey::Str(s.to_string())),
                        );
                        keys
                    })
                    .collect(),
            },
        },
        KvCacheEvent::BlockRemoved { block_hashes } => KvEvent::BlockRemoved {
            block_hashes: block_hashes.clone(),
            medium: Medium::Gpu,
        },
        KvCacheEvent::AllBlocksCleared => KvEvent::AllBlocksCleared,
    }
}
