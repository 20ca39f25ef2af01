//! Where the agent learns which workers run on its node: a stream of [`WorkerChange`]s.
//!
//! The local workers file is the first source; a Kubernetes source (pods on this node matching a label
//! selector) produces the same changes, so the rest of the agent never knows which one is in use.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::{WorkerSpec, WorkersFile};

pub mod kube;

/// A change to the set of local workers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerChange {
    /// A new worker, or a known worker (same url) whose spec changed.
    Upsert(WorkerSpec),
    /// The worker with this url left the node.
    Remove(String),
}

/// The changes that turn the worker set `old` into `new`.
pub fn diff(
    old: &BTreeMap<String, WorkerSpec>,
    new: &BTreeMap<String, WorkerSpec>,
) -> Vec<WorkerChange> {
    let mut out: Vec<WorkerChange> = old
        .keys()
        .filter(|url| !new.contains_key(*url))
        .map(|url| WorkerChange::Remove(url.clone()))
        .collect();
    for (url, spec) in new {
        if old.get(url) != Some(spec) {
            out.push(WorkerChange::Upsert(spec.clone()));
        }
    }
    out
}

/// Follows a workers file: emits its workers at once, then the differences whenever it changes.
/// A file that stops parsing is logged and ignored (the last good set stays in force).
pub fn watch_file(
    path: PathBuf,
    poll: Duration,
    cancel: CancellationToken,
) -> mpsc::Receiver<WorkerChange> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let mut current: BTreeMap<String, WorkerSpec> = BTreeMap::new();
        let mut last_text: Option<String> = None;
        loop {
            match tokio::fs::read_to_string(&path).await {
                Ok(text) if last_text.as_deref() != Some(text.as_str()) => {
                    match WorkersFile::load(&path) {
                        Ok(file) => {
                            let next: BTreeMap<_, _> = file
                                .workers
                                .into_iter()
                                .map(|w| (w.url.clone(), w))
                                .collect();
                            for change in diff(&current, &next) {
                                tracing::info!(?change, "worker set changed");
                                if tx.send(change).await.is_err() {
                                    return;
                                }
                            }
                            current = next;
                        }
                        Err(error) => {
                            tracing::warn!(%error, "workers file ignored; keeping the previous worker set")
                        }
                    }
                    last_text = Some(text);
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(path = %path.display(), %error, "cannot read workers file")
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(poll) => {}
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(url: &str, model: &str) -> WorkerSpec {
        WorkerSpec {
            url: url.into(),
            model: model.into(),
            kv_events_endpoint: None,
            kv_events_bind: true,
            kv_replay_endpoint: None,
            kv_topic: None,
            role: None,
            data_parallel_size: None,
        }
    }

    #[test]
    fn diff_emits_removals_then_upserts_of_changed_specs_only() {
        let old: BTreeMap<_, _> = [("a", "m"), ("b", "m"), ("c", "m")]
            .iter()
            .map(|(u, m)| (u.to_string(), spec(u, m)))
            .collect();
        let new: BTreeMap<_, _> = [("a", "m"), ("b", "m2"), ("d", "m")]
            .iter()
            .map(|(u, m)| (u.to_string(), spec(u, m)))
            .collect();
        assert_eq!(
            diff(&old, &new),
            vec![
                WorkerChange::Remove("c".into()),
                WorkerChange::Upsert(spec("b", "m2")),
                WorkerChange::Upsert(spec("d", "m"))
            ]
        );
    }

    #[tokio::test]
    async fn file_source_follows_edits() {
        let dir =
            std::env::temp_dir().join(format!("kinference-agent-discovery-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("workers.yaml");
        std::fs::write(&path, "workers:\n  - {url: http://a, model: m}\n").expect("write");
        let cancel = CancellationToken::new();
        let mut rx = watch_file(path.clone(), Duration::from_millis(20), cancel.clone());
        assert_eq!(
            rx.recv().await,
            Some(WorkerChange::Upsert(spec("http://a", "m")))
        );
        std::fs::write(&path, "workers:\n  - {url: http://b, model: m}\n").expect("write");
        assert_eq!(
            rx.recv().await,
            Some(WorkerChange::Remove("http://a".into()))
        );
        assert_eq!(
            rx.recv().await,
            Some(WorkerChange::Upsert(spec("http://b", "m")))
        );
        cancel.cancel();
        let _ = std::fs::remove_dir_all(dir);
    }
}
