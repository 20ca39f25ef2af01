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

pub mod btf;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use aya::maps::{HashMap as BpfHashMap, MapData, RingBuf};
use aya::programs::BtfTracePoint;
use kinference_ebpf_common as common;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use self::btf::{Btf, BtfError, VMLINUX_BTF};

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

/// One program in the object: its function name and the tracepoint it attaches to.
struct ProgramSpec {
    function: &'static str,
    tracepoint: &'static str,
    /// Attached only when this other tracepoint's program did not attach.
    fallback_for: Option<&'static str>,
}

const PROGRAMS: [ProgramSpec; 6] = [
    ProgramSpec {
        function: "kinf_sock_state",
        tracepoint: "inet_sock_set_state",
        fallback_for: None,
    },
    ProgramSpec {
        function: "kinf_data_ready",
        tracepoint: "sk_data_ready",
        fallback_for: None,
    },
    ProgramSpec {
        function: "kinf_recv",
        tracepoint: "sock_recv_length",
        fallback_for: None,
    },
    ProgramSpec {
        function: "kinf_tcp_sendmsg",
        tracepoint: "tcp_sendmsg_locked",
        fallback_for: None,
    },
    ProgramSpec {
        function: "kinf_send",
        tracepoint: "sock_send_length",
        fallback_for: Some("tcp_sendmsg_locked"),
    },
    ProgramSpec {
        function: "kinf_sys_exit",
        tracepoint: "sys_exit",
        fallback_for: None,
    },
];

/// The kernel-level view of one worker port.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KernelView {
    /// Requests received and not finished: `waiting` plus responses still being sent.
    pub in_flight: u32,
    /// How long a response counts in `in_flight` after its last send (the monitor's `idle_gap`): a
    /// finished response stays counted up to this long unless its connection carries a new request.
    pub idle_gap: Duration,
    /// Requests received, no response byte sent yet (queued or in prefill).
    pub waiting: u32,
    /// Whether `waiting` lasts until an event-stream response's first body byte (its first token) rather
    /// than its header block, which vLLM sends before the prefill. Needs the `tcp_sendmsg_locked` hook.
    pub waits_for_body: bool,
    /// Open connections to the port that the program has seen.
    pub connections: u32,
    /// The listener's accept queue at the latest observation.
    pub accept_backlog: u32,
    /// The listener's accept queue limit.
    pub accept_backlog_max: u32,
    /// Highest accept queue since the previous poll.
    pub accept_backlog_peak: u32,
    /// Median of the recent times from a request's first byte in to its first response byte out.
    pub ttfb_p50: Option<Duration>,
    /// The recent samples, oldest first.
    pub ttfb_recent: Vec<Duration>,
    /// Median of the recent accept-queue waits.
    pub accept_wait_p50: Option<Duration>,
    /// Requests started since the port was watched.
    pub requests_total: u64,
    /// First response bytes since the port was watched.
    pub responses_total: u64,
    /// Samples lost because the ring buffer was full.
    pub dropped_samples: u64,
}

impl KernelView {
    /// `ttfb_p50` in microseconds, 0 when there is no sample (the summary's `kernel_ttfb_p50_us`).
    pub fn ttfb_p50_us(&self) -> u32 {
        self.ttfb_p50
            .map_or(0, |d| u32::try_from(d.as_micros()).unwrap_or(u32::MAX))
    }
}

/// The local port of a worker base URL (`http://127.0.0.1:8001` -> 8001; scheme default otherwise).
pub fn port_of(url: &str) -> Option<u16> {
    let (scheme, rest) = url.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let host_port = authority.rsplit('@').next()?;
    // An IPv6 literal: [::1]:8001
    let after_host = match host_port.strip_prefix('[') {
        Some(v6) => v6.split_once(']')?.1,
        None => host_port
            .split_once(':')
            .map_or("", |(_, p)| p)
            .split(':')
            .next()
            .map_or("", |p| p),
    };
    let port = after_host.strip_prefix(':').unwrap_or(after_host);
    if port.is_empty() {
        return match scheme {
            "http" => Some(80),
            "https" => Some(443),
            _ => None,
        };
    }
    port.parse().ok()
}

