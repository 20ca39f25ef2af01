//! The API shared by the Kinference node agent and gateway.
//!
//! - [`block_keys`]: Kinference's own chained block keys, computed the same way from a vLLM event's
//!   `token_ids` (agent) and from a tokenized prompt (gateway), so vLLM's hash settings never matter.
//! - [`summary`]: the gRPC server-streaming API the agent serves and every gateway replica watches.
//! - [`vllm`]: vLLM's wire formats (KV-event batches, `/metrics`), for the agent and the simulator.
//! - [`role`]: a worker's part in prefill/decode disaggregation, as every component names it.
//! - [`tls`]: mutual TLS for the gRPC connections (agent stream, ext_proc).
#![forbid(unsafe_code)]

pub mod block_keys;
pub mod metrics;
pub mod role;
pub mod tls;
pub mod vllm;

/// Generated protobuf and tonic code for `kinference.v1` (see `proto/kinference/v1/agent.proto`).
// The generated oneof module `summary::summary` trips clippy's module_inception in every dependent crate.
#[allow(clippy::module_inception)]
pub mod summary {
    tonic::include_proto!("kinference.v1");
}

pub use block_keys::{BlockKey, KeyHasher, str_extra_key, with_extra_keys};
pub use role::WorkerRole;

/// Tokenization as the served model does it: HF `tokenizer.json` plus the model's chat template.
#[cfg(feature = "tokenize")]
pub mod tokenize;
