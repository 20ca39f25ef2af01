//! Node-agent subscriptions: one `Watch` stream per agent, reconnected with backoff, applied to the
//! worker table and the KV index.
//!
//! A snapshot replaces everything the router knew from that agent (an agent restart, seen as a new
//! epoch, therefore drops the old state). Deltas add and remove keys and update load. When an agent is
//! disconnected for longer than the stale timeout its workers' keys and load are dropped: routing on
//! an old picture of a cache is worse than routing on the gateway's own ledger and speculative credit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kinference_api::summary::node_agent_client::NodeAgentClient;
use kinference_api::summary::{Delta, Snapshot, Summary, WatchRequest, WorkerLoad, summary};
use rand::Rng;
use tonic::transport::Endpoint;

use super::Shared;
use super::estimate::KernelQueue;
use super::kv_index::WorkerId;
use super::metrics::AgentLabels;
use super::workers::Load;

const BACKOFF_START: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// A snapshot of a big node (8 workers x 100k blocks) is several MB.
const MAX_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

/// What the router knows about one agent.
#[derive(Debug)]
pub struct AgentState {
    /// gRPC endpoint.
    pub url: String,
    /// Whether the stream is up.
    pub connected: bool,
    /// When `connected` last changed.
    pub since: Instant,
    /// The agent process's epoch from its last snapshot.
    pub epoch: Option<u64>,
    /// Workers its last snapshot and deltas reported.
    pub workers: Vec<WorkerId>,
    /// Its data was dropped as stale (until the next snapshot).
    pub dropped: bool,
    /// Removed from the router (its endpoint left discovery): never used again; its slot is kept so
    /// that agent numbers stay stable.
    pub retired: bool,
    /// Stops its stream task.
    pub task: Option<tokio::task::AbortHandle>,
}

impl AgentState {
    /// A not yet connected agent.
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_string(),
            connected: false,
            since: Instant::now(),
            epoch: None,
            workers: Vec::new(),
            dropped: true,
            retired: false,
            task: None,
        }
    }

    /// Whether its data can be used at `now`.
    pub fn fresh(&self, now: Instant, stale_after: Duration) -> bool {
        !self.retired
            && !self.dropped
            && (self.connected || now.saturating_duration_since(self.since) < stale_after)
    }
}

