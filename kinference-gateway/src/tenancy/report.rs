//! `GET /admin/usage`: usage and cost per tenant / model / pool / provider, from the journal's
//! aggregates or from Redis.
//!
//! Bounded per request: a range covers at most [`MAX_RANGE_DAYS`] (with Redis one hourly aggregate per
//! hour of it, read [`super::store::HOURS_PER_ROUND_TRIP`] to a round trip), and the rows come in
//! pages of at most [`MAX_PAGE_ROWS`] groups, in group order: `limit` asks for fewer, `next` (absent on
//! the last page) is the `after` of the next page. `total` is the whole range's on every page.

use std::collections::BTreeMap;
use std::ops::Bound;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use super::usage::{self, Group, Totals};
use super::{Tenancy, budget, now_ms};

/// The longest range one report covers, in days: this month and the last (the journal keeps 62 days
/// of hourly totals by default; Redis keeps 40 days). A longer one is refused (400): ask in parts.
pub const MAX_RANGE_DAYS: u64 = 62;

/// The most groups (rows) one page holds, and the default `limit`.
pub const MAX_PAGE_ROWS: usize = 1_000;

pub(super) fn percent_decode(s: &str) -> String {
    fn hex(b: u8) -> Option<u8> {
        (b as char).to_digit(16).map(|d| d as u8)
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let decoded = match bytes[i] {
            b'%' => bytes
                .get(i + 1)
                .and_then(|h| hex(*h))
                .zip(bytes.get(i + 2).and_then(|l| hex(*l)))
                .map(|(h, l)| h * 16 + l),
            _ => None,
        };
        match (decoded, bytes[i]) {
            (Some(b), _) => {
                out.push(b);
                i += 3;
            }
            (None, b'+') => {
                out.push(b' ');
                i += 1;
            }
            (None, b) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Why `/admin/usage` answers no report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A parameter is malformed or the store cannot answer (400).
    #[error("{0}")]
    BadQuery(String),
    /// A tenant asked for another tenant's usage (403).
    #[error("a tenant's key reads only that tenant's usage, not `{0}`'s")]
    OtherTenant(String),
}

impl ReportError {
    /// The HTTP status.
    pub fn status(&self) -> http::StatusCode {
        match self {
            ReportError::BadQuery(_) => http::StatusCode::BAD_REQUEST,
            ReportError::OtherTenant(_) => http::StatusCode::FORBIDDEN,
        }
    }
}

/// The parameters of a report.
#[derive(Debug, Default)]
struct Query {
    tenant: Option<String>,
    from: Option<u64>,
    to: Option<u64>,
    /// Rows on this page.
    limit: Option<usize>,
    /// The page starts after this group.
    after: Option<Group>,
}

fn parse_query(query: &str) -> Result<Query, ReportError> {
    let bad = ReportError::BadQuery;
    let mut q = Query::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v);
        if v.is_empty() {
            continue;
        }
        match k {
            "tenant" => q.tenant = Some(v),
            "from" => q.from = Some(budget::parse_time(&v).ok_or(bad(format!("bad `from`: {v}")))?),
            "to" => q.to = Some(budget::parse_time(&v).ok_or(bad(format!("bad `to`: {v}")))?),
            "limit" => {
                q.limit = Some(
                    v.parse::<usize>()
                        .ok()
                        .filter(|n| (1..=MAX_PAGE_ROWS).contains(n))
                        .ok_or(bad(format!("bad `limit`: {v} (1 to {MAX_PAGE_ROWS})")))?,
                )
            }
            "after" => q.after = Some(cursor_group(&v).ok_or(bad(format!("bad `after`: {v}")))?),
            other => return Err(bad(format!("unknown parameter `{other}`"))),
        }
    }
    Ok(q)
}

/// The `next` of a page ending with `group`: opaque to the caller (URL-safe base64 of its fields).
fn group_cursor(group: &Group) -> String {
    let field = format!(
        "{}{sep}{}{sep}{}{sep}{}",
        group.tenant,
        group.model,
        group.pool,
        group.provider,
        sep = usage::SEP
    );
    URL_SAFE_NO_PAD.encode(field)
}

fn cursor_group(cursor: &str) -> Option<Group> {
    let bytes = URL_SAFE_NO_PAD.decode(cursor).ok()?;
    Group::from_field(std::str::from_utf8(&bytes).ok()?)
}

