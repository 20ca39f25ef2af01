//! The simulated GPU KV cache: a pool of fixed-size blocks with vLLM's prefix-caching rules
//! (`vllm/v1/core/block_pool.py`).
//!
//! - Block 0 is the reserved *null block*, as in vLLM, so `num_blocks - 1` blocks are usable.
//! - Free blocks sit in an LRU queue; a block freed by its last request keeps its hash and can be hit
//!   again until it is popped for a new allocation, which evicts it (`BlockRemoved`).
//! - Requests free their blocks tail first, so a sequence's last blocks are evicted before its prefix.
//! - Several blocks may carry the same hash (two requests computing the same prefix at once); each is
//!   announced and removed separately, as vLLM does.
//! - Events accumulate here and are taken by the engine once per step (`take_events`), which is why an
//!   `AllBlocksCleared` only goes out with the next engine step.

pub mod hash;
pub mod lora;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::Arc;

pub use hash::{
    BlockDigest, event_hash, hash_block_salted, hash_block_tokens, hash_blocks, hash_blocks_salted,
    none_hash,
};
pub use lora::LoraAdapter;

/// What a request's blocks are computed with besides their tokens: its adapter and its cache salt,
/// both published in `BlockStored`.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockExtras<'a> {
    /// The adapter (`None`: the base model).
    pub lora: Option<&'a Arc<LoraAdapter>>,
    /// The `cache_salt` (`None`: unsalted).
    pub salt: Option<&'a Arc<str>>,
}

/// Index of a block in the pool.
pub type BlockId = u32;

const NIL: BlockId = BlockId::MAX;

/// A KV cache event as vLLM's block pool queues it (encoded by `sim::kv_events`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvCacheEvent {
    /// Newly full blocks of one request, in chain order.
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
        /// The adapter the blocks were computed with (`None`: the base model).
        lora: Option<Arc<LoraAdapter>>,
        /// The request's `cache_salt` when the first block here is its prompt's first (the one
        /// block vLLM hashes the salt into, and publishes it as the extra key of).
        salt: Option<Arc<str>>,
    },
    /// One evicted block (vLLM sends one event per block).
    BlockRemoved { block_hashes: Vec<u64> },
    /// The whole prefix cache was reset.
    AllBlocksCleared,
}

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    hash: Option<BlockDigest>,
    prev: BlockId,
    next: BlockId,
    in_free: bool,
}

/// One cached block, for `/sim/state`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CachedBlock {
    pub block_id: BlockId,
    pub hash: u64,
    pub ref_cnt: u32,
}

