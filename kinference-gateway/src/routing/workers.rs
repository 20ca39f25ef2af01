//! The router's worker table: every worker it may route to, with its in-flight ledger, learned rates
//! and the latest load figures its agent sent.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::estimate::{KernelQueue, Rates, Seen};
use super::kv_index::{MAX_WORKERS, WorkerId};
pub mod rows;

use kinference_api::{BlockKey, WorkerRole};
use rows::{Row, Rows, StateCell};

/// Load figures from the worker's agent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Load {
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc` (0..1).
    pub kv_usage: f32,
    /// KV cache capacity in blocks (`num_gpu_blocks`), when the worker reports it.
    pub kv_capacity_blocks: Option<u32>,
    /// Whether the scrape behind `running`/`waiting` succeeded.
    pub metrics_ok: bool,
    /// The kernel's view of the worker's port, all clients (eBPF), when the agent has one.
    pub kernel: Option<KernelQueue>,
    /// The kernel's accept queue of the worker's port: connections the worker has not accepted yet
    /// (the peak since the agent's previous read), and its limit; 0 without eBPF.
    pub accept_backlog: (u32, u32),
    /// The kernel's recent median time from a request's first byte in to the first response byte
    /// out; `None` without eBPF or without a sample.
    pub kernel_ttfb: Option<Duration>,
    /// How long a finished response may still count in the kernel's in-flight figure (the agent's idle
    /// gap).
    pub kernel_linger: Duration,
    /// When the scraped figures were measured (receive time minus their age at send).
    pub measured: Instant,
    /// When the figures arrived (the kernel figures are at most one agent poll old when sent).
    pub received: Instant,
}

impl Load {
    /// Whether the scrape figures are usable at `now`.
    pub fn metrics_fresh(&self, now: Instant, max_age: Duration) -> bool {
        self.metrics_ok && now.saturating_duration_since(self.measured) <= max_age
    }
}

/// Mutable per-worker state.
#[derive(Debug)]
pub struct WorkerState {
    /// Requests this gateway has in flight there.
    pub in_flight: usize,
    /// Of which (estimate-routed ones) the first token has not arrived yet.
    pub awaiting_first_token: usize,
    /// The prefill of this gateway's requests there not done yet.
    pub backlog: Backlog,
    /// When the ledger's recent requests started, got their first token and ended.
    pub log: LedgerLog,
    /// Learned rates.
    pub rates: Rates,
    /// EWMA of uncached tokens per request (sizes the agent's `waiting` count in tokens).
    pub avg_uncached: f64,
    /// Tokens per KV block, from the agent.
    pub block_size: Option<usize>,
    /// Index of the agent reporting this worker, if any.
    pub agent: Option<usize>,
    /// Latest load from the agent.
    pub load: Option<Load>,
    /// The worker left (agent-discovered workers only; configured ones stay).
    pub gone: bool,
    /// Set by the gateway's health prober; unhealthy workers are not candidates.
    pub healthy: bool,
    /// The prompts of this gateway's requests in flight there, as block keys.
    pub prompts: InFlightPrompts,
    /// Its part in prefill/decode disaggregation.
    pub role: WorkerRole,
    /// The role was given for this worker itself (its configuration, pod label or agent), not by
    /// its pool: a pool's `role` does not override it.
    pub role_pinned: bool,
    /// Time per output token of this gateway's recent streams there (EWMA, seconds): the decode
    /// side of a split request goes where it is low.
    pub tpot_s: Option<f64>,
}

/// The block keys of this gateway's requests in flight on one worker.
///
/// A prefix that one of them shares with a new prompt is there when the new request is scheduled,
/// whatever room the cache has: a running request holds its blocks (vLLM evicts only blocks no request
/// references), and one still queued ahead allocates or recomputes them first. The memory-pressure
/// discount ([`super::estimate::KvRoom`]) must not take such a prefix as about to be evicted: on the
/// heterogeneous benchmark at concurrency 32 the cache of a worker holding a popular system prompt was
/// 94% in use, by requests running that very prompt, and the discount sent the next request with it to
/// another worker cold.
///
/// Each also keeps when it was sent and the TTFT estimated for it until its first token, which measures
/// how late the worker runs against the estimate ([`InFlightPrompts::lateness`]).
#[derive(Debug, Default)]
pub struct InFlightPrompts {
    next_id: u64,
    prompts: Vec<InFlightPrompt>,
}

#[derive(Debug)]
struct InFlightPrompt {
    id: u64,
    keys: Arc<[BlockKey]>,
    sent: Instant,
    /// The TTFT estimated at the decision, seconds, while the first token is awaited.
    awaiting: Option<f64>,
}

/// A request awaiting its first token counts as late only past this many times its estimated TTFT...
const LATE_AFTER_ESTIMATES: f64 = 2.0;
/// ... and never before this long (a short estimate is mostly noise).
const LATE_MIN_S: f64 = 0.05;

impl InFlightPrompts {
    /// Adds a routed request's prompt with its estimated TTFT; the id removes it when the request ends.
    pub fn add(&mut self, keys: Arc<[BlockKey]>, sent: Instant, estimated_ttft_s: f64) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.prompts.push(InFlightPrompt {
            id,
            keys,
            sent,
            awaiting: Some(estimated_ttft_s),
        });
        id
    }

    /// The request's first token arrived: it no longer tells how late the worker runs.
    pub fn first_token(&mut self, id: u64) {
        if let Some(p) = self.prompts.iter_mut().find(|p| p.id == id) {
            p.awaiting = None;
        }
    }

    /// Removes a prompt added with `id` (nothing if it is gone already).
    pub fn remove(&mut self, id: u64) {
        if let Some(i) = self.prompts.iter().position(|p| p.id == id) {
            self.prompts.swap_remove(i);
        }
    }

    /// How many times slower than estimated the worker runs now, from the requests still awaiting their
    /// first token there: 1 while each has waited less than [`LATE_AFTER_ESTIMATES`] times its estimate,
    /// else the largest `waited / (LATE_AFTER_ESTIMATES x estimate)`.
    ///
    /// The estimate learns a worker's rates only from first tokens, which come late exactly when the
    /// worker is far slower than estimated, and its model can be wrong in ways no rate fixes (on the
    /// heterogeneous benchmark a slow worker with a small cache ran 24 requests of three prompts that
    /// did not fit in it together: estimated 0.15 s, their first tokens took 15-20 s while more were
    /// sent). A request that has already waited several times its estimate says so at once.
    pub fn lateness(&self, now: Instant) -> f64 {
        lateness_of(self.awaiting(), now)
    }

    /// When each prompt still awaiting its first token was sent, and its estimated TTFT.
    fn awaiting(&self) -> impl Iterator<Item = (Instant, f64)> + '_ {
        self.prompts
            .iter()
            .filter_map(|p| Some((p.sent, p.awaiting?)))
    }

    /// The prompts awaiting their first token, as far as a decision row keeps them.
    pub fn awaiting_tail(&self) -> AwaitingTail {
        let mut tail = AwaitingTail::default();
        for (sent, estimate) in self.awaiting() {
            if tail.len == TAIL {
                tail.truncated = true;
                break;
            }
            tail.prompts[tail.len] = Some((sent, estimate));
            tail.len += 1;
        }
        tail
    }

    /// Prompts in flight.
    pub fn len(&self) -> usize {
        self.prompts.len()
    }

    /// Whether none is in flight.
    pub fn is_empty(&self) -> bool {
        self.prompts.is_empty()
    }

    /// The longest run of leading blocks `keys` shares with a prompt in flight.
    pub fn shared_run(&self, keys: &[BlockKey]) -> usize {
        let mut best = 0;
        for prompt in &self.prompts {
            if prompt.keys.len() <= best || keys.len() <= best {
                continue;
            }
            let run = prompt
                .keys
                .iter()
                .zip(keys)
                .take_while(|(a, b)| a == b)
                .count();
            best = best.max(run);
        }
        best
    }
}

/// [`InFlightPrompts::lateness`] of prompts sent at the given times with the given estimated TTFTs
/// (seconds), in the ledger's order.
fn lateness_of(awaiting: impl Iterator<Item = (Instant, f64)>, now: Instant) -> f64 {
    awaiting
        .map(|(sent, estimate)| {
            let waited = now.saturating_duration_since(sent).as_secs_f64();
            waited / (LATE_AFTER_ESTIMATES * estimate).max(LATE_MIN_S)
        })
        .fold(1.0, f64::max)
}

/// How many of the newest ledger entries (and prompts awaiting a first token) a decision row copies
/// ([`super::rows`]): enough for the views of the last second on a worker receiving a few requests a
/// second; a worker with more since its views is read under its lock.
pub const TAIL: usize = 8;

/// The first [`TAIL`] prompts awaiting their first token on a worker (send time, estimated TTFT).
#[derive(Clone, Copy, Debug, Default)]
pub struct AwaitingTail {
    prompts: [Option<(Instant, f64)>; TAIL],
    len: usize,
    /// More were awaiting than the tail holds.
    truncated: bool,
}

impl AwaitingTail {
    /// [`InFlightPrompts::lateness`], or `None` when more prompts await than the tail holds.
    pub fn lateness(&self, now: Instant) -> Option<f64> {
        (!self.truncated).then(|| lateness_of(self.prompts.iter().flatten().copied(), now))
    }
}

/// This gateway's uncached prompt tokens queued on one worker, as a first-come-first-served queue that
/// the worker drains at its prefill rate.
///
/// vLLM runs a started prefill to its end before it admits the next waiting request (running requests
/// are scheduled first), so the prefill still ahead of a new request is the queue's *remaining* work,
/// not the sum of the prompts still waiting for their first token: counting a half-done prefill in full
/// overstated busy workers' queues, and the rates learned from their faster-than-estimated requests
/// then made them look faster than their peers. Each request takes a position (the tokens enqueued up to
/// and including its own); time drains the queue at the rate given with the latest request; a first
/// token proves everything up to its request's position done.
#[derive(Debug, Clone, Copy)]
pub struct Backlog {
    /// Tokens ever enqueued (the position of the newest request's end).
    enqueued: f64,
    /// Tokens known or assumed done.
    done: f64,
    /// When `done` was last brought up to date.
    settled_at: Option<Instant>,
    /// Seconds per token the queue drains at.
    s_per_token: f64,
}

impl Default for Backlog {
    fn default() -> Self {
        Self {
            enqueued: 0.0,
            done: 0.0,
            settled_at: None,
            s_per_token: f64::INFINITY,
        }
    }
}

impl Backlog {
    /// Tokens still to prefill at `now`.
    pub fn tokens(&self, now: Instant) -> f64 {
        (self.enqueued - self.done_at(now)).max(0.0)
    }

    fn done_at(&self, now: Instant) -> f64 {
        let drained = self.settled_at.map_or(0.0, |t| {
            now.saturating_duration_since(t).as_secs_f64() / self.s_per_token
        });
        (self.done + drained).min(self.enqueued)
    }

    fn settle(&mut self, now: Instant) {
        self.done = self.done_at(now);
        self.settled_at = Some(now);
    }

    /// Enqueues a request's `tokens` at `now`, draining at `s_per_token` from now on; returns its
    /// position.
    pub fn push(&mut self, tokens: f64, now: Instant, s_per_token: f64) -> f64 {
        self.settle(now);
        self.enqueued += tokens.max(0.0);
        if s_per_token.is_finite() && s_per_token > 0.0 {
            self.s_per_token = s_per_token;
        }
        self.enqueued
    }

    /// The request at `position` got its first token (or ended): everything up to it is done.
    pub fn reached(&mut self, position: f64, now: Instant) {
        self.settle(now);
        self.done = self.done.max(position.min(self.enqueued));
    }
}

/// When this gateway's recent requests on one worker started, got their first token and ended, so that a
/// view taken a moment ago can be compared with the ledger as it was then ([`LedgerLog::seen`]).
///
/// Entries older than [`LedgerLog::HORIZON`] are dropped as new ones come, and each list is capped, so
/// the memory stays bounded at any request rate; a query reads only the entries since the time asked
/// about and a few before them ([`LedgerLog::after`]).
#[derive(Debug, Default)]
pub struct LedgerLog {
    starts: VecDeque<Instant>,
    first_tokens: VecDeque<Instant>,
    ends: VecDeque<Instant>,
}

/// The newest [`TAIL`] entries of one of a [`LedgerLog`]'s lists, newest first.
#[derive(Clone, Copy, Debug, Default)]
struct Tail {
    newest: [Option<Instant>; TAIL],
    /// The list holds more entries than these.
    truncated: bool,
}

impl Tail {
    fn of(list: &VecDeque<Instant>) -> Self {
        let mut newest = [None; TAIL];
        for (slot, t) in newest.iter_mut().zip(list.iter().rev()) {
            *slot = Some(*t);
        }
        Self {
            newest,
            truncated: list.len() > TAIL,
        }
    }

    /// [`LedgerLog::after`], or `None` when every entry of the tail is later than `t` and the list
    /// holds older ones (which may be later too).
    fn after(&self, t: Instant) -> Option<usize> {
        let n = self
            .newest
            .iter()
            .take_while(|e| e.is_some_and(|e| e > t))
            .count();
        (n < TAIL || !self.truncated).then_some(n)
    }
}

/// The newest entries of a [`LedgerLog`], as a decision row keeps them.
#[derive(Clone, Copy, Debug, Default)]
pub struct LogTail {
    starts: Tail,
    first_tokens: Tail,
    ends: Tail,
}

impl LogTail {
    /// [`LedgerLog::seen`], or `None` when the view is older than the tail reaches.
    pub fn seen(
        &self,
        in_flight: usize,
        awaiting: usize,
        at: Instant,
        linger: Duration,
    ) -> Option<Seen> {
        let started = self.starts.after(at)?;
        let ended = self.ends.after(at.checked_sub(linger).unwrap_or(at))?;
        let first_tokens = self.first_tokens.after(at)?;
        Some(Seen {
            in_flight: (in_flight + ended).saturating_sub(started),
            waiting: (awaiting + first_tokens).saturating_sub(started),
        })
    }
}

impl LedgerLog {
    /// The newest entries, for a decision row.
    pub fn tail(&self) -> LogTail {
        LogTail {
            starts: Tail::of(&self.starts),
            first_tokens: Tail::of(&self.first_tokens),
            ends: Tail::of(&self.ends),
        }
    }

    /// How far back the log reaches: beyond the oldest view the estimate uses plus the longest linger.
    pub const HORIZON: Duration = Duration::from_secs(10);
    /// Most entries kept per list.
    pub const CAP: usize = 16 * 1024;

    /// A request started at `at`.
    pub fn started(&mut self, at: Instant) {
        Self::push(&mut self.starts, at);
    }

    /// A request got its first token at `at`.
    pub fn first_token(&mut self, at: Instant) {
        Self::push(&mut self.first_tokens, at);
    }

    /// A request ended at `at`.
    pub fn ended(&mut self, at: Instant) {
        Self::push(&mut self.ends, at);
    }

    fn push(list: &mut VecDeque<Instant>, at: Instant) {
        while list.len() >= Self::CAP
            || list
                .front()
                .is_some_and(|t| at.saturating_duration_since(*t) > Self::HORIZON)
        {
            list.pop_front();
        }
        // Callers stamp under the worker's lock, so entries arrive in order: append without a search
        // (this runs on every decision and every ticket release); keep the list sorted anyway.
        if list.back().is_none_or(|last| *last <= at) {
            list.push_back(at);
        } else {
            let i = list.partition_point(|t| *t <= at);
            list.insert(i, at);
        }
    }

    /// How many entries are later than `t`. The views asked about are recent, so those entries are
    /// the last few: the search gallops back from the end (1, 2, 4, ... entries), then bisects only
    /// the stretch it stopped in. A bisection of the whole list would touch its middle, long out of
    /// the CPU's caches, for each of three lists of every candidate: half of a 100-worker decision in
    /// a running gateway went there.
    fn after(list: &VecDeque<Instant>, t: Instant) -> usize {
        // Invariant: every entry from `end` on is later than `t`; every entry before `start` is not.
        let (mut start, mut end) = (0, list.len());
        let mut step = 1;
        while step <= end {
            let probe = end - step;
            if list[probe] <= t {
                start = probe + 1;
                break;
            }
            end = probe;
            step *= 2;
        }
        while start < end {
            let mid = start + (end - start) / 2;
            if list[mid] <= t {
                start = mid + 1;
            } else {
                end = mid;
            }
        }
        list.len() - start
    }

    /// Our requests as a view taken at `at` counted them, given the ledger's current `in_flight` and
    /// `awaiting` (first token) figures: requests started after `at` were not in it; requests that ended
    /// after `at - linger` were (a finished response lingers that long in the kernel's count).
    pub fn seen(&self, in_flight: usize, awaiting: usize, at: Instant, linger: Duration) -> Seen {
        let started = Self::after(&self.starts, at);
        let ended = Self::after(&self.ends, at.checked_sub(linger).unwrap_or(at));
        let first_tokens = Self::after(&self.first_tokens, at);
        Seen {
            in_flight: (in_flight + ended).saturating_sub(started),
            waiting: (awaiting + first_tokens).saturating_sub(started),
        }
    }
}

impl WorkerState {
    /// The role given for this worker itself (configuration, pod label): it wins over its pool's.
    pub fn pin_role(&mut self, role: WorkerRole) {
        self.role = role;
        self.role_pinned = true;
    }

    /// The role an agent reports (`""`: the agent was not told; the role known stays).
    pub fn set_reported_role(&mut self, wire: &str) {
        if let Some(role) = WorkerRole::from_wire(wire) {
            self.pin_role(role);
        }
    }

    /// A pool's `role` for its member: applied unless the worker has a role of its own.
    pub fn set_pool_role(&mut self, role: WorkerRole) {
        if !self.role_pinned {
            self.role = role;
        }
    }

    /// A request's prefill is over (its first token, or its end without one): everything up to its
    /// backlog `position` is done and, if it was `awaited`, it no longer awaits its first token.
    pub fn prefill_over(&mut self, position: Option<f64>, awaited: bool, now: Instant) {
        if let Some(position) = position {
            self.backlog.reached(position, now);
        }
        if awaited {
            self.awaiting_first_token = self.awaiting_first_token.saturating_sub(1);
            self.log.first_token(now);
        }
    }
}

/// One worker.
#[derive(Debug)]
pub struct Worker {
    /// Index in the table (and in the KV index).
    pub id: WorkerId,
    /// Base URL (no trailing slash).
    pub url: String,
    /// The data-parallel rank this entry is, for a worker whose agent reports its caches per rank
    /// (vLLM `--data-parallel-size N`): every rank is a cache and a queue of its own, sent its
    /// requests with `X-data-parallel-rank`. `None`: the worker as a whole (rank-less).
    pub dp_rank: Option<u32>,
    /// Served model.
    pub model: String,
    /// From the gateway configuration (as opposed to discovered through an agent).
    pub configured: bool,
    /// Ledger, rates and load (each unlock refreshes the worker's decision row, [`super::rows`]).
    pub state: StateCell,
}

impl Worker {
    /// The worker's URL, with its rank when it is one (`http://10.0.0.7:8000#dp1`): for logs and
    /// `x-kinference-decision`.
    pub fn label(&self) -> String {
        match self.dp_rank {
            Some(rank) => format!("{}#dp{rank}", self.url),
            None => self.url.clone(),
        }
    }
}

