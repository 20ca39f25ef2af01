//! The conventional rate-limit headers of each client protocol (OpenAI `x-ratelimit-*`, Anthropic
//! `anthropic-ratelimit-*`) and `Retry-After`.

use super::limits::{self, Dim, Take};
use super::{budget, now_ms};
use crate::errors::Protocol;

/// OpenAI `1s`, `6m0s`, `20ms` style durations.
pub(super) fn go_duration(seconds: f64) -> String {
    let s = seconds.max(0.0);
    if s < 1.0 {
        return format!("{}ms", (s * 1000.0).ceil() as u64);
    }
    let total = s.ceil() as u64;
    let (m, sec) = (total / 60, total % 60);
    if m > 0 {
        format!("{m}m{sec}s")
    } else {
        format!("{sec}s")
    }
}

/// The conventional rate-limit headers of the client's protocol, from the tightest bucket of each
/// kind; with `retry_after` also `Retry-After` (whole seconds, rounded up).
pub(super) fn rate_headers(
    protocol: Protocol,
    takes: &[Take],
    levels: &[limits::Level],
    retry_after: Option<f64>,
) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    for dim in [Dim::Requests, Dim::InputTokens, Dim::OutputTokens] {
        let tightest = takes
            .iter()
            .zip(levels)
            .filter(|(t, _)| t.dim == dim)
            .min_by(|a, b| a.1.remaining.total_cmp(&b.1.remaining));
        let Some((t, level)) = tightest else { continue };
        let limit = (t.rate_per_s * 60.0).round() as u64;
        let remaining = level.remaining.max(0.0).floor() as u64;
        let reset_s = (t.capacity - level.remaining).max(0.0) / t.rate_per_s;
        match protocol {
            Protocol::OpenAi => {
                let names: [&'static str; 3] = match dim {
                    Dim::Requests => [
                        "x-ratelimit-limit-requests",
                        "x-ratelimit-remaining-requests",
                        "x-ratelimit-reset-requests",
                    ],
                    Dim::InputTokens => [
                        "x-ratelimit-limit-tokens",
                        "x-ratelimit-remaining-tokens",
                        "x-ratelimit-reset-tokens",
                    ],
                    Dim::OutputTokens => [
                        "x-ratelimit-limit-output-tokens",
                        "x-ratelimit-remaining-output-tokens",
                        "x-ratelimit-reset-output-tokens",
                    ],
                };
                out.push((names[0], limit.to_string()));
                out.push((names[1], remaining.to_string()));
                out.push((names[2], go_duration(reset_s)));
            }
            Protocol::Anthropic => {
                let names: [&'static str; 3] = match dim {
                    Dim::Requests => [
                        "anthropic-ratelimit-requests-limit",
                        "anthropic-ratelimit-requests-remaining",
                        "anthropic-ratelimit-requests-reset",
                    ],
                    Dim::InputTokens => [
                        "anthropic-ratelimit-input-tokens-limit",
                        "anthropic-ratelimit-input-tokens-remaining",
                        "anthropic-ratelimit-input-tokens-reset",
                    ],
                    Dim::OutputTokens => [
                        "anthropic-ratelimit-output-tokens-limit",
                        "anthropic-ratelimit-output-tokens-remaining",
                        "anthropic-ratelimit-output-tokens-reset",
                    ],
                };
                out.push((names[0], limit.to_string()));
                out.push((names[1], remaining.to_string()));
                let at = now_ms() + (reset_s * 1000.0).ceil() as u64;
                out.push((names[2], budget::rfc3339(at)));
            }
        }
    }
    if let Some(s) = retry_after {
        out.push(("retry-after", (s.ceil() as u64).max(1).to_string()));
    }
    out
}
