//! The KV connector of prefill/decode disaggregation, as a router sees it: the two protocols a P/D
//! router speaks to vLLM-like workers, and the time the KV cache takes to move.
//!
//! - **vLLM's** (NixlConnector, what Kinference and vllm-router send): the prefill request carries
//!   `kv_transfer_params: {"do_remote_decode": true}`; a producer worker runs it to its first token,
//!   keeps the prompt's KV cache for a pull and answers with `kv_transfer_params` naming it
//!   (`do_remote_prefill: true`, `remote_engine_id`, `remote_request_id`, `remote_block_ids`,
//!   `remote_host`, `remote_port`: here this worker's HTTP address). The decode request carries those
//!   back; a consumer worker pulls the blocks (`POST remote_host:remote_port/sim/kv/pull`, which hands
//!   the kept transfer over once), waits the transfer time, then starts from the pulled cache: its
//!   first step computes one token.
//! - **SGLang's** (bootstrap rooms, what smg's `--pd-disaggregation` sends over HTTP): the same
//!   request goes to both workers at once with `bootstrap_host`, `bootstrap_port` and
//!   `bootstrap_room`. The producer runs it to its first token and marks the room done; the consumer
//!   waits for the room at `bootstrap_host:bootstrap_port` (`GET /sim/kv/room/ROOM`, the prefill
//!   worker's HTTP port standing for SGLang's bootstrap server), then pulls as above.
//!
//! A worker's role is vLLM's `kv_role`: `kv_producer` answers prefill requests, `kv_consumer` decode
//! requests, `kv_both` either (vLLM's usual setting; SGLang's bootstrap rooms need one or the other).
//! Without a role (vLLM without `--kv-transfer-config`) `kv_transfer_params` and bootstrap fields are
//! ignored and every request runs whole. A pull that fails (the transfer is unknown, the producer is
//! gone) makes the consumer compute the prompt itself, as vLLM's default `kv_load_failure_policy` does.
//!
//! Transfers on one consumer share its link: a pull waits for the previous one, then takes
//! `blocks x s_per_block` (model seconds x the time scale). Blocks the consumer already caches are not
//! pulled. The pulled blocks enter its prefix cache (and its KV events) as vLLM caches them.
//! Simplification: a producer returns the prompt's blocks to its prefix cache at once instead of
//! pinning them until the pull (they stay cached unless evicted).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::harness::http::HttpClient;

#[cfg(test)]
mod tests;

/// How long a producer keeps a transfer for its pull, and a consumer waits for a room.
pub const HOLD: Duration = Duration::from_secs(120);
/// How long a consumer waits for a bootstrap room before computing the prompt itself.
pub const ROOM_WAIT: Duration = Duration::from_secs(60);

/// vLLM's `kv_role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum KvRole {
    /// Runs prefills for other workers.
    #[value(name = "kv_producer")]
    #[serde(rename = "kv_producer")]
    Producer,
    /// Continues requests from other workers' prefills.
    #[value(name = "kv_consumer")]
    #[serde(rename = "kv_consumer")]
    Consumer,
    /// Either, by what each request asks (vLLM's NixlConnector setting).
    #[value(name = "kv_both")]
    #[serde(rename = "kv_both")]
    Both,
}

impl KvRole {
    fn produces(self) -> bool {
        self != KvRole::Consumer
    }

    fn consumes(self) -> bool {
        self != KvRole::Producer
    }
}

/// What a request asks of this worker's connector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transfer {
    /// vLLM prefill: run to the first token, keep the cache for a pull, answer with its params.
    Produce,
    /// SGLang prefill: run to the first token, then mark `room` done.
    ProduceRoom {
        /// The bootstrap room.
        room: u64,
    },
    /// vLLM decode: pull `blocks` blocks of transfer `request_id` from `host:port`.
    Pull {
        /// The producer's host.
        host: String,
        /// The producer's port.
        port: u16,
        /// The transfer (the producer's request id).
        request_id: String,
        /// Blocks the producer holds for it.
        blocks: usize,
    },
    /// SGLang decode: wait for `room` at `host:port`, then pull its blocks.
    PullRoom {
        /// The bootstrap host.
        host: String,
        /// The bootstrap port.
        port: u16,
        /// The room.
        room: u64,
    },
}

impl Transfer {
    /// Whether this worker runs the prefill half (one output token).
    pub fn produces(&self) -> bool {
        matches!(self, Transfer::Produce | Transfer::ProduceRoom { .. })
    }
}

