//! Choosing a worker: the cluster-wide KV index and the time-to-first-token estimate.
//!
//! The gateway calls [`Router::pick`] once per request, before forwarding. The router tokenizes the
//! prompt (once per request: an earlier stage's tokens travel in [`RouteRequest::tokens`]), computes
//! its block keys, estimates the time to first token on every candidate worker and
//! records the choice in its in-flight ledger. The returned [`InFlight`] ticket releases the ledger entry
//! when the request ends (also when it is dropped on an error or an aborted stream).
//!
//! Modules, in the order a request meets them:
//! - [`tokenize`]: the prompt's tokens (the model's tokenizer, or the worker's `/tokenize`);
//! - [`kv_index`]: which workers hold which block keys (fed by [`agents`]), and [`speculative`]
//!   credit for requests just routed;
//! - [`estimate`]: TTFT per candidate from cached prefix, queued work and learned rates; the choice
//!   (near-tie spreading, load guard);
//! - `pair`: prefill/decode disaggregation, the prefill worker and the decode worker of a split
//!   request ([`Router::pick_pair`]);
//! - [`baseline`]: the simple strategies the benchmark compares against;
//! - [`workers`]: the worker table with the in-flight ledger; [`metrics`]: what the router exports;
//! - [`replicas`]: what the other gateway replicas dispatch, held in the same ledger;
//! - [`sessions`]: the worker of each conversation's previous turn, a soft signal in the choice.
//!
//! This file holds the [`Router`] and its decision; beside it `config` (the configuration and the
//! tuning), `candidates` (one decision's candidates and their cached runs) and `ticket` (the
//! [`InFlight`] ticket).
//!
//! Missing signals degrade visibly: without live agent data the estimate uses the gateway's own
//! ledger and speculative credit (kept longer then), and the decision reason says `degraded_*`.

mod adapters;
pub mod agents;
pub mod baseline;
mod candidates;
mod config;
pub mod estimate;
pub mod kv_index;
pub mod metrics;
mod pair;
pub mod pools;
pub mod replicas;
pub mod sessions;
pub mod speculative;
mod ticket;
pub mod tokenize;
pub mod workers;

pub use config::{
    BuildError, ModelConfig, RoutingConfig, RoutingMode, RoutingTuning, WorkerConfig,
};
pub use pair::{Pair, PairRequest};
pub use ticket::InFlight;

use std::fmt;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kinference_api::tokenize::ModelTokenizer;
use parking_lot::{Mutex, RwLock};
use prometheus_client::registry::Registry;

use agents::AgentState;
use estimate::{KernelMissing, Rates, Scored};
use kv_index::KvIndex;
use metrics::{KernelMissingLabels, RouteDecisionLabels};
use sessions::{Answers, Held, SessionKey, Sessions, SessionsConfig};
use speculative::Speculative;
use tokenize::{PromptTokens, Source, Tokenizers};
use workers::{Worker, WorkerTable};

/// The default of [`Router::pd_min_uncached_tokens`]: below about 512 tokens a prefill takes less
/// than a decode step or two on the calibrated worker, less than the second call and the KV pull.
pub const DEFAULT_PD_MIN_UNCACHED_TOKENS: usize = 512;

/// Why no worker was picked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No worker serves this model.
    #[error("model {0:?} is not served here")]
    UnknownModel(String),
    /// Workers serve this model but none can take a request now.
    #[error("no healthy worker serves model {0:?}")]
    NoHealthyWorker(String),
}

/// The prompt of a request, as the client sent it.
#[derive(Clone, Copy, Debug)]
pub enum Prompt<'a> {
    /// `/v1/completions`: the prompt text.
    Text(&'a str),
    /// `/v1/chat/completions` (and translated Anthropic requests): the OpenAI `messages` array.
    Chat(&'a serde_json::Value),
    /// `/v1/completions` with token ids for a prompt (the JSON array as sent): the worker computes
    /// exactly these, so they are the tokens routing hashes, no tokenizer involved.
    Ids(&'a [serde_json::Value]),
}

/// One request to route.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// Requested (served) model name.
    pub model: &'a str,
    /// The prompt.
    pub prompt: Prompt<'a>,
    /// Fill [`Decision::explain`].
    pub debug: bool,
    /// The request's tokens so far, shared by every stage that needs them (`None`: tokenized for
    /// this call alone).
    pub tokens: Option<&'a PromptTokens>,
    /// The `cache_salt` the worker is sent (`None`: unsalted): vLLM hashes it into the prompt's first
    /// block, so the prompt's keys carry it too ([`kinference_api::KeyHasher::salted_keys`]) and
    /// find only the blocks of requests salted alike.
    pub salt: Option<&'a str>,
    /// The conversation the request continues, when the client named one ([`sessions`]).
    pub session: Option<SessionKey>,
    /// The stored answer it continues and whose its own will be (`/v1/responses`; [`sessions`]).
    pub answers: Answers,
}

/// What the decision knows of the conversation a request belongs to.
#[derive(Clone, Copy, Debug, Default)]
struct Continues {
    /// The conversation's name (a soft signal, [`estimate::prefer_session`]).
    session: Option<SessionKey>,
    /// The candidates are the one worker holding the stored answer the request continues.
    pinned: bool,
}

/// The router's choice for one request.
#[derive(Debug)]
pub struct Decision {
    /// Worker base URL.
    pub worker: String,
    /// The worker's data-parallel rank to send the request to (`X-data-parallel-rank`); `None` for
    /// a rank-less worker, which gets no header.
    pub dp_rank: Option<u32>,
    /// Why this worker: `cache_hit`, `least_loaded`, `tie_spread`, `load_guard`, `degraded_*`, or the
    /// baseline mode's name.
    pub reason: &'static str,
    /// Per-candidate estimates, for the `x-kinference-decision` header (only when asked).
    pub explain: Option<String>,
    /// The gateway's own prompt token count, when it tokenized.
    pub prompt_tokens: Option<usize>,
    /// Ledger entry; see [`InFlight`].
    pub ticket: InFlight,
}

/// A worker as the router sees it, for `/readyz`, `/v1/models` and metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerView {
    /// Worker base URL.
    pub url: String,
    /// Served model name.
    pub model: String,
    /// Whether the router would send it requests now.
    pub healthy: bool,
    /// Requests this gateway has in flight there.
    pub in_flight: usize,
    /// Whether a live agent reports its cache and load.
    pub agent_live: bool,
    /// Blocks the KV index believes it holds.
    pub cached_blocks: usize,
}

