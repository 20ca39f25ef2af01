//! The body-byte budget: what request bodies may hold of the gateway's memory at once, in all and
//! per tenant. A request reserves its declared length before its body is read (the body limit
//! when it declares none), then what its JSON will cost once parsed ([`parse_cost`]: a tree of
//! small values costs many times its text); past the budget it waits briefly, then is shed (503
//! with `Retry-After`), so one client's large bodies cannot take the memory other tenants' requests
//! need. The reservation is held until the request ends (its body lives as long as its answer).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Reservations are counted in units of this many bytes (a semaphore counts in `u32`).
const UNIT: usize = 1024;

/// What one parsed JSON value is reckoned to hold in memory besides its text: a tree node (32 bytes
/// in `serde_json`), an object member's key and map entry, for each of the two readings of a body
/// (the typed request and the classifier's tree).
pub const BYTES_PER_VALUE: usize = 96;

/// Copies of a body's text held while it is served besides the bytes received: the typed request's
/// strings, the classifier's reading of its text, and the prompt rendered for the tokenizer.
/// Measured: 160 concurrent 3.9 MB `count_tokens` bodies took a release gateway from 127 to 718 MiB
/// when the text was counted once (about 4.6 times the bytes admitted).
pub const PARSED_TEXT_COPIES: usize = 3;

/// How much of the memory one request body may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetSettings {
    /// Bytes all request bodies may hold at once (text and parsed form).
    pub total: usize,
    /// Bytes one tenant's request bodies may hold at once.
    pub per_tenant: usize,
    /// Longest wait for room before the request is shed.
    pub wait: Duration,
}

/// The budget (shared by both front doors).
#[derive(Debug)]
pub struct BodyBudget {
    settings: BudgetSettings,
    total: Arc<Semaphore>,
    tenants: Mutex<HashMap<String, Arc<Semaphore>>>,
    /// Bytes held now.
    held: Gauge,
}

/// Bytes reserved for one request's body, given back when dropped.
#[derive(Debug, Default)]
pub struct BodyReservation {
    permits: Vec<OwnedSemaphorePermit>,
    bytes: usize,
    held: Option<Gauge>,
}

impl BodyReservation {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for BodyReservation {
    fn drop(&mut self) {
        if let Some(held) = &self.held {
            held.dec_by(i64::try_from(self.bytes).unwrap_or(i64::MAX));
        }
    }
}

/// No room for a body within the wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoRoom {
    /// `total` or `tenant`: which budget was full.
    pub scope: &'static str,
}

fn units(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(UNIT)).unwrap_or(u32::MAX)
}

impl BodyBudget {
    /// A budget of `settings`, the bytes it holds shown on `held`.
    pub fn new(settings: BudgetSettings, held: Gauge) -> Self {
        BodyBudget {
            total: Arc::new(Semaphore::new(units(settings.total) as usize)),
            tenants: Mutex::default(),
            settings,
            held,
        }
    }

    /// The settings.
    pub fn settings(&self) -> BudgetSettings {
        self.settings
    }

    fn tenant(&self, tenant: &str) -> Arc<Semaphore> {
        let mut tenants = self.tenants.lock();
        if tenants.len() > 10_000 {
            // Tenants come and go; one that holds nothing now can be forgotten.
            let full = units(self.settings.per_tenant) as usize;
            tenants.retain(|_, s| s.available_permits() < full);
        }
        Arc::clone(
            tenants.entry(tenant.to_string()).or_insert_with(|| {
                Arc::new(Semaphore::new(units(self.settings.per_tenant) as usize))
            }),
        )
    }