/// Every worker the router knows; ids are never reused.
#[derive(Debug, Default)]
pub struct WorkerTable {
    list: Vec<Arc<Worker>>,
    /// Rank-less workers by URL.
    by_url: HashMap<String, WorkerId>,
    /// Data-parallel ranks by (URL, rank), and each URL's ranks.
    by_rank: HashMap<(String, u32), WorkerId>,
    ranks_of: HashMap<String, Vec<WorkerId>>,
    /// LoRA adapter name -> the workers that have it loaded (see `routing::adapters`).
    pub(super) adapters: HashMap<String, Vec<WorkerId>>,
    /// Every worker's decision row, by id.
    rows: Arc<Rows>,
}

/// Worker URLs compare without a trailing slash.
pub fn normalize_url(url: &str) -> &str {
    url.trim_end_matches('/')
}

impl WorkerTable {
    /// The worker with this URL.
    pub fn get(&self, url: &str) -> Option<&Arc<Worker>> {
        self.by_url
            .get(normalize_url(url))
            .map(|id| &self.list[usize::from(*id)])
    }

    /// The cache a summary names: the rank-less worker at `url`, or one of its data-parallel ranks.
    pub fn get_cache(&self, url: &str, rank: Option<u32>) -> Option<&Arc<Worker>> {
        match rank {
            None => self.get(url),
            Some(rank) => self
                .by_rank
                .get(&(normalize_url(url).to_string(), rank))
                .map(|id| &self.list[usize::from(*id)]),
        }
    }

