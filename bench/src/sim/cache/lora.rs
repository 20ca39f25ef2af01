//! LoRA adapters a simulated worker serves beside its base model (vLLM's `--lora-modules`), as the
//! prefix cache tells them apart: an adapter's blocks chain from a root digest of its own.
//!
//! A request names an adapter in `"model"`. vLLM puts the adapter into every block's hash (through the
//! block's extra keys) and publishes its `lora_name` and those extra keys in `BlockStored`; blocks
//! computed under one adapter are therefore never hits for the base model or another adapter. The
//! simulator gets the same separation by chaining an adapter's blocks from a root of its own, and
//! publishes the same event fields as vLLM 0.31+ (`lora_id`, `lora_name`, and the adapter's name as
//! each block's extra key).

use sha2::{Digest, Sha256};

use super::hash::{BlockDigest, none_hash};

/// One loaded adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraAdapter {
    /// The name clients put in `"model"` (and `/v1/models` lists with the base model as `parent`).
    pub name: String,
    /// vLLM's `lora_int_id`: 1 for the first adapter loaded, 2 for the next, ...
    pub id: i64,
    /// The parent digest of the first block of the adapter's prompts.
    root: BlockDigest,
}

impl LoraAdapter {
    /// The adapter `name`, loaded as number `id`.
    pub fn new(name: &str, id: i64) -> Self {
        let mut h = Sha256::new();
        h.update(none_hash());
        h.update(b"lora");
        h.update(name.as_bytes());
        Self {
            name: name.to_string(),
            id,
            root: h.finalize().into(),
        }
    }

    /// The parent digest of the first block of the adapter's prompts.
    pub fn root(&self) -> &BlockDigest {
        &self.root
    }
}
