//! Loading: the object (embedded or from a file), the running kernel's struct offsets from its BTF, and
//! each program attached on its own, with what attached and why not reported per program.

use aya::maps::{HashMap as BpfHashMap, MapData, RingBuf};
use aya::programs::BtfTracePoint;
use kinference_ebpf_common as common;

use super::btf::{Btf, BtfError};
use super::{ENV_DISABLE, EbpfOptions, EbpfStatus, ProgramReport, ProgramState, embedded_object};

/// One program in the object: its function name and the tracepoint it attaches to.
pub(super) struct ProgramSpec {
    function: &'static str,
    tracepoint: &'static str,
    /// Attached only when this other tracepoint's program did not attach.
    fallback_for: Option<&'static str>,
}

pub(super) const PROGRAMS: [ProgramSpec; 6] = [
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

pub(super) fn unavailable(state: ProgramState, reason: String) -> EbpfStatus {
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

pub(super) fn log_status(status: &EbpfStatus) {
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
pub(super) struct Loaded {
    // Kept alive: dropping it detaches the programs.
    _ebpf: aya::Ebpf,
    pub(super) logger: Option<aya_log::EbpfLogger<TracingLog>>,
    pub(super) ports: BpfHashMap<MapData, common::WatchKey, common::PortStats>,
    pub(super) conns: BpfHashMap<MapData, u64, common::Conn>,
    pub(super) backlog: BpfHashMap<MapData, common::WatchKey, common::Backlog>,
    pub(super) events: RingBuf<MapData>,
    /// The send hook recognises event-stream headers sent alone ([`KernelView::waits_for_body`]).
    pub(super) waits_for_body: bool,
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
pub(super) struct TracingLog;

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

pub(super) fn load(options: &EbpfOptions) -> (EbpfStatus, Option<Loaded>) {
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
