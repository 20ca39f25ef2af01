//! The candidates of one decision: each worker's figures read once (the ledger, the agent's views,
//! the learned rates) and the prompt's cached run on it, shared by the decision and the policy
//! stage's estimates.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kinference_api::{BlockKey, KeyHasher};

use super::estimate::{
    self, EngineQueue, Inputs, KernelMissing, KvRoom, Ledger, Queue, QueueSignal, Rates, Seen,
};
use super::kv_index::WorkerId;
use super::workers::Worker;
use super::workers::rows::{Figures, Row};
use super::*;

/// One candidate while a decision is being made: everything its estimate needs, read once. It borrows
/// the worker from the decision's candidate list: a decision over 100 workers then takes no reference
/// count per candidate (the ticket clones the chosen one's).
pub(super) struct Candidate<'w> {
    pub(super) worker: &'w Arc<Worker>,
    pub(super) block_size: usize,
    /// A live agent reports the worker.
    pub(super) live: bool,
    /// This gateway's requests in flight there.
    pub(super) in_flight: usize,
    /// The live agent's scraped figures, when its scrape of the worker is fresh.
    pub(super) scraped: Option<Scraped>,
    /// The live agent's kernel figures, when its kernel view of the worker is fresh.
    pub(super) kernel_fresh: Option<KernelFresh>,
    /// This gateway's requests there still awaiting their first token.
    pub(super) awaiting_first_token: usize,
    /// The queue ahead of a new request (every client's, from the best view).
    pub(super) queue: Queue,
    /// Which view sized the other clients' share.
    pub(super) signal: QueueSignal,
    /// Why the kernel view was not used, when it was not.
    pub(super) kernel_missing: Option<KernelMissing>,
    /// The worker's rates, shrunk toward the fleet's.
    pub(super) rates: Rates,
    /// Its own prefill rate before the shrinkage, seconds per token (for the explanation).
    pub(super) own_s_per_token: f64,
    /// How many times slower than estimated it runs now, from our requests still awaiting their first
    /// token there ([`super::workers::InFlightPrompts::lateness`]); `rates` are scaled by it.
    pub(super) late: f64,
    /// Leading blocks of the prompt the worker holds (index or speculative credit).
    pub(super) run: usize,
    /// Of the run, the leading blocks shared with this gateway's requests in flight there (kept whatever
    /// the room); only counted where the room is short of the run.
    pub(super) pinned: usize,
    /// Blocks after the run that the worker holds only in a lower tier (CPU offload, disk, LMCache):
    /// loaded back, not computed.
    pub(super) offloaded_run: usize,
    /// Blocks of any prompt the index believes the worker holds (how full its cache is).
    pub(super) held_blocks: usize,
    /// The worker's cache as this request will find it; `None`: capacity unknown (the run counts in full).
    pub(super) kv_room: Option<KvRoom>,
}

/// Of a fresh scrape, what the policy stage shows beside the estimate (the rest of the worker's
/// [`Load`](super::workers::Load) is in the candidate's queue and room). Kept small: a decision
/// writes a candidate per worker, and two whole `Load`s made a candidate 512 bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Scraped {
    /// [`Load::waiting`](super::workers::Load::waiting).
    pub(super) waiting: u32,
    /// [`Load::kv_usage`](super::workers::Load::kv_usage).
    pub(super) kv_usage: f32,
}

/// Of a fresh kernel view, what the policy stage shows beside the estimate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct KernelFresh {
    /// [`Load::accept_backlog`](super::workers::Load::accept_backlog).
    pub(super) accept_backlog: (u32, u32),
    /// [`Load::kernel_ttfb`](super::workers::Load::kernel_ttfb).
    pub(super) kernel_ttfb: Option<Duration>,
}

