//! The band reserves sized from the traffic: how much of a pool's room a lower band must leave free
//! so that a request of a higher band, arriving at a random moment, finds room at once.
//!
//! **Reserves nest.** The room a band may not take is the sum of what each band above it needs:
//!
//! ```text
//! reserve(high) = 0
//! reserve(medium) = need(high)
//! reserve(low)    = need(high) + need(medium)
//! need(band)      = max(--flow-band-reserve, sized from that band's own arrivals)
//! ```
//!
//! so a lower band always leaves at least the room of the band above it, plus that band's own need:
//! the middle band keeps room of its own even when both needs come out equal (with one reserve sized
//! from all the bands above together, the low and the medium band could keep the same room, and a
//! medium request found none that the low band had left for it).
//!
//! The model of one band's need. While the room is at or under a lower band's reserve, that band
//! takes nothing: the free slots are a buffer that the band's arrivals draw from (rate `lambda`,
//! requests per second) and that the pool's request ends refill (rate `mu`). As a birth-death chain
//! the buffer is empty, so that an arrival of the band has to wait, with a chance of about `rho^R`
//! for `R` slots (`rho = lambda / mu`). The need is the smallest `R` with `rho^R <= miss`:
//!
//! ```text
//! R = ceil(ln(miss) / ln(rho))      (rho = lambda / mu; at least 1 while lambda > 0)
//! ```
//!
//! at most `--flow-reserve-max`, and that when `rho >= 1`. Both rates are counted per pool over the
//! last [`WINDOW`]: `lambda` from the band's requests that arrived (let through or queued), `mu`
//! from the pool's requests that ended. A band with no arrival in the window needs nothing.
//!
//! **Cold start.** With no request of the pool ended in the window (a pool that has just started,
//! or has not served for [`WINDOW`]) there is nothing to size from: each band above keeps
//! [`COLD_START_SLOTS`] (2, the need the formula gives a band sending 5-22% of what the pool ends,
//! with `miss = 0.05`), so a flood arriving first cannot take every slot before the first ends come
//! in. (The flow control holds no reserve from an idle pool, so this floor cannot keep a lower band
//! out for good: see `overload::flow`.) A floor of 1 was measured too short: in the
//! noisy-neighbour benchmark A's flood filled all but 2 slots in under a second, and B's and C's
//! arrivals of the ~2.5 s before A's first requests ended shared those 2 (B's p90 7.4x its alone
//! run, against 1.25x with a fixed reserve of 2 per band).
//!
//! Example (the noisy-neighbour benchmark): the pool ending 6 req/s, B (medium) arriving 0.9 req/s
//! (`rho = 0.15`) and C (high) 0.6 req/s (`rho = 0.1`); with `miss = 0.05` each needs 2 slots: the
//! medium band leaves 2, the low band 4; at a cold start the same.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kinference_crds::TenantPriority;

use super::fair_queue::{BANDS, rank};

/// How far back arrivals and ends are counted.
pub const WINDOW: Duration = Duration::from_secs(10);

/// Slots each band above keeps while there is nothing to size its need from (no end in the window).
pub const COLD_START_SLOTS: usize = 2;

/// The room a band arriving at `lambda` requests per second needs kept free in a pool whose requests
/// end at `mu` per second, so that one of its arrivals finds no room with a chance of at most
/// `miss`; at most `max`. Zero when it does not arrive, when no end was seen yet (nothing to size
/// it from: see [`need`]), or when `miss` is outside (0, 1) (the sized reserve is off).
pub fn sized(lambda: f64, mu: f64, miss: f64, max: usize) -> usize {
    if lambda <= 0.0 || mu <= 0.0 || !(miss > 0.0 && miss < 1.0) {
        return 0;
    }
    let rho = lambda / mu;
    if rho >= 1.0 {
        // The band alone fills the pool: every slot it can get.
        return max;
    }
    let slots = (miss.ln() / rho.ln()).ceil();
    (slots.max(1.0) as usize).min(max)
}

/// [`sized`], or at a cold start (no end seen in the window, `mu == 0`) [`COLD_START_SLOTS`]
/// whatever the band's arrivals (at most `max`); 0 when the sized reserve is off.
pub fn need(lambda: f64, mu: f64, miss: f64, max: usize) -> usize {
    if !(miss > 0.0 && miss < 1.0) {
        return 0;
    }
    if mu <= 0.0 {
        return COLD_START_SLOTS.min(max);
    }
    sized(lambda, mu, miss, max)
}

/// One pool's recent arrivals by band and request ends.
#[derive(Debug, Default)]
pub struct Rates {
    arrivals: [VecDeque<Instant>; BANDS],
    ends: VecDeque<Instant>,
}

impl Rates {
    /// A request of `band` arrived at `now`.
    pub fn arrived(&mut self, band: TenantPriority, now: Instant) {
        let times = &mut self.arrivals[rank(band)];
        times.push_back(now);
        forget_before(times, now);
    }

    /// A request of the pool ended at `now`.
    pub fn ended(&mut self, now: Instant) {
        self.ends.push_back(now);
        forget_before(&mut self.ends, now);
    }

    /// Arrivals per second of `band` over the window.
    pub fn arrivals(&mut self, band: TenantPriority, now: Instant) -> f64 {
        let times = &mut self.arrivals[rank(band)];
        forget_before(times, now);
        times.len() as f64 / WINDOW.as_secs_f64()
    }

    /// Request ends per second over the window.
    pub fn ends(&mut self, now: Instant) -> f64 {
        forget_before(&mut self.ends, now);
        self.ends.len() as f64 / WINDOW.as_secs_f64()
    }
}

fn forget_before(times: &mut VecDeque<Instant>, now: Instant) {
    while times
        .front()
        .is_some_and(|t| now.saturating_duration_since(*t) > WINDOW)
    {
        times.pop_front();
    }
}
