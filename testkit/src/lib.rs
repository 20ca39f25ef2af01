//! What the integration tests of every crate share: a prerequisite check that skips locally and fails under
//! CI ([`require`], [`skip`]), free loopback ports, a child process killed on drop, the tokenizer and binary
//! folders, test certificates made by `openssl` ([`certs`]), a real kube-apiserver started from `deploy/tests/kube-apiserver/`, the replay of saved fuzz
//! corpora ([`replay_corpus`]), and the check that a crate's modules import each other in layers
//! ([`layers`]).
//!
//! A dev-dependency of the crates, and a normal one of `xtask` (for [`in_ci`], [`repo_root`]) and of the
//! bench binaries (their harness: ports, paths, child processes): nothing here is for services, and it
//! depends on the standard library alone, so it stays light wherever it goes. The Python tests get the
//! same rule from `testkit/python/kinference_ci.py`, a pytest plugin `cargo xtask test` loads.
#![forbid(unsafe_code)]

pub mod apiserver;
pub mod certs;
mod fuzz;
pub mod layers;
mod paths;
mod prereq;
mod process;

pub use apiserver::Apiserver;
pub use fuzz::{LargeSeeds, replay_corpus};
pub use paths::{bin_dir, repo_root, tokenizer_dir};
pub use prereq::{in_ci, require, skip};
pub use process::{ChildGuard, free_port, free_ports};
