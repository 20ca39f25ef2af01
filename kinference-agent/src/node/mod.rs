//! Node-level signals: eBPF connection-level queueing and NVML GPU state.

pub mod ebpf;
pub mod gpu;