/// The rates a worker starts from: its model's engine profile where the configuration names one
/// ([`estimate::profiles`]), else the tuning's priors.
struct Priors {
    default: Rates,
    by_model: std::collections::HashMap<String, Rates>,
}

impl Priors {
    fn new(models: &[ModelConfig], cfg: &estimate::EstimatorConfig) -> Result<Self, BuildError> {
        let mut by_model = std::collections::HashMap::new();
        for m in models {
            if let Some(name) = &m.profile {
                by_model.insert(m.name.clone(), Self::profiled(&m.name, name)?);
            }
        }
        Ok(Self {
            default: Rates::prior(cfg),
            by_model,
        })
    }

    /// The priors of `model` under the profile called `name`; an unknown name is refused.
    fn profiled(model: &str, name: &str) -> Result<Rates, BuildError> {
        estimate::profiles::profile(name)
            .map(Rates::from_profile)
            .ok_or_else(|| BuildError::UnknownProfile {
                model: model.to_string(),
                name: name.to_string(),
                known: estimate::profiles::names().join(", "),
            })
    }

    /// The priors of `model`'s workers.
    fn of(&self, model: &str) -> &Rates {
        self.by_model.get(model).unwrap_or(&self.default)
    }
}

impl Shared {
    /// The rates a new worker of `model` starts from.
    fn prior_of(&self, model: &str) -> Rates {
        self.priors.read().of(model).clone()
    }
}

/// State shared by the router, its agent tasks and the in-flight tickets.
struct Shared {
    mode: RoutingMode,
    /// Workers known to run (true) or not to run (false) vLLM's `--scheduling-policy priority`,
    /// from their pool; the others follow `default_priority`.
    priority_scheduling: RwLock<std::collections::HashMap<String, bool>>,
    /// Whether workers no pool speaks for run priority scheduling (`gateway.yaml`).
    default_priority: std::sync::atomic::AtomicBool,
    tuning: RoutingTuning,
    priors: RwLock<Priors>,
    /// Rates learned from every worker's observations, per model; workers with few samples borrow
    /// their model's.
    fleet_rates: Mutex<std::collections::HashMap<String, Rates>>,
    workers: RwLock<WorkerTable>,
    /// The workers' decision rows (the table's, reachable without its lock).
    rows: Arc<workers::rows::Rows>,
    index: RwLock<KvIndex>,
    /// The keys workers hold only in a lower tier (CPU offload, disk, LMCache): hits that cost a load.
    offloaded: RwLock<KvIndex>,
    spec: Mutex<Speculative>,
    /// Agents by number; only ever grows (a removed agent is retired in place).
    agents: RwLock<Vec<Arc<Mutex<AgentState>>>>,
    tokenizers: Tokenizers,
    metrics: metrics::Metrics,
    /// This mode's series of `metrics.stage_seconds`.
    stages: metrics::StageTimers,
    round_robin: AtomicUsize,
    last_degraded_log: Mutex<Option<Instant>>,
    /// When a missing kernel view was last logged.
    last_kernel_log: Mutex<Option<Instant>>,
    gateway_id: String,
    /// Mutual TLS to the agents (`--agent-tls-*`): their `http://` URLs are dialled as `https://`.
    agent_tls: Option<kinference_api::tls::ClientTls>,
    /// The gateway's `disaggregation.min_uncached_tokens` (pools may set their own).
    pd_min_uncached_tokens: AtomicUsize,
    /// The other replicas' requests in flight ([`replicas`]).
    peer_ledger: replicas::PeerLedger,
    /// Where this replica's dispatches go to the others (set once sharing starts).
    outbox: std::sync::OnceLock<Arc<replicas::Outbox>>,
    /// A replica silent this long is forgotten (`replicas.forget_after_ms`).
    replica_forget_after_ms: std::sync::atomic::AtomicU64,
    /// `sessions:` of `gateway.yaml`.
    session_config: RwLock<SessionsConfig>,
    /// The worker of each conversation's previous turn.
    sessions: Mutex<Sessions>,
}

impl Shared {
    fn update_index_metrics(&self) {
        let index = self.index.read();
        self.metrics.index_pairs.set(index.pairs() as i64);
        self.metrics.index_bytes.set(index.memory_bytes() as i64);
        let evictions = index.evictions();
        drop(index);
        let counted = self.metrics.index_evictions.get();
        if evictions > counted {
            self.metrics.index_evictions.inc_by(evictions - counted);
        }
    }

    /// Agent number `a`.
    fn agent(&self, a: usize) -> Arc<Mutex<AgentState>> {
        Arc::clone(&self.agents.read()[a])
    }

    /// Whether any agent is configured or discovered (not retired).
    fn has_agents(&self) -> bool {
        self.agents.read().iter().any(|a| !a.lock().retired)
    }

    /// Which agents' data is usable now.
    pub(super) fn fresh_agents(&self, now: Instant) -> Vec<bool> {
        self.agents
            .read()
            .iter()
            .map(|a| a.lock().fresh(now, self.tuning.stale_after))
            .collect()
    }

