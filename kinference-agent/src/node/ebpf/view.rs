//! What the monitor reports per worker ([`KernelView`]) and how a worker's base URL names the endpoint
//! the kernel program matches.

use std::time::Duration;

use kinference_ebpf_common as common;

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
