//! Stages "authenticate" and "admit", before any byte of the body is read: the caller from its API
//! key (401), then its place under the gateway's in-flight limit (by the tenant's priority) and
//! room for its body in the body-byte budget (503 with `Retry-After` past either). Once the body
//! is in, [`body_read`] reserves what it will cost parsed. An unknown caller, or one past the
//! limits, costs the gateway no memory for its body.

use http::HeaderMap;
use tracing::Instrument as _;

use super::exchange::Exchange;
use crate::errors::GatewayError;
use crate::gateway::Gateway;
use crate::overload::budget::parse_cost;

/// The budget's name for callers of an open gateway (no tenants): they share one tenant's share.
const OPEN_CALLER: &str = "";

/// Stage "authenticate": the caller of `headers` (401 in the client's protocol without a valid
/// key, when the gateway has tenants).
pub fn authenticate(
    gw: &Gateway,
    ex: &mut Exchange,
    headers: &HeaderMap,
) -> Result<(), GatewayError> {
    let caller =
        tracing::debug_span!("authenticate").in_scope(|| gw.tenancy.authenticate(headers))?;
    ex.caller = Some(caller);
    Ok(())
}

/// Stage "admit": an in-flight slot, and room for a body of `declared` bytes (the body limit when
/// the client declares no length; nothing for an endpoint without a body), both held by the
/// request's settlement until it ends.
pub async fn admit(
    gw: &Gateway,
    ex: &mut Exchange,
    declared: Option<usize>,
) -> Result<(), GatewayError> {
    let admitted = async {
        let (priority, tenant) = caller_of(ex);
        let slot = gw.overload.admit(priority).await?;
        if let (Some(s), Some(slot)) = (ex.settlement(), slot) {
            s.hold(slot);
        }
        if !ex.endpoint.has_body() {
            return Ok(());
        }
        let limit = gw.settings.body_limit_bytes;
        if declared.is_some_and(|n| n > limit) {
            return Err(GatewayError::BodyTooLarge { limit });
        }
        reserve(gw, ex, &tenant, declared.unwrap_or(limit), priority).await
    };
    admitted.instrument(tracing::debug_span!("admit")).await
}

/// Once the body is read: what it will cost parsed ([`parse_cost`]) on top of its text (reserved
/// before it was read; a body that declared no length gives back what it did not use).
pub async fn body_read(gw: &Gateway, ex: &mut Exchange, body: &[u8]) -> Result<(), GatewayError> {
    let (priority, tenant) = caller_of(ex);
    let reserved = ex.settlement.as_ref().map_or(0, |s| s.body_bytes_held());
    let wanted = parse_cost(body);
    if wanted <= reserved {
        return Ok(());
    }
    let limit = gw.overload.body_budget().per_tenant;
    if wanted > limit {
        // It could never be parsed within a tenant's room: too large, not a moment's overload.
        return Err(GatewayError::BodyTooCostly {
            cost: wanted,
            limit,
        });
    }
    reserve(gw, ex, &tenant, wanted - reserved, priority).await
}

async fn reserve(
    gw: &Gateway,
    ex: &mut Exchange,
    tenant: &str,
    bytes: usize,
    priority: kinference_crds::TenantPriority,
) -> Result<(), GatewayError> {
    let mut held = ex
        .settlement()
        .and_then(|s| s.take_body_reservation())
        .unwrap_or_default();
    let reserved = gw
        .overload
        .reserve_body(&mut held, tenant, bytes, priority)
        .await;
    if let Some(s) = ex.settlement() {
        s.hold_body(held);
    }
    Ok(reserved?)
}

/// The caller's priority and the name its body budget is kept under.
fn caller_of(ex: &Exchange) -> (kinference_crds::TenantPriority, String) {
    match &ex.caller {
        Some(c) => (
            c.priority(),
            c.tenant()
                .map_or(OPEN_CALLER.to_string(), |t| t.name.clone()),
        ),
        None => (Default::default(), OPEN_CALLER.to_string()),
    }
}
