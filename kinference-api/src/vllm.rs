//! vLLM's wire formats, in one place, for every crate that speaks them (the agent reads them, the
//! simulator in `bench/` writes them). See `docs/vllm-interfaces.md` for the captures they follow.
//!
//! - [`kv_events`]: the msgpack KV-event batches a worker publishes over ZeroMQ, both event formats
//!   (positional arrays up to vLLM 0.23, maps from 0.24), decoded and encoded.
//! - [`metrics`]: the load and cache figures read from a worker's Prometheus `/metrics`.

pub mod kv_events;
pub mod metrics;
