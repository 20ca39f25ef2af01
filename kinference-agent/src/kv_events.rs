//! vLLM KV-cache event batches, the payload of each ZMQ message a worker publishes. The codec (both event
//! formats, decode and encode) is [`kinference_api::vllm::kv_events`], shared with the simulator in
//! `bench/`; it is re-exported here so the agent's code reads `kv_events::decode_batch`.

pub use kinference_api::vllm::kv_events::*;
