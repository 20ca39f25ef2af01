//! The cluster-wide KV index: which workers hold each block key, in bounded memory.
//!
//! One hash map from block key to the set of workers holding it. Keys are already uniform 64-bit
//! hashes, so the map hashes them by identity. A holder set is 8 bytes inline: up to four 16-bit worker
//! ids; a key held by more workers spills to a bitset in a side slab (shared system prompts are the
//! typical case, and there the per-(block, worker) cost falls as the set grows). A map entry is then 16
//! bytes plus hashbrown's one control byte.
//!
//! The index mirrors the workers' own caches, which are bounded, so it is bounded as long as removal
//! events arrive. A hard cap on (block, worker) pairs guards against lost removals and very large
//! clusters: past it, a sixteenth of the keys (chosen by key bits, so a different sixteenth each round)
//! is dropped, counted in [`KvIndex::evictions`]. Dropping a block only shortens the cached prefix
//! the router believes in, which costs a cache miss, never a wrong answer.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use kinference_api::BlockKey;

/// A worker's index in the router's worker table. At most [`MAX_WORKERS`] workers.
pub type WorkerId = u16;

/// Worker ids at and above this value are reserved for the inline holder encoding.
pub const MAX_WORKERS: usize = EMPTY as usize - 1;

const EMPTY: u16 = u16::MAX;
const SPILL: u16 = u16::MAX - 1;
const INLINE: usize = 4;

/// Hashes a block key by identity: keys are xxh3 outputs already.
#[derive(Default, Clone, Copy)]
pub struct KeyIdentity(u64);

impl Hasher for KeyIdentity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed here; fold anything else for completeness.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type KeyMap<V> = HashMap<BlockKey, V, BuildHasherDefault<KeyIdentity>>;

/// The holders of one key: up to four inline worker ids, or a spill marker and a slab index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holders([u16; INLINE]);

impl Holders {
    fn one(w: WorkerId) -> Self {
        Holders([w, EMPTY, EMPTY, EMPTY])
    }
    fn spill_index(&self) -> Option<usize> {
        (self.0[0] == SPILL).then(|| (usize::from(self.0[1]) << 16) | usize::from(self.0[2]))
    }
    fn spilled(idx: usize) -> Self {
        Holders([SPILL, (idx >> 16) as u16, (idx & 0xffff) as u16, EMPTY])
    }
}

/// A set of worker ids as a bitset (one bit per worker id).
pub type WorkerBits = Vec<u64>;

fn set_bit(bits: &mut WorkerBits, w: WorkerId) {
    let word = usize::from(w) / 64;
    if bits.len() <= word {
        bits.resize(word + 1, 0);
    }
    bits[word] |= 1 << (w % 64);
}

fn has_bit(bits: &[u64], w: WorkerId) -> bool {
    bits.get(usize::from(w) / 64)
        .is_some_and(|word| word & (1 << (w % 64)) != 0)
}

/// Which workers hold which block keys.
#[derive(Debug)]
pub struct KvIndex {
    map: KeyMap<Holders>,
    spill: Vec<Box<[u64]>>,
    spill_free: Vec<u32>,
    per_worker: Vec<u32>,
    pairs: usize,
    max_pairs: usize,
    evictions: u64,
    evict_round: u64,
}

impl KvIndex {
    /// An empty index holding at most `max_pairs` (block, worker) pairs.
    pub fn new(max_pairs: usize) -> Self {
        Self {
            map: KeyMap::default(),
            spill: Vec::new(),
            spill_free: Vec::new(),
            per_worker: Vec::new(),
            pairs: 0,
            max_pairs: max_pairs.max(1),
            evictions: 0,
            evict_round: 0,
        }
    }

    /// Number of (block, worker) pairs.
    pub fn pairs(&self) -> usize {
        self.pairs
    }

    /// Number of distinct keys.
    pub fn keys(&self) -> usize {
        self.map.len()
    }

    /// Blocks the index believes `w` holds.
    pub fn worker_blocks(&self, w: WorkerId) -> usize {
        self.per_worker
            .get(usize::from(w))
            .map_or(0, |n| *n as usize)
    }