    /// Counts the candidates estimated without their kernel view; logs it at most once a minute (a missing
    /// agent is already logged as a degraded decision).
    fn note_kernel_missing(&self, cands: &[candidates::Candidate<'_>]) {
        // One count per reason, one label lookup per reason seen: this runs on every decision.
        let mut counts = [0u64; 3];
        let reasons = [
            KernelMissing::NoAgent,
            KernelMissing::EbpfOff,
            KernelMissing::Stale,
        ];
        for c in cands {
            if let Some(why) = c.kernel_missing {
                counts[reasons.iter().position(|r| *r == why).unwrap_or(0)] += 1;
            }
        }
        for (reason, n) in reasons.iter().zip(counts) {
            if n > 0 {
                self.metrics
                    .kernel_view_missing
                    .get_or_create(&KernelMissingLabels {
                        reason: reason.as_str().to_string(),
                    })
                    .inc_by(n);
            }
        }
        let Some((why, worker)) = cands.iter().find_map(|c| {
            c.kernel_missing
                .filter(|w| *w != KernelMissing::NoAgent)
                .map(|w| (w, c.worker.url.as_str()))
        }) else {
            return;
        };
        let mut last = self.last_kernel_log.lock();
        let now = Instant::now();
        if last.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(60)) {
            *last = Some(now);
            tracing::warn!(
                reason = why.as_str(),
                worker,
                "no kernel-level queue view: other gateways' requests on this worker are seen only through its scraped counters"
            );
        }
    }

    /// `worker` made the stored answer `id` of `owner` ([`sessions`]): remembered here, and told
    /// to the other replicas so that its follow-ups go there whichever replica they reach.
    fn remember_answer(&self, id: &str, owner: sessions::Owner, worker: &Worker) {
        let Some(key) = SessionKey::answer(id) else {
            return;
        };
        {
            let mut sessions = self.sessions.lock();
            sessions.record_answer(key, owner, worker.id, Instant::now());
            self.metrics.sessions.set(sessions.len() as i64);
        }
        if let Some(outbox) = self.outbox.get() {
            outbox.send(replicas::Note::Answer {
                id: id.to_string(),
                owner: owner.to_wire(),
                worker: worker.url.clone(),
                dp_rank: worker.dp_rank,
            });
        }
    }

    /// Logs a degraded decision at most every 10 s.
    fn log_degraded(&self, reason: &'static str, model: &str) {
        let mut last = self.last_degraded_log.lock();
        let now = Instant::now();
        if last.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(10)) {
            *last = Some(now);
            tracing::warn!(
                reason,
                model,
                "routing degraded: estimating from the gateway's own ledger and credit"
            );
        }
    }
}

/// Picks a worker for each request. Cheap to share: wrap it in an `Arc`.
pub struct Router {
    shared: Arc<Shared>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl fmt::Debug for Router {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Router")
            .field("mode", &self.shared.mode)
            .field("workers", &self.shared.workers.read().all().len())
            .field("agents", &self.shared.agents.read().len())
            .finish()
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        for a in self.shared.agents.read().iter() {
            if let Some(task) = a.lock().task.take() {
                task.abort();
            }
        }
    }
}

impl Router {
    /// Builds a router from the gateway configuration (default tuning).
    pub fn new(config: RoutingConfig) -> Result<Self, BuildError> {
        Self::with_tuning(config, RoutingTuning::default())
    }

    /// Builds a router with explicit tuning. Starts one task per agent (inside the current runtime).
    pub fn with_tuning(config: RoutingConfig, tuning: RoutingTuning) -> Result<Self, BuildError> {
        Self::with_agent_tls(config, tuning, None)
    }

    /// [`Router::with_tuning`], watching the agents over mutual TLS when `agent_tls` is given.
    pub fn with_agent_tls(
        config: RoutingConfig,
        tuning: RoutingTuning,
        agent_tls: Option<kinference_api::tls::ClientTls>,
    ) -> Result<Self, BuildError> {
        if config.workers.len() > kv_index::MAX_WORKERS {
            return Err(BuildError::TooManyWorkers(config.workers.len()));
        }
        let priors = Priors::new(&config.models, &tuning.estimator)?;
        let mut table = WorkerTable::default();
        for w in &config.workers {
            if table.get(&w.url).is_some() {
                return Err(BuildError::DuplicateWorker(w.url.clone()));
            }
            if let Some(worker) = table.get_or_add(&w.url, &w.model, true, priors.of(&w.model))
                && w.role != kinference_api::WorkerRole::Both
            {
                worker.state.lock().pin_role(w.role);
            }
        }
        let tokenizers = Tokenizers::load(
            config
                .models
                .iter()
                .map(|m| (m.name.as_str(), m.tokenizer_dir.as_deref())),
        )
        .map_err(|(model, error)| BuildError::Tokenizer { model, error })?;
        let metrics = metrics::Metrics::default();
        let stages =
            metrics.stage_timers(config.mode.as_str(), config.mode == RoutingMode::Kinference);
        let shared = Arc::new(Shared {
            mode: config.mode,
            priority_scheduling: RwLock::default(),
            default_priority: Default::default(),
            fleet_rates: Mutex::default(),
            priors: RwLock::new(priors),
            rows: Arc::clone(table.rows()),
            workers: RwLock::new(table),
            index: RwLock::new(KvIndex::new(tuning.index_max_pairs)),
            offloaded: RwLock::new(KvIndex::new(tuning.index_max_pairs)),
            spec: Mutex::new(Speculative::new(tuning.speculative_max_keys)),
            agents: RwLock::new(
                config
                    .agents
                    .iter()
                    .map(|a| Arc::new(Mutex::new(AgentState::new(a))))
                    .collect(),
            ),
            tokenizers,
            metrics,
            stages,
            round_robin: AtomicUsize::new(0),
            last_degraded_log: Mutex::new(None),
            last_kernel_log: Mutex::new(None),
            gateway_id: format!("kinference-gateway-{}", std::process::id()),
            agent_tls,
            tuning,
            pd_min_uncached_tokens: AtomicUsize::new(DEFAULT_PD_MIN_UNCACHED_TOKENS),
            peer_ledger: replicas::PeerLedger::default(),
            outbox: std::sync::OnceLock::new(),
            replica_forget_after_ms: std::sync::atomic::AtomicU64::new(
                replicas::ReplicasConfig::default().forget_after_ms,
            ),
            session_config: RwLock::new(SessionsConfig::default()),
            sessions: Mutex::new(Sessions::new(&SessionsConfig::default())),
        });
        let mut tasks = Vec::new();
        let count = shared.agents.read().len();
        if count > 0 && shared.tuning.connect_agents {
            let handle =
                tokio::runtime::Handle::try_current().map_err(|_| BuildError::NoRuntime)?;
            for a in 0..count {
                let task = handle.spawn(agents::run(Arc::clone(&shared), a));
                shared.agent(a).lock().task = Some(task.abort_handle());
                tasks.push(task);
            }
        }
        Ok(Self { shared, tasks })
    }

