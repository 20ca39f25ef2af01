//! Mixed fleets for the `heterogeneous` and `restart` workloads: workers of different speeds and
//! KV-cache sizes side by side, and an event halfway through a run that slows one of them down or
//! restarts it.
//!
//! Speeds are `vllm-sim --slowdown` factors (model time x factor) and can change at run time
//! (`POST /sim/slowdown`), so every run starts from the plan's initial speeds; cache sizes are
//! `--num-blocks`, fixed when the workers start. A restart kills the worker's process (as a crash
//! would) and starts it again on the same ports after a pause: it comes back cold, with an empty
//! cache and its KV event sequence starting over.

use serde::Serialize;

use super::workload::WorkloadKind;

#[cfg(test)]
mod tests;

/// One worker of a mixed fleet.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct WorkerSpec {
    /// How many times slower than the preset it runs at the start of each run.
    pub slowdown: f64,
    /// Its KV-cache capacity in blocks (vLLM's `num_gpu_blocks`).
    pub num_blocks: usize,
}

/// A change to one worker during a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct FleetEvent {
    /// Fires when the virtual users take this share of the measured sessions (0.5: halfway).
    pub at_share: f64,
    /// The worker, from 0.
    pub worker: usize,
    /// What happens to it.
    pub change: FleetChange,
}

/// What a [`FleetEvent`] does to its worker.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FleetChange {
    /// It runs at a new slowdown factor from then on (a throttled or shared GPU).
    Slowdown(f64),
    /// Its process is killed and started again after `down_s` simulated seconds (a crashed engine
    /// that a supervisor brings back): what it was running fails, and it returns with an empty cache.
    Restart {
        /// Simulated seconds between the kill and the new start.
        down_s: f64,
    },
}

impl FleetEvent {
    /// The index of the session whose taking fires the event, in a run of `sessions` sessions.
    pub fn at_session(&self, sessions: usize) -> usize {
        ((sessions as f64 * self.at_share.clamp(0.0, 1.0)).floor() as usize)
            .min(sessions.saturating_sub(1))
    }
}

/// The workers of a mixed fleet and what happens to them during a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FleetPlan {
    /// One entry per worker, in start order.
    pub workers: Vec<WorkerSpec>,
    /// The mid-run change, if any.
    pub event: Option<FleetEvent>,
}

impl FleetPlan {
    /// The mixed fleet `kind` runs on (`None`: the cluster's identical workers).
    pub fn for_workload(kind: WorkloadKind) -> Option<Self> {
        match kind {
            WorkloadKind::Heterogeneous => Some(Self::heterogeneous()),
            WorkloadKind::Restart => Some(Self::restart()),
            _ => None,
        }
    }

    /// The `heterogeneous` fleet: two fast workers with the calibrated preset's cache (4,096 blocks,
    /// 65,536 tokens, about nine of the workload's 7,500-token shared prompts) beside two workers 2.5x
    /// slower with a third of that cache (1,365 blocks, three prompts), as when a pool mixes GPU
    /// generations; halfway through each run the first fast worker drops to 4x slower (a throttled or
    /// shared GPU). All twenty prompts fit only when each lives on one worker, and where a prompt lives
    /// now decides between a cached prefill on a fast worker and a cold one on a slow worker.
    pub fn heterogeneous() -> Self {
        Self {
            workers: Self::mixed_workers(),
            event: Some(FleetEvent {
                at_share: 0.5,
                worker: 0,
                change: FleetChange::Slowdown(4.0),
            }),
        }
    }

    /// The `restart` fleet: the workers of [`FleetPlan::heterogeneous`], and halfway through each run
    /// the first fast worker (holding about half the prompts) is killed and comes back after 10
    /// simulated seconds, cold. Requests it was running fail under every policy; what differs is how
    /// fast a router stops sending to it, and whether it sends work back once it returns with
    /// none of its old cache.
    pub fn restart() -> Self {
        Self {
            workers: Self::mixed_workers(),
            event: Some(FleetEvent {
                at_share: 0.5,
                worker: 0,
                change: FleetChange::Restart { down_s: 10.0 },
            }),
        }
    }

    fn mixed_workers() -> Vec<WorkerSpec> {
        let fast = WorkerSpec {
            slowdown: 1.0,
            num_blocks: 4096,
        };
        let slow = WorkerSpec {
            slowdown: 2.5,
            num_blocks: 1365,
        };
        vec![fast, fast, slow, slow]
    }

    /// The extra `vllm-sim` arguments of each worker, in start order.
    pub fn worker_args(&self) -> Vec<Vec<String>> {
        self.workers
            .iter()
            .map(|w| {
                vec![
                    "--slowdown".to_string(),
                    w.slowdown.to_string(),
                    "--num-blocks".to_string(),
                    w.num_blocks.to_string(),
                ]
            })
            .collect()
    }
}
