//! What the scale benchmark reads from the processes it runs: CPU time and resident memory from
//! `/proc/<pid>`, and a histogram from a Prometheus text exposition (the gateway's own decision timer).

use std::collections::BTreeMap;

#[cfg(test)]
mod tests;

/// Clock ticks per second of the CPU times in `/proc/<pid>/stat` (`USER_HZ`, 100 on Linux).
const USER_HZ: f64 = 100.0;

/// A process's CPU time and resident memory at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProcSample {
    /// User + system CPU seconds since the process started.
    pub cpu_s: f64,
    /// Resident set size, bytes.
    pub rss_bytes: u64,
}

/// Reads `pid`'s CPU time and resident memory; `None` when the process is gone or the files do not
/// parse (not Linux).
pub fn sample(pid: u32) -> Option<ProcSample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    Some(ProcSample {
        cpu_s: cpu_seconds(&stat)?,
        rss_bytes: rss_bytes(&status)?,
    })
}

/// User + system seconds from the text of `/proc/<pid>/stat`. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted from the last `)`: utime and stime are fields 14
/// and 15 of the line, the 12th and 13th after the name.
pub fn cpu_seconds(stat: &str) -> Option<f64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / USER_HZ)
}

pub use crate::harness::rss_bytes;

/// One series of a Prometheus histogram: cumulative bucket counts by upper bound, sum and count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// `(le, cumulative count)`, ascending `le`, `+Inf` last.
    pub buckets: Vec<(f64, f64)>,
    /// Sum of the observations.
    pub sum: f64,
    /// Number of observations.
    pub count: f64,
}

impl Histogram {
    /// The series of histogram `name` whose labels include every pair of `labels` (the `le` label
    /// aside), from a text exposition; `None` when there is no such series.
    pub fn parse(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<Histogram> {
        let mut buckets = BTreeMap::new();
        let (mut sum, mut count) = (None, None);
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some(rest) = line.strip_prefix(name) else {
                continue;
            };
            let (suffix, rest) = rest.split_at(rest.find(['{', ' ']).unwrap_or(rest.len()));
            let (set, value) = match rest.strip_prefix('{') {
                Some(r) => {
                    let end = r.find('}')?;
                    (label_set(&r[..end]), &r[end + 1..])
                }
                None => (BTreeMap::new(), rest),
            };
            if !labels
                .iter()
                .all(|(k, v)| set.get(*k).map(String::as_str) == Some(*v))
            {
                continue;
            }
            let Some(value) = value
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<f64>().ok())
            else {
                continue;
            };
            match suffix {
                "_bucket" => {
                    let le = match set.get("le").map(String::as_str) {
                        Some("+Inf") => f64::INFINITY,
                        Some(le) => le.parse().ok()?,
                        None => continue,
                    };
                    buckets.insert(OrderedLe(le), value);
                }
                "_sum" => sum = Some(value),
                "_count" => count = Some(value),
                _ => {}
            }
        }
        if buckets.is_empty() {
            return None;
        }
        Some(Histogram {
            buckets: buckets.into_iter().map(|(le, c)| (le.0, c)).collect(),
            sum: sum.unwrap_or(0.0),
            count: count.unwrap_or(0.0),
        })
    }

    /// The observations made since `earlier` (a snapshot of the same series).
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, c)| {
                    let before = earlier
                        .buckets
                        .iter()
                        .find(|(l, _)| *l == le)
                        .map_or(0.0, |(_, c)| *c);
                    (le, c - before)
                })
                .collect(),
            sum: self.sum - earlier.sum,
            count: self.count - earlier.count,
        }
    }

    /// The mean observation; `NaN` for none.
    pub fn mean(&self) -> f64 {
        if self.count > 0.0 {
            self.sum / self.count
        } else {
            f64::NAN
        }
    }

    /// The `q`-quantile (0..=1) as Prometheus' `histogram_quantile` estimates it: linear within the
    /// bucket that holds it (the first bucket starting at 0); in the `+Inf` bucket, the largest finite
    /// bound. `NaN` for no observations.
    pub fn quantile(&self, q: f64) -> f64 {
        let total = self.buckets.last().map_or(0.0, |b| b.1);
        if total <= 0.0 {
            return f64::NAN;
        }
        let rank = q.clamp(0.0, 1.0) * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(le, cumulative) in &self.buckets {
            if cumulative >= rank {
                if le.is_infinite() {
                    return lower;
                }
                let inside = cumulative - below;
                return if inside > 0.0 {
                    lower + (le - lower) * (rank - below) / inside
                } else {
                    le
                };
            }
            (lower, below) = (le, cumulative);
        }
        lower
    }

    /// The bounds `(lower, upper]` of the bucket that holds the `q`-quantile (`upper` infinite in the
    /// overflow bucket): how coarse [`Histogram::quantile`]'s estimate is.
    pub fn bucket_of(&self, q: f64) -> Option<(f64, f64)> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total;
        let mut lower = 0.0;
        for &(le, cumulative) in &self.buckets {
            if cumulative >= rank {
                return Some((lower, le));
            }
            lower = le;
        }
        None
    }
}

/// `a="1",b="x"` as a map (values unescaped only for `\"` and `\\`, all a benchmark label needs).
fn label_set(text: &str) -> BTreeMap<String, String> {
    let mut set = BTreeMap::new();
    let mut rest = text;
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].trim_start_matches([',', ' ']).to_string();
        let mut value = String::new();
        let mut chars = rest[eq + 2..].char_indices();
        let mut end = rest.len() - eq - 2;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(n);
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        set.insert(key, value);
        rest = &rest[eq + 2 + end..];
    }
    set
}

/// A bucket bound ordered as a number (bounds are never NaN).
#[derive(Debug, Clone, Copy, PartialEq)]
struct OrderedLe(f64);

impl Eq for OrderedLe {}

impl PartialOrd for OrderedLe {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for OrderedLe {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}
