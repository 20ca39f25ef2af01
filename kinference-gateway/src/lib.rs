//! The Kinference gateway: an OpenAI- and Anthropic-compatible HTTP endpoint in front of vLLM workers.
#![forbid(unsafe_code)]

pub mod policy;
pub mod routing;
