//! Local mode: the [`ConfigSource`] fed by a directory (or one file) of CRD-shaped YAML, polled for
//! changes. The policy stage and tenancy both read their local configuration through it.
//!
//! Reading and per-object validation are [`crate::policy::source::load_dir`]'s (each document on
//! its own, an unreadable document keeps the previous version of the objects its file held); this
//! front end turns each load into a [`Snapshot`] with the same per-object states as the cluster's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use super::{ConfigSource, ObjectEntry, ObjectRef, ObjectState, Snapshot};
use crate::policy::model::{ApplyState, BuildOutcome};
use crate::policy::source::{Loaded, SourceError, load_dir};

/// Starts watching `dir`: loads it now (an error only if it cannot be read) and re-reads it every
/// `interval` when a file changed.
pub fn start(dir: PathBuf, interval: Duration) -> Result<ConfigSource, SourceError> {
    let seen = fingerprint(&dir);
    let loaded = load_dir(&dir, None)?;
    log_load(&loaded, None);
    Ok(watch_from(
        dir,
        interval,
        seen,
        snapshot(&loaded.outcome, 1),
    ))
}

/// [`start`] for a consumer that fails closed (tenancy): a path that cannot be read yet is no
/// error; the source publishes an unsynced, empty snapshot until it can be read.
pub fn start_or_wait(dir: PathBuf, interval: Duration) -> ConfigSource {
    let seen = fingerprint(&dir);
    let first = match load_dir(&dir, None) {
        Ok(loaded) => {
            log_load(&loaded, None);
            snapshot(&loaded.outcome, 1)
        }
        Err(error) => {
            tracing::error!(%error, "configuration unreadable; what depends on it is refused until it loads");
            Snapshot {
                revision: 1,
                synced: false,
                ..Snapshot::default()
            }
        }
    };
    watch_from(dir, interval, seen, first)
}

/// Publishes `first`, then a new snapshot whenever a file under `dir` changes.
fn watch_from(
    dir: PathBuf,
    interval: Duration,
    mut seen: Vec<(PathBuf, u64, Option<SystemTime>)>,
    first: Snapshot,
) -> ConfigSource {
    let mut revision = first.revision;
    let (tx, rx) = watch::channel(Arc::new(first));
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if tx.is_closed() {
                return;
            }
            let now = fingerprint(&dir);
            // A path missing at start has no fingerprint until it appears.
            if now == seen {
                continue;
            }
            seen = now;
            let previous = Arc::clone(&tx.borrow());
            match load_dir(&dir, Some(&previous.set)) {
                Ok(loaded) => {
                    log_load(&loaded, Some(&previous));
                    revision += 1;
                    tx.send_replace(Arc::new(snapshot(&loaded.outcome, revision)));
                }
                Err(error) => {
                    tracing::warn!(%error, "configuration files unreadable; the current set keeps serving");
                }
            }
        }
    });
    ConfigSource::new(rx, vec![task])
}

/// Logs a load's problems and each object whose state changed since `before`.
fn log_load(loaded: &Loaded, before: Option<&Snapshot>) {
    for p in &loaded.problems {
        tracing::warn!(file = %p.file.display(), line = p.line, check = p.check, "policy document problem: {}", p.message);
    }
    for p in &loaded.outcome.problems {
        tracing::warn!(object = %p.object, file = %p.file.display(), line = p.line, "policy object invalid: {}", p.message);
    }
    for (key, state) in &loaded.outcome.states {
        let unchanged = before
            .and_then(|b| b.entry(key.kind, &key.name))
            .is_some_and(|e| e.state == ObjectState::Accepted);
        match state {
            ApplyState::Applied if unchanged => {}
            ApplyState::Applied => tracing::info!(object = %key, "policy object applied"),
            ApplyState::RolledBack { reason } => {
                tracing::warn!(object = %key, %reason, "policy object NOT applied; the previous version keeps serving")
            }
            ApplyState::Rejected { reason } => {
                tracing::warn!(object = %key, %reason, "policy object NOT applied (no previous version)")
            }
        }
    }
}

/// The snapshot of one load of the directory.
pub fn snapshot(outcome: &BuildOutcome, revision: u64) -> Snapshot {
    let mut objects = BTreeMap::new();
    for (key, state) in &outcome.states {
        let serving = outcome.set.manifest(key).and_then(|m| m.generation);
        let in_set = outcome.set.manifest(key).is_some();
        let state = match state {
            ApplyState::Applied => ObjectState::Accepted,
            ApplyState::RolledBack { reason } => ObjectState::RolledBack {
                error: reason.clone(),
                serving_generation: serving,
            },
            ApplyState::Rejected { reason } => ObjectState::Rejected {
                error: reason.clone(),
            },
        };
        let object = ObjectRef {
            kind: key.kind,
            namespace: String::new(),
            name: key.name.clone(),
        };
        objects.insert(
            object.clone(),
            ObjectEntry {
                object,
                observed_generation: serving,
                serving_generation: if in_set { serving } else { None },
                state,
                live_status: None,
                uid: None,
            },
        );
    }
    Snapshot {
        revision,
        set: Arc::new(outcome.set.clone()),
        objects,
        synced: true,
    }
}

/// Every YAML file under `dir` (or `dir` itself, a file) with its size and mtime.
fn fingerprint(dir: &Path) -> Vec<(PathBuf, u64, Option<SystemTime>)> {
    let mut out = Vec::new();
    if dir.is_file() {
        let meta = std::fs::metadata(dir).ok();
        let len = meta.as_ref().map_or(0, |m| m.len());
        out.push((dir.to_path_buf(), len, meta.and_then(|m| m.modified().ok())));
        return out;
    }
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml")
            ) {
                let meta = std::fs::metadata(&path).ok();
                let len = meta.as_ref().map_or(0, |m| m.len());
                out.push((path, len, meta.and_then(|m| m.modified().ok())));
            }
        }
    }
    out.sort();
    out
}
