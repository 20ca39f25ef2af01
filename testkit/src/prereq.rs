//! A test that lacks a prerequisite (Redis, the apiserver, eBPF, the simulator...) skips where a developer
//! runs it and fails in CI, where a skip would read as a pass.

use std::fmt::Display;

/// True under CI: `CI` set to anything but empty, `0` or `false` (GitHub, GitLab and `.ci/run` set `true`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false" | "FALSE" | "False"))
}

/// Reports that the test cannot run without `what` (`why`: how to get it). Prints `SKIPPED: ...` and returns
/// locally; under CI ([`in_ci`]) it panics naming the missing prerequisite.
#[track_caller]
pub fn skip(what: &str, why: impl Display) {
    if in_ci() {
        panic!(
            "missing prerequisite under CI=true: {what}: {why} \
             (a CI run must not skip; install or build it, or unset CI to skip locally)"
        );
    }
    eprintln!("SKIPPED: {what} missing: {why}");
}

/// `available`, after [`skip`] when it is false: `if !testkit::require(ok, "redis-server", "...") { return; }`.
#[track_caller]
pub fn require(available: bool, what: &str, why: impl Display) -> bool {
    if !available {
        skip(what, why);
    }
    available
}

#[cfg(test)]
mod tests;
