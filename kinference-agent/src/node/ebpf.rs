//! Kernel-level view of the local workers' connections, from the eBPF object built by
//! `cargo xtask build-ebpf` (see `kinference-ebpf/`).
//!
//! [`KernelMonitor::start`] loads the object, patches in the struct offsets of the running kernel (from its
//! BTF), attaches each program on its own and reports per program what attached and why not. The agent keeps
//! running with whatever subset works, and without eBPF at all. A poller thread then reads the maps every
//! `poll_interval` into a [`KernelView`] per watched worker (local address and port), and feeds the node
//! metrics.
//!
//! "In flight" here is: requests whose first byte arrived and whose response has not started (`waiting`; for
//! an event-stream response, whose first body byte has not gone out, where the send hook can tell),
//! plus requests whose response is still being sent (a send within `idle_gap`). HTTP/1.1 keeps connections
//! open after a response, so a response counts as finished at the next request, at close, or after
//! `idle_gap` without a send.
//!
//! Layout, as in aya's template: [`load`] (object, BTF offsets, attach), [`poll`] (the poller thread),
//! [`view`] (what is reported per worker), [`metrics`] (the node metrics), [`btf`] (the BTF reader); this
//! file holds the options, the status types and the [`KernelMonitor`] handle.

pub mod btf;
mod load;
mod metrics;
mod poll;
mod view;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use kinference_ebpf_common as common;
use parking_lot::Mutex;
use prometheus_client::registry::Registry;

use self::btf::VMLINUX_BTF;
#[cfg(test)]
use self::load::PROGRAMS;
use self::load::{load, log_status, unavailable};
use self::metrics::KernelMetrics;
use self::poll::run_poller;

pub use self::load::resolve_config;
pub use self::poll::{decode_event, median};
pub use self::view::{KernelView, port_of, watch_key};

/// Turns eBPF off when set to anything but `0` or empty.
pub const ENV_DISABLE: &str = "KINFERENCE_DISABLE_EBPF";
/// Loads this object file instead of the one embedded at build time.
pub const ENV_OBJECT: &str = "KINFERENCE_EBPF_OBJECT";

/// The object embedded at build time, when `cargo xtask build-ebpf` had built it.
#[cfg(kinference_ebpf_object)]
pub fn embedded_object() -> Option<&'static [u8]> {
    Some(aya::include_bytes_aligned!(env!(
        "KINFERENCE_EBPF_OBJECT_PATH"
    )))
}

/// The object embedded at build time, when `cargo xtask build-ebpf` had built it.
#[cfg(not(kinference_ebpf_object))]
pub fn embedded_object() -> Option<&'static [u8]> {
    None
}

/// How the monitor loads and reads.
#[derive(Clone, Debug)]
pub struct EbpfOptions {
    /// Skip eBPF entirely.
    pub disabled: bool,
    /// Load this object instead of the embedded one.
    pub object_path: Option<PathBuf>,
    /// The kernel's BTF.
    pub btf_path: PathBuf,
    /// How often the maps are read.
    pub poll_interval: Duration,
    /// A response without a send for this long counts as finished.
    pub idle_gap: Duration,
    /// Samples older than this leave the recent window (TTFB p50, accept wait p50).
    pub window: Duration,
    /// At most this many recent samples per port.
    pub window_samples: usize,
}

impl Default for EbpfOptions {
    fn default() -> Self {
        Self {
            disabled: false,
            object_path: None,
            btf_path: PathBuf::from(VMLINUX_BTF),
            poll_interval: Duration::from_millis(100),
            idle_gap: Duration::from_millis(500),
            window: Duration::from_secs(60),
            window_samples: 256,
        }
    }
}

impl EbpfOptions {
    /// Defaults, with [`ENV_DISABLE`] and [`ENV_OBJECT`] applied.
    pub fn from_env() -> Self {
        let disabled = std::env::var(ENV_DISABLE).is_ok_and(|v| !v.is_empty() && v != "0");
        let object_path = std::env::var_os(ENV_OBJECT)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        Self {
            disabled,
            object_path,
            ..Self::default()
        }
    }
}

/// What happened to one program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProgramState {
    /// Running.
    Attached,
    /// Not attached because another program covers it (`sock_send_length` when `tcp_sendmsg_locked` runs).
    Standby,
    /// eBPF turned off by configuration.
    Disabled,
    /// The agent was built without the eBPF object.
    NotBuilt,
    /// The kernel lacks the tracepoint, the BTF, or a struct member the program needs.
    Unsupported,
    /// The object or the program did not load (permissions, verifier).
    LoadFailed,
    /// Loaded but the attach failed.
    AttachFailed,
}

impl ProgramState {
    /// All states, for exporting a 0/1 gauge per state.
    pub const ALL: [ProgramState; 7] = [
        ProgramState::Attached,
        ProgramState::Standby,
        ProgramState::Disabled,
        ProgramState::NotBuilt,
        ProgramState::Unsupported,
        ProgramState::LoadFailed,
        ProgramState::AttachFailed,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ProgramState::Attached => "attached",
            ProgramState::Standby => "standby",
            ProgramState::Disabled => "disabled",
            ProgramState::NotBuilt => "not_built",
            ProgramState::Unsupported => "unsupported",
            ProgramState::LoadFailed => "load_failed",
            ProgramState::AttachFailed => "attach_failed",
        }
    }
}

