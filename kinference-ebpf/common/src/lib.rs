//! Types shared by the Kinference eBPF program and the agent's loader.
//!
//! Everything here is `#[repr(C)]` plain data: the program writes it into maps and ring buffers, the agent
//! reads it back (with the `user` feature these types implement `aya::Pod`). Field offsets of kernel structs
//! are not compiled in: the loader resolves them from the running kernel's BTF and passes them in [`Config`],
//! so one object works on every kernel.
#![no_std]

/// Name of the global (`.rodata`) holding the [`Config`] the loader patches before loading.
pub const CONFIG_GLOBAL: &str = "KINF_CONFIG";
/// Watched worker endpoints and their counters: `HashMap<WatchKey, PortStats>`.
pub const PORTS_MAP: &str = "KINF_PORTS";
/// Connections to watched ports: `LruHashMap<u64 /* struct sock address */, Conn>`.
pub const CONNS_MAP: &str = "KINF_CONNS";
/// Listener backlog observations per watched endpoint: `HashMap<WatchKey, Backlog>`.
pub const BACKLOG_MAP: &str = "KINF_BACKLOG";
/// Listening sockets bound to any address, matched to an endpoint at their first accept:
/// `LruHashMap<u64 /* struct sock address */, WatchKey>`.
pub const LISTENERS_MAP: &str = "KINF_LISTENERS";
/// Samples (time to first byte, accept wait): `RingBuf` of [`Event`].
pub const EVENTS_MAP: &str = "KINF_EVENTS";

/// Maximum number of watched ports.
pub const MAX_PORTS: u32 = 1024;
/// Maximum number of tracked connections (LRU: the oldest idle ones are evicted first).
pub const MAX_CONNS: u32 = 65536;

/// [`Config::flags`]: the offsets were resolved and the programs may run.
pub const CONFIG_VALID: u32 = 1;
/// [`Config::flags`]: the fd-table offsets and syscall numbers for the accept hook are set.
pub const CONFIG_ACCEPT: u32 = 2;
/// [`Config::flags`]: the `msghdr` / `iov_iter` offsets are set, so a send can be recognised as an
/// event-stream response's header block alone (see [`PHASE_HEADERS`]).
pub const CONFIG_BODY: u32 = 4;
/// [`Config::magic`]: keeps the global non-zero so it lands in `.rodata`, where the loader patches it.
pub const CONFIG_MAGIC: u32 = 0x6b69_6e66;

/// Kernel struct field offsets (bytes) and syscall numbers, resolved by the loader from BTF.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// Always [`CONFIG_MAGIC`].
    pub magic: u32,
    /// [`CONFIG_VALID`] | [`CONFIG_ACCEPT`].
    pub flags: u32,
    /// `struct sock` -> `__sk_common.skc_family` (u16).
    pub sock_family: u32,
    /// `struct sock` -> `__sk_common.skc_num` (u16, local port, host order).
    pub sock_num: u32,
    /// `struct sock` -> `__sk_common.skc_state` (u8).
    pub sock_state: u32,
    /// `struct sock` -> `sk_ack_backlog` (u32).
    pub sock_ack_backlog: u32,
    /// `struct sock` -> `sk_max_ack_backlog` (u32).
    pub sock_max_ack_backlog: u32,
    /// `struct task_struct` -> `files` (pointer).
    pub task_files: u32,
    /// `struct files_struct` -> `fdt` (pointer).
    pub files_fdt: u32,
    /// `struct fdtable` -> `max_fds` (u32).
    pub fdtable_max_fds: u32,
    /// `struct fdtable` -> `fd` (pointer to an array of `struct file *`).
    pub fdtable_fd: u32,
    /// `struct file` -> `private_data` (a `struct socket *` for sockets).
    pub file_private_data: u32,
    /// `struct socket` -> `sk`.
    pub socket_sk: u32,
    /// `struct pt_regs` -> the syscall number (x86_64 `orig_ax`, arm64 `syscallno`).
    pub regs_syscall_nr: u32,
    /// `struct pt_regs` -> the first syscall argument as saved at entry (x86_64 `di`, arm64 `orig_x0`).
    pub regs_arg0: u32,
    /// Syscall number of `accept`.
    pub nr_accept: u32,
    /// Syscall number of `accept4`.
    pub nr_accept4: u32,
    /// `struct sock` -> `__sk_common.skc_rcv_saddr` (IPv4 local address, network order).
    pub sock_rcv_saddr: u32,
    /// `struct msghdr` -> `msg_iter` (a `struct iov_iter`).
    pub msghdr_iter: u32,
    /// `struct iov_iter` -> `iter_type` (u8).
    pub iter_type: u32,
    /// `struct iov_iter` -> `iov_offset` (size_t).
    pub iter_iov_offset: u32,
    /// `struct iov_iter` -> `ubuf` / `__iov` (one union: the user buffer, or the first `struct iovec`).
    pub iter_ptr: u32,
    /// `struct iov_iter` -> `count` (size_t: bytes left).
    pub iter_count: u32,
    /// `struct iov_iter` -> `nr_segs` (unsigned long).
    pub iter_nr_segs: u32,
    /// `enum iter_type` value `ITER_UBUF` (255 where the kernel has none).
    pub iter_ubuf: u32,
    /// `enum iter_type` value `ITER_IOVEC`.
    pub iter_iovec: u32,
}

