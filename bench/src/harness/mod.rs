//! The apparatus every benchmark shares, so that each binary finds, starts, watches and stops its
//! processes the same way:
//! - from [`testkit`] (std only; the tests' fixtures too): [`free_port`] and [`free_ports`] (handed
//!   out in turn from 10000-19999, below the kernel's ephemeral range, each checked free by a bind),
//!   [`repo_root`], [`bin_dir`], and the child guard each [`Process`] holds;
//! - [`http`]: the HTTP client;
//! - [`Process`]: a named child with its log, killed on drop (with its process group when started as
//!   the leader of one), and [`on_cpus`] to pin one;
//! - [`wait_ready`]: polls a URL until it answers as expected, failing as soon as its process exits
//!   ([`wait_until`]: any probe);
//! - [`reset_prefix_cache`]: empties a simulated worker's prefix cache, retried until it is empty;
//! - [`rss_mib`]: a process's resident memory.

pub mod http;
mod process;

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::json;

pub use process::{Process, on_cpus};
pub use testkit::{bin_dir, free_port, free_ports, repo_root};

use self::http::{HttpClient, HttpError};

#[cfg(test)]
mod tests;

/// How long one readiness probe may take (a process that accepts but never answers is not ready).
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// The pause between readiness probes.
const PROBE_EVERY: Duration = Duration::from_millis(100);
/// How long a worker may keep refusing to empty its cache (requests still running).
const RESET_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a harness step failed.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// A process exited (during start-up, or while it was needed).
    #[error("{name} exited ({status}); last log lines:\n{log}")]
    Exited {
        /// The process.
        name: String,
        /// Its exit status.
        status: String,
        /// The end of its log.
        log: String,
    },
    /// A process did not become ready in time.
    #[error("{name} not ready at {what} after {timeout:?}; last log lines:\n{log}")]
    NotReady {
        /// The process.
        name: String,
        /// What was polled (a URL).
        what: String,
        /// The limit.
        timeout: Duration,
        /// The end of its log.
        log: String,
    },
    /// A worker kept its cache despite `POST /reset_prefix_cache`.
    #[error("{0} still holds cached blocks after /reset_prefix_cache for 30 s")]
    ResetRefused(String),
    /// A request failed.
    #[error(transparent)]
    Http(#[from] HttpError),
}

/// A closure for `map_err` that names what was being done.
pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> HarnessError {
    let what = what.into();
    move |source| HarnessError::Io { what, source }
}

/// Polls `GET url` until it answers 2xx with a body that is `ready`, and returns that body: a
/// [`wait_until`] whose probe is one `GET`.
pub async fn wait_ready(
    http: &HttpClient,
    process: &mut Process,
    url: &str,
    timeout: Duration,
    ready: impl Fn(&str) -> bool,
) -> Result<String, HarnessError> {
    wait_until(process, url, timeout, || async {
        let body = tokio::time::timeout(PROBE_TIMEOUT, http.get_text(url)).await;
        body.ok()?.ok().filter(|b| ready(b))
    })
    .await
}

/// Runs `probe` every 100 ms until it gives an answer, and returns it. Fails as soon as `process`
/// exits (naming it, with its log's end), or once `timeout` has passed (naming `what` it waited for).
pub async fn wait_until<T, F, Fut>(
    process: &mut Process,
    what: &str,
    timeout: Duration,
    mut probe: F,
) -> Result<T, HarnessError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(exited) = process.exited() {
            return Err(exited);
        }
        if let Some(answer) = probe().await {
            return Ok(answer);
        }
        if Instant::now() > deadline {
            return Err(HarnessError::NotReady {
                name: process.name().to_string(),
                what: what.to_string(),
                timeout,
                log: process.log_tail(),
            });
        }
        tokio::time::sleep(PROBE_EVERY).await;
    }
}

/// Resident memory of process `pid` in MiB (`VmRSS`; NaN when it cannot be read).
pub fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| rss_bytes(&s))
        .map_or(f64::NAN, |b| b as f64 / (1024.0 * 1024.0))
}

/// `VmRSS` from the text of `/proc/<pid>/status`, in bytes.
pub fn rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Empties `worker`'s prefix cache (`POST /reset_prefix_cache`), so that the next run starts cold.
///
/// vLLM refuses the reset while requests run (answering 200 all the same), so the simulator's own
/// view (`/sim/state`) is checked and the reset retried, for at most 30 s, until the cache is really
/// empty. Like vLLM, the simulator publishes `AllBlocksCleared` only with its next engine step: one
/// tiny completion of `model` (too short to fill a block, so it caches nothing) makes that step.
/// The caller then gives the event time to travel worker -> agent -> gateways.
pub async fn reset_prefix_cache(
    http: &HttpClient,
    worker: &str,
    model: &str,
) -> Result<(), HarnessError> {
    let deadline = Instant::now() + RESET_TIMEOUT;
    loop {
        http.call(
            ::http::Method::POST,
            &format!("{worker}/reset_prefix_cache"),
            Bytes::new(),
        )
        .await?;
        let state = http.get_text(&format!("{worker}/sim/state")).await?;
        let empty = serde_json::from_str::<serde_json::Value>(&state)
            .ok()
            .and_then(|v| v["block_hashes"].as_array().map(Vec::is_empty))
            // Not a simulator: trust the reset.
            .unwrap_or(true);
        if empty {
            break;
        }
        if Instant::now() > deadline {
            return Err(HarnessError::ResetRefused(worker.to_string()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let flush = json!({"model": model, "prompt": "hi", "max_tokens": 1});
    http.post_json(&format!("{worker}/v1/completions"), &flush)
        .await?;
    Ok(())
}
