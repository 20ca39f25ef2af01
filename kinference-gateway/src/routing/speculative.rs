//! Speculative credit: the blocks a worker will hold once it has prefilled a request just sent to it.
//!
//! Between routing a request and the worker's `BlockStored` events reaching the index there is a gap
//! (the prefill itself, then event batching). Without credit, a burst of requests sharing a new prefix
//! would all see "no cache anywhere" and scatter. So the router remembers, per routed request, the
//! prompt's key chain and the chosen worker for a short TTL; by then the events have confirmed it. With a
//! live agent the credit also ends shortly after the request's first token (its prefill is done, so its
//! blocks' events are on their way): a fixed TTL longer than that kept crediting a worker with a prefix
//! its cache had already evicted, and drew every request of that prefix back to it.
//!
//! Because keys are chained, two key sequences share exactly the leading run up to their last equal
//! key, so a remembered request's overlap with a new prompt is a binary search, not a per-key map
//! insert: crediting costs O(1) per request and lookups O(entries sharing the first key x log n).
//! Without a live agent the same entries (with a longer TTL) are the router's only cache signal.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kinference_api::BlockKey;

use super::kv_index::WorkerId;

/// Entries kept per first key; the oldest goes first.
const MAX_PER_FIRST_KEY: usize = 64;

#[derive(Debug)]
struct Entry {
    keys: Arc<[BlockKey]>,
    worker: WorkerId,
    expires: Instant,
}

/// Recently routed prompts and where they went.
#[derive(Debug)]
pub struct Speculative {
    by_first: HashMap<BlockKey, Vec<Entry>>,
    total_keys: usize,
    max_keys: usize,
}

impl Speculative {
    /// Keeps at most about `max_keys` keys over all entries.
    pub fn new(max_keys: usize) -> Self {
        Self {
            by_first: HashMap::new(),
            total_keys: 0,
            max_keys: max_keys.max(1),
        }
    }

    /// Keys held over all entries.
    pub fn total_keys(&self) -> usize {
        self.total_keys
    }

    /// Live entries (for metrics).
    pub fn entries(&self) -> usize {
        self.by_first.values().map(Vec::len).sum()
    }

    /// Credits `worker` with `keys` until `expires`.
    pub fn credit(
        &mut self,
        keys: Arc<[BlockKey]>,
        worker: WorkerId,
        now: Instant,
        expires: Instant,
    ) {
        let Some(first) = keys.first().copied() else {
            return;
        };
        let list = self.by_first.entry(first).or_default();
        let mut freed = 0;
        // Drop expired entries and those the new one subsumes (same worker, a prefix of the new chain):
        // a conversation's next turn replaces its previous one.
        list.retain(|e| {
            let keep =
                e.expires > now && !(e.worker == worker && lcp(&e.keys, &keys) == e.keys.len());
            if !keep {
                freed += e.keys.len();
            }
            keep
        });
        if list.len() >= MAX_PER_FIRST_KEY {
            let oldest = list
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.expires)
                .map(|(i, _)| i)
                .unwrap_or(0);
            freed += list.swap_remove(oldest).keys.len();
        }
        self.total_keys += keys.len();
        list.push(Entry {
            keys,
            worker,
            expires,
        });
        self.total_keys -= freed;
        if self.total_keys > self.max_keys {
            self.shrink(now);
        }
    }

    /// Shortens the credit given to `worker` for exactly `keys` (the same chain [`Speculative::credit`]
    /// got) to end by `by`: the request's prefill is over, so its blocks' events are on their way.
    pub fn end_by(&mut self, keys: &Arc<[BlockKey]>, worker: WorkerId, by: Instant) {
        let Some(list) = keys.first().and_then(|k| self.by_first.get_mut(k)) else {
            return;
        };
        if let Some(e) = list
            .iter_mut()
            .find(|e| e.worker == worker && Arc::ptr_eq(&e.keys, keys))
        {
            e.expires = e.expires.min(by);
        }
    }

    /// Calls `f(worker, run)` with each live entry's leading run shared with `keys` (run > 0).
    pub fn runs(&self, keys: &[BlockKey], now: Instant, mut f: impl FnMut(WorkerId, usize)) {
        let Some(first) = keys.first() else { return };
        let Some(list) = self.by_first.get(first) else {
            return;
        };
        for e in list.iter().filter(|e| e.expires > now) {
            let run = lcp(&e.keys, keys);
            if run > 0 {
                f(e.worker, run);
            }
        }
    }

    /// Forgets every entry of `worker` (it restarted or left).
    pub fn forget_worker(&mut self, worker: WorkerId) {
        let mut freed = 0;
        self.by_first.retain(|_, list| {
            list.retain(|e| {
                let keep = e.worker != worker;
                if !keep {
                    freed += e.keys.len();
                }
                keep
            });
            !list.is_empty()
        });
        self.total_keys -= freed;
    }

    /// Drops expired entries, then the soonest-expiring ones, until under 90% of the cap.
    fn shrink(&mut self, now: Instant) {
        let mut freed = 0;
        self.by_first.retain(|_, list| {
            list.retain(|e| {
                let keep = e.expires > now;
                if !keep {
                    freed += e.keys.len();
                }
                keep
            });
            !list.is_empty()
        });
        self.total_keys -= freed;
        let target = self.max_keys - self.max_keys / 10;
        if self.total_keys <= target {
            return;
        }
        let mut all: Vec<(Instant, BlockKey)> = self
            .by_first
            .iter()
            .flat_map(|(k, list)| list.iter().map(move |e| (e.expires, *k)))
            .collect();
        all.sort_unstable();
        for (expires, first) in all {
            if self.total_keys <= target {
                break;
            }
            if let Some(list) = self.by_first.get_mut(&first) {
                if let Some(pos) = list.iter().position(|e| e.expires == expires) {
                    self.total_keys -= list.swap_remove(pos).keys.len();
                }
                if list.is_empty() {
                    self.by_first.remove(&first);
                }
            }
        }
    }
}

/// Length of the common leading run of two key chains. Chained keys are equal at position i only if
/// every earlier position is equal too, so the equal positions form a prefix: binary search it.
pub fn lcp(a: &[BlockKey], b: &[BlockKey]) -> usize {
    let (mut lo, mut hi) = (0, a.len().min(b.len()));
    // Invariant: a[..lo] == b[..lo]; a[hi..] != b[hi..] (positions at or past hi differ or are absent).
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if a[mid - 1] == b[mid - 1] {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests;
