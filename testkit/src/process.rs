//! Loopback ports and child processes for tests that start real servers.

use std::process::Child;
use std::sync::atomic::{AtomicU32, Ordering};

/// A loopback port that was free a moment ago, for a process the test starts next (another process
/// may still take it before that one binds it).
///
/// It is taken below the kernel's ephemeral range, from which `bind` to port 0 and outgoing
/// connections draw their ports. A port found there and given up is free for the kernel to hand to
/// the next socket of this very process: the server of another test running beside this one, or a
/// client connection. The process the port was meant for then cannot bind it, and this test's
/// requests reach the other socket (a full run once read "connection reset" while waiting for a
/// gateway to start). Below that range, ports are handed out in turn from an offset of this
/// process's own, each checked free by binding it; where the range leaves no room below it, the
/// kernel picks as before.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 10_000;
    let high = ephemeral_low().unwrap_or(0);
    if high > LOW + 1_000 {
        let span = high - LOW;
        let offset = std::process::id().wrapping_mul(2_654_435_761) % span;
        for _ in 0..span {
            let port = LOW + (offset + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
            let Ok(port) = u16::try_from(port) else {
                break;
            };
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral loopback port")
}

/// The first port of the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`).
fn ephemeral_low() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A child process killed (and reaped) on drop, also when the test panics.
#[derive(Debug)]
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// The process id.
    pub fn id(&self) -> u32 {
        self.0.id()
    }
}

impl From<Child> for ChildGuard {
    fn from(child: Child) -> Self {
        ChildGuard(child)
    }
}

impl std::ops::Deref for ChildGuard {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
