//! Kinference's benchmark harness and the vLLM simulator it runs against.
#![forbid(unsafe_code)]
pub mod harness;
pub mod routing;
pub mod scale;
pub mod sim;
pub mod stats;
