//! Peer routers in the routing benchmark: the routers a Kinference user would otherwise install
//! (`vllm-router`, SGLang's `smg` and `sglang-router`, the LiteLLM proxy), each installed from PyPI into
//! its own venv at a pinned version, started as a real process in front of the same simulated workers,
//! and driven by the same load client as the Kinference gateways.
//!
//! - [`PeerRouter`]: the four packages (pinned versions from `docs/peer-routers.md`).
//! - [`plan`]: the exact command line, environment and config files of one router + policy; pure, so
//!   the unit tests check it without a network.
//! - [`install`]: `python3 -m venv` + `pip install NAME==VERSION` into the cache dir, reused when present.
//! - [`start`]: spawns the router (its own process group) and waits until a real request goes through.
//! - [`process_cpu_seconds`]: user + system CPU of a process group from `/proc`, for CPU per request.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::client::Route;
use super::cluster::{ClusterError, WorkerEndpoints};
use super::policy::Policy;
use crate::harness::http::HttpClient;
use crate::harness::{Process, wait_until};

#[cfg(test)]
mod tests;

/// The API key LiteLLM is started with (its proxy refuses to start without a master key).
pub const LITELLM_MASTER_KEY: &str = "sk-kinference-bench";

/// One installable router package.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PeerRouter {
    /// vLLM's Rust router (a fork of SGLang's).
    VllmRouter,
    /// SGLang's model gateway.
    Smg,
    /// SGLang's older router.
    SglangRouter,
    /// The LiteLLM proxy (Python).
    Litellm,
}

impl PeerRouter {
    /// Every package, in report order.
    pub const ALL: [PeerRouter; 4] = [
        Self::VllmRouter,
        Self::Smg,
        Self::SglangRouter,
        Self::Litellm,
    ];

    /// The package name (and the venv's name prefix).
    pub fn name(self) -> &'static str {
        match self {
            Self::VllmRouter => "vllm-router",
            Self::Smg => "smg",
            Self::SglangRouter => "sglang-router",
            Self::Litellm => "litellm",
        }
    }

    /// The pinned version.
    pub fn version(self) -> &'static str {
        match self {
            Self::VllmRouter => "0.1.17",
            Self::Smg => "1.13.0",
            Self::SglangRouter => "0.3.2",
            Self::Litellm => "1.108.7",
        }
    }

    /// What `pip install` is given.
    pub fn requirement(self) -> String {
        match self {
            Self::Litellm => format!("litellm[proxy]=={}", self.version()),
            other => format!("{}=={}", other.name(), other.version()),
        }
    }

    /// The venv directory under the cache directory: `NAME-VERSION`.
    pub fn venv_name(self) -> String {
        format!("{}-{}", self.name(), self.version())
    }

    /// The router package and its own policy name behind a peer [`Policy`].
    pub fn of(policy: Policy) -> Option<(PeerRouter, &'static str)> {
        Some(match policy {
            Policy::VllmRouterKvAware => (Self::VllmRouter, "kv_aware"),
            Policy::VllmRouterCacheAware => (Self::VllmRouter, "cache_aware"),
            Policy::SmgCacheAware => (Self::Smg, "cache_aware"),
            Policy::SmgPrefixHash => (Self::Smg, "prefix_hash"),
            Policy::SglangRouterCacheAware => (Self::SglangRouter, "cache_aware"),
            Policy::LitellmLeastBusy => (Self::Litellm, "least-busy"),
            _ => return None,
        })
    }
}

/// Errors installing or starting a peer; each becomes the "could not run" note of its rows.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// `python3 -m venv` or `pip install` failed.
    #[error("installing {requirement} failed ({status}); see {log}")]
    Install {
        /// What was installed.
        requirement: String,
        /// Exit status or spawn error.
        status: String,
        /// The install log.
        log: String,
    },
    /// A file could not be written, a process not started, or the router never answered a
    /// request.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

