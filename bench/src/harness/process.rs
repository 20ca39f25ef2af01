//! The benchmarks' child processes: named, logged, stopped on drop.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};

use testkit::ChildGuard;

use super::{HarnessError, io};

/// A child process with the name errors give it and, when its output goes to one, its log file.
/// Dropping it stops it: killed and reaped by the [`ChildGuard`] it holds, after its whole process
/// group when it was started as the leader of one ([`Process::spawn_group`]).
#[derive(Debug)]
pub struct Process {
    name: String,
    log: Option<PathBuf>,
    /// Leads a process group of its own that is still to be stopped.
    group: bool,
    child: ChildGuard,
}

impl Process {
    /// Starts `program` with `args` and `env` added, stdin closed, stdout and stderr into `log`.
    /// Quiet by default (`RUST_LOG=warn` unless set): per-request logging would cost CPU the
    /// benchmark measures.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        log: PathBuf,
    ) -> Result<Self, HarnessError> {
        Self::spawn_with(name, program, args, env, log, false)
    }

    /// [`Process::spawn`] as the leader of a new process group, so that stopping it also stops the
    /// helpers it starts (Python launchers, worker processes).
    pub fn spawn_group(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        log: PathBuf,
    ) -> Result<Self, HarnessError> {
        Self::spawn_with(name, program, args, env, log, true)
    }

    fn spawn_with(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        log: PathBuf,
        new_group: bool,
    ) -> Result<Self, HarnessError> {
        let out = File::create(&log).map_err(io(format!("creating {}", log.display())))?;
        let err = out.try_clone().map_err(io("duplicating a log handle"))?;
        let mut command = Command::new(program);
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "warn");
        }
        command.envs(env.iter().map(|(k, v)| (k, v)));
        if new_group {
            use std::os::unix::process::CommandExt as _;
            command.process_group(0);
        }
        let child = command
            .spawn()
            .map_err(io(format!("starting {}", program.display())))?;
        tracing::debug!(name, pid = child.id(), "started");
        Ok(Self {
            name: name.to_string(),
            log: Some(log),
            group: new_group,
            child: ChildGuard(child),
        })
    }

    /// Watches `child`, started elsewhere with its output wherever its command sent it.
    pub fn adopt(name: &str, child: Child) -> Self {
        Self {
            name: name.to_string(),
            log: None,
            group: false,
            child: ChildGuard(child),
        }
    }

    /// The name errors give it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The process id (the process group id for [`Process::spawn_group`]).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        let Some(log) = &self.log else {
            return "(its output goes to no log)".to_string();
        };
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Why it is no longer running, if it is not.
    pub fn exited(&mut self) -> Option<HarnessError> {
        match self.child.0.try_wait() {
            Ok(Some(status)) => Some(HarnessError::Exited {
                name: self.name.clone(),
                status: status.to_string(),
                log: self.log_tail(),
            }),
            _ => None,
        }
    }

    /// Its exit status if it has exited (reaping it), `None` while it runs.
    pub fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        self.child.0.try_wait()
    }

    /// Stops it as dropping it does: its group first (SIGTERM to all of it, once), then the
    /// process itself, killed and reaped.
    pub fn stop(&mut self) {
        if std::mem::take(&mut self.group) {
            let _ = Command::new("kill")
                .args(["-TERM", "--", &format!("-{}", self.child.id())])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        self.child.stop();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.stop();
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
