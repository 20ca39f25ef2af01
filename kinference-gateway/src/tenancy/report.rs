//! `GET /admin/usage`: usage and cost per tenant / model / pool / provider, from the journal's
//! aggregates or from Redis.

use std::collections::BTreeMap;

use super::usage::{self};
use super::{Tenancy, budget, now_ms};

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

/// `tenant`, `from` and `to` of the query.
type Query = (Option<String>, Option<u64>, Option<u64>);

fn parse_query(query: &str) -> Result<Query, ReportError> {
    let bad = ReportError::BadQuery;
    let mut tenant = None;
    let mut from = None;
    let mut to = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v);
        if v.is_empty() {
            continue;
        }
        match k {
            "tenant" => tenant = Some(v),
            "from" => from = Some(budget::parse_time(&v).ok_or(bad(format!("bad `from`: {v}")))?),
            "to" => to = Some(budget::parse_time(&v).ok_or(bad(format!("bad `to`: {v}")))?),
            other => return Err(bad(format!("unknown parameter `{other}`"))),
        }
    }
    Ok((tenant, from, to))
}

impl Tenancy {
    /// `GET /admin/usage?tenant=&from=&to=`: usage and cost per tenant / model / pool / provider.
    /// `from`/`to`: Unix seconds, `YYYY-MM-DD` or RFC 3339 (UTC); default: this month so far.
    /// `only`: the caller is this tenant (its own API key), which sees nothing of any other.
    pub async fn usage_report(
        &self,
        query: &str,
        only: Option<&str>,
    ) -> Result<serde_json::Value, ReportError> {
        let (tenant, from, to) = parse_query(query)?;
        let tenant = match (only, tenant) {
            (Some(me), Some(asked)) if asked != me => {
                return Err(ReportError::OtherTenant(asked));
            }
            (Some(me), _) => Some(me.to_string()),
            (None, asked) => asked,
        };
        self.report_between(tenant, from, to)
            .await
            .map_err(ReportError::BadQuery)
    }

    async fn report_between(
        &self,
        tenant: Option<String>,
        from: Option<u64>,
        to: Option<u64>,
    ) -> Result<serde_json::Value, String> {
        let now = now_ms();
        let to = to.unwrap_or(now + 60_000);
        let from = from.unwrap_or_else(|| budget::month_start_ms(now));
        match &self.redis {
            None => {
                let groups = self.aggregates.lock().query(tenant.as_deref(), from, to);
                Ok(usage::report(&groups, from, to, "journal"))
            }
            Some(redis) => {
                let mut groups: BTreeMap<usage::Group, usage::Totals> = BTreeMap::new();
                let mut hour = from - from % 3_600_000;
                let mut hours = 0;
                while hour < to {
                    hours += 1;
                    if hours > 24 * 400 {
                        return Err("range too long (at most 400 days)".into());
                    }
                    let fields = redis
                        .hour(&budget::hour_key(hour))
                        .await
                        .map_err(|e| e.to_string())?;
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
                    hour += 3_600_000;
                }
                let mut report = usage::report(&groups, from, to, "redis");
                report["pending_records"] = redis.pending().into();
                Ok(report)
            }
        }
    }
}
