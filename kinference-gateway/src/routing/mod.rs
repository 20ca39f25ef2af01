//! Choosing a worker: the cluster-wide KV index and the time-to-first-token estimate.
//!
//! The gateway calls [`Router::pick`] once per request, before forwarding. The router tokenizes the
//! prompt, computes its block keys, estimates the time to first token on every candidate worker and
//! records the choice in its in-flight ledger. The returned [`InFlight`] ticket releases the ledger entry
//! when the request ends (also when it is dropped on an error or an aborted stream).
//!
//! Modules, in the order a request meets them:
//! - [`tokenize`]: the prompt's tokens (the model's tokenizer, or the worker's `/tokenize`);
//! - [`kv_index`]: which workers hold which block keys (fed by [`agents`]), and [`speculative`]
//!   credit for requests just routed;
//! - [`estimate`]: TTFT per candidate from cached prefix, queued work and learned rates; the choice
//!   (near-tie spreading, load guard);
//! - [`baseline`]: the simple strategies the benchmark compares against;
//! - [`workers`]: the worker table with the in-flight ledger; [`metrics`]: what the router exports.
//!
//! Missing signals degrade visibly: without live agent data the estimate uses the gateway's own
//! ledger and speculative credit (kept longer then), and the decision reason says `degraded_*`.

pub mod agents;
pub mod baseline;
pub mod estimate;
pub mod kv_index;
pub mod metrics;
pub mod pools;
pub mod speculative;
pub mod tokenize;
pub mod workers;

use std::fmt;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use kinference_api::{BlockKey, KeyHasher};
use parking_lot::{Mutex, RwLock};
use prometheus_client::registry::Registry;
use serde::Deserialize;

use agents::AgentState;
use estimate::{
    EngineQueue, EstimatorConfig, Inputs, KernelMissing, Ledger, Queue, QueueSignal, Rates, Scored,
};
use kv_index::{KvIndex, WorkerId};
use metrics::{DecisionLabels, KernelMissingLabels, WorkerLabels};
use speculative::Speculative;
use tokenize::{Source, Tokenizers};
use workers::{Load, Worker, WorkerTable};

/// What the router needs from the gateway configuration (gateway-http fills it from `gateway.yaml`).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    /// Statically configured workers (local mode).
    #[serde(default)]
    pub workers: Vec<WorkerConfig>,
    /// Served models and where their tokenizers are.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// gRPC endpoints of node agents, e.g. `http://127.0.0.1:7070`.
    #[serde(default)]
    pub agents: Vec<String>,
    /// How to pick a worker.
    #[serde(default)]
    pub mode: RoutingMode,
}

/// One statically configured worker.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Worker base URL; also the worker's id everywhere (agent summaries, response headers).
    pub url: String,
    /// Served model name (what clients put in `model`).
    pub model: String,
}

/// One served model.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Served model name.
    pub name: String,
    /// Directory with `tokenizer.json` and `tokenizer_config.json`; without it the router asks a
    /// worker's `POST /tokenize`.
    #[serde(default)]
    pub tokenizer_dir: Option<PathBuf>,
}

/// The routing strategy. Everything but `kinference` is a baseline for the benchmark.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum RoutingMode {
    /// Lowest estimated time to first token (KV cache contents, queues, learned rates).
    #[default]
    Kinference,
    /// Fewest requests in flight from this gateway.
    LeastOutstanding,
    /// Uniformly random (what a Kubernetes Service does).
    Random,
    /// Each worker in turn.
    RoundRobin,
    /// Hash of the prompt's leading characters (approximate prefix affinity, as simple routers do).
    PrefixHash,
}

impl RoutingMode {
    /// The name used in configuration and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            RoutingMode::Kinference => "kinference",
            RoutingMode::LeastOutstanding => "least-outstanding",
            RoutingMode::Random => "random",
            RoutingMode::RoundRobin => "round-robin",
            RoutingMode::PrefixHash => "prefix-hash",
        }
    }
}

impl fmt::Display for RoutingMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RoutingMode {
    type Err = BuildError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "kinference" => RoutingMode::Kinference,
            "least-outstanding" => RoutingMode::LeastOutstanding,
            "random" => RoutingMode::Random,
            "round-robin" => RoutingMode::RoundRobin,
            "prefix-hash" => RoutingMode::PrefixHash,
            other => return Err(BuildError::UnknownMode(other.to_string())),
        })
    }
}

