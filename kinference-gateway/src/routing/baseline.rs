//! The simple strategies Kinference is compared against (and falls back to when it has no tokens).
//!
//! - `random`: what a Kubernetes Service does;
//! - `round-robin`: each worker in turn;
//! - `least-outstanding`: fewest requests in flight from this gateway (ties drawn at random);
//! - `prefix-hash`: a hash of the prompt's first characters picks the worker, the approximate prefix
//!   affinity of simple routers (same leading text -> same worker, blind to load and to real cache).

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::Rng;

use super::workers::Worker;
use super::{Prompt, RoutingMode, RoutingTuning};

/// Picks an index into `candidates` (non-empty) with a baseline strategy; returns it and the reason.
pub fn pick(
    mode: RoutingMode,
    candidates: &[Arc<Worker>],
    prompt: Prompt<'_>,
    tuning: &RoutingTuning,
    round_robin: &AtomicUsize,
) -> (usize, &'static str) {
    let n = candidates.len().max(1);
    match mode {
        RoutingMode::Random => (rand::rng().random_range(0..n), "random"),
        RoutingMode::RoundRobin => (
            round_robin.fetch_add(1, Ordering::Relaxed) % n,
            "round_robin",
        ),
        RoutingMode::PrefixHash => {
            let head = prompt_head(prompt, tuning.prefix_hash_chars);
            // Candidates are in worker-table order, which is stable, so the mapping is too.
            let mut h = DefaultHasher::new();
            head.hash(&mut h);
            ((h.finish() % n as u64) as usize, "prefix_hash")
        }
        RoutingMode::LeastOutstanding | RoutingMode::Kinference => {
            let loads: Vec<usize> = candidates
                .iter()
                .map(|w| w.state.read().in_flight)
                .collect();
            let min = loads.iter().copied().min().unwrap_or(0);
            let ties: Vec<usize> = (0..loads.len()).filter(|i| loads[*i] == min).collect();
            let i = match ties.len() {
                0 => 0,
                1 => ties[0],
                k => ties[rand::rng().random_range(0..k)],
            };
            (i, "least_outstanding")
        }
    }
}

/// The first `chars` characters of the prompt text (chat: the messages' contents in order).
pub fn prompt_head(prompt: Prompt<'_>, chars: usize) -> String {
    match prompt {
        Prompt::Text(t) => t.chars().take(chars).collect(),
        // The ids as text, about as many characters as the same prompt's words.
        Prompt::Ids(ids) => {
            let mut out = String::new();
            for id in ids.iter() {
                if out.len() >= chars {
                    break;
                }
                out.push_str(&id.to_string());
                out.push(' ');
            }
            out.chars().take(chars).collect()
        }
        Prompt::Chat(messages) => {
            let mut out = String::new();
            let mut left = chars;
            if let Some(list) = messages.as_array() {
                for m in list {
                    let content = &m["content"];
                    let text = match content {
                        serde_json::Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    for c in text.chars().take(left) {
                        out.push(c);
                    }
                    left = chars.saturating_sub(out.chars().count());
                    if left == 0 {
                        break;
                    }
                }
            }
            out
        }
    }
}
