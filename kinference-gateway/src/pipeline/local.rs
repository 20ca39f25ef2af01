//! Stage "forward" for the endpoints the gateway answers itself, after the same stages as every
//! other request (a caller, a slot, its tenant's limits and policies): `POST
//! /v1/messages/count_tokens` (the prompt's size from the gateway's own tokenizer) and `GET
//! /v1/models` ([`super::models`]). Both doors answer with the same JSON; nothing reaches a backend.

use super::exchange::{Exchange, Kind, Request};
use super::routes::Endpoint;
use crate::api::anthropic;
use crate::api::openai;
use crate::errors::GatewayError;
use crate::gateway::Gateway;

/// The answer's status and JSON body, the request settled with its status.
pub async fn answer(
    gw: &Gateway,
    ex: &mut Exchange,
    request: &Request,
) -> Result<serde_json::Value, GatewayError> {
    let body = match (&request.kind, ex.endpoint) {
        (Kind::CountTokens { request, .. }, _) => {
            let tokenizer = gw.router.tokenizer(&request.model);
            if tokenizer.is_none() && !gw.models.contains(&request.model) {
                return Err(GatewayError::UnknownModel(request.model.clone()));
            }
            let request = request.clone();
            // A long prompt takes milliseconds to render and encode: off the reactor, one per core.
            let n = crate::routing::tokenize::off_reactor(move || {
                anthropic::count_tokens::count(tokenizer.as_deref(), &request)
            })
            .await
            .map_err(|e| GatewayError::invalid("messages", format!("count_tokens: {e}")))??;
            anthropic::count_tokens::response_body(n)
        }
        (Kind::Models, _) => {
            // A tenant held to some models sees those.
            let mut cards = super::models::cards(gw);
            if let Some(caller) = &ex.caller {
                cards.retain(|c| gw.tenancy.allows(caller, &c.id));
            }
            openai::models_response(&cards)
        }
        (_, endpoint) => {
            return Err(GatewayError::NotFound {
                method: endpoint.method().to_string(),
                path: endpoint.path().to_string(),
            });
        }
    };
    if let Some(mut settlement) = ex.settlement.take() {
        settlement.finish(http::StatusCode::OK.as_u16(), None);
    }
    Ok(body)
}

/// Whether the gateway answers `endpoint` itself.
pub fn answers(endpoint: Endpoint) -> bool {
    !endpoint.reaches_backend()
}