/// Why a router could not be built from its configuration.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The routing mode name is not one of the known modes.
    #[error(
        "unknown routing mode {0:?} (kinference, least-outstanding, random, round-robin, prefix-hash)"
    )]
    UnknownMode(String),
    /// The same worker URL appears twice.
    #[error("worker {0} is configured twice")]
    DuplicateWorker(String),
    /// More workers than the index can name.
    #[error("too many workers ({0}); at most 65533")]
    TooManyWorkers(usize),
    /// A configured tokenizer could not be loaded.
    #[error("tokenizer of model {model}: {error}")]
    Tokenizer {
        /// The model.
        model: String,
        /// What failed.
        error: kinference_api::tokenize::TokenizeError,
    },
    /// Agents are configured but the router was built outside a tokio runtime.
    #[error("the router must be built inside a tokio runtime to watch agents")]
    NoRuntime,
}

/// Tuning knobs; the defaults suit a local cluster and the simulator.
#[derive(Clone, Debug)]
pub struct RoutingTuning {
    /// Block size assumed for workers whose agent has not said (vLLM's default).
    pub default_block_size: usize,
    /// How long a routed prompt credits its worker while an agent reports it.
    pub speculative_ttl: Duration,
    /// The same without a live agent (the credit is then the only cache signal).
    pub speculative_ttl_no_agent: Duration,
    /// With a live agent, how long the credit outlives the request's first token (the events of its
    /// blocks reach the index within about this long).
    pub speculative_after_first_token: Duration,
    /// A disconnected agent's data is dropped after this long.
    pub stale_after: Duration,
    /// Load figures older than this are ignored.
    pub load_max_age: Duration,
    /// KV index cap, (block, worker) pairs.
    pub index_max_pairs: usize,
    /// Speculative credit cap, keys.
    pub speculative_max_keys: usize,
    /// Characters of the prompt the `prefix-hash` baseline hashes.
    pub prefix_hash_chars: usize,
    /// Start a Watch stream per configured agent. Off: the caller feeds summaries through
    /// [`Router::apply_agent_summary`].
    pub connect_agents: bool,
    /// Estimate and choice.
    pub estimator: EstimatorConfig,
}

impl Default for RoutingTuning {
    fn default() -> Self {
        Self {
            default_block_size: 16,
            speculative_ttl: Duration::from_secs(3),
            speculative_ttl_no_agent: Duration::from_secs(120),
            speculative_after_first_token: Duration::from_millis(250),
            stale_after: Duration::from_secs(10),
            load_max_age: Duration::from_secs(5),
            index_max_pairs: 32 * 1024 * 1024,
            speculative_max_keys: 4 * 1024 * 1024,
            prefix_hash_chars: 256,
            connect_agents: true,
            estimator: EstimatorConfig::default(),
        }
    }
}

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
}

/// The router's choice for one request.
#[derive(Debug)]
pub struct Decision {
    /// Worker base URL.
    pub worker: String,
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

/// State shared by the router, its agent tasks and the in-flight tickets.
struct Shared {
    mode: RoutingMode,
    tuning: RoutingTuning,
    prior_rates: Rates,
    /// Rates learned from every worker's observations; workers with few samples borrow them.
    fleet_rates: Mutex<Rates>,
    workers: RwLock<WorkerTable>,
    index: RwLock<KvIndex>,
    spec: Mutex<Speculative>,
    agents: Vec<Mutex<AgentState>>,
    tokenizers: Tokenizers,
    metrics: metrics::Metrics,
    /// This mode's series of `metrics.stage_seconds`.
    stages: metrics::StageTimers,
    round_robin: AtomicUsize,
    last_degraded_log: Mutex<Option<Instant>>,
    /// When a missing kernel view was last logged.
    last_kernel_log: Mutex<Option<Instant>>,
    gateway_id: String,
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

    /// Which agents' data is usable now.
    fn fresh_agents(&self, now: Instant) -> Vec<bool> {
        self.agents
            .iter()
            .map(|a| a.lock().fresh(now, self.tuning.stale_after))
            .collect()
    }

