//! Node agents from the EndpointSlices of the chart's headless agent Service: every ready endpoint
//! address is one agent, reached at `http://<address>:<grpc port>`. The other gateway replicas are
//! found the same way, from the gateway Service's slices at its `admin` port.
//!
//! Slices are read as [`kube::core::DynamicObject`]s in the version the apiserver prefers
//! (`discovery.k8s.io/v1`, or `v1beta1` before Kubernetes 1.21): the fields used here are the same in
//! both.

use std::collections::BTreeSet;

use serde::Deserialize;

/// Label every EndpointSlice carries with the name of its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The agent Service's port name for the summary stream (the chart's).
pub const GRPC_PORT_NAME: &str = "grpc";

/// The parts of an EndpointSlice (v1 and v1beta1) discovery reads.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Slice {
    /// `IPv4`, `IPv6` or `FQDN`.
    #[serde(default, rename = "addressType")]
    pub address_type: Option<String>,
    /// The endpoints.
    #[serde(default)]
    pub endpoints: Vec<SliceEndpoint>,
    /// The Service ports.
    #[serde(default)]
    pub ports: Option<Vec<SlicePort>>,
}

/// One endpoint of a slice.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SliceEndpoint {
    /// Its addresses (all of one pod).
    #[serde(default)]
    pub addresses: Vec<String>,
    /// Readiness.
    #[serde(default)]
    pub conditions: Option<SliceConditions>,
}

/// Endpoint conditions.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SliceConditions {
    /// Unset means ready (the API's rule).
    #[serde(default)]
    pub ready: Option<bool>,
}

/// A Service port in a slice.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SlicePort {
    /// Port name.
    #[serde(default)]
    pub name: Option<String>,
    /// Port number.
    #[serde(default)]
    pub port: Option<i32>,
}

/// Agent gRPC URLs in a slice: ready endpoints, at the slice's `grpc` port (else `default_port`).
pub fn agents_of(slice: &Slice, default_port: u16) -> BTreeSet<String> {
    endpoints_of(slice, GRPC_PORT_NAME, default_port)
}

/// `http://address:port` of each ready endpoint in a slice, at the slice's port named `port_name`
/// (else `default_port`; none when that is 0).
pub fn endpoints_of(slice: &Slice, port_name: &str, default_port: u16) -> BTreeSet<String> {
    let port = slice
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(port_name))
        .and_then(|p| p.port)
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or(default_port);
    if port == 0 {
        return BTreeSet::new();
    }
    let v6 = slice.address_type.as_deref() == Some("IPv6");
    slice
        .endpoints
        .iter()
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false))
        .filter_map(|e| e.addresses.first())
        .map(|a| {
            if v6 {
                format!("http://[{a}]:{port}")
            } else {
                format!("http://{a}:{port}")
            }
        })
        .collect()
}