    /// Adds `bytes` to `held` for `tenant`, waiting at most the budget's wait for room. A request
    /// larger than a whole budget can never fit: it is refused at once.
    pub async fn reserve(
        &self,
        held: &mut BodyReservation,
        tenant: &str,
        bytes: usize,
    ) -> Result<(), NoRoom> {
        if bytes == 0 {
            return Ok(());
        }
        let n = units(bytes);
        if bytes > self.settings.per_tenant {
            return Err(NoRoom { scope: "tenant" });
        }
        if bytes > self.settings.total {
            return Err(NoRoom { scope: "total" });
        }
        let tenant_sem = self.tenant(tenant);
        let wait = self.settings.wait;
        let tenant_permit = tokio::time::timeout(wait, tenant_sem.acquire_many_owned(n))
            .await
            .ok()
            .and_then(Result::ok)
            .ok_or(NoRoom { scope: "tenant" })?;
        let total_permit =
            tokio::time::timeout(wait, Arc::clone(&self.total).acquire_many_owned(n))
                .await
                .ok()
                .and_then(Result::ok)
                .ok_or(NoRoom { scope: "total" })?;
        held.permits.push(tenant_permit);
        held.permits.push(total_permit);
        held.bytes += bytes;
        self.held.inc_by(i64::try_from(bytes).unwrap_or(i64::MAX));
        held.held.get_or_insert_with(|| self.held.clone());
        Ok(())
    }

    /// Bytes all bodies hold now.
    pub fn held(&self) -> usize {
        usize::try_from(self.held.get()).unwrap_or(0)
    }
}

/// What `body` will cost once parsed: its text, [`PARSED_TEXT_COPIES`] more copies of it, and
/// [`BYTES_PER_VALUE`] for every JSON value in it (counted by one pass over the bytes: the commas,
/// colons and brackets outside strings bound the number of values from above).
pub fn parse_cost(body: &[u8]) -> usize {
    let mut values = 1usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in body {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else {
            match b {
                b'"' => in_string = true,
                b',' | b'[' | b'{' | b':' => values += 1,
                _ => {}
            }
        }
    }
    body.len()
        .saturating_mul(1 + PARSED_TEXT_COPIES)
        .saturating_add(values.saturating_mul(BYTES_PER_VALUE))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(total: usize, per_tenant: usize) -> BodyBudget {
        BodyBudget::new(
            BudgetSettings {
                total,
                per_tenant,
                wait: Duration::from_millis(50),
            },
            Gauge::default(),
        )
    }

    #[tokio::test]
    async fn a_tenant_cannot_take_more_than_its_share_and_others_still_get_theirs() {
        let b = budget(10 * UNIT, 4 * UNIT);
        let mut a1 = BodyReservation::default();
        b.reserve(&mut a1, "a", 4 * UNIT).await.unwrap();
        let mut a2 = BodyReservation::default();
        assert_eq!(
            b.reserve(&mut a2, "a", UNIT).await,
            Err(NoRoom { scope: "tenant" })
        );
        let mut other = BodyReservation::default();
        b.reserve(&mut other, "b", 4 * UNIT).await.unwrap();
        assert_eq!(b.held(), 8 * UNIT);
        drop(a1);
        b.reserve(&mut a2, "a", UNIT).await.unwrap();
        assert_eq!(b.held(), 5 * UNIT);
        // Larger than a whole share: refused without waiting.
        let mut big = BodyReservation::default();
        assert!(b.reserve(&mut big, "c", 5 * UNIT).await.is_err());
    }

    #[tokio::test]
    async fn a_waiting_reservation_gets_room_freed_within_the_wait() {
        let b = Arc::new(budget(2 * UNIT, 2 * UNIT));
        let mut first = BodyReservation::default();
        b.reserve(&mut first, "a", 2 * UNIT).await.unwrap();
        let waiter = {
            let b = Arc::clone(&b);
            tokio::spawn(async move {
                let mut r = BodyReservation::default();
                b.reserve(&mut r, "a", UNIT).await.map(|()| r.bytes())
            })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(first);
        assert_eq!(waiter.await.unwrap(), Ok(UNIT));
    }

    #[test]
    fn parsed_cost_grows_with_the_values_not_only_the_bytes() {
        let zeros = format!("[{}0]", "0,".repeat(1000));
        let text = format!("[\"{}\"]", "a,".repeat(1000));
        assert!(parse_cost(zeros.as_bytes()) > 1000 * BYTES_PER_VALUE);
        let copies = 1 + PARSED_TEXT_COPIES;
        assert!(parse_cost(text.as_bytes()) < copies * text.len() + 4 * BYTES_PER_VALUE);
        assert_eq!(
            parse_cost(br#"{"a\"":"x,y"}"#),
            copies * 13 + 3 * BYTES_PER_VALUE,
            "commas and quotes inside strings do not count"
        );
    }
}
