//! Kinference block keys: a chained 64-bit hash over fixed-size blocks of token ids.
//!
//! vLLM names each full KV block by a hash whose algorithm, seed and width depend on its version and
//! flags. Kinference does not try to match them: the agent recomputes its own key for every block from
//! the `token_ids` carried by `BlockStored` events, and the gateway computes the same keys from the
//! prompt it tokenized. A block's key covers its tokens and, through the parent key, every token before
//! it, so "the longest run of leading keys a worker holds" is exactly that worker's cached prefix.
//!
//! Keys are seeded by the served model name: the same tokens under two models never collide. A LoRA
//! adapter is served under its own name, so its blocks are keyed by that name and are never taken for
//! the base model's (nor the base model's for the adapter's).

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// One block's key. Equal keys mean equal model, equal block tokens and equal prefix before them.
pub type BlockKey = u64;

/// Computes block keys for one model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyHasher {
    seed: u64,
}

/// Blocks of up to this many tokens are staged in a stack buffer; larger ones spill to the heap.
/// vLLM's block sizes are 16, 32, 64 or 128 in practice. (A buffer is zeroed when made, so
/// [`KeyHasher::block_key`] sizes it to the block and [`KeyHasher::extend_keys`] makes one per prompt.)
const STACK_TOKENS: usize = 128;

impl KeyHasher {
    /// The hasher for a served model name.
    pub fn for_model(model: &str) -> Self {
        Self {
            seed: xxh3_64(model.as_bytes()),
        }
    }

    /// The parent of a sequence's first block: a model-specific root, so a root block never equals a
    /// child.
    fn root(&self) -> BlockKey {
        self.seed ^ 0x9e37_79b9_7f4a_7c15
    }

    /// The key of one block, given its parent's key (`None` for the first block of a sequence).
    pub fn block_key(&self, parent: Option<BlockKey>, tokens: &[u32]) -> BlockKey {
        let parent = parent.unwrap_or(self.root());
        // Buffers sized exactly for vLLM's usual block sizes, so the length is a constant in each arm
        // (see `extend_keys`).
        match tokens.len() {
            16 => self.hash_block(parent, tokens, &mut [0u8; 8 + 4 * 16]),
            32 => self.hash_block(parent, tokens, &mut [0u8; 8 + 4 * 32]),
            64 => self.hash_block(parent, tokens, &mut [0u8; 8 + 4 * 64]),
            n if n <= STACK_TOKENS => {
                self.hash_block(parent, tokens, &mut [0u8; 8 + 4 * STACK_TOKENS])
            }
            n => self.hash_block(parent, tokens, &mut vec![0u8; 8 + 4 * n]),
        }
    }

    /// Keys of every *full* block of `tokens`, in order, chained from `parent`.
    /// A trailing partial block has no key (vLLM caches only full blocks).
    pub fn keys(
        &self,
        parent: Option<BlockKey>,
        tokens: &[u32],
        block_size: usize,
    ) -> Vec<BlockKey> {
        let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
        self.extend_keys(parent, tokens, block_size, &mut out);
        out
    }

    /// [`KeyHasher::keys`] of a prompt sent with a cache salt (vLLM's `cache_salt`, `None`: none):
    /// vLLM hashes the salt into the prompt's first block only, so the first key is mixed with it
    /// ([`with_extra_keys`] of [`str_extra_key`], as the agent keys that block from its event's
    /// `extra_keys`) and the rest chain from it. A salted prompt shares no key with the same tokens
    /// unsalted, nor under another salt.
    pub fn salted_keys(
        &self,
        salt: Option<&str>,
        tokens: &[u32],
        block_size: usize,
    ) -> Vec<BlockKey> {
        let Some(salt) = salt.filter(|_| block_size > 0 && tokens.len() >= block_size) else {
            return self.keys(None, tokens, block_size);
        };
        let mut extra = Vec::with_capacity(9 + salt.len());
        str_extra_key(salt, &mut extra);
        let first = with_extra_keys(self.block_key(None, &tokens[..block_size]), &extra);
        let mut out = Vec::with_capacity(tokens.len() / block_size);
        out.push(first);
        self.extend_keys(Some(first), &tokens[block_size..], block_size, &mut out);
        out
    }

