//! The routing benchmark: reproduces the published cache-aware routing experiment on simulated workers.
//!
//! A run sends one deterministic request sequence ([`workload`]) with a fixed number of virtual users
//! ([`client`]) through one routing policy: a `kinference-gateway` in one of its routing modes, or the
//! client-side [`oracle`] that asks every simulated worker for its exact TTFT estimate. [`cluster`] starts
//! and stops the real processes; [`stats`] turns the measured requests into the figures that
//! [`report`] writes (JSON, markdown, SVG). [`experiment`] ties them together for `routing-bench` and
//! `demo`, over the routing [`policy`]s; [`fleet`] describes the mixed fleet of the `heterogeneous` and
//! `restart` workloads. [`pd`] compares prefill/decode disaggregation with the peers' P/D modes and
//! with aggregated serving (`routing-bench --pd`); [`replicas`] reports one gateway against several
//! replicas behind a random front (`routing-bench --replicas`).

pub mod client;
pub mod cluster;
pub mod experiment;
pub mod fleet;
pub mod noisy;
pub mod oracle;
pub mod pd;
pub mod peers;
pub mod policy;
pub mod replicas;
pub mod report;
pub mod stats;
pub mod workload;