    /// Counts the candidates estimated without their kernel view; logs it at most once a minute (a missing
    /// agent is already logged as a degraded decision).
    fn note_kernel_missing(&self, missing: &[(KernelMissing, &str)]) {
        // One label lookup per reason, not per candidate: this runs on every decision.
        for reason in [
            KernelMissing::NoAgent,
            KernelMissing::EbpfOff,
            KernelMissing::Stale,
        ] {
            let n = missing.iter().filter(|(w, _)| *w == reason).count() as u64;
            if n > 0 {
                self.metrics
                    .kernel_view_missing
                    .get_or_create(&KernelMissingLabels {
                        reason: reason.as_str().to_string(),
                    })
                    .inc_by(n);
            }
        }
        let Some(&(why, worker)) = missing.iter().find(|(w, _)| *w != KernelMissing::NoAgent)
        else {
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
            .field("agents", &self.shared.agents.len())
            .finish()
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// One candidate while a decision is being made: everything its estimate needs, read once.
struct Candidate {
    worker: Arc<Worker>,
    block_size: usize,
    /// A live agent reports the worker.
    live: bool,
    /// This gateway's requests in flight there.
    in_flight: usize,
    /// The live agent's figures, when its scrape of the worker is fresh.
    scraped: Option<Load>,
    /// The queue ahead of a new request (every client's, from the best view).
    queue: Queue,
    /// Which view sized the other clients' share.
    signal: QueueSignal,
    /// Why the kernel view was not used, when it was not.
    kernel_missing: Option<KernelMissing>,
    /// The worker's rates, shrunk toward the fleet's.
    rates: Rates,
    /// Leading blocks of the prompt the worker holds (index or speculative credit).
    run: usize,
    /// Blocks of any prompt the index believes the worker holds (how full its cache is).
    held_blocks: usize,
}

impl Candidate {
    /// The estimate's inputs for a prompt of `prompt_tokens` tokens.
    fn inputs(&self, prompt_tokens: usize) -> Inputs {
        Inputs {
            prompt_tokens,
            // vLLM always computes at least the last prompt token, so a full hit still prefills one.
            cached_tokens: (self.run * self.block_size).min(prompt_tokens.saturating_sub(1)),
            queue_tokens: self.queue.queue_tokens,
            running: self.queue.running,
        }
    }
}

impl Shared {
    /// Every candidate's figures at `now`: the ledger, the agent's views, the rates. Shared by the
    /// decision and the policy stage's estimates, so both see the same queue.
    fn candidates_at(&self, workers: &[Arc<Worker>], now: Instant) -> Vec<Candidate> {
        let tuning = &self.tuning;
        let fresh = self.fresh_agents(now);
        let fleet = self.fleet_rates.lock().clone();
        workers
            .iter()
            .map(|w| {
                let st = w.state.lock();
                let live = st
                    .agent
                    .is_some_and(|a| fresh.get(a).copied().unwrap_or(false));
                // Everything the agent said about the worker; its two views of every client's requests,
                // each with our own requests as that view saw them.
                let seen = |at: Instant, linger: Duration| {
                    st.log
                        .seen(st.in_flight, st.awaiting_first_token, at, linger)
                };
                let load = st.load.filter(|_| live);
                let scraped = load.filter(|l| l.metrics_fresh(now, tuning.load_max_age));
                let engine = scraped.map(|l| {
                    let e = EngineQueue {
                        running: l.running,
                        waiting: l.waiting,
                    };
                    (e, seen(l.measured, Duration::ZERO))
                });
                let kernel = match load {
                    None => Err(KernelMissing::NoAgent),
                    Some(l) => match l.kernel {
                        None => Err(KernelMissing::EbpfOff),
                        Some(_)
                            if now.saturating_duration_since(l.received)
                                > tuning.estimator.kernel_max_age =>
                        {
                            Err(KernelMissing::Stale)
                        }
                        Some(k) => {
                            // The agent sends a changed figure within `kernel_delay`, so one received
                            // earlier and not replaced still held then.
                            let at = l.received.max(
                                now.checked_sub(tuning.estimator.kernel_delay)
                                    .unwrap_or(now),
                            );
                            Ok((k, seen(at, l.kernel_linger)))
                        }
                    },
                };
                let ledger = Ledger {
                    in_flight: st.in_flight,
                    awaiting_first_token: st.awaiting_first_token,
                    pending_prefill_tokens: st.backlog.tokens(now),
                    avg_uncached: st.avg_uncached,
                };
                let (queue, signal) =
                    estimate::queue(&ledger, kernel.ok(), engine, &tuning.estimator);
                Candidate {
                    worker: Arc::clone(w),
                    block_size: st.block_size.unwrap_or(tuning.default_block_size).max(1),
                    live,
                    in_flight: st.in_flight,
                    scraped,
                    queue,
                    signal,
                    kernel_missing: kernel.err(),
                    rates: estimate::blended(&st.rates, &fleet, now),
                    run: 0,
                    held_blocks: 0,
                }
            })
            .collect()
    }

    /// The prompt's block keys per block size in use, and every candidate's cached run (KV index, then
    /// speculative credit) in one pass per size; also each candidate's `held_blocks`, read under the same
    /// index lock.
    fn cached_runs(
        &self,
        model: &str,
        tokens: &[u32],
        cands: &mut [Candidate],
        now: Instant,
    ) -> Vec<(usize, Arc<[BlockKey]>)> {
        let hasher = KeyHasher::for_model(model);
        let mut sizes: Vec<usize> = cands.iter().map(|c| c.block_size).collect();
        sizes.sort_unstable();
        sizes.dedup();
        // Hash before taking any lock: it is the most expensive part of a decision.
        let keys_by_size: Vec<(usize, Arc<[BlockKey]>)> = sizes
            .into_iter()
            .map(|bs| (bs, hasher.keys(None, tokens, bs).into()))
            .collect();
        let mut slot_of = vec![
            usize::MAX;
            cands
                .iter()
                .map(|c| usize::from(c.worker.id) + 1)
                .max()
                .unwrap_or(0)
        ];
        for (i, c) in cands.iter().enumerate() {
            slot_of[usize::from(c.worker.id)] = i;
        }
        let index = self.index.read();
        for c in cands.iter_mut() {
            c.held_blocks = index.worker_blocks(c.worker.id);
        }
        let spec = self.spec.lock();
        let mut runs = Vec::new();
        for (bs, keys) in &keys_by_size {
            let group: Vec<usize> = (0..cands.len())
                .filter(|i| cands[*i].block_size == *bs && cands[*i].live)
                .collect();
            let ids: Vec<WorkerId> = group.iter().map(|i| cands[*i].worker.id).collect();
            index.leading_runs_bisect(keys, &ids, &mut runs);
            for (i, run) in group.iter().zip(runs.iter()) {
                cands[*i].run = *run;
            }
            spec.runs(keys, now, |w, run| {
                if let Some(c) = slot_of.get(usize::from(w)).and_then(|i| cands.get_mut(*i))
                    && c.block_size == *bs
                {
                    c.run = c.run.max(run);
                }
            });
        }
        drop(spec);
        drop(index);
        keys_by_size
    }
}

impl Router {
    /// Builds a router from the gateway configuration (default tuning).
    pub fn new(config: RoutingConfig) -> Result<Self, BuildError> {
        Self::with_tuning(config, RoutingTuning::default())
    }

    /// Builds a router with explicit tuning. Starts one task per agent (inside the current runtime).
    pub fn with_tuning(config: RoutingConfig, tuning: RoutingTuning) -> Result<Self, BuildError> {
        if config.workers.len() > kv_index::MAX_WORKERS {
            return Err(BuildError::TooManyWorkers(config.workers.len()));
        }
        let prior_rates = Rates::prior(&tuning.estimator);
        let mut table = WorkerTable::default();
        for w in &config.workers {
            if table.get(&w.url).is_some() {
                return Err(BuildError::DuplicateWorker(w.url.clone()));
            }
            table.get_or_add(&w.url, &w.model, true, &prior_rates);
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
            fleet_rates: Mutex::new(prior_rates.clone()),
            prior_rates,
            workers: RwLock::new(table),
            index: RwLock::new(KvIndex::new(tuning.index_max_pairs)),
            spec: Mutex::new(Speculative::new(tuning.speculative_max_keys)),
            agents: config
                .agents
                .iter()
                .map(|a| Mutex::new(AgentState::new(a)))
                .collect(),
            tokenizers,
            metrics,
            stages,
            round_robin: AtomicUsize::new(0),
            last_degraded_log: Mutex::new(None),
            last_kernel_log: Mutex::new(None),
            gateway_id: format!("kinference-gateway-{}", std::process::id()),
            tuning,
        });
        let mut tasks = Vec::new();
        if !shared.agents.is_empty() && shared.tuning.connect_agents {
            let handle =
                tokio::runtime::Handle::try_current().map_err(|_| BuildError::NoRuntime)?;
            for a in 0..shared.agents.len() {
                tasks.push(handle.spawn(agents::run(Arc::clone(&shared), a)));
            }
        }
        Ok(Self { shared, tasks })
    }

    /// The routing mode.
    pub fn mode(&self) -> RoutingMode {
        self.shared.mode
    }

    /// Picks a worker for `req` and records it in the in-flight ledger.
    pub async fn pick(&self, req: RouteRequest<'_>) -> Result<Decision, RouteError> {
        let candidates = self.candidates(req.model)?;
        Ok(self.pick_from(req, &candidates).await)
    }

    /// [`Router::pick`] among `candidates` (non-empty).
    async fn pick_from(&self, req: RouteRequest<'_>, candidates: &[Arc<Worker>]) -> Decision {
        let shared = &self.shared;
        if shared.mode != RoutingMode::Kinference {
            let started = Instant::now();
            let (i, reason) = baseline::pick(
                shared.mode,
                candidates,
                req.prompt,
                &shared.tuning,
                &shared.round_robin,
            );
            let decision = self.record_simple(candidates, i, reason, req.debug);
            shared
                .stages
                .decide
                .observe(started.elapsed().as_secs_f64());
            return decision;
        }
        // Ask the least busy worker when the gateway has no tokenizer for this model.
        let fallback = candidates
            .iter()
            .min_by_key(|w| w.state.lock().in_flight)
            .map(|w| w.url.clone());
        let started = Instant::now();
        let tokens = shared
            .tokenizers
            .tokens(req.model, req.prompt, fallback.as_deref())
            .await;
        if let Some(tokenize) = &shared.stages.tokenize {
            tokenize.observe(started.elapsed().as_secs_f64());
        }
        match tokens {
            Ok((tokens, source)) => {
                let source = match source {
                    Source::Local => "local",
                    Source::Remote => "worker",
                };
                shared
                    .metrics
                    .tokenize
                    .get_or_create(&metrics::TokenizeLabels {
                        model: req.model.to_string(),
                        source: source.to_string(),
                    })
                    .inc();
                let started = Instant::now();
                let decision = self.decide(req.model, candidates, &tokens, req.debug);
                shared
                    .stages
                    .decide
                    .observe(started.elapsed().as_secs_f64());
                decision
            }
            Err(e) => {
                shared
                    .metrics
                    .tokenize
                    .get_or_create(&metrics::TokenizeLabels {
                        model: req.model.to_string(),
                        source: "failed".into(),
                    })
                    .inc();
                tracing::debug!(model = req.model, error = %e, "prompt not tokenized");
                shared.log_degraded("degraded_no_tokens", req.model);
                let (i, _) = baseline::pick(
                    RoutingMode::LeastOutstanding,
                    candidates,
                    req.prompt,
                    &shared.tuning,
                    &shared.round_robin,
                );
                self.record_simple(candidates, i, "degraded_no_tokens", req.debug)
            }
        }
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
        Ok(self.decide(model, &candidates, tokens, debug))
    }

    /// Applies one summary as if agent number `agent` (its index in the configured `agents`) had
    /// streamed it, and marks that agent connected. For routers built with
    /// `RoutingTuning::connect_agents = false` (tests, benchmarks, an agent embedded in-process).
    pub fn apply_agent_summary(&self, agent: usize, summary: kinference_api::summary::Summary) {
        if agent >= self.shared.agents.len() {
            return;
        }
        {
            let mut st = self.shared.agents[agent].lock();
            if !st.connected {
                st.connected = true;
                st.since = Instant::now();
            }
        }
        agents::apply(&self.shared, agent, summary);
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
                .map(|w| format!("{} in_flight={}", w.url, w.state.lock().in_flight))
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
            reason,
            explain,
            prompt_tokens: None,
            ticket: InFlight::new(Arc::clone(shared), worker, None, None, None),
        }
    }

    fn count(&self, reason: &'static str, cached_tokens: usize) {
        let m = &self.shared.metrics;
        m.decisions
            .get_or_create(&DecisionLabels {
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
        workers: &[Arc<Worker>],
        tokens: &[u32],
        debug: bool,
    ) -> Decision {
        let shared = &self.shared;
        let tuning = &shared.tuning;
        let now = Instant::now();
        let mut cands = shared.candidates_at(workers, now);
        let missing: Vec<(KernelMissing, &str)> = cands
            .iter()
            .filter_map(|c| Some((c.kernel_missing?, c.worker.url.as_str())))
            .collect();
        if !missing.is_empty() {
            shared.note_kernel_missing(&missing);
        }
        let keys_by_size = shared.cached_runs(model, tokens, &mut cands, now);

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
        let (pick, why) = estimate::choose(&scored, est_cfg, &mut rand::rng())
            .unwrap_or((0, estimate::Why::LeastLoaded));
        let any_live = cands.iter().any(|c| c.live);
        let reason = if any_live {
            why.as_str()
        } else if shared.agents.is_empty() {
            "degraded_no_agent"
        } else {
            "degraded_stale"
        };
        if !any_live {
            shared.log_degraded(reason, model);
        }

        let chosen = &cands[pick];
        let (inputs, est) = estimates[pick];
        let uncached = (prompt_tokens - inputs.cached_tokens) as f64;
        let position = {
            let mut st = chosen.worker.state.lock();
            st.in_flight += 1;
            st.awaiting_first_token += 1;
            st.log.started(now);
            st.avg_uncached = 0.9 * st.avg_uncached + 0.1 * uncached;
            st.backlog.push(uncached, now, chosen.rates.s_per_token)
        };
        let keys = keys_by_size
            .iter()
            .find(|(bs, _)| *bs == chosen.block_size)
            .map(|(_, keys)| Arc::clone(keys));
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
                    "{}{} cached={} queue_tokens={:.0} running={} queue_s={:.4} est_s={:.4} cost_s={:.4} agent={} kernel={} signal={} others={} others_waiting={} held_blocks={}",
                    if i == pick { "*" } else { "" },
                    c.worker.url,
                    inp.cached_tokens,
                    inp.queue_tokens,
                    inp.running,
                    e.queue_s,
                    e.ttft_s,
                    e.cost_s,
                    if c.live { "live" } else { "none" },
                    c.kernel_missing.map_or("live", KernelMissing::as_str),
                    c.signal.as_str(),
                    c.queue.others,
                    c.queue.others_waiting,
                    c.held_blocks,
                );
            }
            s
        });
        Decision {
            worker: chosen.worker.url.clone(),
            reason,
            explain,
            prompt_tokens: Some(prompt_tokens),
            ticket: InFlight::new(
                Arc::clone(shared),
                Arc::clone(&chosen.worker),
                Some(position),
                Some(est.work),
                credit,
            ),
        }
    }