/// One page of `groups` (after `after`, at most `limit` rows), with the total of all of them.
fn page(
    groups: &BTreeMap<Group, Totals>,
    after: Option<&Group>,
    limit: usize,
    from_ms: u64,
    to_ms: u64,
    source: &str,
) -> serde_json::Value {
    let start = after.map_or(Bound::Unbounded, Bound::Excluded);
    let mut rest = groups.range((start, Bound::Unbounded));
    let rows: BTreeMap<Group, Totals> = rest
        .by_ref()
        .take(limit)
        .map(|(g, t)| (g.clone(), *t))
        .collect();
    let more = rest.next().is_some();
    let mut report = usage::report(&rows, from_ms, to_ms, source);
    let mut total = Totals::default();
    for t in groups.values() {
        total.merge(t);
    }
    report["total"] = serde_json::to_value(total).unwrap_or_default();
    report["next"] = match rows.keys().next_back() {
        Some(last) if more => group_cursor(last).into(),
        _ => serde_json::Value::Null,
    };
    report
}

impl Tenancy {
    /// `GET /admin/usage?tenant=&from=&to=&limit=&after=`: usage and cost per tenant / model / pool /
    /// provider, a page at a time. `from`/`to`: Unix seconds, `YYYY-MM-DD` or RFC 3339 (UTC); default:
    /// this month so far; at most [`MAX_RANGE_DAYS`] apart. `only`: the caller is this tenant (its
    /// own API key), which sees nothing of any other.
    pub async fn usage_report(
        &self,
        query: &str,
        only: Option<&str>,
    ) -> Result<serde_json::Value, ReportError> {
        let mut q = parse_query(query)?;
        q.tenant = match (only, q.tenant) {
            (Some(me), Some(asked)) if asked != me => {
                return Err(ReportError::OtherTenant(asked));
            }
            (Some(me), _) => Some(me.to_string()),
            (None, asked) => asked,
        };
        self.report_between(q).await.map_err(ReportError::BadQuery)
    }

    async fn report_between(&self, q: Query) -> Result<serde_json::Value, String> {
        let now = now_ms();
        let to = q.to.unwrap_or(now + 60_000);
        let from = q.from.unwrap_or_else(|| budget::month_start_ms(now));
        let days = to.saturating_sub(from).div_ceil(86_400_000);
        if days > MAX_RANGE_DAYS {
            return Err(format!(
                "a range of {days} days: at most {MAX_RANGE_DAYS} days per report, ask for longer ones in parts"
            ));
        }
        let (tenant, limit) = (q.tenant, q.limit.unwrap_or(MAX_PAGE_ROWS));
        match &self.redis {
            None => {
                let groups = self.aggregates.lock().query(tenant.as_deref(), from, to);
                Ok(page(&groups, q.after.as_ref(), limit, from, to, "journal"))
            }
            Some(redis) => {
                let mut groups: BTreeMap<usage::Group, usage::Totals> = BTreeMap::new();
                let first = from - from % 3_600_000;
                let hours: Vec<String> = (first..to)
                    .step_by(3_600_000)
                    .map(budget::hour_key)
                    .collect();
                let answers = redis.hours(&hours).await.map_err(|e| e.to_string())?;
                for fields in answers {
                    for (field, value) in fields {
                        let Some((group, what)) = field.rsplit_once(usage::SEP) else {
                            continue;
                        };
                        let Some(g) = usage::Group::from_field(group) else {
                            continue;
                        };
                        if tenant.as_deref().is_some_and(|t| t != g.tenant) {
                            continue;
                        }
                        let t = groups.entry(g).or_default();
                        let n = value.parse::<u64>().unwrap_or(0);
                        match what {
                            "requests" => t.requests += n,
                            "input_uncached" => t.input_uncached_tokens += n,
                            "input_cached" => t.input_cached_tokens += n,
                            "output" => t.output_tokens += n,
                            "cost" => t.cost += value.parse::<f64>().unwrap_or(0.0),
                            _ => {}
                        }
                    }
                }
                let mut report = page(&groups, q.after.as_ref(), limit, from, to, "redis");
                report["pending_records"] = redis.pending().into();
                Ok(report)
            }
        }
    }
}
