//! The cost of one engine step, and the calibrated presets.
//!
//! One vLLM engine step runs every scheduled request together: the prefill chunks (compute-bound,
//! cost proportional to the number of *uncached* prompt tokens computed) and one token for each
//! decoding request (memory-bound: the weights are streamed once per step, plus each sequence's KV
//! cache). The model is
//!
//! ```text
//! step_s = step_base_s                                  // weights streamed once + launch/scheduling
//!        + prefill_tokens        * prefill_s_per_token  // compute of the prefill chunks (GEMMs)
//!        + prefill_attention_pairs * prefill_s_per_attention_pair // causal attention of the chunks
//!        + decode_seqs           * decode_s_per_seq     // per-sequence compute and sampling
//!        + decode_context_tokens * decode_s_per_ctx_token // reading each decoding sequence's KV cache
//! ```
//!
//! and the scheduler never puts more than `max_num_batched_tokens` tokens into one step (chunked
//! prefill), so a long prompt spreads over several steps and decoders keep running in between.
//!
//! ## `l40s-27b-fp8`: one NVIDIA L40S serving a ~27B-parameter model in FP8
//! - **Decode, batch 1: ~31 ms per token.** 27 GB of FP8 weights streamed at the L40S's 864 GB/s is
//!   31 ms; `step_base_s = 0.030`.
//! - **Prefill: ~3,200 tokens/s.** A 27B model needs ~2 x 27e9 = 54 GFLOP per token; at ~45% of the
//!   L40S's 362 dense FP8 TFLOPS that is ~0.30 ms per token (`prefill_s_per_token = 0.00030`), so a
//!   full 2,048-token chunk at the start of a prompt takes 0.03 + 0.61 + 0.03 (attention) = 0.67 s.
//! - **Prefill attention:** causal attention costs ~4 x layers x d_model = 4 x 62 x 5,376 = 1.3 MFLOP
//!   per (query, key) pair, run less efficiently than the GEMMs (~100 TFLOPS): 13 ns per pair
//!   (`prefill_s_per_attention_pair`). It adds ~10% at 4k tokens of context and ~20% at 8k.
//! - **Decode grows with the batch:** 0.4 ms per sequence (its share of the GEMMs, sampling) plus
//!   0.3 us per context token: a ~27B GQA model keeps ~250 KB of KV per token, read at 864 GB/s. Ten
//!   sequences of 3,000 tokens: 30 + 4 + 9 = 43 ms per step.
//! - **`max_num_batched_tokens = 2048`:** vLLM's V1 default for the OpenAI server on GPUs with less
//!   than 70 GiB (the L40S has 48 GB).
//! - KV capacity (not set here; `--num-blocks`): 48 GB - 27 GB weights - activations leaves ~15 GB, or
//!   ~60k tokens at ~250 KB/token: `--num-blocks 4096 --block-size 16` (65,536 tokens) matches.
//!
//! **Check against the published benchmark** (3 workers, concurrency 32, random routing, unique
//! prompts: median TTFT 6.9 s). The engine tests replay that setting in virtual time
//! (`calibration_table`); median steady-state TTFT by prompt and output length:
//!
//! | prompt tokens | output 64 | output 128 | output 256 |
//! |---|---|---|---|
//! | 2,000 | 0.69 s | 0.69 s | 0.68 s |
//! | 3,000 | 1.51 s | 1.39 s | 1.36 s |
//! | 4,000 | 2.63 s | 2.20 s | 1.82 s |
//! | 6,000 | 7.02 s | 6.23 s | 5.97 s |
//! | 8,000 | 10.6 s | 10.8 s | 12.5 s |
//!
//! Queueing behind other clients' prefills dominates once a worker's prefill load nears saturation,
//! so TTFT rises steeply with prompt length: ~6,000-token unique prompts reproduce the published
//! ~6.9 s; with the parameters kept inside the physically plausible ranges above, prompts of 3,000-4,000
//! tokens give 1.4-2.6 s.
//!
//! ## `cpu-qwen2-small`: fitted on real vLLM 0.32 on CPU
//! Not derived from published figures but measured: one vLLM 0.32 CPU worker serving the random
//! `make_model.py --size small` Qwen2 (4 layers, hidden 256, float32) on two AVX2 cores, fitted by
//! `bench/real-vllm/calibrate.py` (`bench/real-vllm/run.sh calibrate`), whose report
//! (`bench/results/real-vllm/calibration-cpu-qwen2-small.md`) lists every measured point against the
//! fit (MdAPE 4.5%, worst 24.8%): a 2,048-token prefill 335 ms, 512 of them cached 275 ms, 1,920
//! cached 57 ms; a decode step 13 ms at batch 1, 21-27 ms at batch 8. Two prefills sent together run
//! one after the other (the second's TTFT doubles), which the step model gives by packing both into
//! the token budget. Not modelled: the ~3 ms each request costs outside the engine's steps (HTTP,
//! detokenizing). A GPU profile takes the same five numbers from published figures, as
//! `l40s-27b-fp8` does (memory bandwidth for the decode step, dense TFLOPS for prefill).
//!
//! ## `fast`: for tests
//! Tiny costs (0.5 ms per step, 2 us per prefill token) so tests run quickly while cached prompts
//! still prefill measurably faster than uncached ones.