    /// Like [`KeyHasher::keys`], appending to `out` (no allocation when `out` has room).
    pub fn extend_keys(
        &self,
        parent: Option<BlockKey>,
        tokens: &[u32],
        block_size: usize,
        out: &mut Vec<BlockKey>,
    ) {
        let parent = parent.unwrap_or(self.root());
        // vLLM's usual block sizes get a loop whose block length is a constant: the compiler then
        // unrolls the staging and picks xxh3's length branch once, about 3x faster than the general
        // loop (the gateway hashes every prompt on the routing path).
        match block_size {
            0 => {}
            16 => self.extend_fixed::<16>(parent, tokens, out),
            32 => self.extend_fixed::<32>(parent, tokens, out),
            64 => self.extend_fixed::<64>(parent, tokens, out),
            128 => self.extend_fixed::<128>(parent, tokens, out),
            _ => {
                let mut buf = vec![0u8; 8 + 4 * block_size];
                self.chain(parent, tokens, block_size, &mut buf, out);
            }
        }
    }

    /// [`KeyHasher::extend_keys`] for a block size known at compile time (at most `STACK_TOKENS`).
    fn extend_fixed<const N: usize>(
        &self,
        parent: BlockKey,
        tokens: &[u32],
        out: &mut Vec<BlockKey>,
    ) {
        let mut whole = [0u8; 8 + 4 * STACK_TOKENS];
        out.reserve(tokens.len() / N);
        self.chain(parent, tokens, N, &mut whole[..8 + 4 * N], out);
    }

    /// Appends the keys of `tokens`' full blocks chained from `parent`, staging every block in the
    /// same `buf` (each block overwrites all of it). Always inlined, so a constant `block_size` from
    /// [`KeyHasher::extend_fixed`] reaches the loop.
    #[inline(always)]
    fn chain(
        &self,
        mut parent: BlockKey,
        tokens: &[u32],
        block_size: usize,
        buf: &mut [u8],
        out: &mut Vec<BlockKey>,
    ) {
        for block in tokens.chunks_exact(block_size) {
            parent = self.hash_block(parent, block, buf);
            out.push(parent);
        }
    }

    /// The key of `tokens` under `parent`, staged in `buf` (at least `8 + 4 x tokens` bytes): the
    /// parent's and then each token's little-endian bytes, hashed with the model's seed.
    fn hash_block(&self, parent: BlockKey, tokens: &[u32], buf: &mut [u8]) -> BlockKey {
        let len = encode(parent, tokens, buf);
        xxh3_64_with_seed(&buf[..len], self.seed)
    }
}

/// The key of a block whose vLLM hash also covered extra keys (a multimodal input, a cache salt):
/// `key` mixed with their bytes. No prompt's tokens alone produce it, so such a block, and every block
/// chained after it, is never counted as a hit for a plain prompt of the same tokens.
pub fn with_extra_keys(key: BlockKey, extra: &[u8]) -> BlockKey {
    xxh3_64_with_seed(extra, key ^ 0x6a09_e667_f3bc_c908)
}

/// The bytes one string extra key of a block (a cache salt, say) adds to [`with_extra_keys`]'s input:
/// `s`, its length as u64 little-endian, its UTF-8. The agent writes an event's string keys so and the
/// gateway a request's salt, which is why both find the same key for a salted block.
pub fn str_extra_key(s: &str, out: &mut Vec<u8>) {
    out.push(b's');
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn encode(parent: u64, tokens: &[u32], buf: &mut [u8]) -> usize {
    let len = 8 + 4 * tokens.len();
    let (head, body) = buf[..len].split_at_mut(8);
    head.copy_from_slice(&parent.to_le_bytes());
    for (dst, t) in body.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    len
}

#[cfg(test)]
mod tests;
