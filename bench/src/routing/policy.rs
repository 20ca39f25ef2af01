//! The routing policies under test: the gateway's routing modes, the peer routers and the
//! client-side oracle, by the names the command line, the results and the gateway's `routing:` use.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

#[cfg(test)]
mod tests;

/// A routing policy under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Uniformly random worker: what a Kubernetes ClusterIP Service does.
    Random,
    /// Workers in turn.
    RoundRobin,
    /// The worker with the fewest requests in flight.
    LeastOutstanding,
    /// Approximate prefix affinity: a hash of the prompt's leading characters.
    PrefixHash,
    /// Peer: vLLM's router (`vllm-router`), `kv_aware`, fed the workers' KV events and replay.
    VllmRouterKvAware,
    /// Peer: vLLM's router, `cache_aware` (approximate radix tree of rendered prompts).
    VllmRouterCacheAware,
    /// Peer: SGLang's model gateway (`smg`), `cache_aware`.
    SmgCacheAware,
    /// Peer: SGLang's model gateway, `prefix_hash`.
    SmgPrefixHash,
    /// Peer: SGLang's older router (`sglang-router`), `cache_aware`.
    SglangRouterCacheAware,
    /// Peer: the LiteLLM proxy, `least-busy`.
    LitellmLeastBusy,
    /// Kinference: lowest estimated TTFT from the KV-cache view and queues.
    Kinference,
    /// Client-side oracle with the simulator's exact view (the limit).
    Oracle,
}

impl Policy {
    /// All policies, in report order.
    pub const ALL: [Policy; 6] = [
        Self::Random,
        Self::RoundRobin,
        Self::LeastOutstanding,
        Self::PrefixHash,
        Self::Kinference,
        Self::Oracle,
    ];

    /// The peer routers (`routing-bench --peers`), in report order.
    pub const PEERS: [Policy; 6] = [
        Self::VllmRouterKvAware,
        Self::VllmRouterCacheAware,
        Self::SmgCacheAware,
        Self::SmgPrefixHash,
        Self::SglangRouterCacheAware,
        Self::LitellmLeastBusy,
    ];

    /// The name on the command line, in the results and in the gateway's `routing:` setting.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Random => "random",
            Self::RoundRobin => "round-robin",
            Self::LeastOutstanding => "least-outstanding",
            Self::PrefixHash => "prefix-hash",
            Self::VllmRouterKvAware => "vllm-router-kv-aware",
            Self::VllmRouterCacheAware => "vllm-router-cache-aware",
            Self::SmgCacheAware => "smg-cache-aware",
            Self::SmgPrefixHash => "smg-prefix-hash",
            Self::SglangRouterCacheAware => "sglang-router-cache-aware",
            Self::LitellmLeastBusy => "litellm-least-busy",
            Self::Kinference => "kinference",
            Self::Oracle => "oracle",
        }
    }

    /// The gateway routing mode that implements it (`None` for the client-side oracle and the peers).
    pub fn gateway_mode(self) -> Option<&'static str> {
        match self {
            Self::Oracle => None,
            peer if peer.is_peer() => None,
            other => Some(other.as_str()),
        }
    }

    /// Whether it is another project's router ([`Policy::PEERS`]).
    pub fn is_peer(self) -> bool {
        Self::PEERS.contains(&self)
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy name that is not one of [`Policy::ALL`].
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown policy {0:?} (expected random, round-robin, least-outstanding, prefix-hash, kinference, oracle, or a peer: vllm-router-kv-aware, vllm-router-cache-aware, smg-cache-aware, smg-prefix-hash, sglang-router-cache-aware, litellm-least-busy)"
)]
pub struct UnknownPolicy(String);

impl FromStr for Policy {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .chain(Self::PEERS)
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownPolicy(s.to_string()))
    }
}
