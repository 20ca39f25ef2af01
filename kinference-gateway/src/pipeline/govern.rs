//! The stages between the body and the backend, the same for every endpoint and both front doors
//! (the HTTP pipeline and the Envoy ext_proc handler): parse, limit (the tenant's models, budget and
//! token limits) and plan (classify, the policies, the pools in order; the model's own workers
//! without policies). [`prepare`] runs them in order.

use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use tracing::Instrument as _;

use super::exchange::{self, Exchange, Kind, Request};
use super::routes::{Billing, Endpoint};
use crate::errors::GatewayError;
use crate::gateway::Gateway;
use crate::policy::model::{PolicySet, Requested};
use crate::policy::stage::{Plan, PlanTarget, StageRequest};
use crate::routing::sessions::{Answers, Held, Owner, SessionKey};

/// A request ready for its backend: parsed, admitted, planned.
#[derive(Debug)]
pub struct Prepared {
    /// The request (shared: a stream's second chance outlives the stages).
    pub request: Arc<Request>,
    /// Where it may go, most preferred first.
    pub plan: Arc<Plan>,
}

/// Stages "parse", "limit", "classify" and "policy" for a request whose body is `body`.
pub async fn prepare(
    gw: &Gateway,
    ex: &mut Exchange,
    body: Bytes,
) -> Result<Prepared, GatewayError> {
    let mut request = tracing::debug_span!("parse")
        .in_scope(|| exchange::parse_as(ex.endpoint, body, gw.policy.is_some()))?;
    let tokenizer = gw.router.tokenizer(request.model());
    let bills = ex.endpoint.billing() != Billing::RequestOnly;
    if let Some(s) = ex.settlement() {
        s.model(request.model());
        s.counting_with(bills, tokenizer);
    }
    if ex.endpoint.names_model() {
        gw.router
            .tokenize_locally(request.model(), request.prompt(), &ex.tokens)
            .await;
    }
    limit(gw, ex, &mut request)
        .instrument(tracing::debug_span!("limit"))
        .await?;
    isolate(gw, ex, &mut request);
    request.session = session(ex, &request);
    request.answers = answers(ex, &request);
    if let Some(id) = request.previous_response_id()
        && gw.router.answer_held(&request.answers) == Held::Foreign
    {
        tracing::warn!("a request named another tenant's stored answer: refused as not found");
        return Err(GatewayError::ResponseNotFound(id.to_string()));
    }
    let plan = plan(gw, ex, &request).await?;
    Ok(Prepared {
        request: Arc::new(request),
        plan: Arc::new(plan),
    })
}

/// Stage "limit": the tenant's allowed models, monthly budget and rate limits for `request`, before
/// anything is routed (403, or 429 in the client's protocol with `Retry-After` and the rate-limit
/// headers). The prompt's size is the tokenizer's count when the tokenize stage could run it, else
/// the estimate; the output reservation is the largest limit the worker will honour (the model's
/// own limit when the request sets none), and the worker is sent exactly that limit whenever a
/// bucket holds it.
async fn limit(gw: &Gateway, ex: &mut Exchange, request: &mut Request) -> Result<(), GatewayError> {
    let Some(caller) = ex.caller.clone() else {
        return Ok(());
    };
    let endpoint = ex.endpoint;
    let prompt_tokens = match endpoint.billing() {
        Billing::RequestOnly => 0,
        _ => ex.tokens.size(request.prompt()),
    };
    let asked = request.output_limit(endpoint);
    let output = match endpoint.billing() {
        Billing::Generation => gw.tenancy.output_reservation(
            asked,
            model_limit(gw, request.model(), prompt_tokens),
            endpoint == Endpoint::Completions,
        ),
        _ => 0,
    };
    let admission = gw
        .tenancy
        .admit(
            &caller,
            request.model(),
            prompt_tokens,
            output.saturating_mul(request.choices()),
            ex.protocol,
        )
        .await?;
    if endpoint.billing() == Billing::Generation {
        request.limit_output(endpoint, output, admission.reserves_output())?;
    }
    if let Some(s) = ex.settlement() {
        s.admitted(admission);
    }
    Ok(())
}

/// The `cache_salt` every worker is sent for `request` ([`crate::tenancy::isolation`]): the
/// caller's scope, with the client's own salt mixed in, on every endpoint whose worker keeps a prefix
/// cache; the router keys the prompt with it too, so a probe finds another scope's prompt neither in
/// `cached_tokens` nor in where it is routed.
fn isolate(gw: &Gateway, ex: &Exchange, request: &mut Request) {
    if !ex.endpoint.reaches_prefix_cache() {
        return;
    }
    request.cache_salt = match &ex.caller {
        Some(caller) => gw
            .tenancy
            .cache_salt(caller, request.client_salt.as_deref()),
        None => request.client_salt.clone(),
    };
}

/// The conversation `request` continues ([`crate::routing::sessions`]), its name hashed with the
/// caller's tenant (`anonymous` when the gateway is open): another tenant's same name is another key.
fn session(ex: &Exchange, request: &Request) -> Option<SessionKey> {
    let name = request.session_name(ex.session_header.as_deref())?;
    let tenant = ex.caller.as_ref().map_or("anonymous", |c| c.name());
    SessionKey::new(tenant, &name)
}

/// The stored answers `request` touches ([`crate::routing::sessions`]): on `/v1/responses`, the
/// caller's tenant (`anonymous` when the gateway is open) owns the answer it makes and may continue
/// only its own.
fn answers(ex: &Exchange, request: &Request) -> Answers {
    if !request.stores_answers() {
        return Answers::default();
    }
    let tenant = ex.caller.as_ref().map_or("anonymous", |c| c.name());
    Answers {
        owner: Some(Owner::of(tenant)),
        continues: request.previous_response_id().and_then(SessionKey::answer),
    }
}

