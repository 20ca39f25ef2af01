//! Child processes and loopback ports for the benchmark binaries that start a gateway and simulators.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Child;

/// A child process, with the name errors give it, killed when dropped (also on panic or early return).
pub struct Guard(pub Child, pub &'static str);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The program and arguments that run `program` with `args` on `cpus` (a `taskset -c` list), or
/// as they are without one. `taskset` execs the program, so the process id stays the program's.
pub fn on_cpus(program: &Path, args: Vec<String>, cpus: Option<&str>) -> (PathBuf, Vec<String>) {
    match cpus {
        Some(cpus) => {
            let mut pinned = vec![
                "-c".to_string(),
                cpus.to_string(),
                program.display().to_string(),
            ];
            pinned.extend(args);
            (PathBuf::from("taskset"), pinned)
        }
        None => (program.to_path_buf(), args),
    }
}

/// A free loopback port (released at once; [`crate::routing::cluster::free_ports`] holds several
/// until all are known).
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
