//! Loopback ports and child processes for tests that start real servers.

use std::process::Child;
use std::sync::atomic::{AtomicU32, Ordering};

/// Where [`free_port`] hands out ports: below the kernel's ephemeral range (32768-60999 unless
/// configured otherwise), and apart from the ports the Python end-to-end tests hand out (20000-29999)
/// and from the apiserver helper's etcd ports (28704 and up, see `apiserver.rs`).
const PORTS: std::ops::Range<u32> = 10_000..20_000;

/// A loopback port that nothing listens on now and that no earlier call of this process handed
/// out, for a process the test starts next (another process may still take it before that one
/// binds it).
///
/// It is not the kernel's pick (port 0): a port from the ephemeral range, once given back, can
/// become the local port of any outgoing connection, or the port of another test's server bound to
/// port 0 beside this one, before the process it was meant for binds it (a CI run of the Python
/// tests saw "Address already in use" that way). Ports are handed out in turn, from an offset of
/// this process's own, each checked free by binding it.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = PORTS.end - PORTS.start;
    let offset = std::process::id().wrapping_mul(2_654_435_761) % span;
    for _ in 0..span {
        let port = PORTS.start + (offset + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = u16::try_from(port).expect("PORTS fits in u16");
        if port_free(port) {
            return port;
        }
    }
    kernel_port()
}

/// `n` ports from [`free_port`]: distinct, since each call hands out the next one in turn.
pub fn free_ports(n: usize) -> Vec<u16> {
    (0..n).map(|_| free_port()).collect()
}

/// Whether nothing is bound to loopback `port` now.
pub(crate) fn port_free(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// A loopback port the kernel picks (port 0), from its ephemeral range.
pub fn kernel_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral loopback port")
}

/// A child process killed (and reaped) on drop, also when the test panics.
#[derive(Debug)]
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// The process id.
    pub fn id(&self) -> u32 {
        self.0.id()
    }

    /// Kills the process and reaps it, as dropping the guard does (a no-op once done).
    pub fn stop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
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
        self.stop();
    }
}

#[cfg(test)]
mod tests;