    /// Prompt tokens left to compute on the best decode worker below which a request to a pool
    /// with `prefill` workers runs whole on one worker (the gateway's default; a pool's
    /// `disaggregation.minUncachedTokens` wins).
    pub fn pd_min_uncached_tokens(&self) -> usize {
        self.shared.pd_min_uncached_tokens.load(Ordering::Relaxed)
    }

    /// Sets [`Router::pd_min_uncached_tokens`] (`gateway.yaml`'s `disaggregation`).
    pub fn set_pd_min_uncached_tokens(&self, tokens: usize) {
        self.shared
            .pd_min_uncached_tokens
            .store(tokens, Ordering::Relaxed);
    }

    /// Shares this replica's dispatches with the other replicas in `config.peers` and holds theirs
    /// ([`replicas`]); the sweep of silent peers runs even with no peers configured (others may
    /// still post here). `admin_key` is what the peers' admin ports expect (replicas share one).
    /// Call once, inside the runtime; later calls change nothing.
    pub fn share_with_replicas(
        &self,
        config: &replicas::ReplicasConfig,
        admin_key: Option<String>,
        discovered: Option<tokio::sync::watch::Receiver<std::collections::BTreeSet<String>>>,
    ) {
        if self.shared.outbox.get().is_some() {
            return;
        }
        self.shared
            .replica_forget_after_ms
            .store(config.forget_after_ms.max(1), Ordering::Relaxed);
        let discovering = discovered.is_some();
        if let Some(outbox) = replicas::start(&self.shared, config, admin_key, discovered) {
            let _ = self.shared.outbox.set(outbox);
        }
        if !config.peers.is_empty() || discovering {
            tracing::info!(
                peers = config.peers.len(),
                discovering,
                "sharing dispatches with gateway replicas"
            );
        }
    }

    /// Applies `sessions:` of `gateway.yaml`; the sessions remembered so far are forgotten.
    pub fn configure_sessions(&self, config: &SessionsConfig) {
        *self.shared.sessions.lock() = Sessions::new(config);
        *self.shared.session_config.write() = config.clone();
        self.shared.metrics.sessions.set(0);
    }

    /// Sessions remembered now.
    pub fn sessions_remembered(&self) -> usize {
        self.shared.sessions.lock().len()
    }

    /// Applies a batch another replica posted ([`replicas::PATH`]); peers silent longer than
    /// `replicas.forget_after_ms` are forgotten.
    pub fn apply_replica_batch(&self, batch: replicas::Batch) {
        // A discovered peer list holds this replica too: its own batches are not a peer's.
        if self
            .shared
            .outbox
            .get()
            .is_some_and(|outbox| outbox.is_mine(&batch))
        {
            return;
        }
        let forget_after =
            Duration::from_millis(self.shared.replica_forget_after_ms.load(Ordering::Relaxed));
        replicas::apply(&self.shared, batch, Instant::now(), forget_after);
    }

    /// Forgets the replicas silent at `now` for longer than `forget_after` (the periodic sweep does
    /// this with the real clock; tests pass a later `now`).
    pub fn forget_silent_replicas(&self, now: Instant, forget_after: Duration) {
        replicas::sweep(&self.shared, now, forget_after);
    }

    /// Requests the other replicas told this one they have in flight.
    pub fn replica_requests_in_flight(&self) -> usize {
        self.shared.peer_ledger.tickets()
    }

    /// The routing mode.
    pub fn mode(&self) -> RoutingMode {
        self.shared.mode
    }

    /// The gateway's own tokenizer for `model` (none configured: `None`).
    pub fn tokenizer(&self, model: &str) -> Option<Arc<ModelTokenizer>> {
        self.shared.tokenizers.local(model).cloned()
    }

    /// Picks a worker for `req` and records it in the in-flight ledger.
    pub async fn pick(&self, req: RouteRequest<'_>) -> Result<Decision, RouteError> {
        let candidates = self.candidates(req.model)?;
        Ok(self.pick_from(req, &candidates).await)
    }

    /// The worker of `model` with the fewest requests in flight, for requests with no prompt cache
    /// to exploit (embeddings, tokenizing); recorded in the in-flight ledger like any pick.
    pub fn pick_least_loaded(&self, model: &str, debug: bool) -> Result<Decision, RouteError> {
        let candidates = self.candidates(model)?;
        Ok(self.least_loaded_of(&candidates, debug))
    }

    /// The least loaded of `candidates` (non-empty), recorded.
    fn least_loaded_of(&self, candidates: &[Arc<Worker>], debug: bool) -> Decision {
        let (i, _) = baseline::pick(
            RoutingMode::LeastOutstanding,
            candidates,
            Prompt::Text(""),
            &self.shared.tuning,
            &self.shared.round_robin,
        );
        self.record_simple(candidates, i, "least_loaded", debug)
    }

    /// [`Router::pick`] among `candidates` (non-empty), in the `routing` span (the choice and, from
    /// the estimate, the chosen worker's cached tokens and estimated time to first token).
    async fn pick_from(&self, req: RouteRequest<'_>, candidates: &[Arc<Worker>]) -> Decision {
        use tracing::field::Empty;
        let span = tracing::debug_span!(
            "routing",
            model = req.model,
            mode = self.shared.mode.as_str(),
            candidates = candidates.len(),
            worker = Empty,
            dp_rank = Empty,
            reason = Empty,
            prompt_tokens = Empty,
            cached_tokens = Empty,
            queue_s = Empty,
            est_ttft_s = Empty,
        );
        let owner = req.answers.owner;
        let mut decision =
            tracing::Instrument::instrument(self.pick_from_in_span(req, candidates), span.clone())
                .await;
        decision.ticket.answers_for(owner);
        span.record("worker", decision.worker.as_str());
        if let Some(rank) = decision.dp_rank {
            span.record("dp_rank", rank);
        }
        span.record("reason", decision.reason);
        if let Some(tokens) = decision.prompt_tokens {
            span.record("prompt_tokens", tokens);
        }
        decision
    }