#[derive(Debug, thiserror::Error)]
enum WatchError {
    #[error("bad agent endpoint: {0}")]
    Endpoint(String),
    #[error("connect: {0}")]
    Connect(#[from] tonic::transport::Error),
    #[error("watch: {0}")]
    Status(#[from] tonic::Status),
}

/// Keeps agent `a`'s stream up for as long as the router lives.
pub(super) async fn run(shared: Arc<Shared>, a: usize) {
    let url = shared.agent(a).lock().url.clone();
    let labels = AgentLabels { agent: url.clone() };
    let mut backoff = BACKOFF_START;
    let mut failures = 0u32;
    loop {
        if shared.agent(a).lock().retired {
            return;
        }
        let mut got_message = false;
        let result = watch(&shared, a, &url, &mut got_message).await;
        set_connected(&shared, a, false);
        shared.metrics.agent_connected.get_or_create(&labels).set(0);
        if got_message {
            backoff = BACKOFF_START;
            failures = 0;
        }
        match result {
            Ok(()) => tracing::info!(agent = %url, "agent stream ended; reconnecting"),
            // Log the first failures and then every 30th, so a long outage stays visible but quiet.
            Err(e) if failures < 3 || failures.is_multiple_of(30) => {
                tracing::warn!(agent = %url, error = %e, "agent stream failed; reconnecting")
            }
            Err(e) => tracing::debug!(agent = %url, error = %e, "agent stream failed"),
        }
        failures = failures.saturating_add(1);
        let jitter = rand::rng().random_range(0..=backoff.as_millis() as u64 / 4);
        tokio::time::sleep(backoff + Duration::from_millis(jitter)).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
        drop_if_stale(&shared, a);
    }
}

async fn watch(
    shared: &Shared,
    a: usize,
    url: &str,
    got_message: &mut bool,
) -> Result<(), WatchError> {
    // Over mTLS the connector below does TLS itself: tonic sees a plain HTTP/2 connection.
    let endpoint = Endpoint::from_shared(url.replacen("https://", "http://", 1))
        .map_err(|e| WatchError::Endpoint(e.to_string()))?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        // Keepalive notices a vanished agent whose connection never closed.
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true);
    // Each (re)connection shakes hands with the certificates current then: renewals apply.
    let channel = match &shared.agent_tls {
        None => endpoint.connect().await?,
        Some(tls) => endpoint.connect_with_connector(tls.clone()).await?,
    };
    let mut client = NodeAgentClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let mut stream = client
        .watch(WatchRequest {
            gateway_id: shared.gateway_id.clone(),
        })
        .await?
        .into_inner();
    let labels = AgentLabels {
        agent: url.to_string(),
    };
    shared.metrics.agent_connects.get_or_create(&labels).inc();
    while let Some(msg) = stream.message().await? {
        if !*got_message {
            *got_message = true;
            set_connected(shared, a, true);
            shared.metrics.agent_connected.get_or_create(&labels).set(1);
            tracing::info!(agent = %url, "agent connected");
        }
        apply(shared, a, msg);
        shared.metrics.agent_messages.get_or_create(&labels).inc();
    }
    Ok(())
}

fn set_connected(shared: &Shared, a: usize, connected: bool) {
    let agent = shared.agent(a);
    let mut st = agent.lock();
    if st.connected != connected {
        st.connected = connected;
        st.since = Instant::now();
    }
}

/// Drops agent `a`'s workers' keys and load once it has been away longer than the stale timeout.
pub(super) fn drop_if_stale(shared: &Shared, a: usize) {
    let workers = {
        let agent = shared.agent(a);
        let mut st = agent.lock();
        if st.dropped || st.connected || st.since.elapsed() < shared.tuning.stale_after {
            return;
        }
        st.dropped = true;
        tracing::warn!(agent = %st.url, workers = st.workers.len(), "agent data is stale: dropping its cache view and load");
        shared
            .metrics
            .agent_stale
            .get_or_create(&AgentLabels {
                agent: st.url.clone(),
            })
            .inc();
        std::mem::take(&mut st.workers)
    };
    detach(shared, a, &workers);
}

/// Retires agent `a` (its endpoint is gone): stops its stream and forgets its workers' keys and load.
/// The workers themselves stay (they may be configured, or reported again by the node's new agent).
pub(super) fn retire(shared: &Shared, a: usize) {
    let workers = {
        let agent = shared.agent(a);
        let mut st = agent.lock();
        if st.retired {
            return;
        }
        st.retired = true;
        st.connected = false;
        st.dropped = true;
        if let Some(task) = st.task.take() {
            task.abort();
        }
        shared.metrics.agent_connected.remove(&AgentLabels {
            agent: st.url.clone(),
        });
        std::mem::take(&mut st.workers)
    };
    detach(shared, a, &workers);
}

/// Forgets the keys and load of `workers` (which agent `a` reported).
fn detach(shared: &Shared, a: usize, workers: &[WorkerId]) {
    shared.index.write().clear_workers(workers);
    shared.offloaded.write().clear_workers(workers);
    let table = shared.workers.read();
    for id in workers {
        if let Some(w) = table.by_id(*id) {
            let mut st = w.state.lock();
            if st.agent == Some(a) {
                st.agent = None;
                st.load = None;
            }
        }
    }
    drop(table);
    shared.update_index_metrics();
}

/// Applies one summary message from agent `a`.
pub(super) fn apply(shared: &Shared, a: usize, msg: Summary) {
    if shared.agent(a).lock().retired {
        return;
    }
    match msg.kind {
        Some(summary::Kind::Snapshot(s)) => apply_snapshot(shared, a, s),
        Some(summary::Kind::Delta(d)) => apply_delta(shared, a, d),
        None => {}
    }
    shared.update_index_metrics();
}

fn to_load(l: &WorkerLoad, now: Instant) -> Load {
    Load {
        running: l.running,
        waiting: l.waiting,
        kv_usage: l.kv_usage,
        // 0: an older agent, or vLLM has not profiled its memory yet.
        kv_capacity_blocks: (l.num_gpu_blocks > 0).then_some(l.num_gpu_blocks),
        metrics_ok: l.metrics_ok,
        kernel: l.kernel_ok.then_some(KernelQueue {
            in_flight: l.kernel_in_flight,
            waiting: l.kernel_waiting.min(l.kernel_in_flight),
            waits_for_body: l.kernel_waits_for_body,
        }),
        accept_backlog: if l.kernel_ok {
            (l.accept_backlog, l.accept_backlog_max)
        } else {
            (0, 0)
        },
        kernel_ttfb: (l.kernel_ok && l.kernel_ttfb_p50_us > 0)
            .then(|| Duration::from_micros(u64::from(l.kernel_ttfb_p50_us))),
        kernel_linger: Duration::from_millis(match l.kernel_idle_gap_ms {
            // Agents before the field had a fixed 500 ms idle gap.
            0 => 500,
            ms => u64::from(ms),
        }),
        measured: now
            .checked_sub(Duration::from_millis(u64::from(l.metrics_age_ms)))
            .unwrap_or(now),
        received: now,
    }
}

fn apply_snapshot(shared: &Shared, a: usize, snap: Snapshot) {
    let now = Instant::now();
    let old = {
        let agent = shared.agent(a);
        let st = agent.lock();
        if st.epoch.is_some_and(|e| e != snap.epoch) {
            tracing::info!(agent = %st.url, node = %snap.node, "agent restarted (new epoch): replacing its state");
        }
        st.workers.clone()
    };
    let mut ids = Vec::with_capacity(snap.workers.len());
    {
        let mut table = shared.workers.write();
        for ws in &snap.workers {
            match table.get_or_add_cache(
                &ws.worker_id,
                ws.data_parallel_rank,
                &ws.model,
                false,
                &shared.prior_of(&ws.model),
            ) {
                Some(w) => ids.push(w.id),
                None => {
                    tracing::warn!(worker = %ws.worker_id, "worker table full: ignoring worker")
                }
            }
        }
    }
    // Workers this agent no longer reports lose their agent data.
    let left: Vec<WorkerId> = old.iter().copied().filter(|w| !ids.contains(w)).collect();
    {
        let mut index = shared.index.write();
        let mut all = old.clone();
        all.extend(ids.iter().copied());
        index.clear_workers(&all);
        let mut offloaded = shared.offloaded.write();
        offloaded.clear_workers(&all);
        for (ws, id) in snap.workers.iter().zip(ids.iter()) {
            for key in &ws.keys {
                index.insert(*key, *id);
            }
            for key in &ws.offloaded_keys {
                offloaded.insert(*key, *id);
            }
        }
    }
    {
        let table = shared.workers.read();
        for (ws, id) in snap.workers.iter().zip(ids.iter()) {
            if let Some(w) = table.by_id(*id) {
                let mut st = w.state.lock();
                st.agent = Some(a);
                st.gone = false;
                if ws.block_size > 0 {
                    st.block_size = Some(ws.block_size as usize);
                }
                st.set_reported_role(&ws.role);
                st.load = ws.load.as_ref().map(|l| to_load(l, now));
            }
        }
        for id in &left {
            if let Some(w) = table.by_id(*id) {
                let mut st = w.state.lock();
                if st.agent == Some(a) {
                    st.agent = None;
                    st.load = None;
                    st.gone = !w.configured;
                }
            }
        }
    }
    let agent = shared.agent(a);
    let mut st = agent.lock();
    st.epoch = Some(snap.epoch);
    st.workers = ids;
    st.dropped = false;
}

fn apply_delta(shared: &Shared, a: usize, delta: Delta) {
    let now = Instant::now();
    for wd in delta.workers {
        let worker = {
            let found = shared
                .workers
                .read()
                .get_cache(&wd.worker_id, wd.data_parallel_rank)
                .cloned();
            match found {
                Some(w) => w,
                None if !wd.model.is_empty() => {
                    match shared.workers.write().get_or_add_cache(
                        &wd.worker_id,
                        wd.data_parallel_rank,
                        &wd.model,
                        false,
                        &shared.prior_of(&wd.model),
                    ) {
                        Some(w) => w,
                        None => continue,
                    }
                }
                None => {
                    tracing::debug!(worker = %wd.worker_id, "delta for an unknown worker without its model: ignored");
                    continue;
                }
            }
        };
        let id = worker.id;
        {
            let agent = shared.agent(a);
            let mut st = agent.lock();
            if wd.gone {
                st.workers.retain(|w| *w != id);
            } else if !st.workers.contains(&id) {
                st.workers.push(id);
            }
        }
        if wd.gone {
            shared.index.write().clear_workers(&[id]);
            shared.offloaded.write().clear_workers(&[id]);
            shared.spec.lock().forget_worker(id);
            let mut st = worker.state.lock();
            st.agent = None;
            st.load = None;
            st.gone = !worker.configured;
            continue;
        }
        {
            let mut index = shared.index.write();
            if wd.cleared {
                index.clear_workers(&[id]);
            }
            for key in &wd.removed {
                index.remove(*key, id);
            }
            for key in &wd.added {
                index.insert(*key, id);
            }
            let mut offloaded = shared.offloaded.write();
            if wd.cleared {
                offloaded.clear_workers(&[id]);
            }
            for key in &wd.offloaded_removed {
                offloaded.remove(*key, id);
            }
            for key in &wd.offloaded_added {
                offloaded.insert(*key, id);
            }
        }
        if wd.cleared {
            shared.spec.lock().forget_worker(id);
        }
        let mut st = worker.state.lock();
        st.agent = Some(a);
        st.gone = false;
        if wd.block_size > 0 {
            st.block_size = Some(wd.block_size as usize);
        }
        if !wd.model.is_empty() {
            st.set_reported_role(&wd.role);
        }
        if let Some(l) = &wd.load {
            st.load = Some(to_load(l, now));
        }
    }
}