    /// Every known worker.
    pub fn workers(&self) -> Vec<WorkerView> {
        let now = Instant::now();
        let fresh = self.shared.fresh_agents(now);
        let table = self.shared.workers.read();
        let index = self.shared.index.read();
        table
            .all()
            .iter()
            .map(|w| {
                let st = w.state.lock();
                WorkerView {
                    url: w.url.clone(),
                    model: w.model.clone(),
                    healthy: !st.gone && st.healthy,
                    in_flight: st.in_flight,
                    agent_live: st
                        .agent
                        .is_some_and(|a| fresh.get(a).copied().unwrap_or(false)),
                    cached_blocks: index.worker_blocks(w.id),
                }
            })
            .collect()
    }

    /// Marks a worker healthy or not (gateway-http's health prober and refused connections call it).
    /// Unhealthy workers are not candidates.
    pub fn set_healthy(&self, worker: &str, healthy: bool) {
        if let Some(w) = self.shared.workers.read().get(worker) {
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
                .get_or_add(url, model, false, &self.shared.prior_rates);
        match added {
            Some(w) => {
                w.state.lock().gone = false;
                true
            }
            None => false,
        }
    }

    /// A discovered worker left (pod deleted, not ready, relabelled): no longer a candidate.
    /// Configured workers stay.
    pub fn remove_worker(&self, url: &str) {
        if let Some(w) = self.shared.workers.read().get(url)
            && !w.configured
        {
            w.state.lock().gone = true;
        }
    }

    /// Registers the router's metrics (decisions by reason, index size, agents, tokenization, rates).
    pub fn register_metrics(&self, registry: &mut Registry) {
        self.shared.metrics.register(registry);
    }
}

/// A routed request's entry in the in-flight ledger.
///
/// Call [`InFlight::first_token`] when the first token arrives and [`InFlight::finish`] at the end.
/// Dropping it without `finish` counts as a failed request. Either way the worker's in-flight count is
/// released exactly once.
pub struct InFlight {
    shared: Arc<Shared>,
    worker: Arc<Worker>,
    started: Instant,
    /// The request's position in the worker's [`workers::Backlog`], until its first token.
    backlog_position: Option<f64>,
    /// The speculative credit to end soon after the first token (live agent only).
    credit: Option<Arc<[BlockKey]>>,
    /// The estimate's work in tokens, to learn from the observed TTFT.
    work: Option<f64>,
    /// Counted in the worker's `awaiting_first_token` until the first token (or the end).
    awaiting: bool,
    first_token: Option<Instant>,
    done: bool,
}

impl fmt::Debug for InFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight")
            .field("worker", &self.worker.url)
            .field("started", &self.started)
            .field("first_token", &self.first_token)
            .finish()
    }
}

