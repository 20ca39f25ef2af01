//! A worker's part in prefill/decode disaggregation, named the same way by the `--worker` flag, the
//! gateway's and the agent's worker lists, the pod label [`ROLE_KEY`], the `InferencePool` CRD and the
//! agent's summary stream.
//!
//! vLLM itself has no notion of role: any instance started with a KV connector (`kv_both`) can compute
//! a prefill for another instance, pull one from another, or serve a whole request. The role says how
//! the router may use it: a `prefill` worker runs the prefill of requests split in two, a `decode`
//! worker continues them (and serves whole requests too short to split), a `both` worker (the
//! default, and every worker without a connector) serves whole requests only.

use std::fmt;
use std::str::FromStr;

/// The pod label (or annotation) naming a worker's role.
pub const ROLE_KEY: &str = "kinference.ai/role";

/// A worker's role.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum WorkerRole {
    /// Whole requests (prefill and decode on the same worker); the default.
    #[default]
    Both,
    /// The prefill of split requests: the prompt's KV cache, handed to a decode worker.
    Prefill,
    /// The decode of split requests (from a prefill worker's KV cache), and whole short requests.
    Decode,
}

impl WorkerRole {
    /// The name on the wire, in flags, labels and configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Both => "both",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }

    /// Whether it takes whole requests (everything but a prefill-only worker).
    pub fn serves_whole(self) -> bool {
        self != WorkerRole::Prefill
    }

    /// The role a summary's `role` field names; `None` for "" (the agent was not told) or an unknown
    /// name (a newer agent's).
    pub fn from_wire(s: &str) -> Option<Self> {
        s.parse().ok()
    }
}

impl fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role name that is not `prefill`, `decode` or `both`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown worker role {0:?} (prefill, decode or both)")]
pub struct UnknownRole(pub String);

impl FromStr for WorkerRole {
    type Err = UnknownRole;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "both" => Ok(WorkerRole::Both),
            "prefill" => Ok(WorkerRole::Prefill),
            "decode" => Ok(WorkerRole::Decode),
            other => Err(UnknownRole(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_are_refused() {
        for role in [WorkerRole::Both, WorkerRole::Prefill, WorkerRole::Decode] {
            assert_eq!(role.as_str().parse::<WorkerRole>(), Ok(role));
            assert_eq!(WorkerRole::from_wire(role.as_str()), Some(role));
        }
        assert_eq!(WorkerRole::from_wire(""), None);
        assert!("encode".parse::<WorkerRole>().is_err());
        assert!(!WorkerRole::Prefill.serves_whole());
        assert!(WorkerRole::Decode.serves_whole() && WorkerRole::Both.serves_whole());
        assert_eq!(WorkerRole::default(), WorkerRole::Both);
    }
}
