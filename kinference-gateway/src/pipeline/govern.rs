//! The governance stages both front doors run (the HTTP pipeline and the Envoy ext_proc handler):
//! admit (the tenant's budget and token limits) and plan (the policies, or the plain pool without
//! them). Authentication is [`crate::tenancy::Tenancy::authenticate`] on the request's headers.

use std::sync::Arc;

use crate::errors::{GatewayError, Protocol};
use crate::policy::stage::{Plan, PlanTarget, PolicyStage, StageRequest};
use crate::routing::Router;
use crate::routing::tokenize::PromptTokens;
use crate::tenancy::{Admission, Caller, Tenancy};

use super::exchange::Request;

/// Stage "admit": the tenant's monthly budget and token rate limits for `request`, before anything
/// is routed (429 in the client's protocol, with `Retry-After` and the rate-limit headers). The
/// prompt's size is [`PromptTokens::size`]: the tokenizer's count when the tokenize stage could run
/// it, else the estimate.
pub async fn admit(
    tenancy: &Arc<Tenancy>,
    caller: &Caller,
    request: &Request,
    tokens: &PromptTokens,
    protocol: Protocol,
) -> Result<Admission, GatewayError> {
    let (fields, completion) = request.fields();
    let prompt_tokens = tokens.size(request.prompt());
    let (input, output) = tenancy.demand(prompt_tokens, fields, completion);
    // Each of `n` choices generates up to the limit.
    let choices = fields
        .get("n")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(1)
        .max(1);
    tenancy
        .admit(
            caller,
            request.model(),
            input,
            output.saturating_mul(choices),
            protocol,
        )
        .await
}

/// What the plan stage reads beside the request.
#[derive(Debug, Clone, Copy)]
pub struct PlanInput<'a> {
    /// Who is calling.
    pub caller: Option<&'a Caller>,
    /// `x-kinference-tags`.
    pub tags: Option<&'a str>,
    /// Explain the decision.
    pub debug: bool,
    /// Only local pools may serve (the tenant's budget is spent and `onExceeded` is `LocalOnly`).
    pub local_only: bool,
    /// The prompt's tokens so far; the plan's estimates add to them and the route reuses them.
    pub tokens: &'a PromptTokens,
}

/// Stage "plan" (with a policy directory): classify the request, evaluate the policies against the
/// pools' state, and get the ordered targets (pools, providers); a refusal ends the request here
/// (and counts in the tenant's policy metrics). A tenant held to local pools gets a local-only plan.
pub async fn plan(
    stage: &PolicyStage,
    router: &Router,
    tenancy: Option<&Tenancy>,
    request: &Request,
    input: PlanInput<'_>,
    explain: &mut Option<String>,
) -> Result<Plan, GatewayError> {
    // Parsed once by the parse stage when policies apply; parsed here otherwise.
    let parsed;
    let json = match &request.json {
        Some(json) => json,
        None => {
            parsed = crate::api::openai::parse_body::<serde_json::Value>(&request.client_body)?;
            &parsed
        }
    };
    let req = StageRequest {
        body: json,
        model: request.model(),
        prompt: request.prompt(),
        tenant: input
            .caller
            .and_then(|c| c.tenant())
            .map(|t| t.name.as_str()),
        tags_header: input.tags,
        debug: input.debug,
        tokens: input.tokens,
    };
    let mut plan = match stage.decide(router, req, explain).await {
        Ok(plan) => plan,
        Err(error) => {
            if let (GatewayError::PolicyRejected { code, .. }, Some(caller), Some(tenancy)) =
                (&error, input.caller, tenancy)
            {
                tenancy.policy_decision(caller, code, "reject");
            }
            return Err(error);
        }
    };
    if input.local_only && !plan.local_only {
        // Past its budget the tenant keeps local pools only: paid providers are dropped.
        plan.local_only = true;
        plan.targets
            .retain(|t| matches!(t, PlanTarget::Pool { .. }));
        if plan.targets.is_empty() {
            // A burst to providers only: the tenant is served by the pool of its model instead.
            plan.targets.push(PlanTarget::Pool {
                pool: "default".into(),
                model: request.model().to_string(),
                workers: None,
            });
        }
        if let Some(e) = explain.as_mut() {
            e.push_str("; local_only=budget");
        }
    }
    Ok(plan)
}
