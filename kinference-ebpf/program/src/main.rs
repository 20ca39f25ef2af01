//! Kinference's eBPF programs: connection-level queueing of the local vLLM workers, per watched endpoint
//! (local address and port).
//!
//! All programs are BTF tracepoints (`tp_btf`), which load on kernels without kprobes or tracefs:
//! - `inet_sock_set_state`: a server-side connection completes its handshake (enters the accept queue) or closes.
//! - `sk_data_ready`: request bytes arrive (first byte in) on a connection; on a listener: a new connection was
//!   queued (accept backlog).
//! - `sock_recv_length`: the application reads (first read; also the request start where `sk_data_ready` is
//!   missing, kernels before 6.6).
//! - `tcp_sendmsg_locked` (fallback `sock_send_length`): the first response byte out (time to first byte). With
//!   `tcp_sendmsg_locked` the program also reads the send: an event-stream response's header block sent on its
//!   own (vLLM sends a streaming response's headers before the prefill) leaves the request waiting, and its
//!   time to first byte is taken at the first body byte (the first token).
//! - `sys_exit` for accept/accept4: accept wait, and the listener's backlog after the dequeue.
//!
//! Kernel struct fields are read with `bpf_probe_read_kernel` at offsets the loader resolved from the running
//! kernel's BTF (`KINF_CONFIG`), never at offsets compiled in here.
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![allow(internal_features)]

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{
    Global,
    helpers::{bpf_get_current_task, bpf_ktime_get_ns, bpf_probe_read_kernel, generated},
    macros::{btf_tracepoint, map},
    maps::{HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::BtfTracePointContext,
};
use aya_log_ebpf::warn;
use kinference_ebpf_common::{
    Backlog, CONFIG_ACCEPT, CONFIG_BODY, CONFIG_VALID, Config, Conn, EVENT_ACCEPT_WAIT, EVENT_TTFB,
    Event, HEADER_SCAN_BYTES, MAX_CONNS, MAX_PORTS, PHASE_HEADERS, PHASE_RESPONDING, PHASE_WAITING,
    PortStats, WatchKey,
};

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
const TCP_ESTABLISHED: i32 = 1;
const TCP_SYN_RECV: i32 = 3;
const TCP_CLOSE: i32 = 7;
const TCP_CLOSE_WAIT: u8 = 8;
const TCP_LISTEN: u8 = 10;

/// Offsets and syscall numbers, patched by the loader before load.
#[unsafe(no_mangle)]
static KINF_CONFIG: Global<Config> = Global::new(Config::UNRESOLVED);

#[map(name = "KINF_PORTS")]
static PORTS: HashMap<WatchKey, PortStats> = HashMap::with_max_entries(MAX_PORTS, 0);

#[map(name = "KINF_CONNS")]
static CONNS: LruHashMap<u64, Conn> = LruHashMap::with_max_entries(MAX_CONNS, 0);

#[map(name = "KINF_BACKLOG")]
static BACKLOG: HashMap<WatchKey, Backlog> = HashMap::with_max_entries(MAX_PORTS, 0);

#[map(name = "KINF_LISTENERS")]
static LISTENERS: LruHashMap<u64, WatchKey> = LruHashMap::with_max_entries(MAX_PORTS, 0);

#[map(name = "KINF_EVENTS")]
static EVENTS: RingBuf = RingBuf::with_byte_size(1 << 18, 0);

/// Room for one send's first bytes (a header block), per CPU: too large for the 512-byte stack. The margin
/// past [`HEADER_SCAN_BYTES`] keeps every masked index in bounds for the verifier.
#[map(name = "KINF_SCRATCH")]
static SCRATCH: PerCpuArray<[u8; HEADER_SCAN_BYTES + 16]> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
fn config() -> Option<Config> {
    let cfg = KINF_CONFIG.load();
    if cfg.flags & CONFIG_VALID == 0 {
        return None;
    }
    Some(cfg)
}

#[inline(always)]
fn read<T>(base: u64, offset: u32) -> Option<T> {
    // SAFETY: bpf_probe_read_kernel copies from any kernel address and fails cleanly on a bad one.
    unsafe { bpf_probe_read_kernel((base + offset as u64) as *const T).ok() }
}

#[inline(always)]
fn now() -> u64 {
    // SAFETY: a helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
fn add(counter: &mut u64, value: u64) {
    // SAFETY: `counter` points into a map value, which outlives this program run; other CPUs update it too,
    // hence the atomic add (`AtomicU64::fetch_add` does not compile for the BPF target).
    unsafe {
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(counter, value);
    }
}

/// The watched endpoint a socket of the IPv4/IPv6 families belongs to: its exact local address and port,
/// else the any-address entry for the port.
#[inline(always)]
fn watched(cfg: &Config, sk: u64) -> Option<(WatchKey, *mut PortStats)> {
    let family: u16 = read(sk, cfg.sock_family)?;
    if family != AF_INET && family != AF_INET6 {
        return None;
    }
    let port: u16 = read(sk, cfg.sock_num)?;
    let addr: u32 = read(sk, cfg.sock_rcv_saddr)?;
    let exact = WatchKey {
        addr,
        port,
        _pad: 0,
    };
    if addr != 0
        && let Some(stats) = PORTS.get_ptr_mut(exact)
    {
        return Some((exact, stats));
    }
    let any = WatchKey {
        addr: 0,
        port,
        _pad: 0,
    };
    let stats = PORTS.get_ptr_mut(any)?;
    Some((any, stats))
}

fn emit(
    kind: u32,
    key: WatchKey,
    value_ns: u64,
    read_delay_ns: u64,
    ts_ns: u64,
    stats: *mut PortStats,
) {
    let event = Event {
        ts_ns,
        value_ns,
        read_delay_ns,
        kind,
        addr: key.addr,
        port: key.port,
        _pad: 0,
        _pad2: 0,
    };
    if EVENTS.output::<Event>(&event, 0).is_err() {
        // SAFETY: `stats` came from get_ptr_mut on a live map entry.
        unsafe { add(&mut (*stats).dropped_events, 1) };
    }
}

/// Records the listener's accept queue length and limit for `key`.
#[inline(always)]
fn observe_backlog(cfg: &Config, listener: u64, key: WatchKey) {
    let Some(current) = read::<u32>(listener, cfg.sock_ack_backlog) else {
        return;
    };
    let Some(max) = read::<u32>(listener, cfg.sock_max_ack_backlog) else {
        return;
    };
    let updated_ms = (now() / 1_000_000) as u32;
    match BACKLOG.get_ptr_mut(key) {
        Some(b) => {
            // SAFETY: a live map entry; a racing update only loses one observation.
            unsafe {
                (*b).current = current;
                (*b).max = max;
                if current > (*b).peak {
                    (*b).peak = current;
                }
                (*b).updated_ms = updated_ms;
            }
        }
        None => {
            let _ = BACKLOG.insert(
                key,
                Backlog {
                    current,
                    max,
                    peak: current,
                    updated_ms,
                },
                0,
            );
        }
    }
}

/// The connection entry for `sk`, created on first sight (connections that predate the agent, or whose
/// handshake was missed) so that long-lived keep-alive pools are counted too.
#[inline(always)]
fn conn_for(sk: u64, key: WatchKey) -> Option<*mut Conn> {
    if let Some(c) = CONNS.get_ptr_mut(sk) {
        return Some(c);
    }
    let fresh = Conn {
        port: key.port,
        addr: key.addr,
        accepted: 1,
        ..Conn::default()
    };
    CONNS.insert(sk, fresh, 0).ok()?;
    CONNS.get_ptr_mut(sk)
}

/// Starts a request on `conn` at `ts` (first byte in), ending whatever response was in progress.
#[inline(always)]
fn start_request(conn: *mut Conn, stats: *mut PortStats, ts: u64) {
    // SAFETY: live map entries.
    unsafe {
        (*conn).phase = PHASE_WAITING;
        (*conn).request_start_ns = ts;
        (*conn).first_read_ns = 0;
        add(&mut (*stats).requests, 1);
    }
}

#[btf_tracepoint(function = "inet_sock_set_state")]
pub fn kinf_sock_state(ctx: BtfTracePointContext) -> i32 {
    let Some(cfg) = config() else { return 0 };
    let sk: u64 = ctx.arg(0);
    let old: i32 = ctx.arg(1);
    let new: i32 = ctx.arg(2);
    if new == TCP_CLOSE {
        // The local port is already cleared here: match by socket address.
        let _ = CONNS.remove(sk);
        let _ = LISTENERS.remove(sk);
    } else if new == TCP_ESTABLISHED && old == TCP_SYN_RECV {
        let Some((key, _)) = watched(&cfg, sk) else {
            return 0;
        };
        let conn = Conn {
            established_ns: now(),
            port: key.port,
            addr: key.addr,
            ..Conn::default()
        };
        if CONNS.insert(sk, conn, 0).is_err() {
            warn!(
                &ctx,
                "kinference: connection table insert failed on port {}", key.port
            );
        }
    }
    0
}

#[btf_tracepoint(function = "sk_data_ready")]
pub fn kinf_data_ready(ctx: BtfTracePointContext) -> i32 {
    let Some(cfg) = config() else { return 0 };
    let sk: u64 = ctx.arg(0);
    let Some(state) = read::<u8>(sk, cfg.sock_state) else {
        return 0;
    };
    if state == TCP_LISTEN {
        // A connection finished its handshake and was queued on this listener. A listener on any address
        // (a pod's 0.0.0.0) is matched to its endpoint at its first accept.
        if let Some(key) = LISTENERS.get_ptr(sk) {
            // SAFETY: live map entry.
            observe_backlog(&cfg, sk, unsafe { *key });
        } else if let Some((key, _)) = watched(&cfg, sk) {
            observe_backlog(&cfg, sk, key);
        }
        return 0;
    }
    // The peer's FIN also signals data-ready (state already CLOSE_WAIT): only data on ESTABLISHED counts.
    if state != TCP_ESTABLISHED as u8 {
        return 0;
    }
    let Some((key, stats)) = watched(&cfg, sk) else {
        return 0;
    };
    let Some(conn) = conn_for(sk, key) else {
        return 0;
    };
    // SAFETY: live map entry.
    if unsafe { (*conn).phase } != PHASE_WAITING {
        start_request(conn, stats, now());
    }
    0
}

#[btf_tracepoint(function = "sock_recv_length")]
pub fn kinf_recv(ctx: BtfTracePointContext) -> i32 {
    let Some(cfg) = config() else { return 0 };
    let sk: u64 = ctx.arg(0);
    let ret: i32 = ctx.arg(1);
    if ret <= 0 || sk == 0 {
        return 0;
    }
    let Some(state) = read::<u8>(sk, cfg.sock_state) else {
        return 0;
    };
    if state != TCP_ESTABLISHED as u8 && state != TCP_CLOSE_WAIT {
        return 0;
    }
    let Some((key, stats)) = watched(&cfg, sk) else {
        return 0;
    };
    let Some(conn) = conn_for(sk, key) else {
        return 0;
    };
    let ts = now();
    // SAFETY: live map entry.
    unsafe {
        if (*conn).phase != PHASE_WAITING {
            // No data-ready event started this request (tracepoint missing on this kernel): the first read is
            // the earliest sign of it.
            start_request(conn, stats, ts);
        }
        if (*conn).first_read_ns == 0 {
            (*conn).first_read_ns = ts;
        }
    }
    0
}

/// Whether the send described by `msg` (a `struct msghdr`) is an event-stream response's header block and
/// nothing else: at most [`HEADER_SCAN_BYTES`] in one buffer, ending with the blank line that ends the
/// headers, and naming `event-stream` (the content type of a streaming completion). Any doubt (another
/// buffer layout, an unreadable buffer) answers false, which keeps the plain first-byte rule.
#[inline(always)]
fn event_stream_headers_only(cfg: &Config, msg: u64) -> bool {
    if cfg.flags & CONFIG_BODY == 0 || msg == 0 {
        return false;
    }
    let iter = msg + cfg.msghdr_iter as u64;
    let (Some(kind), Some(count), Some(offset), Some(ptr)) = (
        read::<u8>(iter, cfg.iter_type),
        read::<u64>(iter, cfg.iter_count),
        read::<u64>(iter, cfg.iter_iov_offset),
        read::<u64>(iter, cfg.iter_ptr),
    ) else {
        return false;
    };
    if !(16..HEADER_SCAN_BYTES as u64).contains(&count) {
        return false;
    }
    let start = if kind as u32 == cfg.iter_ubuf {
        ptr + offset
    } else if kind as u32 == cfg.iter_iovec {
        // One segment holding the whole send (a writev of headers and body has several).
        let (Some(segs), Some(base), Some(len)) = (
            read::<u64>(iter, cfg.iter_nr_segs),
            read::<u64>(ptr, 0),
            read::<u64>(ptr, 8),
        ) else {
            return false;
        };
        if segs != 1 || len.saturating_sub(offset) != count {
            return false;
        }
        base + offset
    } else {
        return false;
    };
    let Some(buf) = SCRATCH.get_ptr_mut(0) else {
        return false;
    };
    let n = (count as u32) & (HEADER_SCAN_BYTES as u32 - 1);
    // SAFETY: `buf` is this CPU's scratch value, at least HEADER_SCAN_BYTES long, and n < HEADER_SCAN_BYTES;
    // the helper copies from user memory and fails cleanly on a bad address.
    let copied =
        unsafe { generated::bpf_probe_read_user((*buf).as_mut_ptr().cast(), n, start as *const _) };
    if copied != 0 {
        return false;
    }
    // SAFETY: every index below is masked into the buffer.
    let b = unsafe { &*buf };
    let at = |i: u32| b[(i & (HEADER_SCAN_BYTES as u32 - 1)) as usize];
    if at(n - 4) != b'\r' || at(n - 3) != b'\n' || at(n - 2) != b'\r' || at(n - 1) != b'\n' {
        return false;
    }
    const NEEDLE: &[u8; 12] = b"event-stream";
    let mut i: u32 = 0;
    while i + 12 <= n && i < HEADER_SCAN_BYTES as u32 {
        if at(i) == b'e' {
            let mut j: u32 = 1;
            while j < 12 && at(i + j) == NEEDLE[j as usize] {
                j += 1;
            }
            if j == 12 {
                return true;
            }
        }
        i += 1;
    }
    false
}

/// A response send on `sk`; `msg` is the send's `struct msghdr` where the hook has it (else 0).
#[inline(always)]
fn on_send(cfg: &Config, sk: u64, msg: u64) {
    let Some((key, stats)) = watched(cfg, sk) else {
        return;
    };
    let Some(conn) = CONNS.get_ptr_mut(sk) else {
        return;
    };
    let ts = now();
    // SAFETY: live map entries.
    unsafe {
        if (*conn).phase == PHASE_WAITING && event_stream_headers_only(cfg, msg) {
            (*conn).phase = PHASE_HEADERS;
            (*conn).last_send_ns = ts;
            return;
        }
        if (*conn).phase == PHASE_WAITING || (*conn).phase == PHASE_HEADERS {
            let start = (*conn).request_start_ns;
            let ttfb = ts.saturating_sub(start);
            let read_delay = if (*conn).first_read_ns >= start {
                (*conn).first_read_ns - start
            } else {
                0
            };
            (*conn).phase = PHASE_RESPONDING;
            add(&mut (*stats).responses, 1);
            add(&mut (*stats).ttfb_sum_ns, ttfb);
            emit(EVENT_TTFB, key, ttfb, read_delay, ts, stats);
        }
        (*conn).last_send_ns = ts;
    }
}

#[btf_tracepoint(function = "tcp_sendmsg_locked")]
pub fn kinf_tcp_sendmsg(ctx: BtfTracePointContext) -> i32 {
    let Some(cfg) = config() else { return 0 };
    let sk: u64 = ctx.arg(0);
    let msg: u64 = ctx.arg(1);
    on_send(&cfg, sk, msg);
    0
}

#[btf_tracepoint(function = "sock_send_length")]
pub fn kinf_send(ctx: BtfTracePointContext) -> i32 {
    let Some(cfg) = config() else { return 0 };
    let sk: u64 = ctx.arg(0);
    let ret: i32 = ctx.arg(1);
    if ret <= 0 || sk == 0 {
        return 0;
    }
    on_send(&cfg, sk, 0);
    0
}

/// The `struct sock` behind file descriptor `fd` of the current task, through task->files->fdt->fd[fd]->
/// private_data (a `struct socket`)->sk.
#[inline(always)]
fn fd_to_sock(cfg: &Config, fd: u64) -> Option<u64> {
    // SAFETY: a helper without arguments; the result is only used as a base for probe reads.
    let task = unsafe { bpf_get_current_task() };
    let files: u64 = read(task, cfg.task_files)?;
    let fdt: u64 = read(files, cfg.files_fdt)?;
    let max_fds: u32 = read(fdt, cfg.fdtable_max_fds)?;
    if fd >= max_fds as u64 {
        return None;
    }
    let fds: u64 = read(fdt, cfg.fdtable_fd)?;
    let file: u64 = read(fds + fd * 8, 0)?;
    if file == 0 {
        return None;
    }
    let socket: u64 = read(file, cfg.file_private_data)?;
    if socket == 0 {
        return None;
    }
    let sk: u64 = read(socket, cfg.socket_sk)?;
    if sk == 0 { None } else { Some(sk) }
}

#[btf_tracepoint(function = "sys_exit")]
pub fn kinf_sys_exit(ctx: BtfTracePointContext) -> i32 {
    let Some(cfg) = config() else { return 0 };
    if cfg.flags & CONFIG_ACCEPT == 0 {
        return 0;
    }
    let regs: u64 = ctx.arg(0);
    let ret: i64 = ctx.arg(1);
    if ret < 0 {
        return 0;
    }
    let Some(nr) = read::<u64>(regs, cfg.regs_syscall_nr) else {
        return 0;
    };
    if nr != cfg.nr_accept as u64 && nr != cfg.nr_accept4 as u64 {
        return 0;
    }
    let Some(sk) = fd_to_sock(&cfg, ret as u64) else {
        return 0;
    };
    let Some(conn) = CONNS.get_ptr_mut(sk) else {
        return 0;
    };
    // SAFETY: live map entry.
    let (key, established, accepted) = unsafe {
        let c = &*conn;
        (
            WatchKey {
                addr: c.addr,
                port: c.port,
                _pad: 0,
            },
            c.established_ns,
            c.accepted,
        )
    };
    let Some(stats) = PORTS.get_ptr_mut(key) else {
        return 0;
    };
    if accepted == 0 {
        let ts = now();
        // SAFETY: live map entries.
        unsafe {
            (*conn).accepted = 1;
            if established != 0 {
                let wait = ts.saturating_sub(established);
                add(&mut (*stats).accepts, 1);
                add(&mut (*stats).accept_wait_sum_ns, wait);
                emit(EVENT_ACCEPT_WAIT, key, wait, 0, ts, stats);
            }
        }
    }
    // The listening socket is accept's first argument: its queue just shrank by one. Remember which endpoint
    // it serves, for its enqueue events.
    if let Some(listen_fd) = read::<u64>(regs, cfg.regs_arg0)
        && let Some(listener) = fd_to_sock(&cfg, listen_fd)
    {
        if LISTENERS.get_ptr(listener).is_none() {
            let _ = LISTENERS.insert(listener, key, 0);
        }
        observe_backlog(&cfg, listener, key);
    }
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
