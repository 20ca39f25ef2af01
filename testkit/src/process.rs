//! Loopback ports and child processes for tests that start real servers.

use std::process::Child;

/// A loopback port that was free a moment ago (the OS picks it; another process may take it before use).
pub fn free_port() -> u16 {
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
