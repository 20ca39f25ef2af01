//! The endpoint picker protocol's own fields (Gateway API Inference Extension, proposal 004, v1):
//! what the proxy says besides HTTP, and what the handler says back besides the route.
//!
//! - **Subset hint** (proxy -> picker): filter metadata `envoy.lb.subset_hint {
//!   x-gateway-destination-endpoint-subset }`, a list of `ip:port` (or a comma-separated string;
//!   a bare `ip` admits every port of that address, as the reference picker reads it). When the key
//!   is present the picker picks only within it; when nothing in it is eligible (or it is empty) the
//!   answer is a local 503.
//! - **Fallback list** (picker -> proxy): the destination header and the `envoy.lb` metadata hold
//!   the same value, the chosen endpoint first, then up to N others (`ip:port,ip:port`); a proxy
//!   with retries goes down the list.
//! - **Served endpoint** (proxy -> picker, response phase): filter metadata `envoy.lb {
//!   x-gateway-destination-endpoint-served }`, the endpoint that answered (a fallback when the first
//!   failed).

use std::net::{IpAddr, SocketAddr};

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::value::Kind;

use crate::routing::WorkerView;

/// The filter-metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of the subset hint.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The key (in `envoy.lb`) of the endpoint that served the request.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";

/// The endpoints the proxy allows the picker to choose from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subset {
    entries: Vec<String>,
}

impl Subset {
    /// The subset hint of a request's metadata; `None` when the proxy sent none (the whole pool).
    pub fn from_metadata(metadata: Option<&Metadata>) -> Option<Self> {
        let hint = metadata?.filter_metadata.get(SUBSET_NAMESPACE)?;
        let value = hint.fields.get(SUBSET_KEY)?;
        let mut entries = Vec::new();
        let mut add = |text: &str| {
            entries.extend(
                text.split(',')
                    .map(str::trim)
                    .filter(|e| !e.is_empty())
                    .map(str::to_string),
            );
        };
        match &value.kind {
            Some(Kind::StringValue(s)) => add(s),
            Some(Kind::ListValue(list)) => {
                for v in &list.values {
                    if let Some(Kind::StringValue(s)) = &v.kind {
                        add(s);
                    }
                }
            }
            // Any other shape names no endpoint: nothing is eligible.
            _ => {}
        }
        Some(Self { entries })
    }

    /// A subset of `entries` (for tests and callers that have the list already).
    pub fn of(entries: &[&str]) -> Self {
        Self {
            entries: entries.iter().map(|e| e.to_string()).collect(),
        }
    }

    /// Whether the endpoint `host:port` is in the subset (an entry without a port admits every
    /// port of its address).
    pub fn admits(&self, endpoint: &str) -> bool {
        let socket: Option<SocketAddr> = endpoint.parse().ok();
        self.entries.iter().any(|entry| {
            if entry == endpoint {
                return true;
            }
            match (entry.parse::<SocketAddr>(), entry.parse::<IpAddr>(), socket) {
                (Ok(e), _, Some(s)) => e == s,
                (_, Ok(ip), Some(s)) => ip == s.ip(),
                // A host name without a port: the endpoint's host part.
                _ => endpoint
                    .rsplit_once(':')
                    .is_some_and(|(host, _)| host == entry),
            }
        })
    }

    /// The workers a pick may choose from: those of `pool` (every worker when `None`) whose
    /// endpoint the subset admits.
    pub fn restrict(&self, workers: &[WorkerView], pool: Option<&[String]>) -> Vec<String> {
        workers
            .iter()
            .filter(|w| pool.is_none_or(|p| p.contains(&w.url)))
            .filter(|w| super::endpoint_of(&w.url).is_some_and(|e| self.admits(&e)))
            .map(|w| w.url.clone())
            .collect()
    }
}

/// Up to `n` endpoints to try after `chosen`: other healthy workers of `model` among `pool` (every
/// worker when `None`) that the subset admits, least loaded first. Read from the router's view
/// only: no ticket is taken (the proxy tries one only when the chosen endpoint failed).
pub fn fallbacks(
    workers: &[WorkerView],
    model: &str,
    chosen: &str,
    pool: Option<&[String]>,
    n: usize,
) -> Vec<String> {
    if n == 0 {
        return Vec::new();
    }
    let mut others: Vec<&WorkerView> = workers
        .iter()
        .filter(|w| w.healthy && w.model == model && w.url != chosen)
        .filter(|w| pool.is_none_or(|p| p.contains(&w.url)))
        .collect();
    others.sort_by_key(|w| w.in_flight);
    others
        .into_iter()
        .filter_map(|w| super::endpoint_of(&w.url))
        .take(n)
        .collect()
}

/// The endpoint that served the request, as the proxy reports it in the response phase.
pub fn served(metadata: Option<&Metadata>) -> Option<String> {
    let lb = metadata?.filter_metadata.get(super::reply::LB_NAMESPACE)?;
    match &lb.fields.get(SERVED_KEY)?.kind {
        Some(Kind::StringValue(s)) if !s.is_empty() => Some(s.clone()),
        _ => None,
    }
}

/// The worker whose endpoint is `endpoint`.
pub fn worker_at(workers: &[WorkerView], endpoint: &str) -> Option<String> {
    workers
        .iter()
        .find(|w| super::endpoint_of(&w.url).as_deref() == Some(endpoint))
        .map(|w| w.url.clone())
}