/// `--peers`: `all`, or a comma list of peer policy names (`smg-prefix-hash`) or package names (`smg`:
/// every policy of that package).
pub fn parse_peers(spec: &str) -> Result<Vec<Policy>, String> {
    let mut out: Vec<Policy> = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let matched: Vec<Policy> = if item == "all" {
            Policy::PEERS.to_vec()
        } else if let Some(router) = PeerRouter::ALL.iter().find(|r| r.name() == item) {
            Policy::PEERS
                .into_iter()
                .filter(|p| PeerRouter::of(*p).is_some_and(|(r, _)| r == *router))
                .collect()
        } else {
            match item.parse::<Policy>() {
                Ok(p) if p.is_peer() => vec![p],
                _ => {
                    return Err(format!(
                        "unknown peer {item:?} (expected all, vllm-router, smg, sglang-router, litellm, or one of {})",
                        Policy::PEERS.map(Policy::as_str).join(", ")
                    ));
                }
            }
        };
        for p in matched {
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// Where the venvs live: `KINFERENCE_PEERS_DIR`, else `~/.cache/kinference-bench/peers`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KINFERENCE_PEERS_DIR") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache/kinference-bench/peers")
}

/// Installs `router` into `cache_dir/NAME-VERSION` unless a finished install is there (marked by a
/// `.installed` file), and returns the venv. `progress` gets one line per step.
pub fn install(
    router: PeerRouter,
    cache_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, PeerError> {
    let venv = cache_dir.join(router.venv_name());
    if venv.join(".installed").is_file() {
        progress(&format!(
            "{}: reusing {}",
            router.requirement(),
            venv.display()
        ));
        return Ok(venv);
    }
    let log = cache_dir.join(format!("{}.install.log", router.venv_name()));
    let fail = |status: String| PeerError::Install {
        requirement: router.requirement(),
        status,
        log: log.display().to_string(),
    };
    std::fs::create_dir_all(cache_dir).map_err(|e| fail(e.to_string()))?;
    // A half-finished venv from an interrupted install is started over.
    let _ = std::fs::remove_dir_all(&venv);
    progress(&format!(
        "{}: installing into {} (about a minute; log {})",
        router.requirement(),
        venv.display(),
        log.display()
    ));
    let started = Instant::now();
    let run = |program: &Path, args: &[&str]| -> Result<(), PeerError> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| fail(e.to_string()))?;
        let err = out.try_clone().map_err(|e| fail(e.to_string()))?;
        let status = Command::new(program)
            .args(args)
            .stdout(out)
            .stderr(err)
            .status()
            .map_err(|e| fail(format!("{}: {e}", program.display())))?;
        if status.success() {
            Ok(())
        } else {
            Err(fail(status.to_string()))
        }
    };
    run(
        Path::new("python3"),
        &["-m", "venv", &venv.display().to_string()],
    )?;
    run(
        &venv.join("bin/pip"),
        &[
            "install",
            "--disable-pip-version-check",
            "-q",
            &router.requirement(),
        ],
    )?;
    std::fs::write(venv.join(".installed"), router.requirement())
        .map_err(|e| fail(e.to_string()))?;
    progress(&format!(
        "{}: installed in {:.0} s",
        router.requirement(),
        started.elapsed().as_secs_f64()
    ));
    Ok(venv)
}

/// What a peer is started in front of.
#[derive(Debug, Clone)]
pub struct PeerContext {
    /// The workers.
    pub workers: Vec<WorkerEndpoints>,
    /// Served model name.
    pub model: String,
    /// Tokens per KV block (read from the workers' `vllm:cache_config_info`).
    pub block_size: usize,
    /// The router's HTTP port.
    pub port: u16,
    /// Its Prometheus port (every Rust router opens one; distinct so they can run side by side).
    pub metrics_port: u16,
    /// Where config files and the log go.
    pub work_dir: PathBuf,
}

/// How to start one router + policy: the program inside the venv's `bin/`, its arguments and
/// environment, the files to write first, and the key its clients must send.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchPlan {
    /// Executable name under `VENV/bin`.
    pub program: &'static str,
    /// Arguments.
    pub args: Vec<String>,
    /// Extra environment.
    pub env: Vec<(String, String)>,
    /// Files to write before starting (path, content).
    pub files: Vec<(PathBuf, String)>,
    /// API key for `Authorization: Bearer`.
    pub api_key: Option<String>,
}

impl LaunchPlan {
    /// The route the load client sends through.
    pub fn route(&self, port: u16) -> Route {
        let base = format!("http://127.0.0.1:{port}");
        match &self.api_key {
            Some(key) => Route::Authorized {
                base,
                api_key: key.clone(),
            },
            None => Route::Endpoint(base),
        }
    }
}