/// Per-step cost parameters (seconds of model time; `--time-scale` converts to wall time).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LatencyModel {
    /// Fixed cost of every step.
    pub step_base_s: f64,
    /// Cost of each prefill (uncached prompt) token computed in the step.
    pub prefill_s_per_token: f64,
    /// Cost of each (query, key) pair of the prefill chunks' causal attention: what makes long
    /// prompts, and chunks late in a long prompt, slower per token.
    pub prefill_s_per_attention_pair: f64,
    /// Cost of each decoding sequence in the step.
    pub decode_s_per_seq: f64,
    /// Cost of each context token of the decoding sequences (KV cache reads).
    pub decode_s_per_ctx_token: f64,
    /// Token budget of one step (chunked prefill).
    pub max_num_batched_tokens: usize,
}

impl LatencyModel {
    /// Seconds of model time for a step with this work.
    pub fn step_time(
        &self,
        prefill_tokens: usize,
        prefill_attention_pairs: f64,
        decode_seqs: usize,
        decode_ctx_tokens: usize,
    ) -> f64 {
        self.step_base_s
            + prefill_tokens as f64 * self.prefill_s_per_token
            + prefill_attention_pairs * self.prefill_s_per_attention_pair
            + decode_seqs as f64 * self.decode_s_per_seq
            + decode_ctx_tokens as f64 * self.decode_s_per_ctx_token
    }
}

/// Named parameter sets (`--preset`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Preset {
    /// Tiny delays for tests.
    #[default]
    Fast,
    /// One L40S serving a ~27B FP8 model (see the module docs for the derivation).
    #[value(name = "l40s-27b-fp8")]
    L40s27bFp8,
    /// Real vLLM 0.32 on two CPU cores with a small random Qwen2, fitted (see the module docs).
    #[value(name = "cpu-qwen2-small")]
    CpuQwen2Small,
}

impl Preset {
    /// Model seconds to move one KV block from a prefill worker to a decode worker (the calibrated
    /// worker: 16 tokens x ~250 KB of KV per token = 4 MB per block over a ~25 GB/s RDMA link, 0.16 ms;
    /// a 4,000-token prompt's 250 blocks take 40 ms).
    pub fn kv_transfer_s_per_block(self) -> f64 {
        match self {
            Self::Fast => 0.000_01,
            Self::L40s27bFp8 => 0.000_16,
            // 32 tokens x 8 KB of float32 KV (4 layers, 2 KV heads of 64) over loopback: negligible.
            Self::CpuQwen2Small => 0.000_01,
        }
    }

    /// The preset's latency model.
    pub fn latency(self) -> LatencyModel {
        match self {
            Self::Fast => LatencyModel {
                step_base_s: 0.0005,
                prefill_s_per_token: 0.000002,
                prefill_s_per_attention_pair: 0.0,
                decode_s_per_seq: 0.00002,
                decode_s_per_ctx_token: 0.0,
                max_num_batched_tokens: 8192,
            },
            Self::L40s27bFp8 => LatencyModel {
                step_base_s: 0.030,
                prefill_s_per_token: 0.00030,
                prefill_s_per_attention_pair: 0.000_000_013,
                decode_s_per_seq: 0.0004,
                decode_s_per_ctx_token: 0.000_000_3,
                max_num_batched_tokens: 2048,
            },
            Self::CpuQwen2Small => LatencyModel {
                step_base_s: 0.0105,
                prefill_s_per_token: 0.000_072_7,
                prefill_s_per_attention_pair: 0.000_000_080,
                decode_s_per_seq: 0.0012,
                decode_s_per_ctx_token: 0.000_000_80,
                max_num_batched_tokens: 2048,
            },
        }
    }
}