impl Config {
    /// The value compiled into the object: magic set, nothing resolved, programs inactive.
    pub const UNRESOLVED: Config = Config {
        magic: CONFIG_MAGIC,
        flags: 0,
        sock_family: 0,
        sock_num: 0,
        sock_state: 0,
        sock_ack_backlog: 0,
        sock_max_ack_backlog: 0,
        task_files: 0,
        files_fdt: 0,
        fdtable_max_fds: 0,
        fdtable_fd: 0,
        file_private_data: 0,
        socket_sk: 0,
        regs_syscall_nr: 0,
        regs_arg0: 0,
        nr_accept: 0,
        nr_accept4: 0,
        sock_rcv_saddr: 0,
        msghdr_iter: 0,
        iter_type: 0,
        iter_iov_offset: 0,
        iter_ptr: 0,
        iter_count: 0,
        iter_nr_segs: 0,
        iter_ubuf: 255,
        iter_iovec: 255,
    };
}

/// A watched worker endpoint: local IPv4 address and port. Address 0 matches any address (a worker reached
/// on loopback, or bound to 0.0.0.0 on the host network); a pod IP keeps two pods on the same port apart.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WatchKey {
    /// IPv4 address as the kernel stores it (network byte order, read as a native u32); 0 for any.
    pub addr: u32,
    /// Local port, host order.
    pub port: u16,
    pub _pad: u16,
}

/// Counters per watched port (value of [`PORTS_MAP`]; the agent inserts a zeroed one to watch a port).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortStats {
    /// Requests started: first byte in on an idle connection.
    pub requests: u64,
    /// First response bytes sent (each gives a time-to-first-byte sample).
    pub responses: u64,
    /// Connections accepted by the application (each gives an accept-wait sample).
    pub accepts: u64,
    /// Sum of time to first byte, nanoseconds.
    pub ttfb_sum_ns: u64,
    /// Sum of accept wait, nanoseconds.
    pub accept_wait_sum_ns: u64,
    /// Ring buffer samples dropped because it was full.
    pub dropped_events: u64,
}

/// Listener accept-queue observations per port (value of [`BACKLOG_MAP`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backlog {
    /// `sk_ack_backlog` at the latest observation (enqueue or accept).
    pub current: u32,
    /// `sk_max_ack_backlog` (the listen() backlog, capped by somaxconn).
    pub max: u32,
    /// Highest `current` since the agent last reset it to zero.
    pub peak: u32,
    /// Kernel time of the latest observation, `bpf_ktime_get_ns` (CLOCK_MONOTONIC), truncated to ms.
    pub updated_ms: u32,
}

/// [`Conn::phase`]: no request outstanding (new connection, or the last response finished).
pub const PHASE_IDLE: u8 = 0;
/// [`Conn::phase`]: request bytes arrived, no response byte sent yet (queued or prefilling).
pub const PHASE_WAITING: u8 = 1;
/// [`Conn::phase`]: the response started; the request ends at the next request or at close.
pub const PHASE_RESPONDING: u8 = 2;
/// [`Conn::phase`]: an event-stream (SSE) response's header block went out, no body byte yet. vLLM sends a
/// streaming response's headers before the prefill and its first chunk with the first token, so the request
/// still counts as waiting and its time to first byte is taken at the first body byte.
pub const PHASE_HEADERS: u8 = 3;

/// Most bytes of a header block the program reads to recognise an event-stream response.
pub const HEADER_SCAN_BYTES: usize = 512;

/// One connection to a watched port (value of [`CONNS_MAP`], keyed by the `struct sock` address).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Conn {
    /// When the handshake completed (the connection entered the accept queue); 0 when first seen later.
    pub established_ns: u64,
    /// First byte in of the current request; 0 when idle.
    pub request_start_ns: u64,
    /// The application's first read of the current request; 0 before it.
    pub first_read_ns: u64,
    /// Latest response send.
    pub last_send_ns: u64,
    /// Local (worker) port.
    pub port: u16,
    /// [`PHASE_IDLE`], [`PHASE_WAITING`], [`PHASE_HEADERS`] or [`PHASE_RESPONDING`].
    pub phase: u8,
    /// 1 once the application accepted it.
    pub accepted: u8,
    /// The [`WatchKey::addr`] it matched (0: the any-address entry).
    pub addr: u32,
}

/// [`Event::kind`]: `value_ns` is a request's time from first byte in to first response byte out (for an
/// event-stream response where [`CONFIG_BODY`] is set: to its first body byte).
pub const EVENT_TTFB: u32 = 1;
/// [`Event::kind`]: `value_ns` is a connection's wait in the accept queue.
pub const EVENT_ACCEPT_WAIT: u32 = 2;

/// A sample sent through [`EVENTS_MAP`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Event {
    /// Kernel time of the sample (`bpf_ktime_get_ns`).
    pub ts_ns: u64,
    /// The measured duration.
    pub value_ns: u64,
    /// For TTFB: the application's first read relative to the first byte in (0 when unknown).
    pub read_delay_ns: u64,
    /// [`EVENT_TTFB`] or [`EVENT_ACCEPT_WAIT`].
    pub kind: u32,
    /// The [`WatchKey::addr`] it matched.
    pub addr: u32,
    /// Local (worker) port.
    pub port: u16,
    pub _pad: u16,
    pub _pad2: u32,
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: all of these are #[repr(C)] structs of integers with explicit padding fields, valid for every
    // bit pattern, which is what aya::Pod requires.
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::WatchKey {}
    unsafe impl aya::Pod for super::PortStats {}
    unsafe impl aya::Pod for super::Backlog {}
    unsafe impl aya::Pod for super::Conn {}
    unsafe impl aya::Pod for super::Event {}
}
