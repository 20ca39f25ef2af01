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

impl Tenancy {
    /// `GET /admin/usage?tenant=&from=&to=`: usage and cost per tenant / model / pool / provider.
    /// `from`/`to`: Unix seconds, `YYYY-MM-DD` or RFC 3339 (UTC); default: this month so far.
    pub async fn usage_report(&self, query: &str) -> Result<serde_json::Value, String> {
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
                "from" => from = Some(budget::parse_time(&v).ok_or(format!("bad `from`: {v}"))?),
                "to" => to = Some(budget::parse_time(&v).ok_or(format!("bad `to`: {v}"))?),
                other => return Err(format!("unknown parameter `{other}`")),
            }
        }
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
