//! The tenant table: tenants, their keys and the pools' prices (built from the configuration
//! sources by [`super::from_source`]); authentication against it.

use std::collections::HashMap;
use std::sync::Arc;

use http::HeaderMap;
use kinference_crds::{InferencePoolSpec, TokenPrices};

use super::keys::{self, KeyRing};
use super::metrics::{self, TenantStatus};
use super::served::ServedModels;
use super::{Caller, Tenancy, Tenant};
use crate::errors::GatewayError;

/// The tenants and keys currently in force.
#[derive(Debug, Default)]
pub(super) struct TenantTable {
    pub(super) tenants: Vec<Arc<Tenant>>,
    pub(super) ring: KeyRing,
    /// Pools for pricing: (name, spec), and InferenceModel name -> served name.
    pub(super) pools: Vec<(String, InferencePoolSpec)>,
    pub(super) served_names: HashMap<String, String>,
    /// Requested names (model, alias, class) -> served models, for limits and prices.
    pub(super) served: ServedModels,
    /// A fingerprint of what was loaded (tenant names, key digests), to log changes only.
    pub(super) fingerprint: Vec<u8>,
    /// A tenant source is configured: an empty table refuses requests (503) instead of opening.
    pub(super) required: bool,
}

impl TenantTable {
    /// No tenant yet; `required`: a tenant source is configured (closed until it loads).
    pub(super) fn empty(required: bool) -> Self {
        TenantTable {
            required,
            ..TenantTable::default()
        }
    }
}

impl Tenancy {
    /// Whether the gateway serves without API keys (no tenant configured).
    pub fn is_open(&self) -> bool {
        let table = self.table.read();
        table.tenants.is_empty() && !table.required
    }

    /// Stage "authenticate": the caller of a request, or 401.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, GatewayError> {
        let table = self.table.read().clone();
        if table.tenants.is_empty() {
            if table.required {
                self.auth_failed("tenants_unavailable");
                return Err(GatewayError::TenantsUnavailable(
                    "No valid tenant configuration is loaded; requests are refused until one is. Retry shortly."
                        .into(),
                ));
            }
            return Ok(Caller { tenant: None });
        }
        let Some(key) = keys::presented_key(headers) else {
            self.auth_failed("missing");
            return Err(GatewayError::Unauthenticated(
                "Missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`."
                    .into(),
            ));
        };
        match table.ring.lookup(&key) {
            Some(i) => Ok(Caller {
                tenant: table.tenants.get(i as usize).cloned(),
            }),
            None => {
                self.auth_failed("unknown");
                Err(GatewayError::Unauthenticated(
                    "Incorrect API key provided.".into(),
                ))
            }
        }
    }

    fn auth_failed(&self, reason: &'static str) {
        self.metrics
            .auth_failures
            .get_or_create(&metrics::AuthFailure { reason })
            .inc();
        self.metrics
            .requests
            .get_or_create(&TenantStatus {
                tenant: "unauthenticated".into(),
                model: String::new(),
                status: 401,
            })
            .inc();
    }

    /// The pool that serves `model` on `worker`: one listing the worker's URL, else one serving it.
    pub(super) fn pool_of(&self, worker: &str, model: &str) -> Option<(String, TokenPrices)> {
        let table = self.table.read().clone();
        let by_url = table.pools.iter().find(|(_, p)| {
            p.endpoints
                .iter()
                .any(|e| e.url.trim_end_matches('/') == worker.trim_end_matches('/'))
        });
        let by_model = || {
            table.pools.iter().find(|(_, p)| {
                p.models
                    .iter()
                    .any(|m| m == model || table.served_names.get(m).is_some_and(|s| s == model))
            })
        };
        by_url
            .or_else(by_model)
            .map(|(name, p)| (name.clone(), p.prices.clone()))
    }
}
