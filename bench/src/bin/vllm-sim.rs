//! `vllm-sim`: simulated vLLM workers (see `kinference_bench::sim`), one per `--port`: a fleet of a
//! hundred workers on one machine runs as a dozen processes that each load the tokenizer once.
#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kinference_bench::sim::engine::Preset;
use kinference_bench::sim::kv_events::{EventFormat, KvEventsConfig, ReplayFormat};
use kinference_bench::sim::kv_transfer::KvRole;
use kinference_bench::sim::{SimConfig, start_many};
use tokio_util::sync::CancellationToken;

/// A vLLM 0.32 stand-in: OpenAI API, real tokenization, prefix cache with vLLM's block hashes,
/// KV events over ZeroMQ, vLLM's /metrics, and a continuous-batching latency model.
#[derive(Debug, Parser)]
#[command(name = "vllm-sim", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// HTTP port (0: any free port, printed in the log). A comma list starts one worker per port in
    /// this process; worker `i` (from 0) then takes the `i`-th value of every per-worker list below
    /// and seed `--seed + i`.
    #[arg(long, value_delimiter = ',', default_value = "8001")]
    port: Vec<u16>,
    /// Served model name.
    #[arg(long, default_value = "qwen2-sim")]
    model: String,
    /// Directory with tokenizer.json and tokenizer_config.json.
    #[arg(
        long,
        env = "KINFERENCE_TOKENIZER_DIR",
        default_value = ".assets/qwen2"
    )]
    tokenizer_dir: PathBuf,
    /// Latency preset: `fast` (tests) or `l40s-27b-fp8` (one L40S serving a ~27B FP8 model).
    #[arg(long, value_enum, default_value_t = Preset::Fast)]
    preset: Preset,
    /// Wall seconds per simulated second: 0.1 runs ten times faster than real time.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// How many times slower than the preset this worker runs (2: a GPU of half the speed; workers of
    /// different speeds side by side). `POST /sim/slowdown {"factor": F}` changes it at run time.
    #[arg(long, default_value_t = 1.0)]
    slowdown: f64,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV cache blocks (vLLM's num_gpu_blocks; block 0 is reserved as in vLLM).
    #[arg(long, default_value_t = 4096)]
    num_blocks: usize,
    /// Most requests in one batch.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Longest prompt + completion, in tokens.
    #[arg(long, default_value_t = 32768)]
    max_model_len: usize,
    /// Seed of the generated tokens.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// ZeroMQ PUB endpoint for KV events (binds if it contains `*` or `::` or is ipc://, else connects);
    /// with several ports, a comma list of one endpoint per port.
    #[arg(long, value_delimiter = ',')]
    kv_events_endpoint: Vec<String>,
    /// ZeroMQ ROUTER endpoint for replaying buffered KV event batches (always binds); with several
    /// ports, one per port.
    #[arg(long, value_delimiter = ',')]
    kv_replay_endpoint: Vec<String>,
    /// Topic (first frame) of every KV event message; with several ports, one for all or one per port.
    #[arg(long, value_delimiter = ',', default_value = "")]
    kv_topic: Vec<String>,
    /// Event encoding: `map` (vLLM >= 0.24) or `array` (<= 0.23).
    #[arg(long, value_enum, default_value_t = EventFormat::Map)]
    kv_event_format: EventFormat,
    /// Replay reply shape: `v0.26` ([topic, seq, payload]) or `v0.25` ([seq, payload]).
    #[arg(long, value_enum, default_value_t = ReplayFormat::V026)]
    replay_format: ReplayFormat,
    /// Batches kept for replay.
    #[arg(long, default_value_t = 10000)]
    kv_buffer_steps: usize,
    /// Leave `usage.prompt_tokens_details` null (vLLM without --enable-prompt-tokens-details).
    #[arg(long)]
    no_prompt_tokens_details: bool,
    /// Refuse `auto` tool choice as vLLM does without --enable-auto-tool-choice (named and
    /// `required` choices still work).
    #[arg(long)]
    no_auto_tool_choice: bool,
    /// LoRA adapters served beside the model, as vLLM's `--lora-modules NAME=PATH ...` (the path is
    /// ignored): requests name one in `"model"`, and `/v1/models` lists each with the model as `parent`.
    #[arg(long, num_args = 1..)]
    lora_modules: Vec<String>,
    /// As vLLM's `--api-key`: every `/v1` route wants `Authorization: Bearer <key>` (401 without).
    #[arg(long, env = "VLLM_API_KEY")]
    api_key: Option<String>,
    /// Answer `POST /v1/responses` with 404, as vLLM before 0.10 (which has no Responses API).
    #[arg(long)]
    no_responses_api: bool,
    /// Keep `/v1/responses` answers in memory so that a later request may continue one by
    /// `previous_response_id`, as vLLM with `VLLM_ENABLE_RESPONSES_API_STORE=1` (the same variable
    /// turns it on here). Each worker holds only the answers it made.
    #[arg(long, env = "VLLM_ENABLE_RESPONSES_API_STORE")]
    responses_store: bool,
    /// Answer `POST /v1/messages` with 404, as vLLM without the Anthropic Messages API.
    #[arg(long)]
    no_messages_api: bool,
    /// A KV connector for prefill/decode disaggregation, by vLLM's `kv_role`: `kv_producer` runs
    /// prefills for other workers (vLLM's `kv_transfer_params` or SGLang's bootstrap rooms),
    /// `kv_consumer` continues them, `kv_both` either (vLLM's protocol only). Without it, transfer
    /// fields are ignored. With several ports, one for all or one per port.
    #[arg(long, value_delimiter = ',')]
    kv_role: Vec<KvRole>,
    /// Model seconds to pull one KV block from a prefill worker (default: the preset's; 0.16 ms for
    /// `l40s-27b-fp8`, 4 MB per block over a ~25 GB/s link).
    #[arg(long)]
    kv_transfer_s_per_block: Option<f64>,
    /// vLLM's `--data-parallel-size`: engines (ranks) behind each HTTP port, each with its own prefix
    /// cache and KV event publisher on the endpoints shifted by its rank (TCP port + rank). A request
    /// with `X-data-parallel-rank: <rank>` goes to that rank; without it, to the least loaded rank
    /// (running + waiting, ties round-robin), as vLLM's internal balancer does.
    #[arg(long, default_value_t = 1)]
    data_parallel_size: usize,
}