/// A producer's kept transfers and rooms.
#[derive(Debug, Default)]
struct Held {
    /// Request id -> (blocks, when kept).
    transfers: HashMap<String, (usize, Instant)>,
    /// Room -> blocks once its prefill finished (`None` while it runs), and when opened.
    rooms: HashMap<u64, (Option<usize>, Instant)>,
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
struct Stats {
    handed: AtomicU64,
    pulls: AtomicU64,
    pulled_blocks: AtomicU64,
    failed: AtomicU64,
}

/// One worker's KV connector.
pub struct KvConnector {
    /// Its `kv_role`.
    pub role: KvRole,
    /// Its engine id (`remote_engine_id` of what it produces).
    pub engine_id: String,
    host: String,
    port: u16,
    /// Wall seconds one block takes to pull.
    wall_s_per_block: f64,
    held: Mutex<Held>,
    room_done: Notify,
    /// One pull at a time.
    link: tokio::sync::Mutex<()>,
    http: HttpClient,
    stats: Stats,
}

impl std::fmt::Debug for KvConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvConnector")
            .field("role", &self.role)
            .field("engine_id", &self.engine_id)
            .finish_non_exhaustive()
    }
}

impl KvConnector {
    /// A connector for the worker serving at `host:port`, pulling a block in `s_per_block` model
    /// seconds at `time_scale` wall seconds per model second.
    pub fn new(role: KvRole, host: String, port: u16, s_per_block: f64, time_scale: f64) -> Self {
        Self {
            role,
            engine_id: format!("sim-{:016x}", rand::random::<u64>()),
            host,
            port,
            wall_s_per_block: (s_per_block * time_scale).max(0.0),
            held: Mutex::new(Held::default()),
            room_done: Notify::new(),
            link: tokio::sync::Mutex::new(()),
            http: HttpClient::new(),
            stats: Stats::default(),
        }
    }