    /// Every entry at `url`: the rank-less worker and its data-parallel ranks (health, roles and
    /// discovery speak of the endpoint, so of all of them).
    pub fn at_url(&self, url: &str) -> Vec<&Arc<Worker>> {
        let url = normalize_url(url);
        let ranks = self.ranks_of.get(url).map_or(&[][..], Vec::as_slice);
        self.by_url
            .get(url)
            .into_iter()
            .chain(ranks)
            .map(|id| &self.list[usize::from(*id)])
            .collect()
    }

    /// The worker with this id.
    pub fn by_id(&self, id: WorkerId) -> Option<&Arc<Worker>> {
        self.list.get(usize::from(id))
    }

    /// Every worker.
    pub fn all(&self) -> &[Arc<Worker>] {
        &self.list
    }

    /// Every worker's decision row.
    pub fn rows(&self) -> &Arc<Rows> {
        &self.rows
    }

    /// Adds a worker, or returns the existing one with that URL. `None` when the table is full.
    pub fn get_or_add(
        &mut self,
        url: &str,
        model: &str,
        configured: bool,
        rates: &Rates,
    ) -> Option<Arc<Worker>> {
        self.get_or_add_cache(url, None, model, configured, rates)
    }

    /// [`WorkerTable::get_or_add`] for one data-parallel rank of the worker at `url` (`None`: the
    /// rank-less worker).
    pub fn get_or_add_cache(
        &mut self,
        url: &str,
        dp_rank: Option<u32>,
        model: &str,
        configured: bool,
        rates: &Rates,
    ) -> Option<Arc<Worker>> {
        if let Some(w) = self.get_cache(url, dp_rank) {
            return Some(Arc::clone(w));
        }
        if self.list.len() >= MAX_WORKERS {
            return None;
        }
        let id = self.list.len() as WorkerId;
        let worker = Arc::new(Worker {
            id,
            url: normalize_url(url).to_string(),
            dp_rank,
            model: model.to_string(),
            configured,
            state: StateCell::new(
                id,
                Arc::clone(&self.rows),
                WorkerState {
                    in_flight: 0,
                    awaiting_first_token: 0,
                    backlog: Backlog::default(),
                    log: LedgerLog::default(),
                    rates: rates.clone(),
                    avg_uncached: 512.0,
                    block_size: None,
                    agent: None,
                    load: None,
                    gone: false,
                    healthy: true,
                    prompts: InFlightPrompts::default(),
                    role: WorkerRole::Both,
                    role_pinned: false,
                    tpot_s: None,
                },
            ),
        });
        match dp_rank {
            None => {
                self.by_url.insert(worker.url.clone(), id);
            }
            Some(rank) => {
                self.by_rank.insert((worker.url.clone(), rank), id);
                self.ranks_of
                    .entry(worker.url.clone())
                    .or_default()
                    .push(id);
            }
        }
        self.list.push(Arc::clone(&worker));
        Some(worker)
    }