impl Args {
    /// One configuration per `--port`, or why the per-worker lists do not fit the ports.
    fn into_configs(self) -> Result<Vec<SimConfig>, String> {
        let n = self.port.len();
        if n == 0 {
            return Err("--port needs at least one port".into());
        }
        // A list gives one value per worker; a single topic may be shared by all of them.
        let per_worker = |flag: &str, len: usize, shared_ok: bool| -> Result<(), String> {
            if len == 0 || len == n || (shared_ok && len == 1) {
                Ok(())
            } else {
                Err(format!(
                    "{flag} has {len} values for {n} ports (give one per port)"
                ))
            }
        };
        per_worker("--kv-events-endpoint", self.kv_events_endpoint.len(), false)?;
        per_worker("--kv-replay-endpoint", self.kv_replay_endpoint.len(), false)?;
        per_worker("--kv-topic", self.kv_topic.len(), true)?;
        per_worker("--kv-role", self.kv_role.len(), true)?;
        if !self.kv_replay_endpoint.is_empty() && self.kv_events_endpoint.is_empty() {
            return Err("--kv-replay-endpoint needs --kv-events-endpoint".into());
        }
        let topic = |i: usize| {
            self.kv_topic
                .get(i)
                .or(self.kv_topic.first())
                .cloned()
                .unwrap_or_default()
        };
        Ok((0..n)
            .map(|i| SimConfig {
                listen: SocketAddr::new(self.host, self.port[i]),
                model: self.model.clone(),
                tokenizer_dir: self.tokenizer_dir.clone(),
                preset: self.preset,
                time_scale: self.time_scale,
                slowdown: self.slowdown,
                block_size: self.block_size,
                num_blocks: self.num_blocks,
                max_num_seqs: self.max_num_seqs,
                max_model_len: self.max_model_len,
                seed: self.seed.wrapping_add(i as u64),
                prompt_tokens_details: !self.no_prompt_tokens_details,
                auto_tool_choice: !self.no_auto_tool_choice,
                lora_modules: self
                    .lora_modules
                    .iter()
                    .map(|m| {
                        m.split_once('=')
                            .map_or(m.as_str(), |(name, _)| name)
                            .to_string()
                    })
                    .collect(),
                api_key: self.api_key.clone(),
                responses_api: !self.no_responses_api,
                responses_store: self.responses_store,
                messages_api: !self.no_messages_api,
                kv_events: self
                    .kv_events_endpoint
                    .get(i)
                    .map(|endpoint| KvEventsConfig {
                        endpoint: endpoint.clone(),
                        replay_endpoint: self.kv_replay_endpoint.get(i).cloned(),
                        topic: topic(i),
                        format: self.kv_event_format,
                        replay_format: self.replay_format,
                        buffer_steps: self.kv_buffer_steps,
                        dp_rank: 0,
                    }),
                kv_role: self.kv_role.get(i).or(self.kv_role.first()).copied(),
                kv_transfer_s_per_block: self.kv_transfer_s_per_block,
                data_parallel_size: self.data_parallel_size,
            })
            .collect())
    }
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let configs = match Args::parse().into_configs() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::from(2);
        }
    };
    let shutdown = CancellationToken::new();
    let running = match start_many(configs.clone(), shutdown.clone()).await {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "vllm-sim failed to start");
            return ExitCode::FAILURE;
        }
    };
    for (cfg, running) in configs.iter().zip(&running) {
        tracing::info!(
            addr = %running.addr,
            model = %cfg.model,
            preset = ?cfg.preset,
            time_scale = cfg.time_scale,
            block_size = cfg.block_size,
            num_blocks = cfg.num_blocks,
            zmq = ?running.zmq_bound,
            "vllm-sim listening on http://{}",
            running.addr
        );
    }
    shutdown_signal().await;
    tracing::info!("shutting down");
    shutdown.cancel();
    for r in running {
        let _ = r.server.await;
    }
    ExitCode::SUCCESS
}