impl Candidate<'_> {
    /// Leading blocks of the prompt still cached when the request is scheduled: the run, less what the
    /// queue ahead will evict when the cache is short of room.
    pub(super) fn surviving_run(&self) -> usize {
        self.kv_room
            .map_or(self.run, |room| room.surviving(self.run, self.pinned))
    }

    /// The estimate's inputs for a prompt of `prompt_tokens` tokens.
    pub(super) fn inputs(&self, prompt_tokens: usize) -> Inputs {
        // vLLM always computes at least the last prompt token, so a full hit still prefills one.
        let reusable = prompt_tokens.saturating_sub(1);
        let cached_tokens = (self.surviving_run() * self.block_size).min(reusable);
        // A lower tier's blocks extend the GPU run only where that run was not cut short by the room.
        let offloaded_tokens = if self.surviving_run() == self.run {
            (self.offloaded_run * self.block_size).min(reusable - cached_tokens)
        } else {
            0
        };
        Inputs {
            prompt_tokens,
            cached_tokens,
            offloaded_tokens,
            queue_tokens: self.queue.queue_tokens,
            running: self.queue.running,
        }
    }
}

impl Shared {
    /// The fleet's rates for each of `workers`, by its model: one lock, released before any worker's
    /// (a first token takes a worker's lock, then this one).
    pub(super) fn fleet_of(&self, workers: &[Arc<Worker>]) -> Vec<Rates> {
        let fleet = self.fleet_rates.lock();
        let mut last: Option<(&str, Rates)> = None;
        workers
            .iter()
            .map(|w| match &last {
                // A decision's candidates almost always serve one model: look it up once.
                Some((model, rates)) if *model == w.model => rates.clone(),
                _ => {
                    let rates = fleet
                        .get(&w.model)
                        .cloned()
                        .unwrap_or_else(|| self.prior_of(&w.model));
                    last = Some((w.model.as_str(), rates.clone()));
                    rates
                }
            })
            .collect()
    }

    /// Teaches the fleet's rates of `model` one first token.
    pub(super) fn observe_fleet(&self, model: &str, ttft_s: f64, work: f64) {
        let cfg = &self.tuning.estimator;
        let mut fleet = self.fleet_rates.lock();
        match fleet.get_mut(model) {
            Some(rates) => rates.observe(ttft_s, work, cfg),
            None => {
                let mut rates = self.prior_of(model);
                rates.observe(ttft_s, work, cfg);
                fleet.insert(model.to_string(), rates);
            }
        }
    }