    async fn pick_from_in_span(
        &self,
        req: RouteRequest<'_>,
        candidates: &[Arc<Worker>],
    ) -> Decision {
        let shared = &self.shared;
        // A request continuing a stored answer can only be served where the answer is held.
        let held = match self.answer_held(&req.answers) {
            Held::By(id) => candidates.iter().find(|w| w.id == id).cloned(),
            Held::Unknown | Held::Foreign => None,
        };
        let pinned = held.is_some();
        let candidates = match &held {
            Some(worker) => std::slice::from_ref(worker),
            None => candidates,
        };
        if shared.mode != RoutingMode::Kinference {
            let started = Instant::now();
            let (i, reason) = baseline::pick(
                shared.mode,
                candidates,
                req.prompt,
                &shared.tuning,
                &shared.round_robin,
            );
            let reason = if pinned {
                estimate::Why::PreviousResponse.as_str()
            } else {
                reason
            };
            let decision = self.record_simple(candidates, i, reason, req.debug);
            shared
                .stages
                .decide
                .observe(started.elapsed().as_secs_f64());
            return decision;
        }
        match self.prompt_tokens(req, candidates).await {
            Some(tokens) => {
                let started = Instant::now();
                let decision = self.decide(
                    req.model,
                    req.salt,
                    Continues {
                        session: req.session,
                        pinned,
                    },
                    candidates,
                    &tokens,
                    req.debug,
                );
                shared
                    .stages
                    .decide
                    .observe(started.elapsed().as_secs_f64());
                decision
            }
            None => {
                shared.log_degraded("degraded_no_tokens", req.model);
                let (i, _) = baseline::pick(
                    RoutingMode::LeastOutstanding,
                    candidates,
                    req.prompt,
                    &shared.tuning,
                    &shared.round_robin,
                );
                let reason = if pinned {
                    estimate::Why::PreviousResponse.as_str()
                } else {
                    "degraded_no_tokens"
                };
                self.record_simple(candidates, i, reason, req.debug)
            }
        }
    }

    /// Where the stored answer `answers` continues is held, as its caller may see it
    /// ([`sessions`]): the pipeline refuses another tenant's answer before routing.
    pub fn answer_held(&self, answers: &Answers) -> Held {
        // Most requests continue no answer: no need to take the sessions' lock for them.
        if answers.continues.is_none() {
            return Held::Unknown;
        }
        self.shared.sessions.lock().answer(answers, Instant::now())
    }

    /// Stage "tokenize", before anything is routed: `prompt`'s tokens for `model` into `tokens` when
    /// the gateway has that model's tokenizer and routes on tokens (no byte leaves the gateway). A
    /// worker's `/tokenize` is only asked later, by the stage that knows which workers may see the
    /// prompt.
    pub async fn tokenize_locally(&self, model: &str, prompt: Prompt<'_>, tokens: &PromptTokens) {
        if self.shared.mode != RoutingMode::Kinference
            || !self.shared.tokenizers.has_local(model)
            || tokens.get(model).is_some()
        {
            return;
        }
        let req = RouteRequest {
            model,
            prompt,
            debug: false,
            tokens: Some(tokens),
            salt: None,
            session: None,
            answers: Answers::default(),
        };
        self.prompt_tokens(req, &[]).await;
    }

    /// `req`'s tokens for `req.model`: the request's own when a stage already tokenized it for this
    /// model, else tokenized now (the gateway's tokenizer, or the `/tokenize` of the least busy of
    /// `candidates`) and kept in the request's [`PromptTokens`]. `None`: not tokenized.
    async fn prompt_tokens(
        &self,
        req: RouteRequest<'_>,
        candidates: &[Arc<Worker>],
    ) -> Option<Arc<[u32]>> {
        if let Some(known) = req.tokens.and_then(|t| t.get(req.model)) {
            return known;
        }
        let shared = &self.shared;
        if candidates.is_empty() && !shared.tokenizers.has_local(req.model) {
            // No one may be asked now; a later stage with workers to ask may still tokenize.
            return None;
        }
        let fallback = candidates
            .iter()
            .min_by_key(|w| w.state.read().in_flight)
            .map(|w| w.url.clone());
        let started = Instant::now();
        let result = shared
            .tokenizers
            .tokens(req.model, req.prompt, fallback.as_deref())
            .await;
        if let Some(tokenize) = &shared.stages.tokenize {
            tokenize.observe(started.elapsed().as_secs_f64());
        }
        let (source, tokens) = match result {
            Ok((tokens, Source::Local)) => ("local", Some(Arc::from(tokens))),
            Ok((tokens, Source::Remote)) => ("worker", Some(Arc::from(tokens))),
            Ok((tokens, Source::Given)) => ("given", Some(Arc::from(tokens))),
            Err(e) => {
                tracing::debug!(model = req.model, error = %e, "prompt not tokenized");
                ("failed", None)
            }
        };
        shared
            .metrics
            .tokenize
            .get_or_create(&metrics::TokenizeLabels {
                model: req.model.to_string(),
                source: source.to_string(),
            })
            .inc();
        if let Some(cache) = req.tokens {
            cache.set(req.model, tokens.clone());
        }
        tokens
    }

    /// The decision stage alone, for a prompt already tokenized (the benchmark measures this; an
    /// embedding that tokenizes elsewhere can call it). Always the Kinference estimate.
    pub fn pick_tokens(
        &self,
        model: &str,
        tokens: &[u32],
        debug: bool,
    ) -> Result<Decision, RouteError> {
        let candidates = self.candidates(model)?;
        Ok(self.decide(
            model,
            None,
            Continues::default(),
            &candidates,
            tokens,
            debug,
        ))
    }

