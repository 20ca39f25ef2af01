//! vLLM's data parallelism behind one API server (`--data-parallel-size N`): N engines, each with its
//! own scheduler, prefix cache and KV event publisher, and the choice of the engine for each request.
//!
//! A request with the header `X-data-parallel-rank: <int>` goes to that rank, as vLLM's
//! `OpenAIServing._get_data_parallel_rank` reads it (a value that is not an int is ignored). Without
//! it the server balances as vLLM's `DPLBAsyncMPClient.get_core_engine_for_request` does: the engine
//! with the fewest running plus waiting requests, the scan starting one further each time so that
//! ties go round-robin.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use http::HeaderMap;

use crate::sim::engine::Engine;
use crate::sim::metrics::Gauges;

/// The request header naming a data-parallel rank (header names are case-insensitive).
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// The engines of one simulated worker, in rank order (a single one without data parallelism).
#[derive(Debug)]
pub struct Ranks {
    engines: Vec<Arc<Engine>>,
    /// Where the next balanced pick starts its scan.
    next: AtomicUsize,
    /// Requests that named their rank with the header.
    named: AtomicU64,
    /// Requests each rank served.
    served: Vec<AtomicU64>,
}

/// A header naming a rank the worker does not have.
#[derive(Debug, thiserror::Error)]
#[error("data parallel rank {0} is out of range")]
pub struct NoSuchRank(pub i64);

impl Ranks {
    /// The engines, rank 0 first.
    pub fn new(engines: Vec<Arc<Engine>>) -> Self {
        let served = engines.iter().map(|_| AtomicU64::new(0)).collect();
        Self {
            engines,
            next: AtomicUsize::new(0),
            named: AtomicU64::new(0),
            served,
        }
    }

    /// Rank 0's engine (the only one without data parallelism).
    pub fn first(&self) -> &Arc<Engine> {
        &self.engines[0]
    }

    /// Every rank's engine.
    pub fn all(&self) -> &[Arc<Engine>] {
        &self.engines
    }

    /// The engine to serve a request with these headers, and its rank.
    pub fn pick(&self, headers: &HeaderMap) -> Result<(usize, Arc<Engine>), NoSuchRank> {
        let named = headers
            .get(DP_RANK_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<i64>().ok());
        let rank = match named {
            Some(r) => {
                self.named.fetch_add(1, Ordering::Relaxed);
                usize::try_from(r)
                    .ok()
                    .filter(|r| *r < self.engines.len())
                    .ok_or(NoSuchRank(r))?
            }
            None => self.balanced(),
        };
        self.served[rank].fetch_add(1, Ordering::Relaxed);
        Ok((rank, Arc::clone(&self.engines[rank])))
    }

    /// The least loaded rank (running + waiting), ties to the first from a rotating start.
    fn balanced(&self) -> usize {
        let n = self.engines.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|i| (start + i) % n)
            .min_by_key(|&r| {
                let g = self.engines[r].gauges();
                g.running + g.waiting
            })
            .unwrap_or(0)
    }

    /// Each rank's gauges, by rank (what `/metrics` labels `engine`).
    pub fn gauges(&self) -> Vec<Gauges> {
        self.engines.iter().map(|e| e.gauges()).collect()
    }

    /// For `/sim/state`: the ranks, how many requests named one, and how many each served.
    pub fn info(&self) -> serde_json::Value {
        serde_json::json!({
            "size": self.engines.len(),
            "rank_header_requests": self.named.load(Ordering::Relaxed),
            "served_by_rank": self.served.iter().map(|s| s.load(Ordering::Relaxed)).collect::<Vec<_>>(),
            "cached_blocks_by_rank": self.engines.iter().map(|e| e.snapshot().cached_blocks.len()).collect::<Vec<_>>(),
        })
    }
}