    /// Which of the table's workers `urls` name, by id: a pool's member list matched in one pass
    /// (comparing each candidate with each URL cost 15 us per request for a pool of 100).
    pub fn named(&self, urls: &[String]) -> Vec<bool> {
        let mut named = vec![false; self.list.len()];
        for url in urls {
            for w in self.at_url(url) {
                named[usize::from(w.id)] = true;
            }
        }
        named
    }

    /// Healthy workers serving `model` (or with an adapter of that name loaded) that have not left
    /// and take whole requests: `prefill` workers only when the model has no other.
    pub fn candidates(&self, model: &str) -> Vec<Arc<Worker>> {
        let (mut whole, mut prefill) = (Vec::new(), Vec::new());
        // The rows, not each worker's lock: every request calls this.
        let rows = self.rows.read();
        for w in self
            .list
            .iter()
            .filter(|w| w.model == model || self.has_adapter(w.id, model))
        {
            let Some(row) = rows.get(usize::from(w.id)) else {
                continue;
            };
            if row.gone || !row.healthy || self.split_into_ranks_in(w, &rows) {
                continue;
            }
            if row.serves_whole {
                whole.push(Arc::clone(w));
            } else {
                prefill.push(Arc::clone(w));
            }
        }
        if whole.is_empty() { prefill } else { whole }
    }