/// One program's outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgramReport {
    /// The tracepoint it hooks (also the metric's `program` label).
    pub program: &'static str,
    pub state: ProgramState,
    /// Why it is not attached.
    pub reason: Option<String>,
}

/// The monitor's overall outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EbpfStatus {
    /// At least the connection-state program runs, so views are available.
    pub active: bool,
    /// Why eBPF is off or partial, for logs and summaries.
    pub reason: Option<String>,
    pub programs: Vec<ProgramReport>,
}

enum Command {
    Watch(common::WatchKey, String),
    Unwatch(common::WatchKey),
}

struct Shared {
    status: std::sync::OnceLock<EbpfStatus>,
    views: Mutex<HashMap<common::WatchKey, (String, KernelView)>>,
    commands: Mutex<Vec<Command>>,
    metrics: KernelMetrics,
    stop: AtomicBool,
}

/// Loads the eBPF programs and keeps the per-port [`KernelView`]s current. Dropping it detaches everything.
pub struct KernelMonitor {
    shared: Arc<Shared>,
    poller: Option<std::thread::JoinHandle<()>>,
}

impl KernelMonitor {
    /// Loads and attaches what works here and starts the poller; never fails (see [`KernelMonitor::status`]).
    /// Logs each program's state once. Blocks while loading (well under a second).
    pub fn start(options: EbpfOptions) -> KernelMonitor {
        let shared = Arc::new(Shared {
            status: std::sync::OnceLock::new(),
            views: Mutex::new(HashMap::new()),
            commands: Mutex::new(Vec::new()),
            metrics: KernelMetrics::new(),
            stop: AtomicBool::new(false),
        });
        let (tx, rx) = mpsc::channel::<()>();
        let thread_shared = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name("kinference-ebpf".into())
            .spawn(move || {
                let (status, loaded) = load(&options);
                log_status(&status);
                thread_shared.metrics.set_programs(&status.programs);
                let _ = thread_shared.status.set(status);
                let _ = tx.send(());
                if let Some(loaded) = loaded {
                    run_poller(loaded, &options, &thread_shared);
                }
            });
        let poller = match spawned {
            Ok(handle) => {
                // The thread always reports; a closed channel means it panicked while loading.
                let _ = rx.recv_timeout(Duration::from_secs(60));
                Some(handle)
            }
            Err(e) => {
                let _ = shared.status.set(unavailable(
                    ProgramState::LoadFailed,
                    format!("cannot start the eBPF thread: {e}"),
                ));
                None
            }
        };
        if shared.status.get().is_none() {
            let status = unavailable(
                ProgramState::LoadFailed,
                "eBPF loading did not finish".to_string(),
            );
            log_status(&status);
            let _ = shared.status.set(status);
        }
        KernelMonitor { shared, poller }
    }

    /// What attached, and why eBPF is off or partial.
    pub fn status(&self) -> &EbpfStatus {
        static PENDING: std::sync::OnceLock<EbpfStatus> = std::sync::OnceLock::new();
        self.shared.status.get().unwrap_or_else(|| {
            PENDING.get_or_init(|| EbpfStatus {
                active: false,
                reason: Some("loading".into()),
                programs: vec![],
            })
        })
    }

    /// Whether views are available.
    pub fn active(&self) -> bool {
        self.status().active
    }

    /// Starts measuring the worker at `worker_url` (its base URL, also the metrics' `worker` label); false
    /// when the URL names no port. Two workers on the same port are told apart only by a pod IP in the URL.
    pub fn watch(&self, worker_url: &str) -> bool {
        let Some(key) = watch_key(worker_url) else {
            return false;
        };
        self.shared
            .commands
            .lock()
            .push(Command::Watch(key, worker_url.to_string()));
        true
    }

    /// Stops measuring the worker at `worker_url` and forgets its view.
    pub fn unwatch(&self, worker_url: &str) {
        if let Some(key) = watch_key(worker_url) {
            self.shared.commands.lock().push(Command::Unwatch(key));
        }
    }

    /// The latest view of the worker at `worker_url`; `None` when eBPF is not active or the worker is not
    /// watched (yet).
    pub fn view(&self, worker_url: &str) -> Option<KernelView> {
        let key = watch_key(worker_url)?;
        self.shared.views.lock().get(&key).map(|(_, v)| v.clone())
    }

    /// Registers the node metrics fed by this monitor: `kinference_agent_ebpf_program_state{program,state}`,
    /// and per `worker`: `kinference_agent_kernel_in_flight`, `kinference_agent_kernel_waiting`,
    /// `kinference_agent_accept_backlog`, `kinference_agent_accept_backlog_max`,
    /// `kinference_agent_kernel_ttfb_seconds` and `kinference_agent_accept_wait_seconds` (histograms).
    pub fn register_metrics(&self, registry: &mut Registry) {
        self.shared.metrics.register(registry);
    }
}

impl Drop for KernelMonitor {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.poller.take() {
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests;