/// The launch plan of peer `policy` (`None` if it is not a peer).
pub fn plan(policy: Policy, ctx: &PeerContext) -> Option<LaunchPlan> {
    let (router, router_policy) = PeerRouter::of(policy)?;
    let urls: Vec<String> = ctx.workers.iter().map(|w| w.url.clone()).collect();
    let common = |log_level: &str| -> Vec<String> {
        let mut a: Vec<String> = vec![
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            ctx.port.to_string(),
            "--worker-urls".into(),
        ];
        a.extend(urls.iter().cloned());
        a.extend([
            "--policy".into(),
            router_policy.into(),
            "--prometheus-host".into(),
            "127.0.0.1".into(),
            "--prometheus-port".into(),
            ctx.metrics_port.to_string(),
            "--log-level".into(),
            log_level.into(),
        ]);
        a
    };
    let plan = match router {
        PeerRouter::VllmRouter => {
            let mut args = common("warning");
            if router_policy == "kv_aware" {
                // The same events and replay Kinference's agent gets, per worker, with the block size
                // and model identity the events carry.
                for w in &ctx.workers {
                    args.push("--kv-event-source".into());
                    args.push(format!("{}={}", w.url, w.kv_events));
                }
                for w in &ctx.workers {
                    args.push("--kv-event-replay-source".into());
                    args.push(format!("{}={}", w.url, w.kv_replay));
                }
                args.extend([
                    "--kv-event-block-size".into(),
                    ctx.block_size.to_string(),
                    "--kv-event-model".into(),
                    ctx.model.clone(),
                ]);
            }
            LaunchPlan {
                program: "vllm-router",
                args,
                env: vec![],
                files: vec![],
                api_key: None,
            }
        }
        PeerRouter::Smg | PeerRouter::SglangRouter => {
            let mut args = vec!["launch".to_string()];
            args.extend(common("warn"));
            LaunchPlan {
                program: if router == PeerRouter::Smg {
                    "smg"
                } else {
                    "sglang-router"
                },
                args,
                env: vec![],
                files: vec![],
                api_key: None,
            }
        }
        PeerRouter::Litellm => {
            let path = ctx.work_dir.join("litellm-config.yaml");
            let config = litellm_config(&urls, &ctx.model, router_policy, LITELLM_MASTER_KEY);
            LaunchPlan {
                program: "litellm",
                args: vec![
                    "--config".into(),
                    path.display().to_string(),
                    "--host".into(),
                    "127.0.0.1".into(),
                    "--port".into(),
                    ctx.port.to_string(),
                    "--num_workers".into(),
                    "1".into(),
                ],
                env: vec![
                    // No network: the bundled model cost map, no telemetry.
                    ("LITELLM_LOCAL_MODEL_COST_MAP".into(), "True".into()),
                    ("LITELLM_LOG".into(), "ERROR".into()),
                    ("LITELLM_TELEMETRY".into(), "False".into()),
                ],
                files: vec![(path, serde_yaml::to_string(&config).unwrap_or_default())],
                api_key: Some(LITELLM_MASTER_KEY.to_string()),
            }
        }
    };
    Some(plan)
}

/// LiteLLM's proxy config: one deployment per worker under the same model name (`hosted_vllm/`, vLLM's
/// OpenAI-compatible server), the routing strategy, and the master key.
pub fn litellm_config(urls: &[String], model: &str, strategy: &str, master_key: &str) -> Value {
    json!({
        "model_list": urls.iter().map(|u| json!({
            "model_name": model,
            "litellm_params": {
                "model": format!("hosted_vllm/{model}"),
                "api_base": format!("{u}/v1"),
                "api_key": "none",
            },
        })).collect::<Vec<_>>(),
        "router_settings": {"routing_strategy": strategy},
        "general_settings": {"master_key": master_key},
    })
}

/// A started peer router; dropping it stops its process group.
pub struct RunningPeer {
    /// Its row name (the peer policy, or the P/D benchmark's router name).
    pub name: String,
    /// Where to send requests.
    pub route: Route,
    /// Base URL.
    pub url: String,
    /// Its log file.
    pub log: PathBuf,
    child: Process,
}

impl RunningPeer {
    /// The process group id (for [`process_cpu_seconds`]).
    pub fn pgid(&self) -> u32 {
        self.child.pid()
    }

