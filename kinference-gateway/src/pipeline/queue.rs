//! Stage "queue": flow control between the plan and the forward stage. While the plan's first pool
//! is saturated the request waits here, in its band, fair between tenants by tokens, and is then
//! routed with the workers' state of the moment it leaves the queue; one that waits too long is shed
//! with 429/503 and `Retry-After` in the client's protocol and settled like any refusal
//! ([`crate::overload::flow`]). Both front doors run it, for every endpoint a worker answers.
//!
//! The request's band is its tenant's priority; `x-kinference-priority` may lower it, and raise it
//! only where the tenant's `flowControl.requestPriority` allows.

use std::sync::Arc;

use kinference_crds::TenantPriority;
use tracing::Instrument as _;

use super::exchange::{Exchange, Request};
use crate::errors::GatewayError;
use crate::gateway::Gateway;
use crate::overload::flow::{Probe, Ticket};
use crate::policy::stage::{Plan, PlanTarget};

/// Stage "queue" for `request` under `plan`: at once when flow control is off, the endpoint has no
/// worker, or the plan starts with a provider.
pub async fn queue(
    gw: &Gateway,
    ex: &mut Exchange,
    request: &Request,
    plan: &Plan,
) -> Result<(), GatewayError> {
    let flow = &gw.overload.flow;
    if !flow.enabled() || !ex.endpoint.reaches_backend() {
        return Ok(());
    }
    let Some(PlanTarget::Pool {
        pool,
        model,
        workers,
    }) = plan.targets.first()
    else {
        return Ok(());
    };
    let router = Arc::clone(&gw.router);
    let (served, within) = (model.clone(), workers.clone());
    let probe: Probe = Arc::new(move || router.pressure(&served, within.as_deref()));
    let ticket = ticket(ex, request);
    let key = format!("{pool}/{model}");
    let waited = flow
        .wait(&key, probe, ticket)
        .instrument(tracing::debug_span!("queue"))
        .await;
    match waited {
        Ok(passed) => {
            if ex.debug
                && let Some(line) = &passed.explain
            {
                let before = ex.explain.take().unwrap_or_default();
                ex.explain = Some(format!(
                    "{before}; {line} after {} ms",
                    passed.waited.as_millis()
                ));
            }
            if let Some(s) = ex.settlement() {
                s.hold_flow(passed);
            }
            Ok(())
        }
        Err(shed) => {
            tracing::debug!(pool = %key, reason = shed.reason.as_str(), waited_ms = shed.waited.as_millis() as u64, "request shed by flow control");
            Err(shed.into())
        }
    }
}

/// The band of a request from a tenant of priority `own` that asked for `asked`: a lower band
/// always, a higher one only where the tenant `may_raise`.
pub fn band(own: TenantPriority, asked: Option<TenantPriority>, may_raise: bool) -> TenantPriority {
    match asked {
        Some(asked) if !asked.above(own) || may_raise => asked,
        _ => own,
    }
}

/// What the flow control weighs the request by: its band, tenant, weight and tokens.
fn ticket(ex: &Exchange, request: &Request) -> Ticket {
    let tenant = ex.caller.as_ref().and_then(|c| c.tenant());
    let own = ex.caller.as_ref().map(|c| c.priority()).unwrap_or_default();
    let share = tenant
        .and_then(|t| t.flow_control.clone())
        .unwrap_or_default();
    let band = band(own, ex.asked_band, share.request_priority);
    let prompt = ex.tokens.size(request.prompt());
    let output = request.output_limit(ex.endpoint).unwrap_or(0);
    Ticket {
        band,
        tenant: tenant.map_or_else(|| "anonymous".to_string(), |t| t.label.clone()),
        weight: share.weight,
        cost: prompt.saturating_add(output),
        deadline: share
            .queue_deadline_ms
            .map(|ms| std::time::Duration::from_millis(u64::from(ms))),
    }
}

#[cfg(test)]
mod tests {
    use super::super::exchange::{PRIORITY_HEADER, asked_band};
    use super::*;
    use TenantPriority::{High, Low, Medium};
    use http::HeaderMap;

    #[test]
    fn a_request_may_lower_its_band_and_raise_it_only_where_its_tenant_allows() {
        assert_eq!(band(Medium, None, false), Medium);
        assert_eq!(band(Medium, Some(Low), false), Low);
        assert_eq!(band(Medium, Some(High), false), Medium);
        assert_eq!(band(Medium, Some(High), true), High);
        let mut headers = HeaderMap::new();
        headers.insert(PRIORITY_HEADER, http::HeaderValue::from_static(" HIGH "));
        assert_eq!(asked_band(&headers), Some(High));
        headers.insert(PRIORITY_HEADER, http::HeaderValue::from_static("urgent"));
        assert_eq!(asked_band(&headers), None);
    }
}