    /// [`WorkerTable::candidates`] of every role: the pair of a split request is picked from them.
    pub fn candidates_any_role(&self, model: &str) -> Vec<Arc<Worker>> {
        self.list
            .iter()
            // The model first: only that model's workers are locked (every request calls this).
            .filter(|w| w.model == model || self.has_adapter(w.id, model))
            .filter(|w| {
                let st = w.state.read();
                !st.gone && st.healthy
            })
            .filter(|w| !self.split_into_ranks(w))
            .cloned()
            .collect()
    }

    /// Whether `w` is a rank-less worker whose agent reports it rank by rank now: its ranks are the
    /// candidates (the entry from the gateway's configuration or discovery holds no cache).
    fn split_into_ranks(&self, w: &Worker) -> bool {
        w.dp_rank.is_none()
            && self.ranks_of.get(&w.url).is_some_and(|ranks| {
                ranks
                    .iter()
                    .any(|id| !self.list[usize::from(*id)].state.read().gone)
            })
    }

    /// [`WorkerTable::split_into_ranks`] from the decision rows.
    fn split_into_ranks_in(&self, w: &Worker, rows: &[Row]) -> bool {
        w.dp_rank.is_none()
            && !self.ranks_of.is_empty()
            && self.ranks_of.get(&w.url).is_some_and(|ranks| {
                ranks
                    .iter()
                    .any(|id| rows.get(usize::from(*id)).is_some_and(|r| !r.gone))
            })
    }

    /// Whether any worker ever served `model`, or has an adapter of that name loaded.
    pub fn knows_model(&self, model: &str) -> bool {
        self.list.iter().any(|w| w.model == model) || self.adapters.contains_key(model)
    }
}

#[cfg(test)]
mod tests;
