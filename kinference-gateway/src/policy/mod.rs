//! Inference policies: which backends may serve a request, decided from declarative rules.
//!
//! - [`model`]: the loaded, validated policy set built from the five CRDs' specs.
//! - [`classify`]: facts about a request (PII, prompt complexity, tags) from its text and headers.
//! - [`engine`]: ordered rules -> a [`engine::PolicyDecision`] (route with preferences, reject, burst,
//!   require-local), explained rule by rule. A pure function of (policy set, facts, pool state).
//! - [`source`]: CRD-shaped YAML from a directory (local mode), reloaded on change; an object that
//!   fails validation is not applied and its previous version keeps serving.
//! - [`pool_members`]: which workers are a pool's (static endpoints, and the discovered pods its
//!   selector and GPU class pick).
//! - [`lint`]: offline checks for `kinfctl lint` (shadowed rules, unknown references, conflicts,
//!   PII rules that could fail open).
//!
//! - [`stage`]: the gateway pipeline's policy stage: per request [`classify::request_facts`] ->
//!   [`engine::PoolStates`] from the router's estimates (and [`worker_load`]) -> [`engine::evaluate`]
//!   on the current [`model::PolicySet`] (from [`source::PolicyWatcher`]) -> an ordered plan of
//!   pools and providers ([`crate::backend::provider`]).

pub mod classify;
pub mod engine;
pub mod lint;
pub mod model;
pub mod pool_members;
pub mod source;
pub mod stage;
pub mod worker_load;

pub use engine::{Outcome, PolicyDecision, PoolSnapshot, PoolStates, RequestFacts, evaluate};
pub use model::PolicySet;
pub use source::{PolicyWatcher, load_dir};
