//! Stage "forward" for a request split between a prefill worker and a decode worker (prefill/decode
//! disaggregation), in vLLM's KV-connector protocol (what its `disagg_proxy` examples, vllm-router's
//! `--vllm-pd-disaggregation` and llm-d's sidecar send):
//!
//! 1. the **prefill call**: the request with `max_tokens: 1` (and `max_completion_tokens: 1`), not
//!    streamed, with `kv_transfer_params: {"do_remote_decode": true, ...}`. The worker computes the
//!    prompt's KV cache, keeps it for the decode worker to pull, and answers with the
//!    `kv_transfer_params` that name it (NixlConnector: its engine id, block ids, host and port);
//! 2. the **decode call**: the request as the client sent it (streamed or not), carrying those
//!    `kv_transfer_params`. The decode worker pulls the KV cache and answers through the one relay.
//!
//! The pair comes from [`crate::routing::Router::pick_pair`], which may also keep the request whole
//! on one worker (too little of its prompt left to compute to be worth splitting).
//!
//! Failures, nothing having reached the client: a prefill worker that cannot be reached or fails
//! (5xx, a broken connection) is marked as any worker is and the request runs whole on the decode
//! worker already chosen (`fallback`); a prefill worker's 4xx is the request's own fault (a prompt
//! longer than the model's context) and is the client's answer, in its protocol. A decode worker that
//! fails before answering passes the call, with the same `kv_transfer_params`, to another worker of
//! the pool (which pulls the same cache), as a stream it breaks before any output does through the
//! relay's second chance. Whatever the retries, the request is settled once: the prompt billed by
//! the prefill worker's usage at its pool's prices, the output by the decode worker's answer
//! ([`crate::pipeline::settle::Settlement::prefilled`]); the prefill's one output token is not billed.

use kinference_crds::ApiStyle;
use serde_json::Value;

use super::{Pick, Unsent, WorkerAnswer, WorkerCall, send_once, send_to_worker};
use crate::api::members::with_members;
use crate::api::openai::Usage;
use crate::errors::GatewayError;
use crate::gateway::Gateway;
use crate::pipeline::exchange::{Door, Exchange, Request};
use crate::policy::stage::Plan;
use crate::routing::{Decision, Pair, PairRequest, RouteRequest};

/// The prefill call's `kv_transfer_params`, as vLLM's own disaggregation proxies send them.
const DO_REMOTE_DECODE: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// How the requests of one plan target may be split.
#[derive(Clone, Debug, Default)]
pub struct Disaggregation {
    /// The workers that may run the prefill (`None`: every `prefill` worker of the model).
    pub prefill_workers: Option<Vec<String>>,
    /// Below this many prompt tokens left to compute on the best decode worker, the request runs
    /// whole on one worker.
    pub min_uncached_tokens: usize,
}

/// The disaggregation of plan target `pool` (its `workers`): its `InferencePool`'s
/// `disaggregation` (the prefill pool, the threshold) when the plan has a policy set, else the
/// gateway's (`disaggregation.min_uncached_tokens`, prefills on any `prefill` worker of the model).
pub fn settings(
    gw: &Gateway,
    plan: &Plan,
    pool: &str,
    workers: Option<&[String]>,
) -> Disaggregation {
    let default_min = gw.router.pd_min_uncached_tokens();
    let Some(set) = plan.set.as_deref() else {
        return Disaggregation {
            prefill_workers: None,
            min_uncached_tokens: default_min,
        };
    };
    let spec = set
        .pools
        .get(pool)
        .and_then(|p| p.spec.disaggregation.as_ref());
    let prefill_workers = match spec.and_then(|d| d.prefill_pool.as_deref()) {
        // A prefill pool the set does not hold (or whose members are not known) has no worker.
        Some(name) => Some(
            set.pools
                .get(name)
                .zip(gw.policy.as_ref())
                .and_then(|(p, stage)| stage.members(&p.spec))
                .unwrap_or_default(),
        ),
        None => workers.map(<[String]>::to_vec),
    };
    Disaggregation {
        prefill_workers,
        min_uncached_tokens: spec
            .and_then(|d| d.min_uncached_tokens)
            .map_or(default_min, |n| n as usize),
    }
}

/// Whether `call` may be split on `door`: the chat and completions APIs of the HTTP door. Envoy's
/// ext_proc door forwards to one destination, so its requests run whole (on a worker that takes
/// whole requests); Anthropic requests passed through to workers' own `/v1/messages` and the
/// pass-through endpoints have no `kv_transfer_params` in vLLM.
pub fn splits(call: &WorkerCall, door: Door) -> bool {
    door == Door::Http
        && call.style == ApiStyle::OpenAI
        && call.pick == Pick::Estimate
        && matches!(call.path, "/v1/chat/completions" | "/v1/completions")
}

