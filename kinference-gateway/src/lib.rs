//! The Kinference gateway: an OpenAI- and Anthropic-compatible HTTP endpoint in front of vLLM workers.
//!
//! A request's path is in [`pipeline`] (one [`pipeline::exchange::Exchange`] through named stages,
//! settled once by [`pipeline::settle::Settlement`]); the client protocols in [`api`]; the backends in
//! [`backend`] (the worker client with its health probing, the providers, one relay back);
//! worker selection in [`routing`]; errors, mapped once to the client's protocol, in [`errors`].
//! No module imports one that imports it back (`tests/module_layers.rs` keeps it so).
#![forbid(unsafe_code)]

pub mod access;
pub mod api;
pub mod backend;
pub mod body;
pub mod config;
pub mod config_source;
pub mod discovery;
pub mod errors;
pub mod extproc;
pub mod gateway;
pub mod metrics;
pub mod overload;
pub mod pipeline;
pub mod policy;
pub mod pools;
pub mod routing;
pub mod server;
pub mod telemetry;
pub mod tenancy;
pub mod untrusted;
pub mod yaml;
