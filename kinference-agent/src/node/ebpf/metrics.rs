//! The node metrics the kernel monitor feeds: each program's state, and per worker the in-flight and
//! waiting counts, the accept queue, and the time-to-first-byte and accept-wait histograms.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::{ProgramReport, ProgramState};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProgramLabels {
    program: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct WorkerLabels {
    pub(super) worker: String,
}

fn seconds_histogram() -> Histogram {
    Histogram::new([
        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ])
}

/// The node metrics this module feeds (registered by [`super::KernelMonitor::register_metrics`]).
#[derive(Clone)]
pub(super) struct KernelMetrics {
    program_state: Family<ProgramLabels, Gauge>,
    pub(super) in_flight: Family<WorkerLabels, Gauge>,
    pub(super) waiting: Family<WorkerLabels, Gauge>,
    pub(super) accept_backlog: Family<WorkerLabels, Gauge>,
    pub(super) accept_backlog_max: Family<WorkerLabels, Gauge>,
    pub(super) ttfb: Family<WorkerLabels, Histogram, fn() -> Histogram>,
    pub(super) accept_wait: Family<WorkerLabels, Histogram, fn() -> Histogram>,
}

impl KernelMetrics {
    pub(super) fn new() -> Self {
        Self {
            program_state: Family::default(),
            in_flight: Family::default(),
            waiting: Family::default(),
            accept_backlog: Family::default(),
            accept_backlog_max: Family::default(),
            ttfb: Family::new_with_constructor(seconds_histogram),
            accept_wait: Family::new_with_constructor(seconds_histogram),
        }
    }

    pub(super) fn set_programs(&self, programs: &[ProgramReport]) {
        for p in programs {
            for s in ProgramState::ALL {
                let labels = ProgramLabels {
                    program: p.program.to_string(),
                    state: s.as_str().to_string(),
                };
                self.program_state
                    .get_or_create(&labels)
                    .set(i64::from(p.state == s));
            }
        }
    }

    pub(super) fn forget(&self, worker: &str) {
        let labels = WorkerLabels {
            worker: worker.to_string(),
        };
        self.in_flight.remove(&labels);
        self.waiting.remove(&labels);
        self.accept_backlog.remove(&labels);
        self.accept_backlog_max.remove(&labels);
        self.ttfb.remove(&labels);
        self.accept_wait.remove(&labels);
    }

    /// Registers every family (the names are listed on [`super::KernelMonitor::register_metrics`]).
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "kinference_agent_ebpf_program_state",
            "State of each eBPF program (1 for its current state)",
            self.program_state.clone(),
        );
        registry.register(
            "kinference_agent_kernel_in_flight",
            "Requests in flight per worker seen in the kernel (all clients)",
            self.in_flight.clone(),
        );
        registry.register(
            "kinference_agent_kernel_waiting",
            "Requests per worker received with no response byte yet, seen in the kernel",
            self.waiting.clone(),
        );
        registry.register(
            "kinference_agent_accept_backlog",
            "Worker listener accept queue length",
            self.accept_backlog.clone(),
        );
        registry.register(
            "kinference_agent_accept_backlog_max",
            "Worker listener accept queue limit",
            self.accept_backlog_max.clone(),
        );
        registry.register(
            "kinference_agent_kernel_ttfb_seconds",
            "Time from a request's first byte in to its first response byte out, per worker",
            self.ttfb.clone(),
        );
        registry.register(
            "kinference_agent_accept_wait_seconds",
            "Time connections wait in a worker's accept queue",
            self.accept_wait.clone(),
        );
    }
}
