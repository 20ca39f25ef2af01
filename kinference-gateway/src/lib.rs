//! The Kinference gateway: an OpenAI- and Anthropic-compatible HTTP endpoint in front of vLLM workers.
//!
//! A request's path is in [`pipeline`]; the client protocols in [`api`]; the worker side in
//! [`upstream`] (pooled client, SSE parsing) and [`relay`] (streaming back); worker selection in
//! [`routing`]; errors, mapped once to the client's protocol, in [`errors`].
#![forbid(unsafe_code)]

pub mod api;
pub mod config;
pub mod discovery;
pub mod errors;
pub mod extproc;
pub mod health;
pub mod metrics;
pub mod pipeline;
pub mod policy;
pub mod providers;
pub mod relay;
pub mod routing;
pub mod server;
pub mod tenancy;
pub mod upstream;
