//! One worker's KV-cache view: the set of Kinference block keys it holds.
//!
//! Keys are recomputed from each `BlockStored`'s `token_ids` with the model's [`KeyHasher`], chained from
//! the parent block through an engine-hash -> key map. The same map resolves `BlockRemoved`, so vLLM's
//! hash algorithm, seed and width never matter. Changes since the last [`WorkerState::take_delta`] are
//! tracked as net differences, so a block added and removed inside one summary window is never sent.
//!
//! A key is held in the GPU tier when any GPU block maps to it, else in a lower tier (vLLM's CPU
//! offloading reports `medium: "CPU"`; disk and LMCache other names) when a block there does: the
//! summary sends the two sets apart ([`WorkerState::keys`], [`WorkerState::offloaded_keys`]), since a
//! hit in a lower tier costs loading it back, not nothing.
//!
//! Blocks computed for a LoRA adapter are keyed under the adapter's name (the model name its requests
//! carry), and a block whose vLLM hash covered other extra keys (an image, a cache salt) gets a key
//! mixed with them: neither is ever taken for the base model's blocks of the same tokens.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::time::{SystemTime, UNIX_EPOCH};

use kinference_api::{BlockKey, KeyHasher, str_extra_key, with_extra_keys};

use crate::kv_events::{ExtraKey, KvEvent, Lora, Medium};

/// A fast hasher for keys that are already well-mixed 64-bit hashes (one multiply and a fold).
#[derive(Default, Clone, Copy)]
pub struct U64Hasher(u64);

impl Hasher for U64Hasher {
    fn finish(&self) -> u64 {
        let x = self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        x ^ (x >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8)) ^ b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = self.0.rotate_left(5) ^ v;
    }
    fn write_u8(&mut self, v: u8) {
        self.0 = self.0.rotate_left(5) ^ v as u64;
    }
    fn write_usize(&mut self, v: usize) {
        self.0 = self.0.rotate_left(5) ^ v as u64;
    }
    fn write_isize(&mut self, v: isize) {
        self.0 = self.0.rotate_left(5) ^ v as u64;
    }
}

type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<U64Hasher>>;

/// An engine block: its published hash and the tier it lives in (the same hash may sit in two tiers).
type EngineBlock = (u64, Medium);

/// Counts from applying events, for metrics and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Block events applied (each stored or removed block, each clear).
    pub block_events: u64,
    /// Stored blocks skipped because their parent was never seen (missed events).
    pub unresolved_parents: u64,
    /// Removals of blocks this view never held.
    pub unknown_removals: u64,
    /// Stored blocks dropped because the worker exceeded the block cap.
    pub dropped_over_cap: u64,
    /// `BlockStored` whose `token_ids` did not cover all its hashes (blocks without tokens are skipped).
    pub short_token_lists: u64,
}

impl ApplyStats {
    fn add(&mut self, o: ApplyStats) {
        self.block_events += o.block_events;
        self.unresolved_parents += o.unresolved_parents;
        self.unknown_removals += o.unknown_removals;
        self.dropped_over_cap += o.dropped_over_cap;
        self.short_token_lists += o.short_token_lists;
    }
}

/// Net change of a worker's key sets since the previous delta.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyDelta {
    /// The worker dropped everything before `added` (the gateway clears its view of the worker first).
    pub cleared: bool,
    /// Keys now held in the GPU tier.
    pub added: Vec<BlockKey>,
    /// Keys no longer held in the GPU tier.
    pub removed: Vec<BlockKey>,
    /// Keys now held only in a lower tier.
    pub offloaded_added: Vec<BlockKey>,
    /// Keys no longer held only in a lower tier.
    pub offloaded_removed: Vec<BlockKey>,
}

impl KeyDelta {
    pub fn is_empty(&self) -> bool {
        !self.cleared
            && self.added.is_empty()
            && self.removed.is_empty()
            && self.offloaded_added.is_empty()
            && self.offloaded_removed.is_empty()
    }
}

