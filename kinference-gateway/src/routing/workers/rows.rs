//! Decision rows: a copy of each worker's figures that a decision reads, kept side by side in one
//! table so a decision over 1,000 workers takes one lock instead of one per worker.
//!
//! A decision needs, per worker, its ledger (requests in flight, awaiting a first token, the prefill
//! backlog), its learned rates, its agent's latest load figures and a few of the ledger's newest
//! timestamps. Read from each worker's [`WorkerState`] behind its own lock, from structures spread
//! over the heap, that cost about 150 ns a worker (161 us a decision at 1,000 workers, issue 35).
//!
//! **What a row holds**: [`Row`], a plain copy of those fields of the worker's state, plus the
//! newest [`TAIL`](super::TAIL) entries of its ledger log and of its prompts awaiting a
//! first token (the rest of the state, the full log and the prompts' block keys, stays behind the
//! worker's lock).
//!
//! **When it is refreshed**: every time the worker's state is unlocked after a change. The state can
//! be changed only through [`StateCell::lock`], whose guard writes the row as it is dropped, so
//! whatever changes the state (a dispatch, a first token, an end, an agent's summary or scrape,
//! health, roles) is in the row before the next lock of the worker; nothing has to remember to
//! refresh it. [`StateCell::read`] locks to read only (no `DerefMut`) and writes nothing.
//!
//! **What stays time-dependent**: the row holds the inputs, not the results, of everything that
//! depends on the time of the decision (the backlog draining, the rates' fade, the views' ages,
//! lateness). A decision computes those from the row with the same functions as from the state, so
//! a candidate from a row is the candidate from the state, figure for figure (the test
//! `rows_match_the_locked_state` in `routing::tests` checks it on random fleets and events). Where
//! a row cannot tell (more ledger entries since a view, or more prompts awaiting, than its tail
//! holds), the decision reads that worker under its lock.
//!
//! Lock order: a worker's lock, then the table's (the guard writes the row while it holds the
//! worker). A decision never takes another lock while it reads the table.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard, RwLock, RwLockReadGuard};

use super::super::estimate::{Rates, Seen};
use super::super::kv_index::WorkerId;
use super::{AwaitingTail, Backlog, Load, LogTail, WorkerState};

/// One worker's figures as a decision reads them (see the module docs).
#[derive(Clone, Debug)]
pub struct Row {
    /// [`WorkerState::gone`].
    pub gone: bool,
    /// [`WorkerState::healthy`].
    pub healthy: bool,
    /// Whether its role takes whole requests ([`kinference_api::WorkerRole::serves_whole`]).
    pub serves_whole: bool,
    /// [`WorkerState::in_flight`].
    pub in_flight: usize,
    /// [`WorkerState::awaiting_first_token`].
    pub awaiting_first_token: usize,
    /// [`WorkerState::backlog`]: drained at decision time.
    pub backlog: Backlog,
    /// [`WorkerState::avg_uncached`].
    pub avg_uncached: f64,
    /// [`WorkerState::block_size`].
    pub block_size: Option<usize>,
    /// [`WorkerState::agent`].
    pub agent: Option<usize>,
    /// [`WorkerState::load`].
    pub load: Option<Load>,
    /// [`WorkerState::rates`]: blended with the fleet's at decision time.
    pub rates: Rates,
    /// The newest entries of [`WorkerState::log`].
    pub log: LogTail,
    /// The first prompts of [`WorkerState::prompts`] awaiting their first token.
    pub awaiting: AwaitingTail,
}

impl Row {
    /// The row of a worker in `st`.
    pub fn of(st: &WorkerState) -> Self {
        Self {
            gone: st.gone,
            healthy: st.healthy,
            serves_whole: st.role.serves_whole(),
            in_flight: st.in_flight,
            awaiting_first_token: st.awaiting_first_token,
            backlog: st.backlog,
            avg_uncached: st.avg_uncached,
            block_size: st.block_size,
            agent: st.agent,
            load: st.load,
            rates: st.rates.clone(),
            log: st.log.tail(),
            awaiting: st.prompts.awaiting_tail(),
        }
    }
}

/// Every worker's row, by [`WorkerId`].
#[derive(Debug, Default)]
pub struct Rows(RwLock<Vec<Row>>);

impl Rows {
    /// Reads every row at once (take no other lock while holding it).
    pub fn read(&self) -> RwLockReadGuard<'_, Vec<Row>> {
        self.0.read()
    }

    fn store(&self, id: WorkerId, row: Row) {
        let mut rows = self.0.write();
        let i = usize::from(id);
        if i < rows.len() {
            rows[i] = row;
        } else {
            // Workers are added in id order, each storing its row when created.
            debug_assert_eq!(i, rows.len());
            rows.push(row);
        }
    }
}