impl InFlight {
    fn new(
        shared: Arc<Shared>,
        worker: Arc<Worker>,
        backlog_position: Option<f64>,
        work: Option<f64>,
        credit: Option<Arc<[BlockKey]>>,
    ) -> Self {
        Self {
            shared,
            worker,
            started: Instant::now(),
            backlog_position,
            work,
            credit,
            awaiting: true,
            first_token: None,
            done: false,
        }
    }

    /// The first token (or first response byte) arrived; feeds the worker's learned rates.
    pub fn first_token(&mut self) {
        if self.first_token.is_some() || self.done {
            return;
        }
        let now = Instant::now();
        self.first_token = Some(now);
        let ttft = now.duration_since(self.started).as_secs_f64();
        let (position, awaited) = (
            self.backlog_position.take(),
            std::mem::take(&mut self.awaiting),
        );
        let mut st = self.worker.state.lock();
        st.prefill_over(position, awaited, now);
        if let Some(work) = self.work {
            st.rates.observe(ttft, work, &self.shared.tuning.estimator);
            self.shared
                .fleet_rates
                .lock()
                .observe(ttft, work, &self.shared.tuning.estimator);
            let labels = WorkerLabels {
                worker: self.worker.url.clone(),
            };
            self.shared
                .metrics
                .worker_tokens_per_s
                .get_or_create(&labels)
                .set(1.0 / st.rates.s_per_token);
            self.shared
                .metrics
                .worker_overhead_s
                .get_or_create(&labels)
                .set(st.rates.overhead_s);
        }
        drop(st);
        self.end_credit(now);
    }

    /// Ends the speculative credit soon after the prefill (see
    /// [`RoutingTuning::speculative_after_first_token`]).
    fn end_credit(&mut self, now: Instant) {
        if let Some(keys) = self.credit.take() {
            let by = now + self.shared.tuning.speculative_after_first_token;
            self.shared.spec.lock().end_by(&keys, self.worker.id, by);
        }
    }

    /// The request ended; `cached_tokens` is what the worker reported (`prompt_tokens_details`).
    pub fn finish(mut self, ok: bool, output_tokens: usize, cached_tokens: Option<usize>) {
        tracing::trace!(worker = %self.worker.url, ok, output_tokens, ?cached_tokens, "request finished");
        self.release();
    }

    fn release(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let now = Instant::now();
        let (position, awaited) = (
            self.backlog_position.take(),
            std::mem::take(&mut self.awaiting),
        );
        let mut st = self.worker.state.lock();
        st.in_flight = st.in_flight.saturating_sub(1);
        st.log.ended(now);
        // Ended before its first token (failed, aborted, or not streamed): its prefill is over one way
        // or the other.
        st.prefill_over(position, awaited, now);
        drop(st);
        self.end_credit(now);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests;