/// Where a key is held: the GPU tier wins over a lower one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// At least one GPU block maps to it.
    Gpu,
    /// Only blocks of lower tiers (CPU offload, disk, LMCache) do.
    Offloaded,
}

/// Engine blocks mapping to one key, per tier.
#[derive(Clone, Copy, Debug, Default)]
struct Holding {
    gpu: u32,
    lower: u32,
}

impl Holding {
    fn tier(self) -> Option<Tier> {
        if self.gpu > 0 {
            Some(Tier::Gpu)
        } else if self.lower > 0 {
            Some(Tier::Offloaded)
        } else {
            None
        }
    }

    fn count(&mut self, medium: Medium) -> &mut u32 {
        match medium {
            Medium::Gpu => &mut self.gpu,
            Medium::Cpu | Medium::Other => &mut self.lower,
        }
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One worker's block keys and the bookkeeping to keep them exact.
pub struct WorkerState {
    hasher: KeyHasher,
    block_size: Option<u32>,
    engine: FastMap<EngineBlock, BlockKey>,
    /// Key -> number of engine blocks mapping to it per tier (or vLLM extra keys we do not model).
    keys: FastMap<BlockKey, Holding>,
    /// Keys touched since the last delta -> their tier at that delta.
    touched: FastMap<BlockKey, Option<Tier>>,
    cleared: bool,
    /// When the state was last cleared, Unix seconds (a restart seen one way need not be acted on again
    /// when it is seen the other way: [`WorkerState::restarted`]).
    cleared_at_unix: Option<f64>,
    /// [`WorkerState::restarted`] cleared the state; the event sequence's restart is the same one.
    restart_noted: bool,
    max_blocks: usize,
}

impl WorkerState {
    /// An empty view for a worker serving `model`, holding at most `max_blocks` engine blocks.
    pub fn new(model: &str, max_blocks: usize) -> Self {
        Self {
            hasher: KeyHasher::for_model(model),
            block_size: None,
            engine: FastMap::default(),
            keys: FastMap::default(),
            touched: FastMap::default(),
            cleared: false,
            cleared_at_unix: None,
            restart_noted: false,
            max_blocks,
        }
    }

    /// Tokens per block, once an event has told us.
    pub fn block_size(&self) -> Option<u32> {
        self.block_size
    }

    /// Distinct keys held, in any tier.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether the worker holds `key`, in any tier.
    pub fn contains(&self, key: BlockKey) -> bool {
        self.keys.contains_key(&key)
    }

    /// Where the worker holds `key`.
    pub fn tier(&self, key: BlockKey) -> Option<Tier> {
        self.keys.get(&key).and_then(|h| h.tier())
    }

    /// Every key held in the GPU tier, in no particular order.
    pub fn keys(&self) -> Vec<BlockKey> {
        self.keys_in(Tier::Gpu)
    }

    /// Every key held only in a lower tier, in no particular order.
    pub fn offloaded_keys(&self) -> Vec<BlockKey> {
        self.keys_in(Tier::Offloaded)
    }

    fn keys_in(&self, tier: Tier) -> Vec<BlockKey> {
        self.keys
            .iter()
            .filter(|(_, h)| h.tier() == Some(tier))
            .map(|(k, _)| *k)
            .collect()
    }

    /// Applies one event.
    pub fn apply(&mut self, event: &KvEvent) -> ApplyStats {
        let mut stats = ApplyStats::default();
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora,
                extra_keys,
            } => self.store(
                StoredBlocks {
                    hashes: block_hashes,
                    parent: *parent_block_hash,
                    tokens: token_ids,
                    block_size: *block_size,
                    medium: *medium,
                    lora: lora.as_ref(),
                    extra_keys,
                },
                &mut stats,
            ),
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                for &h in block_hashes {
                    self.remove((h, *medium), &mut stats);
                }
                self.maybe_shrink();
            }
            KvEvent::AllBlocksCleared => {
                self.clear();
                stats.block_events += 1;
            }
            KvEvent::Unknown => {}
        }
        stats
    }

    /// Applies every event of a batch.
    pub fn apply_all<'a>(&mut self, events: impl IntoIterator<Item = &'a KvEvent>) -> ApplyStats {
        let mut stats = ApplyStats::default();
        for e in events {
            stats.add(self.apply(e));
        }
        stats
    }

    /// Drops every block (AllBlocksCleared, or the engine restarted).
    pub fn clear(&mut self) {
        self.engine = FastMap::default();
        self.keys = FastMap::default();
        self.touched = FastMap::default();
        self.cleared = true;
        self.cleared_at_unix = Some(unix_now());
    }

    /// The worker's metrics say its process started (again) at `started_unix`: its cache is empty. Drops
    /// every block unless the state was cleared since that start already (the engine's new event sequence
    /// got there first). Returns whether it cleared; if so, the event sequence's restart, when it comes,
    /// is this one ([`WorkerState::take_restart_note`]).
    ///
    /// A restarted worker sends its first KV event only once it serves a request, and until then the
    /// router would believe it still holds its old prompts; its metrics show the restart within one
    /// scrape of its coming back.
    pub fn restarted(&mut self, started_unix: f64) -> bool {
        if self.cleared_at_unix.is_some_and(|t| t >= started_unix) {
            return false;
        }
        self.clear();
        self.restart_noted = true;
        true
    }

    /// Whether [`WorkerState::restarted`] already handled the restart the event sequence now shows (the
    /// note is consumed).
    pub fn take_restart_note(&mut self) -> bool {
        std::mem::take(&mut self.restart_noted)
    }

    fn store(&mut self, stored: StoredBlocks<'_>, stats: &mut ApplyStats) {
        let StoredBlocks {
            hashes,
            parent,
            tokens,
            block_size,
            medium,
            lora,
            extra_keys,
        } = stored;
        if block_size == 0 {
            stats.short_token_lists += 1;
            return;
        }
        self.block_size = Some(block_size);
        let mut parent_key = match parent {
            None => None,
            Some(h) => match self
                .engine
                .get(&(h, medium))
                .or_else(|| self.engine.get(&(h, Medium::Gpu)))
            {
                Some(&k) => Some(k),
                None => {
                    // Without the parent's key every key of this chain would be wrong: skip it.
                    stats.unresolved_parents += hashes.len() as u64;
                    return;
                }
            },
        };
        let bs = block_size as usize;
        let full_blocks = tokens.len() / bs;
        if full_blocks < hashes.len() {
            stats.short_token_lists += 1;
        }
        let hasher = match lora {
            None => self.hasher,
            Some(Lora::Name(name)) => KeyHasher::for_model(name),
            // No request names an adapter by number: its blocks get keys no prompt produces.
            Some(Lora::Id(id)) => KeyHasher::for_model(&format!("\0lora_id={id}")),
        };
        let mut extra = Vec::new();
        for (i, &h) in hashes.iter().take(full_blocks).enumerate() {
            let mut key = hasher.block_key(parent_key, &tokens[i * bs..(i + 1) * bs]);
            if let Some(keys) = extra_keys.get(i) {
                extra.clear();
                encode_extra_keys(keys, lora, &mut extra);
                if !extra.is_empty() {
                    key = with_extra_keys(key, &extra);
                }
            }
            parent_key = Some(key);
            stats.block_events += 1;
            match self.engine.get(&(h, medium)) {
                Some(&old) if old == key => continue,
                Some(&old) => self.release(old, medium),
                None if self.engine.len() >= self.max_blocks => {
                    stats.dropped_over_cap += 1;
                    continue;
                }
                None => {}
            }
            self.engine.insert((h, medium), key);
            let holding = self.keys.entry(key).or_default();
            let before = holding.tier();
            *holding.count(medium) += 1;
            if holding.tier() != before {
                self.touch(key, before);
            }
        }
    }

    fn remove(&mut self, block: EngineBlock, stats: &mut ApplyStats) {
        stats.block_events += 1;
        match self.engine.remove(&block) {
            Some(key) => self.release(key, block.1),
            None => stats.unknown_removals += 1,
        }
    }

    /// One engine block of `medium` no longer maps to `key`.
    fn release(&mut self, key: BlockKey, medium: Medium) {
        let Some(holding) = self.keys.get_mut(&key) else {
            return;
        };
        let before = holding.tier();
        let count = holding.count(medium);
        *count = count.saturating_sub(1);
        let after = holding.tier();
        if after.is_none() {
            self.keys.remove(&key);
        }
        if after != before {
            self.touch(key, before);
        }
    }

    /// Records that `key` changed; `before` is its tier before this change.
    fn touch(&mut self, key: BlockKey, before: Option<Tier>) {
        if !self.cleared {
            // Only the first touch since the last delta knows the state the gateway has.
            self.touched.entry(key).or_insert(before);
        }
    }

    /// Gives memory back after large evictions (hash maps never shrink on their own).
    fn maybe_shrink(&mut self) {
        if self.engine.capacity() > 4096 && self.engine.len() * 4 < self.engine.capacity() {
            self.engine.shrink_to(self.engine.len() * 2);
            self.keys.shrink_to(self.keys.len() * 2);
        }
    }

    /// The net change since the previous call.
    pub fn take_delta(&mut self) -> KeyDelta {
        if self.cleared {
            self.cleared = false;
            self.touched.clear();
            return KeyDelta {
                cleared: true,
                added: self.keys(),
                offloaded_added: self.offloaded_keys(),
                ..KeyDelta::default()
            };
        }
        let mut delta = KeyDelta::default();
        for (key, before) in self.touched.drain() {
            let now = self.keys.get(&key).and_then(|h| h.tier());
            if before == now {
                continue;
            }
            match before {
                Some(Tier::Gpu) => delta.removed.push(key),
                Some(Tier::Offloaded) => delta.offloaded_removed.push(key),
                None => {}
            }
            match now {
                Some(Tier::Gpu) => delta.added.push(key),
                Some(Tier::Offloaded) => delta.offloaded_added.push(key),
                None => {}
            }
        }
        if self.touched.capacity() > 4096 {
            self.touched.shrink_to(1024);
        }
        delta
    }

    /// Approximate heap bytes held (for the memory metric).
    pub fn approx_bytes(&self) -> usize {
        // hashbrown: one control byte plus the entry per bucket.
        self.engine.capacity() * (1 + std::mem::size_of::<(EngineBlock, BlockKey)>())
            + self.keys.capacity() * (1 + std::mem::size_of::<(BlockKey, Holding)>())
            + self.touched.capacity() * (1 + std::mem::size_of::<(BlockKey, Option<Tier>)>())
    }
}

/// One `BlockStored`'s fields, as [`WorkerState::store`] reads them.
struct StoredBlocks<'a> {
    hashes: &'a [u64],
    parent: Option<u64>,
    tokens: &'a [u32],
    block_size: u32,
    medium: Medium,
    lora: Option<&'a Lora>,
    extra_keys: &'a [Vec<ExtraKey>],
}

/// The bytes of a block's extra keys other than its adapter's name, which vLLM repeats there and the
/// key already carries (an adapter's plain blocks then key exactly as its requests' prompts do).
/// Nothing is written for a block without other keys.
fn encode_extra_keys(keys: &[ExtraKey], lora: Option<&Lora>, out: &mut Vec<u8>) {
    for key in keys {
        match key {
            ExtraKey::Str(s) if matches!(lora, Some(Lora::Name(name)) if name == s) => {}
            ExtraKey::Str(s) => str_extra_key(s, out),
            ExtraKey::Raw(raw) => {
                out.push(b'r');
                out.extend_from_slice(&(raw.len() as u64).to_le_bytes());
                out.extend_from_slice(raw);
            }
        }
    }
}

#[cfg(test)]
mod tests;