    /// Applies one summary as if agent number `agent` (its index in the configured `agents`) had
    /// streamed it, and marks that agent connected. For routers built with
    /// `RoutingTuning::connect_agents = false` (tests, benchmarks, an agent embedded in-process).
    pub fn apply_agent_summary(&self, agent: usize, summary: kinference_api::summary::Summary) {
        if agent >= self.shared.agents.read().len() {
            return;
        }
        {
            let agent_state = self.shared.agent(agent);
            let mut st = agent_state.lock();
            if !st.connected {
                st.connected = true;
                st.since = Instant::now();
            }
        }
        agents::apply(&self.shared, agent, summary);
    }

    /// The gRPC URLs of the agents the router follows (configured and discovered, not removed).
    pub fn agent_urls(&self) -> Vec<String> {
        self.shared
            .agents
            .read()
            .iter()
            .filter_map(|a| {
                let st = a.lock();
                (!st.retired).then(|| st.url.clone())
            })
            .collect()
    }

    /// Starts following agent `url` (discovery found it); false when it is already followed. Its
    /// stream task runs in the current runtime (none without one, or with `connect_agents` off).
    pub fn add_agent(&self, url: &str) -> bool {
        let a = {
            let mut agents = self.shared.agents.write();
            if agents.iter().any(|a| {
                let st = a.lock();
                !st.retired && st.url == url
            }) {
                return false;
            }
            agents.push(Arc::new(Mutex::new(AgentState::new(url))));
            agents.len() - 1
        };
        if self.shared.tuning.connect_agents
            && let Ok(handle) = tokio::runtime::Handle::try_current()
        {
            let task = handle.spawn(agents::run(Arc::clone(&self.shared), a));
            self.shared.agent(a).lock().task = Some(task.abort_handle());
        }
        tracing::info!(agent = %url, "agent added");
        true
    }

    /// Stops following agent `url` (its endpoint left discovery) and forgets its workers' cache view
    /// and load; false when it was not followed.
    pub fn remove_agent(&self, url: &str) -> bool {
        let found: Vec<usize> = self
            .shared
            .agents
            .read()
            .iter()
            .enumerate()
            .filter(|(_, a)| {
                let st = a.lock();
                !st.retired && st.url == url
            })
            .map(|(i, _)| i)
            .collect();
        for &a in &found {
            agents::retire(&self.shared, a);
        }
        if !found.is_empty() {
            tracing::info!(agent = %url, "agent removed");
        }
        !found.is_empty()
    }

    /// Healthy candidates for `model`, or why there are none.
    fn candidates(&self, model: &str) -> Result<Vec<Arc<Worker>>, RouteError> {
        let table = self.shared.workers.read();
        let c = table.candidates(model);
        if c.is_empty() {
            return Err(if table.knows_model(model) {
                RouteError::NoHealthyWorker(model.to_string())
            } else {
                RouteError::UnknownModel(model.to_string())
            });
        }
        Ok(c)
    }

    /// Records a decision made without an estimate (baselines, no tokens).
    fn record_simple(
        &self,
        candidates: &[Arc<Worker>],
        i: usize,
        reason: &'static str,
        debug: bool,
    ) -> Decision {
        let shared = &self.shared;
        let explain = debug.then(|| {
            candidates
                .iter()
                .map(|w| format!("{} in_flight={}", w.label(), w.state.read().in_flight))
                .collect::<Vec<_>>()
                .join("; ")
        });
        let worker = Arc::clone(&candidates[i]);
        {
            let mut st = worker.state.lock();
            st.in_flight += 1;
            st.awaiting_first_token += 1;
            st.log.started(Instant::now());
        }
        self.count(reason, 0);
        Decision {
            worker: worker.url.clone(),
            dp_rank: worker.dp_rank,
            reason,
            explain,
            prompt_tokens: None,
            ticket: InFlight::new(Arc::clone(shared), worker, None, None, None, None),
        }
    }

    fn count(&self, reason: &'static str, cached_tokens: usize) {
        let m = &self.shared.metrics;
        m.decisions
            .get_or_create(&RouteDecisionLabels {
                mode: self.shared.mode.as_str().to_string(),
                reason: reason.to_string(),
            })
            .inc();
        m.predicted_cached_tokens.inc_by(cached_tokens as u64);
    }