    /// Whether it is still running (else why not, with its log's end).
    pub fn check_alive(&mut self) -> Result<(), String> {
        match self.child.exited() {
            Some(e) => Err(e.to_string()),
            None => Ok(()),
        }
    }
}

/// Starts peer `policy` from `venv` and waits (at most `timeout`) until a one-token chat request goes
/// through it: `/health` alone says too little (smg registers workers in the background).
pub async fn start(
    policy: Policy,
    venv: &Path,
    ctx: &PeerContext,
    http: &HttpClient,
    timeout: Duration,
) -> Result<RunningPeer, PeerError> {
    let plan = plan(policy, ctx).ok_or_else(|| {
        PeerError::Cluster(ClusterError::MissingBinary {
            name: policy.to_string(),
            dir: "not a peer".into(),
        })
    })?;
    launch(&policy.to_string(), &plan, venv, ctx, http, timeout).await
}

/// Starts `plan` (a router named `name` in its log file) from `venv`, as [`start`] does: also for
/// launch plans of other modes than [`plan`]'s (the P/D benchmark's prefill/decode lists).
pub async fn launch(
    name: &str,
    plan: &LaunchPlan,
    venv: &Path,
    ctx: &PeerContext,
    http: &HttpClient,
    timeout: Duration,
) -> Result<RunningPeer, PeerError> {
    std::fs::create_dir_all(&ctx.work_dir).map_err(|source| ClusterError::Io {
        what: format!("creating {}", ctx.work_dir.display()),
        source,
    })?;
    for (path, text) in &plan.files {
        std::fs::write(path, text).map_err(|source| ClusterError::Io {
            what: format!("writing {}", path.display()),
            source,
        })?;
    }
    let log = ctx.work_dir.join(format!("peer-{name}.log"));
    let child = Process::spawn_group(
        name,
        &venv.join("bin").join(plan.program),
        &plan.args,
        &plan.env,
        log.clone(),
    )
    .map_err(ClusterError::from)?;
    let route = plan.route(ctx.port);
    let url = format!("http://127.0.0.1:{}", ctx.port);
    let mut peer = RunningPeer {
        name: name.to_string(),
        route,
        url: url.clone(),
        log,
        child,
    };
    let probe = json!({
        "model": ctx.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    });
    let auth = plan.api_key.as_ref().map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| vec![("authorization", a)])
        .unwrap_or_default();
    let chat = format!("{url}/v1/chat/completions");
    let what = format!("{chat} (a one-token chat request)");
    wait_until(&mut peer.child, &what, timeout, || async {
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            http.send(
                http::Method::POST,
                &chat,
                &headers,
                bytes::Bytes::from(probe.to_string()),
            ),
        )
        .await;
        answer
            .ok()?
            .ok()
            .filter(|r| r.status().is_success())
            .map(drop)
    })
    .await
    .map_err(ClusterError::from)?;
    Ok(peer)
}

/// The block size the workers report in `vllm:cache_config_info{block_size="N"}` (what a vLLM
/// operator would pass to `--kv-event-block-size`).
pub fn block_size_from_metrics(text: &str) -> Option<usize> {
    let line = text
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info{"))?;
    let start = line.find("block_size=\"")? + "block_size=\"".len();
    let end = start + line[start..].find('"')?;
    line[start..end].parse().ok()
}

/// User + system CPU seconds of every live process in process group `pgid` (`/proc/PID/stat` fields
/// 14 and 15, in clock ticks of 1/100 s), or `None` if none is found.
pub fn process_cpu_seconds(pgid: u32) -> Option<f64> {
    let mut ticks = 0u64;
    let mut found = false;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        if let Some((group, cpu)) = parse_stat(&stat)
            && (group == pgid || pid == pgid)
        {
            ticks += cpu;
            found = true;
        }
    }
    found.then(|| ticks as f64 / CLOCK_TICKS_PER_S)
}

/// `sysconf(_SC_CLK_TCK)` on Linux.
const CLOCK_TICKS_PER_S: f64 = 100.0;

/// (process group, utime + stime) of one `/proc/PID/stat` line. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted after its last `)`.
pub fn parse_stat(stat: &str) -> Option<(u32, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state(3) ppid(4) pgrp(5) ... utime(14) stime(15).
    let pgrp = fields.get(2)?.parse().ok()?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((pgrp, utime + stime))
}
