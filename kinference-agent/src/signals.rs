//! Feeds the node signals into the registry, and so into every summary: the kernel's per-port view (eBPF,
//! [`crate::node::ebpf`]) into each worker's load, and the GPU state (NVML, [`crate::node::gpu`]) into the
//! node state that snapshots and deltas carry.
//!
//! Both monitors are optional at run time. Where eBPF cannot load (no privileges, no BTF, switched off with
//! `KINFERENCE_DISABLE_EBPF`, an unreadable `KINFERENCE_EBPF_OBJECT`) every worker's load says
//! `kernel_ok = false`; without a GPU or driver the node state says why (`gpu_unavailable_reason`). Either
//! way the monitors log the reason once and export it on `/metrics`
//! (`kinference_agent_ebpf_program_state`, `kinference_agent_gpu_available`), and the agent carries on.

use std::sync::Arc;
use std::time::Duration;

use kinference_api::summary::NodeState;
use prometheus_client::registry::Registry as PromRegistry;
use tokio_util::sync::CancellationToken;

use crate::node::ebpf::{self, EbpfOptions, KernelMonitor, KernelView};
use crate::node::gpu::GpuMonitor;
use crate::registry::{KernelFigures, Registry};

/// The node's two monitors, started once per process.
pub struct NodeSignals {
    /// eBPF: connection-level queueing per worker port.
    pub kernel: Arc<KernelMonitor>,
    /// NVML: GPU utilisation and memory.
    pub gpu: Arc<GpuMonitor>,
}

impl NodeSignals {
    /// Starts both monitors. Blocks while the eBPF programs load (well under a second); call it from a
    /// blocking context.
    pub fn start(options: EbpfOptions) -> Self {
        Self {
            kernel: Arc::new(KernelMonitor::start(options)),
            gpu: Arc::new(GpuMonitor::start()),
        }
    }

    /// Registers both monitors' node metrics on the agent's root registry.
    pub fn register_metrics(&self, registry: &mut PromRegistry) {
        self.kernel.register_metrics(registry);
        self.gpu.register_metrics(registry);
    }

    /// Starts measuring a worker's port (a new worker was discovered).
    pub fn watch(&self, worker_url: &str) {
        if self.kernel.active() && !self.kernel.watch(worker_url) {
            tracing::warn!(worker = %worker_url, "worker URL names no port: no kernel-level view of it");
        }
    }

    /// Stops measuring a worker's port (the worker left).
    pub fn unwatch(&self, worker_url: &str) {
        self.kernel.unwatch(worker_url);
    }

    /// One line per signal: what works, or why not (for `/readyz` and the start-up log).
    pub fn describe(&self) -> String {
        let status = self.kernel.status();
        let ebpf = match (status.active, &status.reason) {
            (true, None) => "ebpf: active".to_string(),
            (true, Some(reason)) => format!("ebpf: partial ({reason})"),
            (false, reason) => format!("ebpf: off ({})", reason.as_deref().unwrap_or("unknown")),
        };
        let gpu = match self.gpu.unavailable_reason() {
            None => "gpu: available".to_string(),
            Some(reason) => format!("gpu: unavailable ({reason})"),
        };
        format!("{ebpf}\n{gpu}\n")
    }
}

/// The summary's kernel figures of one view.
pub fn kernel_figures(view: &KernelView) -> KernelFigures {
    KernelFigures {
        in_flight: view.in_flight,
        idle_gap_ms: view.idle_gap.as_millis().min(u128::from(u32::MAX)) as u32,
        waiting: view.waiting,
        waits_for_body: view.waits_for_body,
        // The peak since the previous read: a burst that filled the queue between reads still shows.
        accept_backlog: view.accept_backlog.max(view.accept_backlog_peak),
        accept_backlog_max: view.accept_backlog_max,
        ttfb_p50_us: view.ttfb_p50_us(),
    }
}

/// Copies the kernel's view of every worker into its load every `interval`, and wakes the broadcaster
/// when a figure changed (so a gateway hears about a new request within about one interval). Returns at
/// once when eBPF is not active: every load then keeps `kernel: None`.
pub async fn run_kernel(
    kernel: Arc<KernelMonitor>,
    registry: Arc<Registry>,
    interval: Duration,
    cancel: CancellationToken,
) {
    if !kernel.active() {
        return;
    }
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let mut changed = false;
        for slot in registry.list() {
            let figures = kernel.view(&slot.spec.url).map(|v| kernel_figures(&v));
            let mut load = slot.load.lock();
            if load.kernel != figures {
                load.kernel = figures;
                changed = true;
            }
        }
        if changed {
            registry.notify();
        }
    }
}

/// Samples the GPUs now and every `interval` after, into the registry's node state (sent to gateways when
/// it changes). NVML calls and the `/proc` scan that maps GPU processes to workers block: they run on the
/// blocking pool.
pub async fn run_gpu(
    gpu: Arc<GpuMonitor>,
    registry: Arc<Registry>,
    interval: Duration,
    cancel: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let workers: Vec<(String, u16)> = registry
            .list()
            .iter()
            .filter_map(|s| Some((s.spec.url.clone(), ebpf::port_of(&s.spec.url)?)))
            .collect();
        let gpu = Arc::clone(&gpu);
        let state: Option<NodeState> =
            tokio::task::spawn_blocking(move || gpu.sample(&workers).to_proto())
                .await
                .ok();
        if let Some(state) = state {
            registry.set_node_state(state);
        }
    }
}

#[cfg(test)]
mod tests;
