//! GPU state through NVML (`nvml-wrapper`): per GPU utilisation, memory used/total, and which workers'
//! processes use it.
//!
//! NVML is loaded at run time (`libnvidia-ml.so`); on a node without the driver or a GPU the monitor says
//! so once (log + [`GpuMonitor::unavailable_reason`], the summary's `gpu_unavailable_reason`) and carries on.
//! A worker (vLLM's API server, which listens on the worker port) often runs the GPU work in a child process
//! (the engine core), so a GPU process belongs to the worker whose listening process is it or an ancestor.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::path::Path;

use kinference_api::metrics::Described;
use nvml_wrapper::Nvml;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// One GPU at one sample.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuSample {
    pub index: u32,
    pub name: String,
    pub utilization_pct: u32,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// Processes NVML reports on this GPU (compute and graphics).
    pub pids: Vec<u32>,
    /// Worker ids (base URLs) whose processes use this GPU.
    pub worker_ids: Vec<String>,
}

/// The node's GPU state: samples, or why there are none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeGpu {
    pub gpus: Vec<GpuSample>,
    /// Why GPU figures are missing (no driver, no device, NVML error); `None` when sampled.
    pub unavailable_reason: Option<String>,
}

impl NodeGpu {
    /// The summary's `NodeState`.
    pub fn to_proto(&self) -> kinference_api::summary::NodeState {
        kinference_api::summary::NodeState {
            gpus: self
                .gpus
                .iter()
                .map(|g| kinference_api::summary::GpuState {
                    index: g.index,
                    name: g.name.clone(),
                    utilization_pct: g.utilization_pct,
                    memory_used_bytes: g.memory_used_bytes,
                    memory_total_bytes: g.memory_total_bytes,
                    worker_ids: g.worker_ids.clone(),
                })
                .collect(),
            gpu_unavailable_reason: self.unavailable_reason.clone().unwrap_or_default(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
    name: String,
}

#[derive(Clone, Default)]
struct GpuMetrics {
    available: Gauge,
    utilization: Family<GpuLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    memory_used: Family<GpuLabels, Gauge>,
    memory_total: Family<GpuLabels, Gauge>,
}

/// Samples NVML; inert (with a reason) where NVML cannot start.
pub struct GpuMonitor {
    nvml: Option<Nvml>,
    reason: Option<String>,
    metrics: GpuMetrics,
}

impl GpuMonitor {
    /// Starts NVML from the system library; logs once when it cannot.
    pub fn start() -> Self {
        Self::from_result(Nvml::init())
    }

    /// Starts NVML from a given `libnvidia-ml.so` path (tests use a missing one).
    pub fn start_with_library(path: &Path) -> Self {
        Self::from_result(
            Nvml::builder()
                .lib_path(OsStr::new(path.as_os_str()))
                .init(),
        )
    }

    fn from_result(result: Result<Nvml, nvml_wrapper::error::NvmlError>) -> Self {
        let metrics = GpuMetrics::default();
        match result {
            Ok(nvml) => {
                let count = nvml.device_count().unwrap_or(0);
                if count == 0 {
                    let reason = "NVML found no GPU on this node".to_string();
                    tracing::warn!(%reason, "GPU state unavailable");
                    return Self {
                        nvml: None,
                        reason: Some(reason),
                        metrics,
                    };
                }
                tracing::info!(gpus = count, "NVML started");
                metrics.available.set(1);
                Self {
                    nvml: Some(nvml),
                    reason: None,
                    metrics,
                }
            }
            Err(e) => {
                let reason =
                    format!("NVML unavailable (no NVIDIA driver or GPU on this node): {e}");
                tracing::warn!(%reason, "GPU state unavailable; carrying on without it");
                Self {
                    nvml: None,
                    reason: Some(reason),
                    metrics,
                }
            }
        }
    }

    /// Why there are no GPU figures, when there are none.
    pub fn unavailable_reason(&self) -> Option<&str> {
        self.reason.as_deref()
    }

    /// Samples every GPU; `workers` maps worker ids to their listening ports, to attribute GPU processes.
    pub fn sample(&self, workers: &[(String, u16)]) -> NodeGpu {
        let Some(nvml) = &self.nvml else {
            return NodeGpu {
                gpus: Vec::new(),
                unavailable_reason: self.reason.clone(),
            };
        };
        let count = match nvml.device_count() {
            Ok(c) => c,
            Err(e) => {
                return NodeGpu {
                    gpus: Vec::new(),
                    unavailable_reason: Some(format!("NVML: {e}")),
                };
            }
        };
        let mut gpus = Vec::new();
        for index in 0..count {
            let Ok(device) = nvml.device_by_index(index) else {
                continue;
            };
            let mut sample = GpuSample {
                index,
                name: device.name().unwrap_or_default(),
                ..GpuSample::default()
            };
            if let Ok(u) = device.utilization_rates() {
                sample.utilization_pct = u.gpu;
            }
            if let Ok(m) = device.memory_info() {
                sample.memory_used_bytes = m.used;
                sample.memory_total_bytes = m.total;
            }
            let mut pids: Vec<u32> = device
                .running_compute_processes()
                .unwrap_or_default()
                .iter()
                .map(|p| p.pid)
                .collect();
            pids.extend(
                device
                    .running_graphics_processes()
                    .unwrap_or_default()
                    .iter()
                    .map(|p| p.pid),
            );
            pids.sort_unstable();
            pids.dedup();
            sample.pids = pids;
            gpus.push(sample);
        }
        if gpus.iter().any(|g| !g.pids.is_empty()) && !workers.is_empty() {
            let ports: Vec<u16> = workers.iter().map(|(_, p)| *p).collect();
            let listeners = listening_pids(&ports);
            let worker_pids: HashMap<String, Vec<u32>> = workers
                .iter()
                .map(|(w, p)| (w.clone(), listeners.get(p).cloned().unwrap_or_default()))
                .collect();
            let table = ProcessTable::from_proc();
            for g in &mut gpus {
                g.worker_ids = workers_using(&g.pids, &worker_pids, &table);
            }
        }
        for g in &gpus {
            let labels = GpuLabels {
                gpu: g.index.to_string(),
                name: g.name.clone(),
            };
            self.metrics
                .utilization
                .get_or_create(&labels)
                .set(f64::from(g.utilization_pct) / 100.0);
            self.metrics
                .memory_used
                .get_or_create(&labels)
                .set(i64::try_from(g.memory_used_bytes).unwrap_or(i64::MAX));
            self.metrics
                .memory_total
                .get_or_create(&labels)
                .set(i64::try_from(g.memory_total_bytes).unwrap_or(i64::MAX));
        }
        NodeGpu {
            gpus,
            unavailable_reason: None,
        }
    }

    /// Registers `kinference_agent_gpu_available`, `kinference_agent_gpu_utilization_ratio{gpu,name}`,
    /// `kinference_agent_gpu_memory_used_bytes{gpu,name}` and `kinference_agent_gpu_memory_total_bytes{gpu,name}`
    /// (updated by [`GpuMonitor::sample`]).
    pub fn register_metrics(&self, registry: &mut Registry) {
        let m = &self.metrics;
        registry.register(
            "kinference_agent_gpu_available",
            "1 when NVML reports GPUs on this node",
            Described(m.available.clone()),
        );
        registry.register(
            "kinference_agent_gpu_utilization_ratio",
            "GPU utilisation (0-1)",
            Described(m.utilization.clone()),
        );
        registry.register(
            "kinference_agent_gpu_memory_used_bytes",
            "GPU memory used",
            Described(m.memory_used.clone()),
        );
        registry.register(
            "kinference_agent_gpu_memory_total_bytes",
            "GPU memory total",
            Described(m.memory_total.clone()),
        );
    }
}

/// Parent of each process (pid -> ppid).
#[derive(Clone, Debug, Default)]
pub struct ProcessTable {
    parent: HashMap<u32, u32>,
}

impl ProcessTable {
    /// From explicit (pid, ppid) pairs.
    pub fn from_pairs(pairs: impl IntoIterator<Item = (u32, u32)>) -> Self {
        Self {
            parent: pairs.into_iter().collect(),
        }
    }

    /// From `/proc/<pid>/stat` of every process visible here.
    pub fn from_proc() -> Self {
        let mut parent = HashMap::new();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Self::default();
        };
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            if let Some(ppid) = parse_ppid(&stat) {
                parent.insert(pid, ppid);
            }
        }
        Self { parent }
    }

    /// `pid` and its ancestors, nearest first.
    fn lineage(&self, pid: u32) -> impl Iterator<Item = u32> + '_ {
        let mut next = Some(pid);
        let mut seen = HashSet::new();
        std::iter::from_fn(move || {
            let current = next?;
            if !seen.insert(current) {
                return None;
            }
            next = self
                .parent
                .get(&current)
                .copied()
                .filter(|&p| p != 0 && p != current);
            Some(current)
        })
    }
}