    /// What `body` asks of this connector (`None`: run whole). A decode request whose params name no
    /// pull (an older proxy's, a producer without a connector) runs whole too, counted as failed.
    pub fn transfer_of(&self, body: &Value) -> Option<Transfer> {
        if let Some(params) = body.get("kv_transfer_params").filter(|p| p.is_object()) {
            let flag = |name: &str| params.get(name).and_then(Value::as_bool) == Some(true);
            if flag("do_remote_decode") && self.role.produces() {
                return Some(Transfer::Produce);
            }
            if flag("do_remote_prefill") && self.role.consumes() {
                let pull = (|| {
                    Some(Transfer::Pull {
                        host: params.get("remote_host")?.as_str()?.to_string(),
                        port: u16::try_from(params.get("remote_port")?.as_u64()?).ok()?,
                        request_id: params.get("remote_request_id")?.as_str()?.to_string(),
                        blocks: params.get("remote_block_ids")?.as_array()?.len(),
                    })
                })();
                if pull.is_none() {
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        ?params,
                        "kv_transfer_params name no pull: computing the prompt here"
                    );
                }
                return pull;
            }
            return None;
        }
        let room = body.get("bootstrap_room").and_then(Value::as_u64)?;
        match self.role {
            KvRole::Producer => Some(Transfer::ProduceRoom { room }),
            KvRole::Consumer => {
                let host = body.get("bootstrap_host").and_then(Value::as_str)?;
                let port = body.get("bootstrap_port").and_then(Value::as_u64)?;
                Some(Transfer::PullRoom {
                    host: host.to_string(),
                    port: u16::try_from(port).ok()?,
                    room,
                })
            }
            // SGLang's workers are one or the other (`--disaggregation-mode`).
            KvRole::Both => None,
        }
    }

    /// A producer's prefill of `blocks` full prompt blocks is about to run (a room opens).
    pub fn started(&self, transfer: &Transfer) {
        if let Transfer::ProduceRoom { room } = transfer {
            let mut held = self.held.lock();
            expire(&mut held);
            held.rooms.insert(*room, (None, Instant::now()));
        }
    }

    /// A producer's prefill of request `request_id` finished with `blocks` full prompt blocks: the
    /// transfer is kept for its pull (the room marked done). Returns the `kv_transfer_params` of the
    /// answer (vLLM's protocol).
    pub fn produced(&self, transfer: &Transfer, request_id: &str, blocks: usize) -> Option<Value> {
        self.stats.handed.fetch_add(1, Ordering::Relaxed);
        let mut held = self.held.lock();
        expire(&mut held);
        match transfer {
            Transfer::Produce => {
                held.transfers
                    .insert(request_id.to_string(), (blocks, Instant::now()));
                Some(json!({
                    "do_remote_prefill": true,
                    "do_remote_decode": false,
                    "remote_engine_id": self.engine_id,
                    "remote_request_id": request_id,
                    "remote_block_ids": (0..blocks).collect::<Vec<_>>(),
                    "remote_host": self.host,
                    "remote_port": self.port,
                    "tp_size": 1,
                }))
            }
            Transfer::ProduceRoom { room } => {
                held.rooms.insert(*room, (Some(blocks), Instant::now()));
                drop(held);
                self.room_done.notify_waiters();
                None
            }
            _ => None,
        }
    }

    /// `POST /sim/kv/pull`: the blocks of a kept transfer, handed over once.
    pub fn hand_over(&self, request_id: &str) -> Option<usize> {
        self.held
            .lock()
            .transfers
            .remove(request_id)
            .map(|(blocks, _)| blocks)
    }

    /// `GET /sim/kv/room/ROOM`: the room's blocks once its prefill finished (waiting up to `wait`).
    pub async fn room(&self, room: u64, wait: Duration) -> Option<usize> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.room_done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some((Some(blocks), _)) = self.held.lock().rooms.get(&room) {
                return Some(*blocks);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }

    /// A consumer's pull for a prompt of `prompt_blocks` full blocks of which it caches
    /// `local_blocks`: asks the producer, then waits for the link and the transfer time. `Some`
    /// with the blocks moved; `None` when the pull failed (compute the prompt here).
    pub async fn pull(
        &self,
        transfer: &Transfer,
        prompt_blocks: usize,
        local_blocks: usize,
    ) -> Option<usize> {
        let remote = match transfer {
            Transfer::Pull {
                host,
                port,
                request_id,
                blocks,
            } => {
                let url = format!("http://{host}:{port}/sim/kv/pull");
                let answer = self
                    .http
                    .post_json(&url, &json!({ "request_id": request_id }))
                    .await;
                answer
                    .ok()
                    .and_then(|v| v.get("blocks").and_then(Value::as_u64))
                    .map(|b| (b as usize).min(*blocks))
            }
            Transfer::PullRoom { host, port, room } => {
                let url = format!("http://{host}:{port}/sim/kv/room/{room}");
                let wait = tokio::time::timeout(ROOM_WAIT, self.http.get_text(&url)).await;
                wait.ok()
                    .and_then(Result::ok)
                    .and_then(|text| serde_json::from_str::<Value>(&text).ok())
                    .and_then(|v| v.get("blocks").and_then(Value::as_u64))
                    .map(|b| b as usize)
            }
            Transfer::Produce | Transfer::ProduceRoom { .. } => return None,
        };
        let Some(remote) = remote else {
            self.stats.failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(?transfer, "KV pull failed: computing the prompt here");
            return None;
        };
        let moved = remote.min(prompt_blocks).saturating_sub(local_blocks);
        {
            let _link = self.link.lock().await;
            if moved > 0 && self.wall_s_per_block > 0.0 {
                tokio::time::sleep(Duration::from_secs_f64(
                    moved as f64 * self.wall_s_per_block,
                ))
                .await;
            }
        }
        self.stats.pulls.fetch_add(1, Ordering::Relaxed);
        self.stats
            .pulled_blocks
            .fetch_add(moved as u64, Ordering::Relaxed);
        Some(moved)
    }

    /// The connector's counters in Prometheus text (appended to `/metrics`).
    pub fn render(&self, model: &str) -> String {
        let mut out = String::new();
        let role = serde_json::to_value(self.role).ok();
        let role = role.as_ref().and_then(Value::as_str).unwrap_or_default();
        let base = format!("model_name=\"{model}\",kv_role=\"{role}\"");
        for (name, help, v) in [
            (
                "kinference_sim_kv_prefills_handed",
                "Prefills run for another worker (kept for its pull, or their room marked done)",
                &self.stats.handed,
            ),
            (
                "kinference_sim_kv_pulls",
                "KV caches pulled from a producer",
                &self.stats.pulls,
            ),
            (
                "kinference_sim_kv_pulled_blocks",
                "Blocks pulled (those already cached here are not)",
                &self.stats.pulled_blocks,
            ),
            (
                "kinference_sim_kv_pull_failures",
                "Decode requests whose KV could not be pulled (computed here instead)",
                &self.stats.failed,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{{{base}}} {}",
                v.load(Ordering::Relaxed)
            );
        }
        out
    }

    /// Facts for `/sim/state`.
    pub fn info(&self) -> Value {
        json!({
            "kv_role": self.role,
            "engine_id": self.engine_id,
            "pulls": self.stats.pulls.load(Ordering::Relaxed),
            "pulled_blocks": self.stats.pulled_blocks.load(Ordering::Relaxed),
            "pull_failures": self.stats.failed.load(Ordering::Relaxed),
            "prefills_handed": self.stats.handed.load(Ordering::Relaxed),
        })
    }
}

/// Drops transfers and rooms older than [`HOLD`] (never pulled).
fn expire(held: &mut Held) {
    let now = Instant::now();
    held.transfers
        .retain(|_, (_, at)| now.duration_since(*at) < HOLD);
    held.rooms
        .retain(|_, (_, at)| now.duration_since(*at) < HOLD);
}
