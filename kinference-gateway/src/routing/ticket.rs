//! The in-flight ticket ([`InFlight`]): a routed request's entry in the worker's ledger, released
//! exactly once (finish, or drop on an error or an aborted stream); its first token feeds the
//! worker's learned rates.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use kinference_api::BlockKey;

use super::metrics::WorkerUrlLabels;
use super::workers::Worker;
use super::*;

/// Weight of the newest stream in a worker's time per output token.
const TPOT_EWMA: f64 = 0.2;

/// A routed request's entry in the in-flight ledger.
///
/// Call [`InFlight::first_token`] when the first token arrives and [`InFlight::finish`] at the end.
/// Dropping it without `finish` counts as a failed request. Either way the worker's in-flight count is
/// released exactly once.
pub struct InFlight {
    shared: Arc<Shared>,
    worker: Arc<Worker>,
    started: Instant,
    /// The request's position in the worker's [`workers::Backlog`], until its first token.
    backlog_position: Option<f64>,
    /// The speculative credit to end soon after the first token (live agent only).
    credit: Option<Arc<[BlockKey]>>,
    /// The estimate's work in tokens, to learn from the observed TTFT.
    work: Option<f64>,
    /// Its prompt in the worker's [`super::workers::InFlightPrompts`], until the request ends.
    prompt: Option<u64>,
    /// Counted in the worker's `awaiting_first_token` until the first token (or the end).
    awaiting: bool,
    first_token: Option<Instant>,
    done: bool,
    /// Where its first token and end are told to the other replicas, and its number there
    /// (boxed: most gateways have no replicas to tell, and a ticket stays small).
    share: Option<Box<(Arc<dyn Announce>, u64)>>,
    /// Whose stored answer the request makes, when its endpoint stores one ([`sessions::Answers`]).
    answer_owner: Option<sessions::Owner>,
}

/// Who else hears of a request's first token and end: the other gateway replicas
/// (`replicas::Outbox`). A trait, so that a ticket needs to know nothing of how they are told.
pub trait Announce: Send + Sync {
    /// Request `id`'s first token arrived.
    fn first_token(&self, id: u64);
    /// Request `id` ended.
    fn ended(&self, id: u64);
}

impl fmt::Debug for InFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight")
            .field("worker", &self.worker.url)
            .field("started", &self.started)
            .field("first_token", &self.first_token)
            .finish()
    }
}

impl InFlight {
    pub(super) fn new(
        shared: Arc<Shared>,
        worker: Arc<Worker>,
        backlog_position: Option<f64>,
        work: Option<f64>,
        credit: Option<Arc<[BlockKey]>>,
        prompt: Option<u64>,
    ) -> Self {
        Self {
            shared,
            worker,
            started: Instant::now(),
            backlog_position,
            work,
            credit,
            prompt,
            answer_owner: None,
            awaiting: true,
            first_token: None,
            done: false,
            share: None,
        }
    }

    /// Tells the other replicas of this request's first token and end through `share` (the outbox
    /// and the number its dispatch went out with).
    pub(super) fn shared_as(mut self, share: Option<(Arc<dyn Announce>, u64)>) -> Self {
        self.share = share.map(Box::new);
        self
    }

    /// The first token (or first response byte) arrived; feeds the worker's learned rates.
    pub fn first_token(&mut self) {
        if self.first_token.is_some() || self.done {
            return;
        }
        let now = Instant::now();
        self.first_token = Some(now);
        let ttft = now.duration_since(self.started).as_secs_f64();
        let (position, awaited) = (
            self.backlog_position.take(),
            std::mem::take(&mut self.awaiting),
        );
        let mut st = self.worker.state.lock();
        st.prefill_over(position, awaited, now);
        if let Some(prompt) = self.prompt {
            st.prompts.first_token(prompt);
        }
        if let Some(work) = self.work {
            st.rates.observe(ttft, work, &self.shared.tuning.estimator);
            self.shared.observe_fleet(&self.worker.model, ttft, work);
            let labels = WorkerUrlLabels {
                worker: self.worker.url.clone(),
            };
            self.shared
                .metrics
                .worker_tokens_per_s
                .get_or_create(&labels)
                .set(1.0 / st.rates.s_per_token);
            self.shared
                .metrics
                .worker_overhead_s
                .get_or_create(&labels)
                .set(st.rates.overhead_s);
        }
        drop(st);
        self.end_credit(now);
        if let Some(share) = &self.share {
            share.0.first_token(share.1);
        }
    }

    /// Ends the speculative credit soon after the prefill (see
    /// [`RoutingTuning::speculative_after_first_token`]).
    fn end_credit(&mut self, now: Instant) {
        if let Some(keys) = self.credit.take() {
            let by = now + self.shared.tuning.speculative_after_first_token;
            self.shared.spec.lock().end_by(&keys, self.worker.id, by);
        }
    }

    /// The answer the request makes may be stored by its worker for `owner` to continue.
    pub fn answers_for(&mut self, owner: Option<sessions::Owner>) {
        self.answer_owner = owner;
    }

    /// The worker answered with the stored answer `id`: a request continuing it goes to this worker
    /// ([`sessions`]). Nothing is remembered for a request whose endpoint stores no answer.
    pub fn answered(&self, id: &str) {
        if let Some(owner) = self.answer_owner {
            self.shared.remember_answer(id, owner, &self.worker);
        }
    }

    /// The request ended; `cached_tokens` is what the worker reported (`prompt_tokens_details`). A
    /// successful stream of several tokens teaches the worker's time per output token (what the
    /// decode side of a split request is chosen by).
    pub fn finish(mut self, ok: bool, output_tokens: usize, cached_tokens: Option<usize>) {
        tracing::trace!(worker = %self.worker.url, ok, output_tokens, ?cached_tokens, "request finished");
        if let Some(first) = self.first_token.filter(|_| ok && output_tokens >= 2) {
            let tpot = first.elapsed().as_secs_f64() / (output_tokens - 1) as f64;
            let mut st = self.worker.state.lock();
            st.tpot_s = Some(
                st.tpot_s
                    .map_or(tpot, |t| (1.0 - TPOT_EWMA) * t + TPOT_EWMA * tpot),
            );
        }
        self.release();
    }

    fn release(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let now = Instant::now();
        let (position, awaited) = (
            self.backlog_position.take(),
            std::mem::take(&mut self.awaiting),
        );
        let mut st = self.worker.state.lock();
        st.in_flight = st.in_flight.saturating_sub(1);
        st.log.ended(now);
        // Ended before its first token (failed, aborted, or not streamed): its prefill is over one way
        // or the other.
        st.prefill_over(position, awaited, now);
        if let Some(prompt) = self.prompt.take() {
            st.prompts.remove(prompt);
        }
        drop(st);
        self.end_credit(now);
        if let Some(share) = self.share.take() {
            share.0.ended(share.1);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.release();
    }
}
