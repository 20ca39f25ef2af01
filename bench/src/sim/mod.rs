//! A vLLM stand-in that behaves like vLLM 0.32 wherever a router looks: the OpenAI HTTP API with real
//! tokenization, a prefix cache with vLLM's block hashing, KV events over ZeroMQ, `/metrics`, and a
//! latency model of continuous batching, plus `/sim/estimate`, `/sim/state` and `/sim/slowdown` (a
//! worker made slower at run time) for the benchmark.
//!
//! - [`api`]: HTTP routes, OpenAI JSON shapes, SSE.
//! - [`cache`]: blocks, LRU eviction, vLLM's sha256/pickle block hashes, LoRA adapters' roots, KV cache
//!   events.
//! - [`engine`]: the scheduler (continuous batching, chunked prefill) and the latency presets.
//! - [`kv_events`]: the ZeroMQ publisher and replay socket, msgpack as msgspec writes it.
//! - [`kv_transfer`]: the KV connector of prefill/decode disaggregation (vLLM's `kv_transfer_params`
//!   and SGLang's bootstrap rooms), with a transfer time per block.
//! - [`metrics`]: vLLM's Prometheus exposition.
//! - [`ranks`]: data parallelism (`--data-parallel-size N`): N engines behind the one HTTP server,
//!   chosen by the `X-data-parallel-rank` header or balanced as vLLM balances them.

pub mod api;
pub mod cache;
pub mod engine;
pub mod kv_events;
pub mod kv_transfer;
pub mod metrics;
pub mod ranks;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use kinference_api::tokenize::{ModelTokenizer, TokenizeError};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use self::engine::{CoreConfig, Engine, Preset};
use self::kv_events::{KvEventsConfig, KvEventsError, KvPublisher};
use self::kv_transfer::{KvConnector, KvRole};
use self::metrics::Metrics;