    /// Keys dropped by the memory cap so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Approximate heap bytes: map buckets (entry + control byte) and spilled bitsets (with the
    /// allocator's per-allocation overhead, counted as 16 bytes).
    pub fn memory_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(BlockKey, Holders)>() + 1;
        let spilled: usize = self.spill.iter().map(|b| b.len() * 8 + 16).sum();
        self.map.capacity() * entry
            + self.spill.capacity() * std::mem::size_of::<Box<[u64]>>()
            + spilled
            + self.spill_free.capacity() * 4
            + self.per_worker.capacity() * 4
    }

    /// Whether `w` holds `key`.
    pub fn contains(&self, key: BlockKey, w: WorkerId) -> bool {
        match self.map.get(&key) {
            None => false,
            Some(h) => match h.spill_index() {
                Some(i) => has_bit(&self.spill[i], w),
                None => h.0.contains(&w),
            },
        }
    }

    /// Records that `w` holds `key`. Returns whether the pair is new.
    pub fn insert(&mut self, key: BlockKey, w: WorkerId) -> bool {
        debug_assert!(usize::from(w) < MAX_WORKERS);
        let added = match self.map.get_mut(&key) {
            None => {
                self.map.insert(key, Holders::one(w));
                true
            }
            Some(h) => match h.spill_index() {
                Some(i) => {
                    if has_bit(&self.spill[i], w) {
                        false
                    } else {
                        let mut bits = std::mem::take(&mut self.spill[i]).into_vec();
                        set_bit(&mut bits, w);
                        self.spill[i] = bits.into_boxed_slice();
                        true
                    }
                }
                None => {
                    if h.0.contains(&w) {
                        false
                    } else if let Some(slot) = h.0.iter_mut().find(|s| **s == EMPTY) {
                        *slot = w;
                        true
                    } else {
                        let mut bits = WorkerBits::new();
                        for id in h.0.iter().copied().chain(std::iter::once(w)) {
                            set_bit(&mut bits, id);
                        }
                        let bits = bits.into_boxed_slice();
                        let idx = match self.spill_free.pop() {
                            Some(i) => {
                                self.spill[i as usize] = bits;
                                i as usize
                            }
                            None => {
                                self.spill.push(bits);
                                self.spill.len() - 1
                            }
                        };
                        *h = Holders::spilled(idx);
                        true
                    }
                }
            },
        };
        if added {
            self.pairs += 1;
            let w = usize::from(w);
            if self.per_worker.len() <= w {
                self.per_worker.resize(w + 1, 0);
            }
            self.per_worker[w] += 1;
            if self.pairs > self.max_pairs {
                self.evict();
            }
        }
        added
    }

    /// Records that `w` dropped `key`. Returns whether the pair was there.
    pub fn remove(&mut self, key: BlockKey, w: WorkerId) -> bool {
        let Some(h) = self.map.get_mut(&key) else {
            return false;
        };
        let (removed, now_empty) = match h.spill_index() {
            Some(i) => {
                let bits = &mut self.spill[i];
                let word = usize::from(w) / 64;
                if has_bit(bits, w) {
                    bits[word] &= !(1 << (w % 64));
                    let left: u32 = bits.iter().map(|b| b.count_ones()).sum();
                    if left <= INLINE as u32 {
                        // Back to inline: the slab slot is reused by the next spill.
                        let mut inline = [EMPTY; INLINE];
                        let mut n = 0;
                        for (wi, word) in bits.iter().enumerate() {
                            let mut word = *word;
                            while word != 0 {
                                inline[n] = (wi * 64 + word.trailing_zeros() as usize) as u16;
                                n += 1;
                                word &= word - 1;
                            }
                        }
                        self.spill[i] = Box::new([]);
                        self.spill_free.push(i as u32);
                        *h = Holders(inline);
                    }
                    (true, false)
                } else {
                    (false, false)
                }
            }
            None => match h.0.iter().position(|s| *s == w) {
                Some(pos) => {
                    h.0[pos] = EMPTY;
                    (true, h.0.iter().all(|s| *s == EMPTY))
                }
                None => (false, false),
            },
        };
        if now_empty {
            self.map.remove(&key);
        }
        if removed {
            self.pairs -= 1;
            if let Some(n) = self.per_worker.get_mut(usize::from(w)) {
                *n = n.saturating_sub(1);
            }
        }
        removed
    }

    /// Forgets every key of the given workers (one pass over the map).
    pub fn clear_workers(&mut self, workers: &[WorkerId]) {
        if workers.iter().all(|w| self.worker_blocks(*w) == 0) {
            return;
        }
        let mut drop_bits = WorkerBits::new();
        for w in workers {
            set_bit(&mut drop_bits, *w);
        }
        let mut removed = 0usize;
        let spill = &mut self.spill;
        let spill_free = &mut self.spill_free;
        self.map.retain(|_, h| match h.spill_index() {
            Some(i) => {
                let bits = &mut spill[i];
                for (word, d) in bits.iter_mut().zip(drop_bits.iter()) {
                    removed += (*word & d).count_ones() as usize;
                    *word &= !d;
                }
                if bits.iter().all(|b| *b == 0) {
                    spill[i] = Box::new([]);
                    spill_free.push(i as u32);
                    false
                } else {
                    // Stays spilled even with few holders left; the next remove inlines it.
                    true
                }
            }
            None => {
                for s in h.0.iter_mut() {
                    if *s != EMPTY && has_bit(&drop_bits, *s) {
                        *s = EMPTY;
                        removed += 1;
                    }
                }
                h.0.iter().any(|s| *s != EMPTY)
            }
        });
        self.pairs -= removed;
        for w in workers {
            if let Some(n) = self.per_worker.get_mut(usize::from(*w)) {
                *n = 0;
            }
        }
    }

    /// For each candidate, the number of leading `keys` it holds, in one pass over `keys`.
    ///
    /// `extra(key, bits)` may add holders not in the index (speculative credit) by setting bits. The
    /// pass stops at the first key no remaining candidate holds, so its cost is the longest run, not
    /// the prompt length times the number of workers.
    pub fn leading_runs(
        &self,
        keys: &[BlockKey],
        candidates: &[WorkerId],
        mut extra: impl FnMut(BlockKey, &mut WorkerBits),
        out: &mut Vec<usize>,
    ) {
        out.clear();
        out.resize(candidates.len(), keys.len());
        let mut alive = WorkerBits::new();
        let mut slot_of = vec![
            u32::MAX;
            candidates
                .iter()
                .map(|w| usize::from(*w) + 1)
                .max()
                .unwrap_or(0)
        ];
        for (c, w) in candidates.iter().enumerate() {
            set_bit(&mut alive, *w);
            slot_of[usize::from(*w)] = c as u32;
        }
        let mut holders: WorkerBits = vec![0; alive.len()];
        for (i, key) in keys.iter().enumerate() {
            holders.iter_mut().for_each(|b| *b = 0);
            if let Some(h) = self.map.get(key) {
                match h.spill_index() {
                    Some(s) => {
                        for (dst, src) in holders.iter_mut().zip(self.spill[s].iter()) {
                            *dst = *src;
                        }
                    }
                    None => {
                        for w in h.0 {
                            if w == EMPTY {
                                continue;
                            }
                            if let Some(word) = holders.get_mut(usize::from(w) / 64) {
                                *word |= 1 << (w % 64);
                            }
                        }
                    }
                }
            }
            extra(*key, &mut holders);
            let mut any = false;
            for (wi, (a, h)) in alive.iter_mut().zip(holders.iter()).enumerate() {
                let mut dropped = *a & !h;
                *a &= h;
                any |= *a != 0;
                while dropped != 0 {
                    let w = wi * 64 + dropped.trailing_zeros() as usize;
                    out[slot_of[w] as usize] = i;
                    dropped &= dropped - 1;
                }
            }
            if !any {
                return;
            }
        }
    }

    /// Like [`KvIndex::leading_runs`], by bisection: O(distinct run ends x log n) probes instead of
    /// one per key of the longest run (a 2,000-block prompt cached on some worker costs ~30 probes,
    /// not 2,000 cache misses).
    ///
    /// Exact when every worker's block set is prefix-closed (holding a block implies holding its
    /// parent), which is how vLLM evicts: a finished request's blocks are freed tail first, so a
    /// chain is evicted from its end. A hole (a lost removal event) can make a run look longer than
    /// it is; a worker's run never extends past a probed key it lacks.
    pub fn leading_runs_bisect(
        &self,
        keys: &[BlockKey],
        candidates: &[WorkerId],
        out: &mut Vec<usize>,
    ) {
        out.clear();
        out.resize(candidates.len(), 0);
        if keys.is_empty() || candidates.is_empty() {
            return;
        }
        let mut cand = WorkerBits::new();
        let mut slot_of = vec![
            u32::MAX;
            candidates
                .iter()
                .map(|w| usize::from(*w) + 1)
                .max()
                .unwrap_or(0)
        ];
        for (c, w) in candidates.iter().enumerate() {
            set_bit(&mut cand, *w);
            slot_of[usize::from(*w)] = c as u32;
        }
        // Every probe's holder set, `words` words each, in one buffer (a set is named by its offset):
        // one allocation per decision instead of two per probe. Sets never change once made.
        let words = cand.len();
        let mut sets: Vec<u64> = Vec::with_capacity(words * 64);
        sets.extend_from_slice(&cand);
        let empty = sets.len();
        sets.resize(empty + words, 0);
        let h0 = self.holders_within(keys[0], 0, words, &mut sets);
        if sets[h0..h0 + words].iter().all(|b| *b == 0) {
            return;
        }
        let mut stack = vec![(0usize, keys.len(), h0, empty)];
        while let Some((lo, hi, hlo, hhi)) = stack.pop() {
            // Workers in hlo but not in hhi end their run somewhere in (lo, hi].
            if sets[hlo..hlo + words] == sets[hhi..hhi + words] {
                continue;
            }
            if hi == lo + 1 {
                for wi in 0..words {
                    let mut ended = sets[hlo + wi] & !sets[hhi + wi];
                    while ended != 0 {
                        let w = wi * 64 + ended.trailing_zeros() as usize;
                        out[slot_of[w] as usize] = hi;
                        ended &= ended - 1;
                    }
                }
                continue;
            }
            let mid = lo + (hi - lo) / 2;
            // Enforce the prefix: a worker is in the run at mid only if it was at lo.
            let hmid = self.holders_within(keys[mid], hlo, words, &mut sets);
            for wi in 0..words {
                sets[hmid + wi] |= sets[hhi + wi];
            }
            stack.push((lo, mid, hlo, hmid));
            stack.push((mid, hi, hmid, hhi));
        }
    }

    /// Appends to `sets` the holders of `key` that are also in the set at offset `within` (both
    /// `words` words long); returns the new set's offset.
    fn holders_within(
        &self,
        key: BlockKey,
        within: usize,
        words: usize,
        sets: &mut Vec<u64>,
    ) -> usize {
        let at = sets.len();
        sets.resize(at + words, 0);
        let (before, bits) = sets.split_at_mut(at);
        let within = &before[within..within + words];
        if let Some(h) = self.map.get(&key) {
            match h.spill_index() {
                Some(s) => {
                    for ((dst, src), w) in bits.iter_mut().zip(self.spill[s].iter()).zip(within) {
                        *dst = src & w;
                    }
                }
                None => {
                    for w in h.0 {
                        if w != EMPTY && has_bit(within, w) {
                            bits[usize::from(w) / 64] |= 1 << (w % 64);
                        }
                    }
                }
            }
        }
        at
    }

    fn evict(&mut self) {
        let target = self.max_pairs - self.max_pairs / 20;
        while self.pairs > target && !self.map.is_empty() {
            let round = self.evict_round;
            self.evict_round = self.evict_round.wrapping_add(1);
            let victims: Vec<BlockKey> = self
                .map
                .keys()
                .copied()
                .filter(|k| (k >> 20) & 0xf == round & 0xf)
                .collect();
            for key in victims {
                if let Some(h) = self.map.remove(&key) {
                    self.evictions += 1;
                    let ids: Vec<WorkerId> = match h.spill_index() {
                        Some(i) => {
                            let bits = std::mem::replace(&mut self.spill[i], Box::new([]));
                            self.spill_free.push(i as u32);
                            bits_to_ids(&bits)
                        }
                        None => h.0.iter().copied().filter(|s| *s != EMPTY).collect(),
                    };
                    for w in ids {
                        self.pairs -= 1;
                        if let Some(n) = self.per_worker.get_mut(usize::from(w)) {
                            *n = n.saturating_sub(1);
                        }
                    }
                }
            }
        }
    }
}

fn bits_to_ids(bits: &[u64]) -> Vec<WorkerId> {
    let mut ids = Vec::new();
    for (wi, word) in bits.iter().enumerate() {
        let mut word = *word;
        while word != 0 {
            ids.push((wi * 64 + word.trailing_zeros() as usize) as WorkerId);
            word &= word - 1;
        }
    }
    ids
}

#[cfg(test)]
mod tests;
