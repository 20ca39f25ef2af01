//! Who may see what: the admin credential, and which callers are shown the gateway's internals.
//!
//! The admin key (`--admin-key`, `KINFERENCE_ADMIN_KEY`; the chart reads it from a Secret) guards:
//! - on the admin port, `/admin/usage` (every tenant's usage and cost) and `/healthz/workers` (the
//!   workers' addresses), presented as `Authorization: Bearer <key>` or `x-api-key: <key>`; a
//!   tenant's own API key on `/admin/usage` reads that tenant's usage only. `/metrics`, `/healthz`
//!   and `/readyz` stay open for probes and Prometheus unless `--admin-key-for-metrics`;
//! - on the serving port, `x-kinference-debug` (the decision explained in `x-kinference-decision`)
//!   and `x-kinference-worker` (the chosen worker's or provider's address), which are answered only
//!   to a request carrying the key in `x-kinference-admin-key` (the `Authorization` header there is
//!   the tenant's).
//!
//! Without an admin key the safe default is loopback only: a caller connected from `127.0.0.0/8`
//! or `::1` (a developer's machine, `kubectl port-forward`) is an admin, everyone else is not. A
//! proxy in the same pod (a service-mesh sidecar) makes every caller look local: set a key there.
//! With a key configured, loopback means nothing: the key is required from everywhere.

use std::net::SocketAddr;

use http::HeaderMap;
use subtle::ConstantTimeEq;

use crate::tenancy::keys::{self, KeyDigest};

/// The header that carries the admin key on the serving port.
pub const ADMIN_KEY_HEADER: &str = "x-kinference-admin-key";

/// The admin key as configured. Deliberately no `Display`, and `Debug` shows no byte of it.
#[derive(Clone)]
pub struct AdminKey {
    digest: KeyDigest,
    /// The key itself: what this gateway presents to its peer replicas' admin ports.
    secret: std::sync::Arc<str>,
}

impl AdminKey {
    /// Parses the flag's value: at least 16 bytes, so that a placeholder like `changeme` or an
    /// empty Secret is a start-up error rather than a guessable credential.
    pub fn parse(value: &str) -> Result<AdminKey, String> {
        let value = value.trim();
        if value.len() < 16 {
            return Err("the admin key must be at least 16 characters long".into());
        }
        Ok(AdminKey {
            digest: keys::digest(value.as_bytes()),
            secret: value.into(),
        })
    }

    fn matches(&self, presented: &KeyDigest) -> bool {
        bool::from(presented.ct_eq(&self.digest))
    }

    /// The key, for this gateway's own calls to its peer replicas (which share it).
    pub fn expose(&self) -> &str {
        &self.secret
    }
}

impl std::fmt::Debug for AdminKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminKey(<redacted>)")
    }
}

/// The flags of the admin credential.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct AccessArgs {
    /// The admin key (at least 16 characters): required for `/admin/usage` and `/healthz/workers`
    /// on the admin port, and (as `x-kinference-admin-key`) for `x-kinference-debug` and
    /// `x-kinference-worker` on the serving port. Unset: only loopback callers are admins.
    #[arg(long, env = "KINFERENCE_ADMIN_KEY", value_parser = AdminKey::parse, hide_env_values = true)]
    pub admin_key: Option<AdminKey>,

    /// Require the admin key for `/metrics` too (Prometheus then sends it as a bearer token).
    #[arg(long, env = "KINFERENCE_ADMIN_KEY_FOR_METRICS", requires = "admin_key")]
    pub admin_key_for_metrics: bool,
}

/// The connecting peer's address, put into each request's extensions by the server.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub SocketAddr);

/// Who is an admin.
#[derive(Debug, Clone, Default)]
pub struct Access {
    admin_key: Option<AdminKey>,
    metrics_need_key: bool,
}

impl Access {
    /// From the flags.
    pub fn new(args: &AccessArgs) -> Access {
        Access {
            admin_key: args.admin_key.clone(),
            metrics_need_key: args.admin_key_for_metrics,
        }
    }

    /// Whether an admin key is configured.
    pub fn has_key(&self) -> bool {
        self.admin_key.is_some()
    }

    /// Whether `/metrics` needs the admin key.
    pub fn metrics_need_key(&self) -> bool {
        self.metrics_need_key
    }

    /// An admin-port request from `peer` is an admin's: it presents the admin key as its bearer
    /// token or `x-api-key`, or (no key configured) it comes from loopback.
    pub fn admin_port_admin(&self, headers: &HeaderMap, peer: Option<&Peer>) -> bool {
        match &self.admin_key {
            Some(key) => keys::presented_key(headers).is_some_and(|k| key.matches(&k.digest())),
            None => is_loopback(peer),
        }
    }

    /// A serving-port request from `peer` is an admin's: it carries the admin key in
    /// `x-kinference-admin-key`, or (no key configured) it comes from loopback.
    pub fn serving_port_admin(&self, headers: &HeaderMap, peer: Option<&Peer>) -> bool {
        match &self.admin_key {
            Some(key) => headers
                .get(ADMIN_KEY_HEADER)
                .is_some_and(|v| key.matches(&keys::digest(v.as_bytes().trim_ascii()))),
            None => is_loopback(peer),
        }
    }
}

fn is_loopback(peer: Option<&Peer>) -> bool {
    peer.is_some_and(|p| match p.0.ip() {
        std::net::IpAddr::V4(ip) => ip.is_loopback(),
        // `::ffff:127.0.0.1` too: a dual-stack listener reports IPv4 peers that way.
        std::net::IpAddr::V6(ip) => {
            ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    })
}

#[cfg(test)]
mod tests;
