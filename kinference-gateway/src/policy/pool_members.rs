//! Which workers are an `InferencePool`'s: its static `endpoints`, plus (in a cluster, with
//! discovery running) the discovered worker pods its `selector` picks.
//!
//! A discovered worker belongs to a pool when its pod carries every `selector.matchLabels` pair and,
//! if the pod says which GPU class it runs on (label [`GPU_CLASS_LABEL`]), that class is the pool's
//! `gpuClass`. So two pools serving the same model on different GPUs (or one local and one remote)
//! split the model's workers between them by label, and the policy stage's pool state (available,
//! queue depth, KV-cache use, TTFT estimate) is computed over each pool's own workers.
//!
//! Without a discovered view (local mode, no `kubernetes:` block) a selector cannot be evaluated: a
//! pool with no endpoints then stands for every worker serving its model, as before discovery.

use std::collections::BTreeSet;

use kinference_crds::InferencePoolSpec;

use crate::discovery::WorkerSet;
use crate::discovery::pods::PodWorker;

#[cfg(test)]
mod tests;

/// The pod label that says which GPU class a worker runs on (matched against `gpuClass`).
pub const GPU_CLASS_LABEL: &str = "kinference.ai/gpu-class";

/// Whether the pool's selector picks the discovered `worker` (false for a pool without selector).
pub fn selects(pool: &InferencePoolSpec, worker: &PodWorker) -> bool {
    let Some(selector) = &pool.selector else {
        return false;
    };
    let labels_match = selector
        .match_labels
        .iter()
        .all(|(k, v)| worker.labels.get(k) == Some(v));
    let gpu_matches = worker
        .labels
        .get(GPU_CLASS_LABEL)
        .is_none_or(|class| class.eq_ignore_ascii_case(&pool.gpu_class));
    labels_match && gpu_matches
}

/// The pool's worker URLs (no trailing slash): its static endpoints and, with `discovered`, the
/// workers its selector picks. `None`: the pool has a selector, no endpoints and no discovered
/// view to evaluate it against; it then stands for every worker serving its model.
pub fn members(pool: &InferencePoolSpec, discovered: Option<&WorkerSet>) -> Option<Vec<String>> {
    let mut urls: BTreeSet<String> = pool
        .endpoints
        .iter()
        .map(|e| e.url.trim_end_matches('/').to_string())
        .collect();
    match discovered {
        Some(workers) if pool.selector.is_some() => {
            urls.extend(
                workers
                    .values()
                    .filter(|w| selects(pool, w))
                    .map(|w| w.url.trim_end_matches('/').to_string()),
            );
        }
        None if pool.selector.is_some() && urls.is_empty() => return None,
        _ => {}
    }
    Some(urls.into_iter().collect())
}
