//! The Kinference node agent: one per GPU node.
//!
//! It follows every local vLLM worker's KV-cache events and load, keeps each worker's set of Kinference
//! block keys, and streams a snapshot then batched deltas to every gateway replica over gRPC.
//!
//! - [`config`]: flags and the local workers file; [`discovery`]: worker add/remove events.
//! - [`kv_events`]: vLLM event batch decoding; [`worker_state`]: per-worker key set and deltas.
#![forbid(unsafe_code)]

pub mod kv_events;
pub mod node;
pub mod worker_state;
