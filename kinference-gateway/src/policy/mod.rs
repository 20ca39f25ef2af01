//! Inference policies: which backends may serve a request, decided from declarative rules.
//!
//! - [`model`]: the loaded, validated policy set built from the five CRDs' specs.
//! - [`classify`]: facts about a request (PII, prompt complexity, tags) from its text and headers.
//! - [`engine`]: ordered rules -> a [`engine::Decision`] (route with preferences, reject, burst,
//!   require-local), explained rule by rule. A pure function of (policy set, facts, pool state).
//! - [`source`]: CRD-shaped YAML from a directory (local mode), reloaded on change; an object that
//!   fails validation is not applied and its previous version keeps serving.
//! - [`lint`]: offline checks for `kinfctl lint` (shadowed rules, unknown references, conflicts,
//!   PII rules that could fail open).
//!
//! The gateway's pipeline calls, per request: [`classify::classify_request`] -> build
//! [`engine::RequestFacts`] -> [`engine::PoolStates`] from the router -> [`engine::evaluate`]
//! on the current [`model::PolicySet`] (from [`source::PolicyWatcher`]).

pub mod classify;
pub mod engine;
pub mod lint;
pub mod model;
pub mod source;

pub use engine::{Decision, Outcome, PoolSnapshot, PoolStates, RequestFacts, evaluate};
pub use model::PolicySet;
pub use source::{PolicyWatcher, load_dir};
