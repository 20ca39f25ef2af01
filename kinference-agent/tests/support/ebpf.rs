//! Telling an eBPF program that cannot run on this machine from one that is broken.
//!
//! The first is a missing prerequisite ([`testkit::skip`]: a skip locally, a failure under CI); the second,
//! a verifier rejection above all, fails the test everywhere.

/// True when a program's outcome (`state` as in the `kinference_agent_ebpf_program_state` metric, and the
/// reason the agent gave) points at the machine: eBPF switched off, the object not built, a kernel without
/// the hook or BTF, no capability to load (EPERM), or an attach type the kernel does not support. A verifier
/// rejection (EACCES with the verifier's log) and any other load or attach error point at the program.
pub fn environmental(state: &str, reason: &str) -> bool {
    if verifier_rejected(reason) {
        return false;
    }
    let no_capability = reason.contains("Operation not permitted") || reason.contains("EPERM");
    match state {
        "attached" | "standby" | "disabled" | "not_built" | "unsupported" => true,
        "load_failed" => no_capability,
        "attach_failed" => {
            no_capability || reason.contains("not supported") || reason.contains("EOPNOTSUPP")
        }
        _ => false,
    }
}

/// Ends a test whose eBPF programs did not all attach: panics when any outcome points at the program, else
/// skips (failing under CI) with the reasons. `outcomes`: `(program, state, reason)`.
#[track_caller]
pub fn not_running(outcomes: &[(String, String, String)]) {
    let describe = |o: &(String, String, String)| format!("{}: {} {}", o.0, o.1, o.2);
    let broken: Vec<String> = outcomes
        .iter()
        .filter(|(_, state, reason)| !environmental(state, reason))
        .map(describe)
        .collect();
    assert!(
        broken.is_empty(),
        "eBPF programs failed to load or attach (a verifier rejection or another program error is never \
         a skip):\n{}",
        broken.join("\n")
    );
    let all: Vec<String> = outcomes.iter().map(describe).collect();
    testkit::skip(
        "eBPF",
        format_args!(
            "the programs cannot run here (needs root, kernel BTF and `cargo xtask build-ebpf` before the \
             build):\n{}",
            all.join("\n")
        ),
    );
}

/// The verifier said no: EACCES from `BPF_PROG_LOAD`, or a non-empty verifier log in aya's error (aya
/// prints "Verifier output:" after every load error, empty when the kernel refused before verifying).
fn verifier_rejected(reason: &str) -> bool {
    let log = reason
        .split_once("Verifier output:")
        .map(|(_, log)| log.trim());
    log.is_some_and(|log| !log.is_empty())
        || reason.contains("Permission denied")
        || reason.contains("EACCES")
}