/// A worker's state behind its lock, with its row in the table kept up to date.
pub struct StateCell {
    id: WorkerId,
    rows: Arc<Rows>,
    state: Mutex<WorkerState>,
}

impl StateCell {
    /// The state of worker `id`, its row stored in `rows`.
    pub fn new(id: WorkerId, rows: Arc<Rows>, state: WorkerState) -> Self {
        rows.store(id, Row::of(&state));
        Self {
            id,
            rows,
            state: Mutex::new(state),
        }
    }

    /// Locks the state to read it only: the row stays as it is.
    pub fn read(&self) -> StateReadGuard<'_> {
        StateReadGuard(self.state.lock())
    }

    /// Locks the state; the row is rewritten when the guard is dropped.
    pub fn lock(&self) -> StateGuard<'_> {
        StateGuard {
            cell: self,
            state: self.state.lock(),
        }
    }
}

impl std::fmt::Debug for StateCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the table of every worker's row.
        f.debug_struct("StateCell")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// The locked state of one worker (see [`StateCell::lock`]).
pub struct StateGuard<'a> {
    cell: &'a StateCell,
    state: MutexGuard<'a, WorkerState>,
}

/// The locked state of one worker, read only (see [`StateCell::read`]).
pub struct StateReadGuard<'a>(MutexGuard<'a, WorkerState>);

impl Deref for StateReadGuard<'_> {
    type Target = WorkerState;

    fn deref(&self) -> &WorkerState {
        &self.0
    }
}

impl Deref for StateGuard<'_> {
    type Target = WorkerState;

    fn deref(&self) -> &WorkerState {
        &self.state
    }
}

impl DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut WorkerState {
        &mut self.state
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        self.cell.rows.store(self.cell.id, Row::of(&self.state));
    }
}

/// Where a candidate's figures come from: a worker's state under its lock (always exact), or its
/// row (exact too, or `None` where the row's tail of the ledger cannot tell).
pub(in crate::routing) trait Figures {
    fn agent(&self) -> Option<usize>;
    fn load(&self) -> Option<Load>;
    fn in_flight(&self) -> usize;
    fn awaiting_first_token(&self) -> usize;
    fn backlog(&self) -> &Backlog;
    fn avg_uncached(&self) -> f64;
    fn block_size(&self) -> Option<usize>;
    fn rates(&self) -> &Rates;
    /// Our requests as a view taken at `at` counted them ([`super::LedgerLog::seen`]).
    fn seen(&self, at: Instant, linger: Duration) -> Option<Seen>;
    /// [`super::InFlightPrompts::lateness`].
    fn lateness(&self, now: Instant) -> Option<f64>;
}

impl Figures for WorkerState {
    fn agent(&self) -> Option<usize> {
        self.agent
    }
    fn load(&self) -> Option<Load> {
        self.load
    }
    fn in_flight(&self) -> usize {
        self.in_flight
    }
    fn awaiting_first_token(&self) -> usize {
        self.awaiting_first_token
    }
    fn backlog(&self) -> &Backlog {
        &self.backlog
    }
    fn avg_uncached(&self) -> f64 {
        self.avg_uncached
    }
    fn block_size(&self) -> Option<usize> {
        self.block_size
    }
    fn rates(&self) -> &Rates {
        &self.rates
    }
    fn seen(&self, at: Instant, linger: Duration) -> Option<Seen> {
        Some(
            self.log
                .seen(self.in_flight, self.awaiting_first_token, at, linger),
        )
    }
    fn lateness(&self, now: Instant) -> Option<f64> {
        Some(self.prompts.lateness(now))
    }
}

impl Figures for Row {
    fn agent(&self) -> Option<usize> {
        self.agent
    }
    fn load(&self) -> Option<Load> {
        self.load
    }
    fn in_flight(&self) -> usize {
        self.in_flight
    }
    fn awaiting_first_token(&self) -> usize {
        self.awaiting_first_token
    }
    fn backlog(&self) -> &Backlog {
        &self.backlog
    }
    fn avg_uncached(&self) -> f64 {
        self.avg_uncached
    }
    fn block_size(&self) -> Option<usize> {
        self.block_size
    }
    fn rates(&self) -> &Rates {
        &self.rates
    }
    fn seen(&self, at: Instant, linger: Duration) -> Option<Seen> {
        self.log
            .seen(self.in_flight, self.awaiting_first_token, at, linger)
    }
    fn lateness(&self, now: Instant) -> Option<f64> {
        self.awaiting.lateness(now)
    }
}

#[cfg(test)]
mod tests;
