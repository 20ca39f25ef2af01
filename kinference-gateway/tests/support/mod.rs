//! What several integration tests of the gateway share: the real binary started on two free loopback
//! ports.

use std::path::Path;
use std::process::{Command, Stdio};

use testkit::{ChildGuard, free_port};

/// Starts `kinference-gateway --config config` on free ports: (the process, API port, admin port).
// Each test crate compiles this module; those that pass flags call only `spawn_gateway_with`.
#[allow(dead_code)]
pub fn spawn_gateway(config: &Path) -> (ChildGuard, u16, u16) {
    spawn_gateway_with(config, &[])
}

/// [`spawn_gateway`] with more flags.
pub fn spawn_gateway_with(config: &Path, flags: &[&str]) -> (ChildGuard, u16, u16) {
    let (api, admin) = (free_port(), free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_kinference-gateway"))
        .args(["--listen", &format!("127.0.0.1:{api}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .args(flags)
        .arg("--config")
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting kinference-gateway");
    (ChildGuard(child), api, admin)
}
