//! The Kinference node agent: one per GPU node.
//!
//! It follows every local vLLM worker's KV-cache events and load, keeps each worker's set of Kinference
//! block keys, and streams a snapshot then batched deltas to every gateway replica over gRPC.
//!
//! - [`config`]: flags and the local workers file; [`discovery`]: worker add/remove events.
//! - [`kv_events`]: vLLM event batch decoding; [`worker_state`]: one worker's key set and deltas.
//! - [`subscriber`]: a worker's ZMQ event stream with sequence tracking and replay.
//! - [`zmq_guard`]: the ZMTP inspector and relay in front of every ZeroMQ socket (frame, message and
//!   connection limits at the trust boundary).
//! - [`scrape`]: a worker's vLLM `/metrics` (load, block size).
//! - [`registry`]: every local worker's state, shared by the above and [`grpc`], the summary stream.
//! - [`node`]: GPU (NVML) and kernel (eBPF) monitors; [`signals`]: feeds them into the registry.
//! - [`untrusted`]: every parser of outside bytes behind one entry each, for the fuzz targets.
//! - [`metrics`]: the agent's own Prometheus metrics; [`app`]: wiring.
#![forbid(unsafe_code)]

pub mod app;
pub mod config;
pub mod discovery;
pub mod grpc;
pub mod kv_events;
pub mod metrics;
pub mod node;
pub mod registry;
pub mod scrape;
pub mod signals;
pub mod subscriber;
pub mod untrusted;
pub mod worker_state;
pub mod zmq_guard;
