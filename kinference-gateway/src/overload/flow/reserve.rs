//! The band reserve sized from the traffic: how much of a pool's room a lower band must leave free
//! so that a request of a higher band, arriving at a random moment, finds room at once.
//!
//! The model. While the room is at or under a band's reserve, that band takes nothing: the free
//! slots are a buffer that the higher bands' arrivals draw from (rate `lambda`, requests per
//! second) and that the pool's request ends refill (rate `mu`: every end while the buffer is short
//! goes back to it, since the lower band may not take it). As a birth-death chain the buffer is
//! empty, so that a higher arrival has to wait, with a chance of about `rho^R` for a reserve of `R`
//! slots (`rho = lambda / mu`). The reserve is the smallest `R` with `rho^R <= miss`:
//!
//! ```text
//! R = ceil(ln(miss) / ln(rho))      (rho = lambda / mu; at least 1 while lambda > 0)
//! ```
//!
//! Both rates are counted per pool over the last [`WINDOW`]: `lambda` from the requests of the
//! higher bands that arrived (let through or queued), `mu` from the requests of the pool that ended.
//! Example (the noisy-neighbour benchmark): B and C together 1.5 req/s, the pool ending 6 req/s,
//! `rho = 0.25`; with `miss = 0.05` the low band leaves `ceil(2.16) = 3` slots; the medium band,
//! below C's 0.6 req/s alone (`rho = 0.1`), leaves 2.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kinference_crds::TenantPriority;

use super::fair_queue::{BANDS, rank};

/// How far back arrivals and ends are counted.
pub const WINDOW: Duration = Duration::from_secs(10);

/// The reserve of a band whose higher bands arrive at `lambda` requests per second, in a pool whose
/// requests end at `mu` per second, so that a higher arrival finds no room with a chance of at most
/// `miss`; at most `max`. Zero when nothing arrives above, when no end was seen yet (nothing to size
/// it from), or when `miss` is outside (0, 1) (the adaptive reserve is off).
pub fn sized(lambda: f64, mu: f64, miss: f64, max: usize) -> usize {
    if lambda <= 0.0 || mu <= 0.0 || !(miss > 0.0 && miss < 1.0) {
        return 0;
    }
    let rho = lambda / mu;
    if rho >= 1.0 {
        // The higher bands alone fill the pool: every slot they can get.
        return max;
    }
    let slots = (miss.ln() / rho.ln()).ceil();
    (slots.max(1.0) as usize).min(max)
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

    /// Arrivals per second of the bands above `band` over the window.
    pub fn above(&mut self, band: TenantPriority, now: Instant) -> f64 {
        let count: usize = self.arrivals[..rank(band)]
            .iter_mut()
            .map(|times| {
                forget_before(times, now);
                times.len()
            })
            .sum();
        count as f64 / WINDOW.as_secs_f64()
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