/// Everything one simulated worker needs (the `vllm-sim` flags, typed).
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub listen: SocketAddr,
    /// Served model name.
    pub model: String,
    pub tokenizer_dir: PathBuf,
    pub preset: Preset,
    /// Wall seconds per model second (0.1 runs 10x faster than real time).
    pub time_scale: f64,
    /// How many times slower than its preset this worker starts (2: a GPU of half the speed);
    /// `POST /sim/slowdown` changes it at run time.
    pub slowdown: f64,
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub seed: u64,
    pub prompt_tokens_details: bool,
    /// Tool calls with `tool_choice` auto (vLLM's `--enable-auto-tool-choice`).
    pub auto_tool_choice: bool,
    /// Names of the LoRA adapters served beside the model (vLLM's `--lora-modules`).
    pub lora_modules: Vec<String>,
    /// vLLM's `--api-key`: `/v1` routes want `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Serve `POST /v1/responses` (off: 404, as vLLM before 0.10).
    pub responses_api: bool,
    /// Store `/v1/responses` answers for `previous_response_id` (vLLM's
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`); off, a follow-up is answered 404 as by vLLM.
    pub responses_store: bool,
    /// Serve `POST /v1/messages` (off: 404, as vLLM without the Anthropic Messages API).
    pub messages_api: bool,
    pub kv_events: Option<KvEventsConfig>,
    /// vLLM's `kv_role` of its KV connector (prefill/decode disaggregation); `None`: no connector.
    pub kv_role: Option<KvRole>,
    /// Model seconds to pull one KV block from a prefill worker (`None`: the preset's).
    pub kv_transfer_s_per_block: Option<f64>,
    /// vLLM's `--data-parallel-size`: engines behind the HTTP server, each with its own cache and its
    /// own publisher on the endpoints shifted by its rank (1: no data parallelism).
    pub data_parallel_size: usize,
}

/// Why the simulator could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizeError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("kv events: {0}")]
    KvEvents(#[from] KvEventsError),
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// A started simulator.
#[derive(Debug)]
pub struct Running {
    /// The bound HTTP address.
    pub addr: SocketAddr,
    /// The bound ZeroMQ endpoints, if any.
    pub zmq_bound: Vec<String>,
    /// Resolves when the HTTP server has drained after shutdown.
    pub server: tokio::task::JoinHandle<()>,
}

/// Loads the tokenizer, binds every socket, and starts the engine and the HTTP server; both stop when
/// `shutdown` is cancelled.
pub async fn start(cfg: SimConfig, shutdown: CancellationToken) -> Result<Running, SimError> {
    let tokenizer = Arc::new(ModelTokenizer::from_dir(&cfg.tokenizer_dir)?);
    let vocab = Vocabulary::of(&tokenizer);
    start_with_tokenizer(cfg, tokenizer, vocab, shutdown).await
}

/// The tokens a worker generates and their text ([`api::output_vocabulary`]), computed once per
/// tokenizer. It walks the whole vocabulary (150k entries for Qwen2) and decodes every candidate
/// word: done per worker, it was most of a worker's start, and 64 workers in one process on a
/// loaded core bound their sockets at about 9 a minute.
#[derive(Clone)]
struct Vocabulary {
    ids: Arc<[u32]>,
    text: Arc<HashMap<u32, String>>,
}

impl Vocabulary {
    fn of(tokenizer: &ModelTokenizer) -> Self {
        let words = api::output_vocabulary(tokenizer);
        Self {
            ids: words.iter().map(|(id, _)| *id).collect(),
            text: Arc::new(words.into_iter().collect()),
        }
    }
}

/// Starts several workers in this process, one per configuration, sharing one loaded tokenizer per
/// directory (a Qwen2 tokenizer takes tens of megabytes, so a fleet of a hundred workers on one machine
/// loads it once per process, not once per worker). Each worker has its own engine, cache, sockets
/// and metrics, exactly as if it ran alone.
pub async fn start_many(
    cfgs: Vec<SimConfig>,
    shutdown: CancellationToken,
) -> Result<Vec<Running>, SimError> {
    let mut tokenizers: Vec<(PathBuf, Arc<ModelTokenizer>, Vocabulary)> = Vec::new();
    let mut running = Vec::with_capacity(cfgs.len());
    for cfg in cfgs {
        let (tokenizer, vocab) = match tokenizers
            .iter()
            .find(|(dir, ..)| *dir == cfg.tokenizer_dir)
        {
            Some((_, t, v)) => (Arc::clone(t), v.clone()),
            None => {
                let t = Arc::new(ModelTokenizer::from_dir(&cfg.tokenizer_dir)?);
                let v = Vocabulary::of(&t);
                tokenizers.push((cfg.tokenizer_dir.clone(), Arc::clone(&t), v.clone()));
                (t, v)
            }
        };
        running.push(start_with_tokenizer(cfg, tokenizer, vocab, shutdown.clone()).await?);
    }
    Ok(running)
}

/// [`start`] with a tokenizer already loaded from `cfg.tokenizer_dir`.
async fn start_with_tokenizer(
    cfg: SimConfig,
    tokenizer: Arc<ModelTokenizer>,
    vocab: Vocabulary,
    shutdown: CancellationToken,
) -> Result<Running, SimError> {
    if cfg.block_size == 0 || cfg.num_blocks < 2 || cfg.max_num_seqs == 0 {
        return Err(SimError::Config(
            "block size and max-num-seqs must be > 0 and num-blocks >= 2".into(),
        ));
    }
    if !(cfg.time_scale.is_finite() && cfg.time_scale >= 0.0) {
        return Err(SimError::Config("time scale must be >= 0".into()));
    }
    let metrics = Arc::new(Metrics::new(cfg.model.clone()));
    let latency = cfg.preset.latency();
    let mut engines = Vec::with_capacity(cfg.data_parallel_size.max(1));
    let mut zmq_bound = Vec::new();
    for rank in 0..cfg.data_parallel_size.max(1) {
        // One publisher per rank, on the endpoints shifted by the rank, as vLLM's publishers bind.
        let publisher = match cfg.kv_events.clone() {
            Some(kc) => Some(KvPublisher::start(kc.for_rank(rank), shutdown.clone()).await?),
            None => None,
        };
        zmq_bound.extend(publisher.iter().flat_map(|p| p.bound.clone()));
        let engine = Engine::new(
            CoreConfig {
                block_size: cfg.block_size,
                num_blocks: cfg.num_blocks,
                max_num_seqs: cfg.max_num_seqs,
                latency,
                output_vocab: Arc::clone(&vocab.ids),
                seed: cfg.seed + rank as u64,
            },
            cfg.time_scale,
            metrics.clone(),
            publisher,
        );
        engine
            .set_slowdown(cfg.slowdown)
            .map_err(|e| SimError::Config(e.to_string()))?;
        tokio::spawn(engine.clone().run(shutdown.clone()));
        engines.push(engine);
    }
    let ranks = ranks::Ranks::new(engines);
    let engine = Arc::clone(ranks.first());

    let listener = TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| SimError::Listen {
            addr: cfg.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| SimError::Listen {
        addr: cfg.listen,
        source,
    })?;
    let kv = cfg.kv_role.map(|role| {
        KvConnector::new(
            role,
            addr.ip().to_string(),
            addr.port(),
            cfg.kv_transfer_s_per_block
                .unwrap_or_else(|| cfg.preset.kv_transfer_s_per_block()),
            cfg.time_scale,
        )
    });
    let state = Arc::new(api::AppState {
        kv,
        engine,
        ranks,
        tokenizer,
        metrics,
        model: cfg.model.clone(),
        root: cfg.tokenizer_dir.display().to_string(),
        max_model_len: cfg.max_model_len,
        num_blocks: cfg.num_blocks,
        prompt_tokens_details: cfg.prompt_tokens_details,
        auto_tool_choice: cfg.auto_tool_choice,
        lora_modules: (1..)
            .zip(&cfg.lora_modules)
            .map(|(id, name)| Arc::new(cache::LoraAdapter::new(name, id)))
            .collect(),
        api_key: cfg.api_key.clone(),
        responses_api: cfg.responses_api,
        responses_store: cfg
            .responses_store
            .then(api::surface::ResponseStore::default),
        messages_api: cfg.messages_api,
        token_text: vocab.text,
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default(),
        info: json!({
            "preset": format!("{:?}", cfg.preset),
            "time_scale": cfg.time_scale,
            "initial_slowdown": cfg.slowdown,
            "latency": latency,
            "max_num_seqs": cfg.max_num_seqs,
            "num_blocks": cfg.num_blocks,
            "kv_events": cfg.kv_events.as_ref().map(|k| json!({
                "endpoint": k.endpoint, "replay_endpoint": k.replay_endpoint, "topic": k.topic,
                "format": format!("{:?}", k.format), "replay_format": format!("{:?}", k.replay_format),
            })),
        }),
    });
    let server = tokio::spawn(api::serve(listener, state, shutdown));
    Ok(Running {
        addr,
        zmq_bound,
        server,
    })
}