/// The block pool. Not thread-safe on its own: the engine owns it under its lock.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    free_head: BlockId,
    free_tail: BlockId,
    num_free: usize,
    cached: HashMap<BlockDigest, Vec<BlockId>>,
    events: Vec<KvCacheEvent>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks (at least 2: one is the null block) of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let num_blocks = num_blocks.max(2);
        let blocks = (0..num_blocks)
            .map(|_| Block {
                ref_cnt: 0,
                hash: None,
                prev: NIL,
                next: NIL,
                in_free: false,
            })
            .collect();
        let mut pool = Self {
            block_size: block_size.max(1),
            blocks,
            free_head: NIL,
            free_tail: NIL,
            num_free: 0,
            cached: HashMap::new(),
            events: Vec::new(),
        };
        for id in 1..num_blocks as BlockId {
            pool.push_free(id);
        }
        // The null block is never allocated nor freed.
        pool.blocks[0].ref_cnt = 1;
        pool
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Total blocks, the null block included (vLLM's `num_gpu_blocks`).
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be allocated now (free, including cached blocks nobody references).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// `vllm:kv_cache_usage_perc`: `1 - free / num_gpu_blocks`.
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free as f64 / self.blocks.len() as f64
    }

    /// Longest run of cached blocks matching `hashes` from the start (no reference taken).
    pub fn find_prefix(&self, hashes: &[BlockDigest]) -> Vec<BlockId> {
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).and_then(|ids| ids.first().copied()))
            .collect()
    }

    /// How many of `ids` are unreferenced (and so would leave the free queue when touched).
    pub fn num_evictable(&self, ids: &[BlockId]) -> usize {
        ids.iter()
            .filter(|&&id| self.blocks[id as usize].ref_cnt == 0)
            .count()
    }

    /// Takes a reference on cache-hit blocks (`BlockPool.touch`).
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            if self.blocks[id as usize].in_free {
                self.unlink_free(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
        }
    }

    /// Pops `n` blocks from the LRU end of the free queue, evicting any cached content.
    /// `None` if fewer than `n` blocks are free (nothing is changed then).
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.free_head;
            self.unlink_free(id);
            self.evict(id);
            self.blocks[id as usize].ref_cnt = 1;
            out.push(id);
        }
        Some(out)
    }

    /// Releases a request's blocks, given in request order; they are queued tail first so the end of a
    /// sequence is evicted before its shared prefix (`KVCacheManager.free`).
    pub fn free(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let b = &mut self.blocks[id as usize];
            if id == 0 || b.ref_cnt == 0 {
                continue;
            }
            b.ref_cnt -= 1;
            if b.ref_cnt == 0 {
                self.push_free(id);
            }
        }
    }

    /// Registers newly full blocks of one request (`BlockPool.cache_full_blocks`): `blocks` and
    /// `hashes` are the request's blocks and block digests, `all_tokens` its tokens, and blocks
    /// `num_cached..num_full` become cached. Queues one `BlockStored` for them, naming the request's
    /// `extras`.
    pub fn cache_full_blocks(
        &mut self,
        blocks: &[BlockId],
        hashes: &[BlockDigest],
        all_tokens: &[u32],
        num_cached: usize,
        num_full: usize,
        extras: BlockExtras<'_>,
    ) {
        let BlockExtras { lora, salt } = extras;
        let num_full = num_full.min(blocks.len()).min(hashes.len());
        if num_full <= num_cached {
            return;
        }
        let mut stored = Vec::with_capacity(num_full - num_cached);
        let mut first = None;
        for i in num_cached..num_full {
            let id = blocks[i];
            let b = &mut self.blocks[id as usize];
            if b.hash.is_some() {
                // Already cached (a prefix hit): vLLM never re-announces it here.
                continue;
            }
            first.get_or_insert(i);
            b.hash = Some(hashes[i]);
            self.cached.entry(hashes[i]).or_default().push(id);
            stored.push(event_hash(&hashes[i]));
        }
        if stored.is_empty() {
            return;
        }
        let bs = self.block_size;
        self.events.push(KvCacheEvent::BlockStored {
            block_hashes: stored,
            parent_block_hash: num_cached.checked_sub(1).map(|p| event_hash(&hashes[p])),
            token_ids: all_tokens[num_cached * bs..num_full * bs].to_vec(),
            block_size: bs,
            lora: lora.cloned(),
            salt: salt.filter(|_| first == Some(0)).cloned(),
        });
    }

    /// `reset_prefix_cache`: forgets every hash. Refused (false) while any block is referenced,
    /// as vLLM refuses it while requests run.
    pub fn reset(&mut self) -> bool {
        if self.num_free != self.blocks.len() - 1 {
            return false;
        }
        self.cached.clear();
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.events.push(KvCacheEvent::AllBlocksCleared);
        true
    }

    /// Takes the events queued since the last call.
    pub fn take_events(&mut self) -> Vec<KvCacheEvent> {
        std::mem::take(&mut self.events)
    }

    /// Every cached block (for `/sim/state`), by block id.
    pub fn cached_blocks(&self) -> Vec<CachedBlock> {
        let mut out: Vec<CachedBlock> = self
            .cached
            .values()
            .flatten()
            .map(|&id| {
                let b = &self.blocks[id as usize];
                CachedBlock {
                    block_id: id,
                    hash: b.hash.as_ref().map(event_hash).unwrap_or_default(),
                    ref_cnt: b.ref_cnt,
                }
            })
            .collect();
        out.sort_by_key(|b| b.block_id);
        out
    }

    fn evict(&mut self, id: BlockId) {
        let Some(h) = self.blocks[id as usize].hash.take() else {
            return;
        };
        if let Some(ids) = self.cached.get_mut(&h) {
            ids.retain(|&x| x != id);
            if ids.is_empty() {
                self.cached.remove(&h);
            }
        }
        self.events.push(KvCacheEvent::BlockRemoved {
            block_hashes: vec![event_hash(&h)],
        });
    }

    fn push_free(&mut self, id: BlockId) {
        let tail = self.free_tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
            b.in_free = true;
        }
        if tail == NIL {
            self.free_head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.free_tail = id;
        self.num_free += 1;
    }

    fn unlink_free(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &mut self.blocks[id as usize];
            b.in_free = false;
            let pn = (b.prev, b.next);
            b.prev = NIL;
            b.next = NIL;
            pn
        };
        if prev == NIL {
            self.free_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.free_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        self.num_free -= 1;
    }
}