    /// The estimate-based decision for a tokenized prompt (synchronous: no lock is held across an
    /// await, and the benchmark measures exactly this).
    fn decide(
        &self,
        model: &str,
        salt: Option<&str>,
        continues: Continues,
        workers: &[Arc<Worker>],
        tokens: &[u32],
        debug: bool,
    ) -> Decision {
        let shared = &self.shared;
        let tuning = &shared.tuning;
        let now = Instant::now();
        let mut cands = shared.candidates_at(workers, now);
        shared.note_kernel_missing(&cands);
        let keys_by_size = shared.cached_runs(model, salt, tokens, &mut cands, now);

        let prompt_tokens = tokens.len();
        let est_cfg = &tuning.estimator;
        let mut estimates = Vec::with_capacity(cands.len());
        let mut scored = Vec::with_capacity(cands.len());
        for c in &cands {
            let inputs = c.inputs(prompt_tokens);
            let e = estimate::estimate(&c.rates, &inputs, est_cfg);
            scored.push(Scored {
                cost_s: e.cost_s,
                load: inputs.running,
                cached_tokens: inputs.cached_tokens,
                held_blocks: c.held_blocks,
            });
            estimates.push((inputs, e));
        }
        // Near-ties by the prompt's leading tokens: every replica breaks them alike.
        let seed = spread_seed(tokens);
        let rank = |i: usize| spread_rank(seed, &cands[i].worker.url);
        let (mut pick, mut why) =
            estimate::choose_spread(&scored, est_cfg, &mut rand::rng(), Some(&rank))
                .unwrap_or((0, estimate::Why::LeastLoaded));
        let session = continues
            .session
            .filter(|_| shared.session_config.read().enabled);
        if continues.pinned {
            why = estimate::Why::PreviousResponse;
        } else if let Some(key) = session {
            let held = shared.sessions.lock().worker(key, now);
            let slack = shared.session_config.read().slack;
            if let Some(j) = held.and_then(|id| cands.iter().position(|c| c.worker.id == id))
                && estimate::prefer_session(&scored, pick, j, slack, est_cfg)
            {
                pick = j;
                why = estimate::Why::Session;
            }
        }
        let any_live = cands.iter().any(|c| c.live);
        // A pinned request had one candidate: no estimate, degraded or not, chose it.
        let reason = if any_live || continues.pinned {
            why.as_str()
        } else if !shared.has_agents() {
            "degraded_no_agent"
        } else {
            "degraded_stale"
        };
        if !any_live && !continues.pinned {
            shared.log_degraded(reason, model);
        }

        let chosen = &cands[pick];
        if let Some(key) = session {
            let mut sessions = shared.sessions.lock();
            sessions.record(key, chosen.worker.id, now);
            shared.metrics.sessions.set(sessions.len() as i64);
        }
        let (inputs, est) = estimates[pick];
        if crate::telemetry::tracing_enabled() {
            let span = tracing::Span::current();
            span.record("cached_tokens", inputs.cached_tokens);
            span.record("queue_s", est.queue_s);
            span.record("est_ttft_s", est.ttft_s);
        }
        // What the worker will do for this prompt, in prefill tokens: the computed ones (with their
        // attention) and the loads.
        let uncached = est.prefill;
        let keys = keys_by_size
            .iter()
            .find(|(bs, _)| *bs == chosen.block_size)
            .map(|(_, keys)| Arc::clone(keys));
        let (position, prompt) = {
            let mut st = chosen.worker.state.lock();
            st.in_flight += 1;
            st.awaiting_first_token += 1;
            st.log.started(now);
            st.avg_uncached = 0.9 * st.avg_uncached + 0.1 * uncached;
            let prompt = keys
                .as_ref()
                .map(|keys| st.prompts.add(Arc::clone(keys), now, est.ttft_s));
            (
                st.backlog.push(uncached, now, chosen.rates.s_per_token),
                prompt,
            )
        };
        if let Some(keys) = &keys {
            let ttl = if chosen.live {
                tuning.speculative_ttl
            } else {
                tuning.speculative_ttl_no_agent
            };
            let mut spec = shared.spec.lock();
            spec.credit(Arc::clone(keys), chosen.worker.id, now, now + ttl);
            shared
                .metrics
                .speculative_keys
                .set(spec.total_keys() as i64);
        }
        // The other replicas hold this request in their ledgers until its end.
        let share = shared.outbox.get().map(|outbox| {
            let id = outbox.next_id();
            outbox.send(replicas::Note::Dispatch {
                id,
                worker: chosen.worker.url.clone(),
                dp_rank: chosen.worker.dp_rank,
                keys: keys
                    .as_ref()
                    .map(|k| k[..k.len().min(replicas::MAX_KEYS)].to_vec())
                    .unwrap_or_default(),
                uncached_tokens: uncached,
                est_ttft_s: est.ttft_s,
            });
            (Arc::clone(outbox) as Arc<dyn ticket::Announce>, id)
        });
        // With a live agent, the credit ends soon after the first token (the events take over).
        let credit = keys.filter(|_| chosen.live);
        self.count(reason, inputs.cached_tokens);

        let explain = debug.then(|| {
            let mut s = String::new();
            for (i, (c, (inp, e))) in cands.iter().zip(estimates.iter()).enumerate() {
                if i > 0 {
                    s.push_str("; ");
                }
                let _ = write!(
                    s,
                    "{}{} cached={} offloaded={} queue_tokens={:.0} running={} queue_s={:.4} prefill={:.0} est_s={:.4} cost_s={:.4} us_per_token={:.2}(own:{:.2} n:{} late:{:.1}) agent={} kernel={} signal={} others={} others_waiting={} held_blocks={} kv={}",
                    if i == pick { "*" } else { "" },
                    c.worker.label(),
                    inp.cached_tokens,
                    inp.offloaded_tokens,
                    inp.queue_tokens,
                    inp.running,
                    e.queue_s,
                    e.prefill,
                    e.ttft_s,
                    e.cost_s,
                    c.rates.s_per_token * 1e6,
                    c.own_s_per_token * 1e6,
                    c.rates.rate_samples,
                    c.late,
                    if c.live { "live" } else { "none" },
                    c.kernel_missing.map_or("live", KernelMissing::as_str),
                    c.signal.as_str(),
                    c.queue.others,
                    c.queue.others_waiting,
                    c.held_blocks,
                    c.kv_room.map_or_else(
                        || "capacity_unknown".to_string(),
                        |r| format!(
                            "capacity:{} in_use:{} queued:{} free:{} run:{}->{} pinned:{}",
                            r.capacity,
                            r.in_use,
                            r.queued,
                            r.free(),
                            c.run,
                            c.surviving_run(),
                            c.pinned
                        )
                    ),
                );
            }
            s
        });
        Decision {
            worker: chosen.worker.url.clone(),
            dp_rank: chosen.worker.dp_rank,
            reason,
            explain,
            prompt_tokens: Some(prompt_tokens),
            ticket: InFlight::new(
                Arc::clone(shared),
                Arc::clone(chosen.worker),
                Some(position),
                Some(est.work),
                credit,
                prompt,
            )
            .shared_as(share),
        }
    }

    /// Every worker the router may route to: configured, or discovered and not removed since (a
    /// removed worker is listed again when discovery or an agent brings it back). A worker of
    /// several data-parallel ranks is one entry: its ranks' requests and blocks added up.
    pub fn workers(&self) -> Vec<WorkerView> {
        let mut views: Vec<WorkerView> = Vec::new();
        for view in self.caches() {
            match views.iter_mut().find(|v| v.url == view.url) {
                Some(v) => {
                    v.healthy |= view.healthy;
                    v.in_flight += view.in_flight;
                    v.agent_live |= view.agent_live;
                    v.cached_blocks += view.cached_blocks;
                }
                None => views.push(view),
            }
        }
        views
    }

