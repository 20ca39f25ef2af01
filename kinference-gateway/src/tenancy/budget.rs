//! Monthly budgets: what a tenant spent this calendar month (UTC), and whether it may spend more.
//!
//! Spend is the sum of the cost of its usage records in the month (from the journal, replayed at
//! start, or from Redis with several replicas). A tenant whose spend reached
//! `spec.budget.monthlyLimit` with `onExceeded: Reject` is refused until the month ends: HTTP 429
//! (OpenAI: type and code `insufficient_quota`, as OpenAI reports an exhausted quota; Anthropic:
//! `rate_limit_error`), with `Retry-After` set to the seconds left in the month. `LocalOnly` keeps
//! serving, from local pools only: the pipeline's plan drops every provider for that tenant. The check happens at
//! admission, so requests already in flight when the budget is reached still finish: the overshoot
//! is at most their cost.
//!
//! Also the calendar helpers the tenancy module needs (no date crate for four functions).

use std::collections::HashMap;

use parking_lot::Mutex;

/// Days since 1970-01-01 -> (year, month 1-12, day 1-31) (Howard Hinnant's civil_from_days).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = (if mp < 10 { mp + 3 } else { mp - 9 }) as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// (year, month, day) -> days since 1970-01-01.
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `YYYY-MM` of a Unix time in ms.
pub fn month_key(ts_ms: u64) -> String {
    let (y, m, _) = civil_from_days((ts_ms / 86_400_000) as i64);
    format!("{y:04}-{m:02}")
}

/// `YYYYMMDDHH` of a Unix time in ms (the Redis usage aggregate's key).
pub fn hour_key(ts_ms: u64) -> String {
    let days = (ts_ms / 86_400_000) as i64;
    let (y, m, d) = civil_from_days(days);
    let h = (ts_ms % 86_400_000) / 3_600_000;
    format!("{y:04}{m:02}{d:02}{h:02}")
}

/// Redis key of a tenant's spend in the month of `ts_ms`.
pub fn spend_key(tenant: &str, ts_ms: u64) -> String {
    format!("kinf:spend:{{{tenant}}}:{}", month_key(ts_ms))
}

/// Start of the next UTC month after `ts_ms`, in ms.
pub fn next_month_ms(ts_ms: u64) -> u64 {
    let (y, m, _) = civil_from_days((ts_ms / 86_400_000) as i64);
    let (y, m) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    (days_from_civil(y, m, 1).max(0) as u64) * 86_400_000
}

/// Start of the UTC month of `ts_ms`, in ms.
pub fn month_start_ms(ts_ms: u64) -> u64 {
    let (y, m, _) = civil_from_days((ts_ms / 86_400_000) as i64);
    (days_from_civil(y, m, 1).max(0) as u64) * 86_400_000
}

/// RFC 3339 (UTC, seconds) of a Unix time in ms.
pub fn rfc3339(ts_ms: u64) -> String {
    let (y, m, d) = civil_from_days((ts_ms / 86_400_000) as i64);
    let s = (ts_ms % 86_400_000) / 1000;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        s / 3600,
        (s % 3600) / 60,
        s % 60
    )
}

/// Parses a time parameter: Unix seconds, `YYYY-MM-DD`, or `YYYY-MM-DDTHH:MM[:SS]Z`.
pub fn parse_time(s: &str) -> Option<u64> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Some(secs * 1000);
    }
    let num = |a: usize, b: usize| s.get(a..b).and_then(|v| v.parse::<u32>().ok());
    let (y, m, d) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
    if s.get(4..5) != Some("-")
        || s.get(7..8) != Some("-")
        || !(1..=12).contains(&m)
        || !(1..=31).contains(&d)
    {
        return None;
    }
    let days = days_from_civil(i64::from(y), m, d);
    let mut secs = days.checked_mul(86_400)?;
    if s.len() > 10 {
        let rest = s
            .get(10..)?
            .trim_start_matches(['T', ' '])
            .trim_end_matches('Z');
        let mut parts = rest.split(':').map(|p| p.parse::<i64>().ok());
        let h = parts.next()??;
        let mi = parts.next()??;
        let se = parts.next().unwrap_or(Some(0))?;
        secs += h * 3600 + mi * 60 + se;
    }
    u64::try_from(secs).ok().map(|s| s * 1000)
}

/// Monthly spend per tenant, in this process (the embedded store's view).
#[derive(Debug, Default)]
pub struct Spend {
    by_month: Mutex<HashMap<(String, String), f64>>,
}

impl Spend {
    /// Adds a cost in the month of `ts_ms`.
    pub fn add(&self, tenant: &str, ts_ms: u64, cost: f64) {
        if cost == 0.0 {
            return;
        }
        *self
            .by_month
            .lock()
            .entry((tenant.to_string(), month_key(ts_ms)))
            .or_default() += cost;
    }

    /// Spend of `tenant` in the month of `ts_ms`.
    pub fn spent(&self, tenant: &str, ts_ms: u64) -> f64 {
        self.by_month
            .lock()
            .get(&(tenant.to_string(), month_key(ts_ms)))
            .copied()
            .unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests;