/// A model's own output limit for a prompt of `prompt_tokens`: its context length (from its
/// `InferenceModel`) less the prompt.
fn model_limit(gw: &Gateway, model: &str, prompt_tokens: u64) -> Option<u64> {
    let set = gw.policy.as_ref()?.current();
    let context = set
        .models
        .values()
        .find(|m| m.spec.served_name == model || m.name == model)?
        .spec
        .context_length?;
    Some(u64::from(context).saturating_sub(prompt_tokens).max(1))
}

/// Stage "plan": with a policy directory, classify the request and evaluate the policies against
/// the pools' state (a refusal ends the request here and counts in the tenant's policy metrics); a
/// tenant held to local pools gets a local-only plan. Without policies: the model's own workers.
/// The model list has nothing to plan.
async fn plan(gw: &Gateway, ex: &mut Exchange, request: &Request) -> Result<Plan, GatewayError> {
    let Some(stage) = gw.policy.as_ref().filter(|_| ex.endpoint.names_model()) else {
        return Ok(Plan::default_pool(request.model()));
    };
    let parsed;
    let json = match &request.json {
        Some(json) => json,
        None => {
            parsed = crate::api::openai::parse_body::<serde_json::Value>(&request.client_body)?;
            &parsed
        }
    };
    let caller = ex.caller.as_ref();
    let req = StageRequest {
        body: json,
        model: request.model(),
        prompt: request.prompt(),
        tenant: caller.and_then(|c| c.tenant()).map(|t| t.name.as_str()),
        tags_header: ex.tags.as_deref(),
        debug: ex.debug,
        tokens: &ex.tokens,
        cache_salt: request.cache_salt.as_deref(),
    };
    let decided = stage
        .decide(&gw.router, req)
        .instrument(tracing::debug_span!("policy"))
        .await;
    let mut plan = match decided {
        Ok(plan) => plan,
        Err(refused) => {
            ex.explain = refused.explain;
            if let (GatewayError::PolicyRejected { code, .. }, Some(caller)) =
                (&refused.error, caller)
            {
                gw.tenancy.policy_decision(caller, code, "reject");
            }
            return Err(refused.error);
        }
    };
    ex.explain = plan.explain.clone();
    let local_only = ex
        .settlement
        .as_ref()
        .and_then(|s| s.admission())
        .is_some_and(|a| a.local_only());
    if local_only && !plan.local_only {
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
        if let Some(e) = ex.explain.as_mut() {
            e.push_str("; local_only=budget");
        }
    }
    if let (Kind::Passthrough { route, .. }, Some(set)) = (&request.kind, &plan.set) {
        one_model_for_ids(set, ex.endpoint, *route, request.model())?;
    }
    Ok(plan)
}

/// Token ids and embedding vectors mean different things for different models, so `/tokenize`,
/// `/detokenize` and `/v1/embeddings` take a class only when it has a single model.
fn one_model_for_ids(
    set: &PolicySet,
    endpoint: Endpoint,
    route: crate::api::openai::passthrough::Route,
    requested: &str,
) -> Result<(), GatewayError> {
    use crate::api::openai::passthrough::Route;
    let Requested::Class(class) = set.resolve(requested) else {
        return Ok(());
    };
    let members: Vec<&str> = set
        .models_in_class(&class)
        .filter_map(|m| set.models.get(m))
        .map(|m| m.spec.served_name.as_str())
        .collect();
    if members.len() <= 1 || route == Route::Responses {
        return Ok(());
    }
    Err(GatewayError::invalid(
        "model",
        format!(
            "model class {class:?} has several models ({}); {} needs one model, since each has its \
             own {}: name one of them",
            members.join(", "),
            endpoint.path(),
            if route == Route::Embeddings {
                "embeddings"
            } else {
                "token ids"
            },
        ),
    ))
}

/// The answer when no target of a plan could take the request.
pub fn no_backend(plan: &Plan, last: Option<GatewayError>) -> GatewayError {
    last.unwrap_or_else(|| GatewayError::PolicyRejected {
        status: StatusCode::SERVICE_UNAVAILABLE,
        code: "no_backend_available",
        message: format!(
            "no backend chosen by the policies ({}) could take the request",
            plan.rule
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::openai::passthrough::Route;
    use crate::policy::engine::tests::{RESOURCES, set_from};

    /// Classes of `RESOURCES`: `general` = org/large + org/small, `coding` = org/large.
    fn ids(endpoint: Endpoint, route: Route, class: &str) -> Result<(), GatewayError> {
        one_model_for_ids(&set_from(&[RESOURCES]), endpoint, route, class)
    }

    #[test]
    fn a_class_of_several_models_is_refused_where_models_differ_in_kind() {
        for (endpoint, route) in [
            (Endpoint::Embeddings, Route::Embeddings),
            (Endpoint::Tokenize, Route::Tokenize),
            (Endpoint::Detokenize, Route::Detokenize),
        ] {
            let error = ids(endpoint, route, "general").expect_err("refused");
            assert_eq!(error.status(), StatusCode::BAD_REQUEST);
            let text = error.to_string();
            assert!(
                text.contains("several models (org/large, org/small)")
                    && text.contains(endpoint.path()),
                "{text}"
            );
            assert!(ids(endpoint, route, "coding").is_ok(), "one model: served");
            assert!(ids(endpoint, route, "org/large").is_ok(), "a model: served");
        }
        assert!(
            ids(Endpoint::Responses, Route::Responses, "general").is_ok(),
            "a response is text: any model of the class"
        );
    }
}