    /// [`Router::workers`], each data-parallel rank apart.
    fn caches(&self) -> Vec<WorkerView> {
        let now = Instant::now();
        let fresh = self.shared.fresh_agents(now);
        let table = self.shared.workers.read();
        let index = self.shared.index.read();
        table
            .all()
            .iter()
            .filter_map(|w| {
                let st = w.state.read();
                (!st.gone).then(|| WorkerView {
                    url: w.url.clone(),
                    model: w.model.clone(),
                    healthy: st.healthy,
                    in_flight: st.in_flight,
                    agent_live: st
                        .agent
                        .is_some_and(|a| fresh.get(a).copied().unwrap_or(false)),
                    cached_blocks: index.worker_blocks(w.id),
                })
            })
            .collect()
    }

    /// Sets the engine profile of `model` (an `InferenceModel`'s `engineProfile`, on every reload): its
    /// new workers start from the profile's priors, and its workers already there price attention by
    /// it at once (what they have learned stays; one that has learned nothing takes the new priors).
    /// `None` goes back to the defaults. An unknown name is refused and changes nothing.
    pub fn set_model_profile(&self, model: &str, profile: Option<&str>) -> Result<(), BuildError> {
        let rates = profile
            .map(|name| Priors::profiled(model, name))
            .transpose()?;
        {
            let mut priors = self.shared.priors.write();
            if priors.by_model.get(model) == rates.as_ref() {
                return Ok(());
            }
            match &rates {
                Some(r) => priors.by_model.insert(model.to_string(), r.clone()),
                None => priors.by_model.remove(model),
            };
        }
        let prior = self.shared.prior_of(model);
        for w in self.shared.workers.read().all() {
            if w.model != model {
                continue;
            }
            let mut st = w.state.lock();
            if st.rates.samples == 0 {
                st.rates = prior.clone();
            } else {
                st.rates.attention_pair_tokens = prior.attention_pair_tokens;
            }
        }
        if let Some(fleet) = self.shared.fleet_rates.lock().get_mut(model) {
            fleet.attention_pair_tokens = prior.attention_pair_tokens;
        }
        Ok(())
    }

    /// Marks a worker healthy or not (gateway-http's health prober and refused connections call it).
    /// Unhealthy workers are not candidates.
    pub fn set_healthy(&self, worker: &str, healthy: bool) {
        for w in self.shared.workers.read().at_url(worker) {
            w.state.lock().healthy = healthy;
        }
    }

    /// Adds a worker found by in-cluster discovery, or brings back one that left; `false` when the
    /// table is full. A known URL keeps the model it was first added with.
    pub fn upsert_worker(&self, url: &str, model: &str) -> bool {
        let added =
            self.shared
                .workers
                .write()
                .get_or_add(url, model, false, &self.shared.prior_of(model));
        match added {
            Some(w) => {
                w.state.lock().gone = false;
                true
            }
            None => false,
        }
    }

    /// Gives `worker` its own `role` (its pod's `kinference.ai/role` label): over its pool's.
    pub fn set_role(&self, worker: &str, role: kinference_api::WorkerRole) {
        for w in self.shared.workers.read().at_url(worker) {
            w.state.lock().pin_role(role);
        }
    }

    /// Whether workers no pool speaks for run vLLM's `--scheduling-policy priority` (`gateway.yaml`'s
    /// `scheduling_policy`).
    pub fn set_default_priority_scheduling(&self, on: bool) {
        self.shared
            .default_priority
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether `worker` runs priority scheduling, as its pool says (an `InferencePool`'s
    /// `schedulingPolicy`).
    pub fn set_priority_scheduling(&self, worker: &str, on: bool) {
        self.shared
            .priority_scheduling
            .write()
            .insert(worker.to_string(), on);
    }

    /// Whether `worker` orders its waiting requests by their `priority` (so it is sent one).
    pub fn priority_scheduling(&self, worker: &str) -> bool {
        self.shared
            .priority_scheduling
            .read()
            .get(worker)
            .copied()
            .unwrap_or_else(|| {
                self.shared
                    .default_priority
                    .load(std::sync::atomic::Ordering::Relaxed)
            })
    }

    /// Gives `worker` its pool's `role`, unless it has one of its own ([`Router::set_role`], an
    /// agent's report, `workers[].role`).
    pub fn set_pool_role(&self, worker: &str, role: kinference_api::WorkerRole) {
        for w in self.shared.workers.read().at_url(worker) {
            w.state.lock().set_pool_role(role);
        }
    }

    /// The role each known worker has now, by URL.
    pub fn roles(&self) -> Vec<(String, kinference_api::WorkerRole)> {
        self.shared
            .workers
            .read()
            .all()
            .iter()
            .map(|w| (w.url.clone(), w.state.read().role))
            .collect()
    }

    /// A discovered worker left (pod deleted, not ready, relabelled): no longer a candidate.
    /// Configured workers stay.
    pub fn remove_worker(&self, url: &str) {
        for w in self.shared.workers.read().at_url(url) {
            if !w.configured {
                w.state.lock().gone = true;
            }
        }
    }

    /// Registers the router's metrics (decisions by reason, index size, agents, tokenization, rates).
    pub fn register_metrics(&self, registry: &mut Registry) {
        self.shared.metrics.register(registry);
    }
}

#[cfg(test)]
mod tests;

/// Leading prompt tokens that name a prefix for breaking near-ties: about four blocks.
const SPREAD_TOKENS: usize = 64;

/// A seed from the prompt's first [`SPREAD_TOKENS`] tokens (the same on every replica: the same
/// tokenizer, the same hasher in the same binary).
fn spread_seed(tokens: &[u32]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    tokens[..tokens.len().min(SPREAD_TOKENS)].hash(&mut h);
    h.finish()
}

/// Rendezvous weight of `worker` for a prompt with `seed`: the highest weight among near-tied
/// workers takes the prompt.
fn spread_rank(seed: u64, worker: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    seed.hash(&mut h);
    worker.hash(&mut h);
    h.finish()
}