/// The endpoint the kernel program matches for a worker base URL: its port, and its IPv4 address when that
/// tells pods apart (not loopback, unspecified, a hostname or IPv6: then any local address matches).
pub fn watch_key(url: &str) -> Option<common::WatchKey> {
    let port = port_of(url)?;
    let authority = url.split_once("://")?.1.split(['/', '?', '#']).next()?;
    let host_port = authority.rsplit('@').next()?;
    let host = host_port.split(':').next().unwrap_or("");
    let addr = match host.parse::<std::net::Ipv4Addr>() {
        // skc_rcv_saddr holds the address in network order; the program reads it as a native u32.
        Ok(ip) if !ip.is_loopback() && !ip.is_unspecified() => u32::from_ne_bytes(ip.octets()),
        _ => 0,
    };
    Some(common::WatchKey {
        addr,
        port,
        _pad: 0,
    })
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProgramLabels {
    program: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    worker: String,
}

fn seconds_histogram() -> Histogram {
    Histogram::new([
        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ])
}

/// The node metrics this module feeds (registered by [`KernelMonitor::register_metrics`]).
#[derive(Clone)]
struct KernelMetrics {
    program_state: Family<ProgramLabels, Gauge>,
    in_flight: Family<WorkerLabels, Gauge>,
    waiting: Family<WorkerLabels, Gauge>,
    accept_backlog: Family<WorkerLabels, Gauge>,
    accept_backlog_max: Family<WorkerLabels, Gauge>,
    ttfb: Family<WorkerLabels, Histogram, fn() -> Histogram>,
    accept_wait: Family<WorkerLabels, Histogram, fn() -> Histogram>,
}

impl KernelMetrics {
    fn new() -> Self {
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

    fn set_programs(&self, programs: &[ProgramReport]) {
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

    fn forget(&self, worker: &str) {
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
        let m = &self.shared.metrics;
        registry.register(
            "kinference_agent_ebpf_program_state",
            "State of each eBPF program (1 for its current state)",
            m.program_state.clone(),
        );
        registry.register(
            "kinference_agent_kernel_in_flight",
            "Requests in flight per worker seen in the kernel (all clients)",
            m.in_flight.clone(),
        );
        registry.register(
            "kinference_agent_kernel_waiting",
            "Requests per worker received with no response byte yet, seen in the kernel",
            m.waiting.clone(),
        );
        registry.register(
            "kinference_agent_accept_backlog",
            "Worker listener accept queue length",
            m.accept_backlog.clone(),
        );
        registry.register(
            "kinference_agent_accept_backlog_max",
            "Worker listener accept queue limit",
            m.accept_backlog_max.clone(),
        );
        registry.register(
            "kinference_agent_kernel_ttfb_seconds",
            "Time from a request's first byte in to its first response byte out, per worker",
            m.ttfb.clone(),
        );
        registry.register(
            "kinference_agent_accept_wait_seconds",
            "Time connections wait in a worker's accept queue",
            m.accept_wait.clone(),
        );
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

fn unavailable(state: ProgramState, reason: String) -> EbpfStatus {
    let programs = PROGRAMS
        .iter()
        .map(|p| ProgramReport {
            program: p.tracepoint,
            state,
            reason: Some(reason.clone()),
        })
        .collect();
    EbpfStatus {
        active: false,
        reason: Some(reason),
        programs,
    }
}

fn log_status(status: &EbpfStatus) {
    for p in &status.programs {
        match (&p.state, &p.reason) {
            (ProgramState::Attached, _) => {
                tracing::info!(program = p.program, "eBPF program attached")
            }
            (state, reason) => tracing::warn!(
                program = p.program,
                state = state.as_str(),
                reason = reason.as_deref().unwrap_or(""),
                "eBPF program not attached"
            ),
        }
    }
    match (&status.active, &status.reason) {
        (true, None) => tracing::info!("eBPF kernel view active"),
        (true, Some(reason)) => tracing::warn!(%reason, "eBPF kernel view partial"),
        (false, reason) => {
            tracing::warn!(
                reason = reason.as_deref().unwrap_or(""),
                "eBPF kernel view unavailable"
            )
        }
    }
}

/// Everything the poller owns once loading worked.
struct Loaded {
    // Kept alive: dropping it detaches the programs.
    _ebpf: aya::Ebpf,
    logger: Option<aya_log::EbpfLogger<TracingLog>>,
    ports: BpfHashMap<MapData, common::WatchKey, common::PortStats>,
    conns: BpfHashMap<MapData, u64, common::Conn>,
    backlog: BpfHashMap<MapData, common::WatchKey, common::Backlog>,
    events: RingBuf<MapData>,
    /// The send hook recognises event-stream headers sent alone ([`KernelView::waits_for_body`]).
    waits_for_body: bool,
}

/// Errors on the way to a loaded object (become the status reason).
#[derive(Debug, thiserror::Error)]
enum LoadError {
    #[error("reading the eBPF object {path}: {source}")]
    Object {
        path: String,
        source: std::io::Error,
    },
    #[error("kernel BTF: {0}")]
    Btf(#[from] BtfError),
    #[error("kernel BTF (aya): {0}")]
    AyaBtf(#[from] aya::BtfError),
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("map {0} missing from the object")]
    MissingMap(&'static str),
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: aya::maps::MapError,
    },
}

/// Forwards the programs' aya-log records to tracing.
struct TracingLog;

impl log::Log for TracingLog {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let message = record.args().to_string();
        match record.level() {
            log::Level::Error => tracing::error!(target: "kinference_ebpf", "{message}"),
            log::Level::Warn => tracing::warn!(target: "kinference_ebpf", "{message}"),
            log::Level::Info => tracing::info!(target: "kinference_ebpf", "{message}"),
            _ => tracing::debug!(target: "kinference_ebpf", "{message}"),
        }
    }

    fn flush(&self) {}
}

/// The kernel offsets the program needs; `accept` is false where the accept hook cannot be configured.
pub fn resolve_config(btf: &Btf) -> Result<common::Config, BtfError> {
    let sock = |m: &str| btf.member_offset("sock", m);
    let mut cfg = common::Config {
        flags: common::CONFIG_VALID,
        sock_family: sock("__sk_common.skc_family")?,
        sock_num: sock("__sk_common.skc_num")?,
        sock_state: sock("__sk_common.skc_state")?,
        sock_ack_backlog: sock("sk_ack_backlog")?,
        sock_max_ack_backlog: sock("sk_max_ack_backlog")?,
        sock_rcv_saddr: sock("__sk_common.skc_rcv_saddr")?,
        ..common::Config::UNRESOLVED
    };
    // The accept hook walks task->files->fdt->fd[n]->private_data->sk and reads the syscall number from
    // pt_regs; it is configured only where all of that resolves (x86_64 layouts).
    let accept = (|| -> Result<(), BtfError> {
        if std::env::consts::ARCH != "x86_64" {
            return Err(BtfError::Malformed(
                "accept hook: syscall numbers known for x86_64 only",
            ));
        }
        cfg.task_files = btf.member_offset("task_struct", "files")?;
        cfg.files_fdt = btf.member_offset("files_struct", "fdt")?;
        cfg.fdtable_max_fds = btf.member_offset("fdtable", "max_fds")?;
        cfg.fdtable_fd = btf.member_offset("fdtable", "fd")?;
        cfg.file_private_data = btf.member_offset("file", "private_data")?;
        cfg.socket_sk = btf.member_offset("socket", "sk")?;
        cfg.regs_syscall_nr = btf.member_offset("pt_regs", "orig_ax")?;
        cfg.regs_arg0 = btf.member_offset("pt_regs", "di")?;
        cfg.nr_accept = 43;
        cfg.nr_accept4 = 288;
        Ok(())
    })();
    match accept {
        Ok(()) => cfg.flags |= common::CONFIG_ACCEPT,
        Err(e) => tracing::warn!(error = %e, "eBPF accept hook not configured"),
    }
    // The send hook reads the send's buffer through msghdr->msg_iter to recognise an event-stream
    // response's header block sent alone; without these offsets it keeps the plain first-byte rule.
    let body = (|| -> Result<(), BtfError> {
        let iter = |m: &str| btf.member_offset("iov_iter", m);
        cfg.msghdr_iter = btf.member_offset("msghdr", "msg_iter")?;
        cfg.iter_type = iter("iter_type")?;
        cfg.iter_iov_offset = iter("iov_offset")?;
        cfg.iter_ptr = iter("__iov")?;
        cfg.iter_count = iter("count")?;
        cfg.iter_nr_segs = iter("nr_segs")?;
        cfg.iter_iovec = btf.enum_value("iter_type", "ITER_IOVEC")?;
        // ITER_UBUF (single-buffer sends) exists from Linux 6.0; before, those are one-segment iovecs.
        cfg.iter_ubuf = btf.enum_value("iter_type", "ITER_UBUF").unwrap_or(255);
        Ok(())
    })();
    match body {
        Ok(()) => cfg.flags |= common::CONFIG_BODY,
        Err(e) => tracing::warn!(
            error = %e,
            "eBPF send hook: event-stream headers not recognised (time to first byte counts the headers)"
        ),
    }
    Ok(cfg)
}

fn load(options: &EbpfOptions) -> (EbpfStatus, Option<Loaded>) {
    if options.disabled {
        return (
            unavailable(ProgramState::Disabled, format!("disabled by {ENV_DISABLE}")),
            None,
        );
    }
    let bytes: std::borrow::Cow<'static, [u8]> = match &options.object_path {
        Some(path) => match std::fs::read(path) {
            Ok(b) => b.into(),
            Err(source) => {
                let e = LoadError::Object {
                    path: path.display().to_string(),
                    source,
                };
                return (unavailable(ProgramState::LoadFailed, e.to_string()), None);
            }
        },
        None => match embedded_object() {
            Some(b) => b.into(),
            None => {
                let reason = "agent built without the eBPF object (run `cargo xtask build-ebpf`, then rebuild)";
                return (
                    unavailable(ProgramState::NotBuilt, reason.to_string()),
                    None,
                );
            }
        },
    };
    let btf = match Btf::from_file(&options.btf_path) {
        Ok(btf) => btf,
        Err(e) => {
            return (
                unavailable(ProgramState::Unsupported, LoadError::from(e).to_string()),
                None,
            );
        }
    };
    let config = match resolve_config(&btf) {
        Ok(c) => c,
        Err(e) => {
            return (
                unavailable(ProgramState::Unsupported, LoadError::from(e).to_string()),
                None,
            );
        }
    };
    match load_object(&bytes, &btf, &config, options) {
        Ok(result) => result,
        Err(e) => (unavailable(ProgramState::LoadFailed, e.to_string()), None),
    }
}

fn load_object(
    bytes: &[u8],
    btf: &Btf,
    config: &common::Config,
    options: &EbpfOptions,
) -> Result<(EbpfStatus, Option<Loaded>), LoadError> {
    let aya_btf = aya::Btf::parse_file(&options.btf_path, aya::Endianness::default())?;
    // aya-log levels: 1 error, 2 warn, 3 info; the programs only log anomalies.
    let log_level: u8 = 3;
    let mut ebpf = aya::EbpfLoader::new()
        .btf(Some(&aya_btf))
        .override_global(common::CONFIG_GLOBAL, config, true)
        .override_global("AYA_LOG_LEVEL", &log_level, false)
        .load(bytes)?;
    let logger = match aya_log::EbpfLogger::init_with_logger(&mut ebpf, TracingLog) {
        Ok(l) => Some(l),
        Err(e) => {
            tracing::warn!(error = %e, "eBPF log records will not be forwarded");
            None
        }
    };

    let mut programs: Vec<ProgramReport> = Vec::new();
    for spec in &PROGRAMS {
        let report = |state, reason: Option<String>| ProgramReport {
            program: spec.tracepoint,
            state,
            reason,
        };
        if let Some(primary) = spec.fallback_for
            && programs
                .iter()
                .any(|p| p.program == primary && p.state == ProgramState::Attached)
        {
            programs.push(report(
                ProgramState::Standby,
                Some(format!("{primary} is attached")),
            ));
            continue;
        }
        if !btf.has_tracepoint(spec.tracepoint) {
            let reason = format!("kernel has no BTF tracepoint {}", spec.tracepoint);
            programs.push(report(ProgramState::Unsupported, Some(reason)));
            continue;
        }
        if spec.tracepoint == "sys_exit" && config.flags & common::CONFIG_ACCEPT == 0 {
            let reason = "accept hook offsets unresolved on this kernel/arch".to_string();
            programs.push(report(ProgramState::Unsupported, Some(reason)));
            continue;
        }
        let program: &mut BtfTracePoint =
            match ebpf.program_mut(spec.function).map(TryInto::try_into) {
                Some(Ok(p)) => p,
                Some(Err(e)) => {
                    programs.push(report(ProgramState::LoadFailed, Some(e.to_string())));
                    continue;
                }
                None => {
                    let reason = format!("program {} missing from the object", spec.function);
                    programs.push(report(ProgramState::LoadFailed, Some(reason)));
                    continue;
                }
            };
        if let Err(e) = program.load(spec.tracepoint, &aya_btf) {
            programs.push(report(ProgramState::LoadFailed, Some(format!("{e:#}"))));
            continue;
        }
        match program.attach() {
            Ok(_) => programs.push(report(ProgramState::Attached, None)),
            Err(e) => programs.push(report(ProgramState::AttachFailed, Some(e.to_string()))),
        }
    }

    let attached = |tp: &str| {
        programs
            .iter()
            .any(|p| p.program == tp && p.state == ProgramState::Attached)
    };
    let sends = attached("tcp_sendmsg_locked") || attached("sock_send_length");
    let arrivals = attached("sk_data_ready") || attached("sock_recv_length");
    let active = sends && arrivals;
    let missing: Vec<&str> = programs
        .iter()
        .filter(|p| p.state != ProgramState::Attached && p.state != ProgramState::Standby)
        .map(|p| p.program)
        .collect();
    let reason = if !active {
        Some("no program for request arrivals or responses attached".to_string())
    } else if missing.is_empty() {
        None
    } else {
        Some(format!("not attached: {}", missing.join(", ")))
    };
    if !active {
        return Ok((
            EbpfStatus {
                active,
                reason,
                programs,
            },
            None,
        ));
    }

    let ports = take_hash(&mut ebpf, common::PORTS_MAP)?;
    let conns = take_hash(&mut ebpf, common::CONNS_MAP)?;
    let backlog = take_hash(&mut ebpf, common::BACKLOG_MAP)?;
    let events_map = ebpf
        .take_map(common::EVENTS_MAP)
        .ok_or(LoadError::MissingMap(common::EVENTS_MAP))?;
    let events = RingBuf::try_from(events_map).map_err(|source| LoadError::Map {
        name: common::EVENTS_MAP,
        source,
    })?;
    let waits_for_body = attached("tcp_sendmsg_locked") && config.flags & common::CONFIG_BODY != 0;
    let loaded = Loaded {
        _ebpf: ebpf,
        logger,
        ports,
        conns,
        backlog,
        events,
        waits_for_body,
    };
    Ok((
        EbpfStatus {
            active,
            reason,
            programs,
        },
        Some(loaded),
    ))
}

fn take_hash<K: aya::Pod, V: aya::Pod>(
    ebpf: &mut aya::Ebpf,
    name: &'static str,
) -> Result<BpfHashMap<MapData, K, V>, LoadError> {
    let map = ebpf.take_map(name).ok_or(LoadError::MissingMap(name))?;
    BpfHashMap::try_from(map).map_err(|source| LoadError::Map { name, source })
}

/// Per-port state the poller keeps between reads.
struct PortTrack {
    worker: String,
    ttfb: VecDeque<(Instant, Duration)>,
    accept_wait: VecDeque<(Instant, Duration)>,
}

/// Decodes one ring buffer record ([`common::Event`], native byte order).
pub fn decode_event(bytes: &[u8]) -> Option<common::Event> {
    let u64_at = |o: usize| {
        bytes
            .get(o..o + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_ne_bytes)
    };
    let u32_at = |o: usize| {
        bytes
            .get(o..o + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_ne_bytes)
    };
    let u16_at = |o: usize| {
        bytes
            .get(o..o + 2)
            .and_then(|b| b.try_into().ok())
            .map(u16::from_ne_bytes)
    };
    Some(common::Event {
        ts_ns: u64_at(0)?,
        value_ns: u64_at(8)?,
        read_delay_ns: u64_at(16)?,
        kind: u32_at(24)?,
        addr: u32_at(28)?,
        port: u16_at(32)?,
        _pad: 0,
        _pad2: 0,
    })
}

/// The median of `samples` (the upper one of the two middle values for an even count).
pub fn median(samples: impl Iterator<Item = Duration>) -> Option<Duration> {
    let mut v: Vec<Duration> = samples.collect();
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    Some(v[v.len() / 2])
}

fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_nsec as u64)
}

fn run_poller(mut loaded: Loaded, options: &EbpfOptions, shared: &Shared) {
    let mut tracks: HashMap<common::WatchKey, PortTrack> = HashMap::new();
    while !shared.stop.load(Ordering::Relaxed) {
        apply_commands(&mut loaded, &mut tracks, shared);
        poll_once(&mut loaded, &mut tracks, options, shared);
        std::thread::sleep(options.poll_interval);
    }
}

fn apply_commands(
    loaded: &mut Loaded,
    tracks: &mut HashMap<common::WatchKey, PortTrack>,
    shared: &Shared,
) {
    let commands = std::mem::take(&mut *shared.commands.lock());
    for command in commands {
        match command {
            Command::Watch(key, worker) => {
                if let Some(track) = tracks.get_mut(&key) {
                    track.worker = worker;
                    continue;
                }
                if let Err(e) = loaded.ports.insert(key, common::PortStats::default(), 0) {
                    tracing::warn!(port = key.port, %worker, error = %e, "eBPF: cannot watch worker");
                    continue;
                }
                tracing::info!(port = key.port, %worker, "eBPF: watching worker");
                tracks.insert(
                    key,
                    PortTrack {
                        worker,
                        ttfb: VecDeque::new(),
                        accept_wait: VecDeque::new(),
                    },
                );
            }
            Command::Unwatch(key) => {
                let _ = loaded.ports.remove(&key);
                let _ = loaded.backlog.remove(&key);
                if let Some(track) = tracks.remove(&key) {
                    shared.metrics.forget(&track.worker);
                }
                shared.views.lock().remove(&key);
            }
        }
    }
}

fn poll_once(
    loaded: &mut Loaded,
    tracks: &mut HashMap<common::WatchKey, PortTrack>,
    options: &EbpfOptions,
    shared: &Shared,
) {
    let now = Instant::now();
    let metrics = &shared.metrics;
    while let Some(item) = loaded.events.next() {
        let Some(event) = decode_event(&item) else {
            continue;
        };
        let key = common::WatchKey {
            addr: event.addr,
            port: event.port,
            _pad: 0,
        };
        let Some(track) = tracks.get_mut(&key) else {
            continue;
        };
        let value = Duration::from_nanos(event.value_ns);
        let labels = WorkerLabels {
            worker: track.worker.clone(),
        };
        let window = match event.kind {
            common::EVENT_TTFB => {
                metrics
                    .ttfb
                    .get_or_create(&labels)
                    .observe(value.as_secs_f64());
                &mut track.ttfb
            }
            common::EVENT_ACCEPT_WAIT => {
                metrics
                    .accept_wait
                    .get_or_create(&labels)
                    .observe(value.as_secs_f64());
                &mut track.accept_wait
            }
            _ => continue,
        };
        window.push_back((now, value));
        while window.len() > options.window_samples {
            window.pop_front();
        }
    }
    if let Some(logger) = loaded.logger.as_mut() {
        logger.flush();
    }

    // Per port: requests waiting for their first response byte, and responses still being sent.
    let now_ns = monotonic_ns();
    let gap_ns = u64::try_from(options.idle_gap.as_nanos()).unwrap_or(u64::MAX);
    let mut counts: HashMap<common::WatchKey, (u32, u32, u32)> = HashMap::new();
    for entry in loaded.conns.iter() {
        let Ok((_, conn)) = entry else { continue };
        let key = common::WatchKey {
            addr: conn.addr,
            port: conn.port,
            _pad: 0,
        };
        let c = counts.entry(key).or_default();
        c.2 += 1;
        match conn.phase {
            common::PHASE_WAITING | common::PHASE_HEADERS => c.0 += 1,
            common::PHASE_RESPONDING if now_ns.saturating_sub(conn.last_send_ns) < gap_ns => {
                c.1 += 1
            }
            _ => {}
        }
    }

    let mut views = HashMap::with_capacity(tracks.len());
    for (&key, track) in tracks.iter_mut() {
        for window in [&mut track.ttfb, &mut track.accept_wait] {
            while window
                .front()
                .is_some_and(|(at, _)| now.duration_since(*at) > options.window)
            {
                window.pop_front();
            }
        }
        let (waiting, responding, connections) = counts.get(&key).copied().unwrap_or_default();
        let stats = loaded.ports.get(&key, 0).unwrap_or_default();
        let backlog = loaded.backlog.get(&key, 0).ok();
        if let Some(b) = backlog
            && b.peak != b.current
        {
            // Reset the peak so the next read shows the peak of the next interval.
            let _ = loaded.backlog.insert(
                key,
                common::Backlog {
                    peak: b.current,
                    ..b
                },
                0,
            );
        }
        let backlog = backlog.unwrap_or_default();
        let view = KernelView {
            in_flight: waiting + responding,
            idle_gap: options.idle_gap,
            waiting,
            waits_for_body: loaded.waits_for_body,
            connections,
            accept_backlog: backlog.current,
            accept_backlog_max: backlog.max,
            accept_backlog_peak: backlog.peak,
            ttfb_p50: median(track.ttfb.iter().map(|(_, d)| *d)),
            ttfb_recent: track.ttfb.iter().map(|(_, d)| *d).collect(),
            accept_wait_p50: median(track.accept_wait.iter().map(|(_, d)| *d)),
            requests_total: stats.requests,
            responses_total: stats.responses,
            dropped_samples: stats.dropped_events,
        };
        let labels = WorkerLabels {
            worker: track.worker.clone(),
        };
        metrics
            .in_flight
            .get_or_create(&labels)
            .set(i64::from(view.in_flight));
        metrics
            .waiting
            .get_or_create(&labels)
            .set(i64::from(view.waiting));
        metrics
            .accept_backlog
            .get_or_create(&labels)
            .set(i64::from(view.accept_backlog));
        metrics
            .accept_backlog_max
            .get_or_create(&labels)
            .set(i64::from(view.accept_backlog_max));
        views.insert(key, (track.worker.clone(), view));
    }
    *shared.views.lock() = views;
}

#[cfg(test)]
mod tests;