/// The ppid field of `/proc/<pid>/stat` (after the parenthesised command name, which may contain spaces).
pub fn parse_ppid(stat: &str) -> Option<u32> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_comm.split_whitespace();
    let _state = fields.next()?;
    fields.next()?.parse().ok()
}

/// Workers whose listening process is one of `gpu_pids` or an ancestor of one (sorted, deduplicated).
pub fn workers_using(
    gpu_pids: &[u32],
    worker_pids: &HashMap<String, Vec<u32>>,
    table: &ProcessTable,
) -> Vec<String> {
    let mut owner: HashMap<u32, &str> = HashMap::new();
    for (worker, pids) in worker_pids {
        for &pid in pids {
            owner.insert(pid, worker.as_str());
        }
    }
    let mut found: Vec<String> = gpu_pids
        .iter()
        .filter_map(|&pid| {
            table
                .lineage(pid)
                .find_map(|p| owner.get(&p).map(|w| w.to_string()))
        })
        .collect();
    found.sort();
    found.dedup();
    found
}

/// Processes that hold a listening TCP socket on each of `ports` (from `/proc/net/tcp{,6}` and
/// `/proc/<pid>/fd`). Processes of other users are invisible without privileges.
pub fn listening_pids(ports: &[u16]) -> HashMap<u16, Vec<u32>> {
    let mut inode_port: HashMap<u64, u16> = HashMap::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for (port, inode) in parse_listeners(&text) {
            if ports.contains(&port) {
                inode_port.insert(inode, port);
            }
        }
    }
    let mut result: HashMap<u16, Vec<u32>> = HashMap::new();
    if inode_port.is_empty() {
        return result;
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return result;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let Some(inode) = target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:["))
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse::<u64>().ok())
            else {
                continue;
            };
            if let Some(&port) = inode_port.get(&inode) {
                let pids = result.entry(port).or_default();
                if !pids.contains(&pid) {
                    pids.push(pid);
                }
            }
        }
    }
    result
}

/// (local port, socket inode) of the LISTEN sockets in a `/proc/net/tcp`-format table.
pub fn parse_listeners(text: &str) -> Vec<(u16, u64)> {
    const TCP_LISTEN: &str = "0A";
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
            if f.len() < 10 || f[3] != TCP_LISTEN {
                return None;
            }
            let port = u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok()?;
            let inode = f[9].parse().ok()?;
            Some((port, inode))
        })
        .collect()
}

#[cfg(test)]
mod tests;