/// Runs `call` on the pair of workers the router picks (or whole on one), as the module docs say.
pub async fn to_pair(
    gw: &Gateway,
    ex: &mut Exchange,
    request: &Request,
    call: WorkerCall,
    split: &Disaggregation,
) -> Result<WorkerAnswer, GatewayError> {
    let route = RouteRequest {
        model: &call.model,
        prompt: request.prompt(),
        debug: ex.debug,
        tokens: Some(&ex.tokens),
        salt: request.cache_salt.as_deref(),
        session: request.session,
        answers: Default::default(),
    };
    let pair = gw
        .router
        .pick_pair(PairRequest {
            route,
            prefill_within: split.prefill_workers.as_deref(),
            decode_within: call.pool.as_deref(),
            min_uncached_tokens: split.min_uncached_tokens,
        })
        .await?;
    let (prefill, mut decode) = match pair {
        Pair::Whole { decision, .. } => return whole(gw, ex, request, call, decision, None).await,
        Pair::Split { prefill, decode } => (prefill, *decode),
    };
    let prefill_worker = prefill.worker.clone();
    match prefill_call(gw, &call, request, prefill).await {
        Ok(prefilled) => {
            if let Some(s) = ex.settlement() {
                s.prefilled(&prefill_worker, prefilled.usage.as_ref());
            }
            let body = match &prefilled.params {
                Some(params) => {
                    with_members(&call.body, &[("kv_transfer_params", params.clone())])?
                }
                None => {
                    gw.router.count_pd("no_transfer_params");
                    tracing::warn!(worker = %prefill_worker, model = %call.model, "the prefill worker answered without kv_transfer_params (no KV connector?): the decode worker computes the prompt again");
                    call.body.clone()
                }
            };
            let decode_call = WorkerCall { body, ..call };
            whole(gw, ex, request, decode_call, decode, Some(prefill_worker)).await
        }
        // The request's own fault: no other worker would answer otherwise.
        Err(Unsent::Refused(error)) => Err(error),
        Err(Unsent::Unavailable(error)) => {
            gw.router.count_pd("fallback");
            tracing::warn!(worker = %prefill_worker, model = %call.model, %error, "prefill failed; the request runs whole on its decode worker");
            decode.explain = decode.explain.map(|e| {
                format!(
                    "pd=fallback: the prefill worker {prefill_worker} failed ({error}), the request runs whole on the decode worker; {e}"
                )
            });
            whole(gw, ex, request, call, decode, None).await
        }
    }
}

/// What the prefill worker answered.
struct Prefilled {
    /// Its `kv_transfer_params`, as JSON text (`None`: it sent none).
    params: Option<String>,
    /// Its usage (the prompt tokens it computed and found cached).
    usage: Option<Usage>,
}

/// The prefill call to `decision`'s worker ([`DO_REMOTE_DECODE`], one output token, not streamed),
/// its answer read whole; the worker's ticket ends with it.
async fn prefill_call(
    gw: &Gateway,
    call: &WorkerCall,
    request: &Request,
    mut decision: Decision,
) -> Result<Prefilled, Unsent> {
    let mut set: Vec<(&str, String)> = vec![
        ("stream", "false".into()),
        ("stream_options", "null".into()),
        ("max_tokens", "1".into()),
        // vLLM's default; it refuses null (`min_tokens: int`), and a client's min_tokens over 1
        // would contradict max_tokens 1.
        ("min_tokens", "0".into()),
        ("kv_transfer_params", DO_REMOTE_DECODE.into()),
    ];
    if call.path == "/v1/chat/completions" {
        set.push(("max_completion_tokens", "1".into()));
    }
    let body = with_members(&call.body, &set).map_err(Unsent::Refused)?;
    let prefill = WorkerCall {
        body,
        ..call.clone()
    };
    let response = match send_once(gw, &prefill, request, &decision).await {
        Ok(response) => response,
        // A 5xx is the prefill worker's failure, not the request's: the decode worker can still
        // compute the prompt itself.
        Err(Unsent::Refused(error @ GatewayError::BadUpstream { .. })) => {
            return Err(Unsent::Unavailable(error));
        }
        Err(other) => return Err(other),
    };
    let bytes = gw
        .upstream
        .read_body(&decision.worker, response.into_body())
        .await
        .map_err(Unsent::Unavailable)?;
    decision.ticket.first_token();
    let answer: Value = serde_json::from_slice(&bytes).map_err(|e| {
        Unsent::Unavailable(GatewayError::BadUpstream {
            worker: decision.worker.clone(),
            detail: format!("the prefill answer is not JSON: {e}"),
        })
    })?;
    let usage = answer
        .get("usage")
        .and_then(|u| serde_json::from_value::<Usage>(u.clone()).ok());
    let params = answer
        .get("kv_transfer_params")
        .filter(|p| p.is_object())
        .map(Value::to_string);
    decision.ticket.finish(
        true,
        usage.map_or(0, |u| u.completion_tokens as usize),
        usage.and_then(|u| u.cached_tokens()).map(|c| c as usize),
    );
    Ok(Prefilled { params, usage })
}

/// Sends `call` to `decision`'s worker; when that worker fails before answering, to another worker
/// of the call's pool ([`send_to_worker`]).
async fn whole(
    gw: &Gateway,
    ex: &Exchange,
    request: &Request,
    call: WorkerCall,
    decision: Decision,
    prefill: Option<String>,
) -> Result<WorkerAnswer, GatewayError> {
    let (decision, response) = match send_once(gw, &call, request, &decision).await {
        Ok(response) => (decision, response),
        Err(Unsent::Refused(error)) => return Err(error),
        Err(Unsent::Unavailable(error)) => {
            gw.metrics.retry();
            let failed = vec![decision.worker.clone()];
            // Its ticket ends now (failed), before another worker is picked.
            drop(decision);
            match send_to_worker(gw, &call, request, false, &ex.tokens, failed).await {
                Ok(sent) => sent,
                Err(GatewayError::NoHealthyWorker(_)) => return Err(error),
                Err(other) => return Err(other),
            }
        }
    };
    Ok(WorkerAnswer {
        decision,
        response,
        call,
        rest: None,
        prefill,
    })
}
