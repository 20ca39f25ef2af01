//! The Kinference node agent: one per GPU node.
#![forbid(unsafe_code)]

pub mod node;