    /// Every candidate's figures at `now`: the ledger, the agent's views, the rates. Shared by the
    /// decision and the policy stage's estimates, so both see the same queue.
    ///
    /// Read from the workers' decision rows under one lock ([`super::rows`]); a worker whose row
    /// cannot tell (more ledger entries since its views than the row keeps) is read under its own
    /// lock afterwards. With `decision_rows` off, every worker is read under its lock.
    pub(super) fn candidates_at<'w>(
        &self,
        workers: &'w [Arc<Worker>],
        now: Instant,
    ) -> Vec<Candidate<'w>> {
        let fresh = self.fresh_agents(now);
        let fleet = self.fleet_of(workers);
        if !self.tuning.decision_rows {
            return self.locked(workers, &fleet, &fresh, now);
        }
        let mut short = Vec::new();
        let mut cands: Vec<Candidate<'w>> = {
            let rows = self.rows.read();
            workers
                .iter()
                .zip(&fleet)
                .enumerate()
                .map(|(i, (w, fleet))| match rows.get(usize::from(w.id)) {
                    Some(row) => {
                        let (c, exact) = self.candidate(w, row, fleet, &fresh, now);
                        if !exact {
                            short.push(i);
                        }
                        c
                    }
                    None => {
                        short.push(i);
                        self.candidate(w, &Row::of(&w.state.read()), fleet, &fresh, now)
                            .0
                    }
                })
                .collect()
        };
        // Only now, the rows released, the workers they could not answer for: locking a worker
        // writes its row.
        for i in short {
            cands[i] = self.locked_one(&workers[i], &fleet[i], &fresh, now);
        }
        cands
    }

    /// [`Shared::candidates_at`] with every worker read under its own lock (the reference the rows
    /// are checked against).
    #[cfg(test)]
    pub(super) fn candidates_locked<'w>(
        &self,
        workers: &'w [Arc<Worker>],
        now: Instant,
    ) -> Vec<Candidate<'w>> {
        self.locked(
            workers,
            &self.fleet_of(workers),
            &self.fresh_agents(now),
            now,
        )
    }

    fn locked<'w>(
        &self,
        workers: &'w [Arc<Worker>],
        fleet: &[Rates],
        fresh: &[bool],
        now: Instant,
    ) -> Vec<Candidate<'w>> {
        workers
            .iter()
            .zip(fleet)
            .map(|(w, fleet)| self.locked_one(w, fleet, fresh, now))
            .collect()
    }

    fn locked_one<'w>(
        &self,
        w: &'w Arc<Worker>,
        fleet: &Rates,
        fresh: &[bool],
        now: Instant,
    ) -> Candidate<'w> {
        self.candidate(w, &*w.state.read(), fleet, fresh, now).0
    }

    /// One candidate's figures at `now`, from its state or its row (`figures`), and whether they are
    /// exact: not where a row cannot tell (more ledger entries since a view, or more prompts awaiting
    /// a first token, than it keeps), which then counts the ledger as it is now.
    pub(super) fn candidate<'w>(
        &self,
        worker: &'w Arc<Worker>,
        figures: &impl Figures,
        fleet: &Rates,
        fresh: &[bool],
        now: Instant,
    ) -> (Candidate<'w>, bool) {
        let tuning = &self.tuning;
        let f = figures;
        let mut exact = true;
        let mut seen = |at: Instant, linger: Duration| {
            f.seen(at, linger).unwrap_or_else(|| {
                exact = false;
                Seen {
                    in_flight: f.in_flight(),
                    waiting: f.awaiting_first_token(),
                }
            })
        };
        let live = f
            .agent()
            .is_some_and(|a| fresh.get(a).copied().unwrap_or(false));
        // Everything the agent said about the worker; its two views of every client's requests, each
        // with our own requests as that view saw them.
        let load = f.load().filter(|_| live);
        let scraped = load.filter(|l| l.metrics_fresh(now, tuning.load_max_age));
        let engine = match scraped {
            Some(l) => {
                let e = EngineQueue {
                    running: l.running,
                    waiting: l.waiting,
                };
                Some((e, seen(l.measured, Duration::ZERO)))
            }
            None => None,
        };
        let kernel = match load {
            None => Err(KernelMissing::NoAgent),
            Some(l) => match l.kernel {
                None => Err(KernelMissing::EbpfOff),
                Some(_)
                    if now.saturating_duration_since(l.received)
                        > tuning.estimator.kernel_max_age =>
                {
                    Err(KernelMissing::Stale)
                }
                Some(k) => {
                    // The agent sends a changed figure within `kernel_delay`, so one received
                    // earlier and not replaced still held then.
                    let at = l.received.max(
                        now.checked_sub(tuning.estimator.kernel_delay)
                            .unwrap_or(now),
                    );
                    Ok((k, seen(at, l.kernel_linger)))
                }
            },
        };
        let ledger = Ledger {
            in_flight: f.in_flight(),
            awaiting_first_token: f.awaiting_first_token(),
            pending_prefill_tokens: f.backlog().tokens(now),
            avg_uncached: f.avg_uncached(),
        };
        let (queue, signal) = estimate::queue(&ledger, kernel.ok(), engine, &tuning.estimator);
        let block_size = f.block_size().unwrap_or(tuning.default_block_size).max(1);
        let late = f.lateness(now).unwrap_or_else(|| {
            exact = false;
            1.0
        });
        let kv_room = scraped.and_then(|l| {
            let capacity = l.kv_capacity_blocks?;
            Some(KvRoom::new(
                capacity,
                l.kv_usage,
                queue.queue_tokens,
                block_size,
            ))
        });
        let c = Candidate {
            worker,
            block_size,
            live,
            in_flight: ledger.in_flight,
            scraped: scraped.map(|l| Scraped {
                waiting: l.waiting,
                kv_usage: l.kv_usage,
            }),
            kernel_fresh: load.filter(|_| kernel.is_ok()).map(|l| KernelFresh {
                accept_backlog: l.accept_backlog,
                kernel_ttfb: l.kernel_ttfb,
            }),
            awaiting_first_token: ledger.awaiting_first_token,
            queue,
            signal,
            kernel_missing: kernel.err(),
            rates: estimate::blended(f.rates(), fleet, now).slowed(late),
            own_s_per_token: f.rates().s_per_token,
            late,
            run: 0,
            offloaded_run: 0,
            pinned: 0,
            held_blocks: 0,
            kv_room,
        };
        (c, exact)
    }

    /// The prompt's block keys (salted with `salt` as its worker will salt them) per block size in use, and every candidate's cached run (KV index, then
    /// speculative credit) in one pass per size; also each candidate's `held_blocks`, read under the same
    /// index lock.
    pub(super) fn cached_runs(
        &self,
        model: &str,
        salt: Option<&str>,
        tokens: &[u32],
        cands: &mut [Candidate<'_>],
        now: Instant,
    ) -> Vec<(usize, Arc<[BlockKey]>)> {
        let hasher = KeyHasher::for_model(model);
        let mut sizes: Vec<usize> = cands.iter().map(|c| c.block_size).collect();
        sizes.sort_unstable();
        sizes.dedup();
        // Hash before taking any lock: it is the most expensive part of a decision.
        let keys_by_size: Vec<(usize, Arc<[BlockKey]>)> = sizes
            .into_iter()
            .map(|bs| (bs, hasher.salted_keys(salt, tokens, bs).into()))
            .collect();
        let mut slot_of = vec![
            usize::MAX;
            cands
                .iter()
                .map(|c| usize::from(c.worker.id) + 1)
                .max()
                .unwrap_or(0)
        ];
        for (i, c) in cands.iter().enumerate() {
            slot_of[usize::from(c.worker.id)] = i;
        }
        let index = self.index.read();
        for c in cands.iter_mut() {
            c.held_blocks = index.worker_blocks(c.worker.id);
        }
        let spec = self.spec.lock();
        let mut runs = Vec::new();
        for (bs, keys) in &keys_by_size {
            let group: Vec<usize> = (0..cands.len())
                .filter(|i| cands[*i].block_size == *bs && cands[*i].live)
                .collect();
            let ids: Vec<WorkerId> = group.iter().map(|i| cands[*i].worker.id).collect();
            index.leading_runs_bisect(keys, &ids, &mut runs);
            for (i, run) in group.iter().zip(runs.iter()) {
                cands[*i].run = *run;
            }
            spec.runs(keys, now, |w, run| {
                if let Some(c) = slot_of.get(usize::from(w)).and_then(|i| cands.get_mut(*i))
                    && c.block_size == *bs
                {
                    c.run = c.run.max(run);
                }
            });
        }
        drop(spec);
        drop(index);
        // Past the GPU run, the blocks a lower tier holds (most workers have none: an empty index
        // answers at once).
        let offloaded = self.offloaded.read();
        if offloaded.pairs() > 0 {
            for c in cands.iter_mut().filter(|c| c.live) {
                if let Some((_, keys)) = keys_by_size.iter().find(|(bs, _)| *bs == c.block_size) {
                    c.offloaded_run = keys[c.run.min(keys.len())..]
                        .iter()
                        .take_while(|k| offloaded.contains(**k, c.worker.id))
                        .count();
                }
            }
        }
        drop(offloaded);
        // Only where the room would cut the run: the comparison walks this gateway's prompts in flight.
        for c in cands.iter_mut() {
            if c.kv_room.is_some_and(|room| room.free() < c.run)
                && let Some((_, keys)) = keys_by_size.iter().find(|(bs, _)| *bs == c.block_size)
            {
                c.pinned = c.worker.state.read().prompts.shared_run(&keys[..c.run]);
            }
        }
        keys_by_size
    }
}
