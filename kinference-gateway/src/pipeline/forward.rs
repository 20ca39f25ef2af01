//! Stages "forward" and "relay" of the HTTP door: the request to a backend (the plan's targets in
//! order, passing over those that cannot take it), and the backend's answer back to the client
//! through the one relay ([`crate::backend::relay`]; a pass-through endpoint's byte for byte,
//! [`super::passthrough`]), settled once. A worker's stream carries a second chance
//! ([`relay::Resend`]): broken before any output, it continues from another worker of its pool or,
//! when none can take it, of the plan's next pools.
//!
//! How a worker is asked ([`worker_call`]) and picked ([`pick`]) is shared with the ext_proc door,
//! which forwards through Envoy instead.
//!
//! A pool with `prefill` workers runs the chat and completions requests of this door in two steps
//! ([`pair`]: prefill/decode disaggregation, vLLM's KV-connector protocol); the ext_proc door sends
//! them whole to one worker (Envoy forwards to one destination).

pub mod pair;

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use hyper::body::Incoming;
use kinference_crds::ApiStyle;

use super::exchange::{Exchange, Request};
use super::passthrough::{self, StreamedBody};
use super::routes::Endpoint;
use super::settle::Settlement;
use crate::api::members::with_members;
use crate::api::openai::UpstreamErrorBody;
use crate::api::openai::passthrough::{answer_id_of, usage_of};
use crate::backend::provider::ProviderClient;
use crate::backend::relay::{self, ClientShape, Spec};
use crate::backend::{self, Outgoing, SendError, Target};
use crate::body::{Body, full};
use crate::errors::GatewayError;
use crate::gateway::Gateway;
use crate::policy::stage::{Plan, PlanTarget};
use crate::routing::tokenize::PromptTokens;
use crate::routing::{Decision, RouteError, RouteRequest};

/// The backend that took the request, and its answer's headers (a 2xx).
pub enum Forwarded {
    /// A worker chosen by the router, answering in its protocol (Anthropic when the request passed
    /// through to its `/v1/messages`).
    Worker(Box<WorkerAnswer>),
    /// A provider (cloud burst), asked for `model`.
    Provider(Arc<ProviderClient>, Response<Incoming>),
}

/// A worker's answer and how it was asked, so that a stream it breaks before any output can be
/// sent again to another worker of the same pool, or of the plan's later pools ([`relay::Resend`]).
pub struct WorkerAnswer {
    decision: Decision,
    response: Response<Incoming>,
    /// How it was asked (its protocol is the answer's).
    call: WorkerCall,
    /// The plan's targets after the one that took the request (none without policies).
    rest: Option<PlanRest>,
    /// The worker that ran the prefill of a split request ([`pair`]).
    prefill: Option<String>,
}

/// The targets of a plan from `next` on: where a stream's second chance goes when no other worker
/// of its own pool can take it.
struct PlanRest {
    plan: Arc<Plan>,
    next: usize,
}

/// What a worker is sent: the path, the body, the protocol it answers in, how it is picked, and
/// the pool it is picked from (a policy's, or every worker of the model).
#[derive(Clone, Debug)]
pub struct WorkerCall {
    /// The worker's path.
    pub path: &'static str,
    /// The worker's body.
    pub body: Bytes,
    /// The protocol it answers in.
    pub style: ApiStyle,
    /// The model the workers serve it as.
    pub model: String,
    /// The pool's workers (`None`: every worker of the model).
    pub pool: Option<Vec<String>>,
    /// How the worker is chosen.
    pub pick: Pick,
    /// The request's band as vLLM's `priority` ([`engine_priority`]), for a worker with priority
    /// scheduling.
    pub priority: Option<i64>,
}

/// A band as vLLM's request `priority` (lower runs earlier; 0 is what a request without one gets, so
/// the medium band is unchanged): high -1, medium 0, low 1.
pub fn engine_priority(band: kinference_crds::TenantPriority) -> i64 {
    match band {
        kinference_crds::TenantPriority::High => -1,
        kinference_crds::TenantPriority::Medium => 0,
        kinference_crds::TenantPriority::Low => 1,
    }
}

/// The `priority` a request of `ex` carries to a worker with priority scheduling: its band, on the
/// endpoints an engine queues (those with a prefix cache; not tokenizing).
pub fn priority_of(ex: &Exchange) -> Option<i64> {
    if !ex.endpoint.reaches_prefix_cache() {
        return None;
    }
    ex.band.map(engine_priority)
}

impl WorkerCall {
    /// The body `worker` is sent: with the request's `priority` where the worker runs vLLM's
    /// `--scheduling-policy priority` (a worker without it refuses a `priority` other than 0).
    pub fn body_for(&self, router: &crate::routing::Router, worker: &str) -> Bytes {
        match self.priority {
            Some(priority) if router.priority_scheduling(worker) => {
                with_members(&self.body, &[("priority", priority.to_string())])
                    .unwrap_or_else(|_| self.body.clone())
            }
            _ => self.body.clone(),
        }
    }
}

/// How a worker is chosen for a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// The lowest estimated time to first token (a prompt a cache can hold).
    Estimate,
    /// The least loaded (no prompt cache to exploit: embeddings, tokenizing).
    LeastLoaded,
}

/// Stage "forward" under a policy plan: the targets in order. A pool without a healthy worker (or
/// whose workers refuse) and a provider that cannot take or fails the request pass it to the next
/// target; nothing has reached the client yet. A local-only plan holds no provider.
pub async fn planned(
    gw: &Gateway,
    ex: &mut Exchange,
    request: &Request,
    plan: Arc<Plan>,
) -> Result<Forwarded, GatewayError> {
    let mut last: Option<GatewayError> = None;
    let providers = request.provider_request().is_some() && !plan.local_only;
    for (i, target) in plan.targets.iter().enumerate() {
        match target {
            PlanTarget::Pool {
                pool,
                model,
                workers,
            } => {
                let renamed = request.renamed_for(model)?;
                let req = renamed.as_ref().unwrap_or(request);
                let split = pair::settings(gw, &plan, pool, workers.as_deref());
                match to_worker(gw, ex, req, workers.as_deref(), &split).await {
                    Ok(mut answer) => {
                        if let Some(stage) = &gw.policy {
                            stage.count_sent(target, plan.burst);
                        }
                        if let Some(s) = ex.settlement() {
                            s.served(req.model());
                        }
                        if ex.debug {
                            let decision = &mut answer.decision;
                            decision.explain = Some(format!(
                                "{}; router: {}",
                                ex.explain.as_deref().unwrap_or(""),
                                decision.explain.as_deref().unwrap_or("")
                            ));
                        }
                        if request.stream && i + 1 < plan.targets.len() {
                            answer.rest = Some(PlanRest {
                                plan: Arc::clone(&plan),
                                next: i + 1,
                            });
                        }
                        return Ok(Forwarded::Worker(Box::new(answer)));
                    }
                    Err(error) if passes_to_next_target(&error) => {
                        tracing::warn!(backend = %target.label(), model = %request.model(), %error, "policy target unavailable; trying the next");
                        last = Some(error);
                    }
                    Err(error) => return Err(error),
                }
            }
            PlanTarget::Provider { provider, model } => {
                // Local-only plans, and endpoints no provider serves, pass over providers.
                if !providers {
                    continue;
                }
                let client = gw
                    .pools
                    .as_ref()
                    .zip(plan.set.as_deref())
                    .and_then(|(pools, set)| pools.provider(set, provider));
                let Some(client) = client else {
                    tracing::warn!(%provider, "provider of the plan not known; passed over");
                    continue;
                };
                let client = &client;
                let target_ref = Target::Provider { client, model };
                match backend::send(&gw.upstream, target_ref, outgoing(request)).await {
                    Ok(response) => {
                        if let Some(stage) = &gw.policy {
                            stage.count_sent(target, plan.burst);
                        }
                        if let Some(s) = ex.settlement() {
                            s.provider(client, model);
                        }
                        return Ok(Forwarded::Provider(Arc::clone(client), response));
                    }
                    Err(SendError::Unusable(reason)) => {
                        tracing::debug!(provider = %client.name(), %reason, "provider skipped");
                    }
                    Err(SendError::Failed(error)) => {
                        tracing::warn!(backend = %target.label(), model = %request.model(), %error, "provider failed; trying the next target");
                        last = Some(error);
                    }
                }
            }
        }
    }
    Err(super::govern::no_backend(&plan, last))
}

/// Whether a pool's failure to take a request passes it to the plan's next target: the pool has
/// no healthy worker, does not serve the model, or its worker cannot be reached. Anything else (a
/// worker's 4xx, say) says the request itself is refused, and ends it.
pub fn passes_to_next_target(error: &GatewayError) -> bool {
    matches!(
        error,
        GatewayError::NoHealthyWorker(_)
            | GatewayError::UnknownModel(_)
            | GatewayError::WorkerUnreachable { .. }
    )
}

/// What a worker of `pool` is sent for `request` on `endpoint` (`door`: the ext_proc door cannot
/// translate, so an Anthropic request goes to the workers' own `/v1/messages` there). An
/// Anthropic request for a model whose workers serve `/v1/messages` goes there as the client sent
/// it (its model named as the workers serve it, its output limit as reserved); a pass-through
/// endpoint's goes to the same path; everything else to the chat or completions API.
pub fn worker_call(
    gw: &Gateway,
    endpoint: Endpoint,
    request: &Request,
    pool: Option<&[String]>,
    door: super::exchange::Door,
) -> Result<WorkerCall, GatewayError> {
    let call = |path, body, style, pick| WorkerCall {
        path,
        body,
        style,
        model: request.model().to_string(),
        pool: pool.map(<[String]>::to_vec),
        pick,
        priority: None,
    };
    if let Some(route) = endpoint.passthrough() {
        let pick = if route == crate::api::openai::passthrough::Route::Responses {
            Pick::Estimate
        } else {
            Pick::LeastLoaded
        };
        let body = if endpoint.reaches_prefix_cache() {
            request.salted(&request.body)?
        } else {
            request.body.clone()
        };
        return Ok(call(endpoint.path(), body, ApiStyle::OpenAI, pick));
    }
    let anthropic_worker =
        door == super::exchange::Door::ExtProc || gw.serves_messages(request.model());
    if endpoint != Endpoint::Messages || !anthropic_worker {
        return Ok(call(
            endpoint.upstream_path(),
            request.salted(&request.body)?,
            ApiStyle::OpenAI,
            Pick::Estimate,
        ));
    }
    let body = with_members(
        &request.client_body,
        &[("model", super::exchange::json_string(request.model()))],
    )?;
    let body = request.salted(&body)?;
    Ok(call(
        "/v1/messages",
        body,
        ApiStyle::Anthropic,
        Pick::Estimate,
    ))
}

fn outgoing(request: &Request) -> Outgoing<'_> {
    Outgoing {
        body: &request.body,
        typed: request.provider_request(),
        stream: request.stream,
    }
}

/// Picks a worker for `call` (routed with `request`'s prompt and `tokens`, explained when `debug`),
/// none of `failed`.
pub async fn pick(
    gw: &Gateway,
    call: &WorkerCall,
    request: &Request,
    debug: bool,
    tokens: &PromptTokens,
    failed: &[String],
) -> Result<Decision, RouteError> {
    match call.pick {
        Pick::Estimate => {
            let route = RouteRequest {
                model: &call.model,
                prompt: request.prompt(),
                debug,
                tokens: Some(tokens),
                salt: request.cache_salt.as_deref(),
                session: request.session,
                answers: request.answers,
            };
            gw.router
                .pick_except(route, call.pool.as_deref(), failed)
                .await
        }
        Pick::LeastLoaded => {
            gw.router
                .pick_least_loaded_except(&call.model, call.pool.as_deref(), failed, debug)
        }
    }
}

/// Picks a worker (among `pool` when a policy chose one) and sends the request
/// ([`send_to_worker`]); a request this door may split, to a pool with `prefill` workers, goes to a
/// pair of workers instead ([`pair::to_pair`]). The settlement holds the router's ticket from then on.
async fn to_worker(
    gw: &Gateway,
    ex: &mut Exchange,
    request: &Request,
    pool: Option<&[String]>,
    split: &pair::Disaggregation,
) -> Result<WorkerAnswer, GatewayError> {
    let mut call = worker_call(gw, ex.endpoint, request, pool, ex.door)?;
    call.priority = priority_of(ex);
    if pair::splits(&call, ex.door) && gw.router.has_prefill_workers(&call.model) {
        return pair::to_pair(gw, ex, request, call, split).await;
    }
    let (decision, response) =
        send_to_worker(gw, &call, request, ex.debug, &ex.tokens, Vec::new()).await?;
    Ok(WorkerAnswer {
        decision,
        response,
        call,
        rest: None,
        prefill: None,
    })
}

/// Picks a worker of the call's pool for `request`, none of `failed`, and sends it the call (routed
/// with the request's prompt and `tokens`, explained when `debug`). When the worker
/// fails it before answering (refused or broken connection, 503) the request goes once more, to
/// another worker: nothing has reached the client yet, and a worker that is shutting down closes
/// its idle connections before every gateway has heard it is gone. A refused connection also marks
/// the worker unhealthy.
async fn send_to_worker(
    gw: &Gateway,
    call: &WorkerCall,
    request: &Request,
    debug: bool,
    tokens: &PromptTokens,
    mut failed: Vec<String>,
) -> Result<(Decision, Response<Incoming>), GatewayError> {
    let mut last: Option<GatewayError> = None;
    loop {
        let decision = match pick(gw, call, request, debug, tokens, &failed).await {
            Ok(decision) => decision,
            // The retry found no other worker: the first failure is the more useful answer.
            Err(RouteError::NoHealthyWorker(_)) if last.is_some() => {
                return Err(last.unwrap_or(GatewayError::NoHealthyWorker(call.model.clone())));
            }
            Err(e) => return Err(e.into()),
        };
        let error = match send_once(gw, call, request, &decision).await {
            Ok(response) => return Ok((decision, response)),
            Err(Unsent::Refused(error)) => return Err(error),
            Err(Unsent::Unavailable(error)) => error,
        };
        if last.is_some() {
            return Err(error);
        }
        gw.metrics.retry();
        failed.push(decision.worker.clone());
        last = Some(error);
    }
}

/// Why a worker did not take a call.
pub(crate) enum Unsent {
    /// It failed before answering (refused or broken connection, 503): another worker may take it.
    Unavailable(GatewayError),
    /// It refused the request itself (a 4xx, a 5xx other than 503): no other worker would do better.
    Refused(GatewayError),
}

/// Sends `call` to the worker of `decision` once: its 2xx answer, or why not, its health observed on
/// the way (a refused connection marks it unhealthy).
async fn send_once(
    gw: &Gateway,
    call: &WorkerCall,
    request: &Request,
    decision: &Decision,
) -> Result<Response<Incoming>, Unsent> {
    let target = Target::Worker {
        url: &decision.worker,
        dp_rank: decision.dp_rank,
        path: call.path,
    };
    let body = call.body_for(&gw.router, &decision.worker);
    let outgoing = Outgoing {
        body: &body,
        ..outgoing(request)
    };
    let model = &call.model;
    match backend::send(&gw.upstream, target, outgoing).await {
        Ok(response) if response.status().is_success() => {
            gw.health.observe(&decision.worker, true);
            Ok(response)
        }
        Ok(response) => {
            let unavailable = response.status() == StatusCode::SERVICE_UNAVAILABLE;
            let worker_fault = response.status().is_server_error();
            gw.health.observe(&decision.worker, !worker_fault);
            let error = rejection(gw, call, &decision.worker, response).await;
            Err(if unavailable {
                Unsent::Unavailable(error)
            } else {
                Unsent::Refused(error)
            })
        }
        Err(SendError::Failed(error @ GatewayError::WorkerUnreachable { .. })) => {
            tracing::warn!(worker = %decision.worker, %model, %error, "worker unreachable; marking it unhealthy");
            gw.health.connect_failed(&decision.worker);
            Err(Unsent::Unavailable(error))
        }
        Err(SendError::Failed(error @ GatewayError::BadUpstream { .. })) => {
            tracing::warn!(worker = %decision.worker, %model, %error, "worker broke the connection before answering");
            gw.health.observe(&decision.worker, false);
            Err(Unsent::Unavailable(error))
        }
        Err(SendError::Failed(error)) => {
            gw.health.observe(&decision.worker, false);
            Err(Unsent::Refused(error))
        }
        Err(SendError::Unusable(detail)) => Err(Unsent::Refused(GatewayError::BadUpstream {
            worker: decision.worker.clone(),
            detail,
        })),
    }
}

/// A streamed request's second chance ([`relay::Resend`]): when `failed` breaks the stream before
/// any output, the same call goes to another worker of its pool, routed like the first time. When
/// none of them can take it, it goes to the plan's later pools (`rest`) in order, as the first send
/// would have: only those whose workers answer in the stream's protocol, and no provider (the
/// relay cannot change an answer's protocol half-way).
fn resend(
    gw: &Arc<Gateway>,
    request: &Arc<Request>,
    ex: &Exchange,
    call: WorkerCall,
    failed: String,
    rest: Option<PlanRest>,
) -> relay::Resend<Settlement> {
    let gw = Arc::clone(gw);
    let request = Arc::clone(request);
    let endpoint = ex.endpoint;
    let tokens = PromptTokens::default();
    if let Some(known) = ex.tokens.get(&call.model) {
        tokens.set(&call.model, known);
    }
    Box::new(move || {
        Box::pin(async move {
            gw.health.observe(&failed, false);
            gw.metrics.retry();
            // Not explained (`debug` false): the headers that carry a decision's explanation went
            // out with the first worker's answer.
            let sent =
                send_to_worker(&gw, &call, &request, false, &tokens, vec![failed.clone()]).await;
            let (decision, response, served) = match sent {
                Ok((decision, response)) => (decision, response, None),
                Err(error) => {
                    tracing::warn!(%error, model = %call.model, "no other worker of the pool took the request");
                    let rest = rest.filter(|_| passes_to_next_target(&error))?;
                    let (decision, response, model) =
                        later_pools(&gw, endpoint, &request, call.style, rest, &failed, &tokens)
                            .await?;
                    (decision, response, Some(model))
                }
            };
            let label = decision.worker.clone();
            Some(relay::Resent {
                body: response.into_body(),
                label,
                moved: Box::new(move |settlement: &mut Settlement| {
                    settlement.moved(&decision.worker, decision.ticket);
                    if let Some(model) = served {
                        settlement.served(&model);
                    }
                }),
            })
        })
    })
}

/// A stream's second chance on the plan's pools from `rest.next` on, in order: the first whose
/// worker (other than `failed`, which a later pool may hold too) answers, with the model it serves;
/// `None` when none does. Pools whose workers answer in another protocol than `style`, and
/// providers, are passed over.
async fn later_pools(
    gw: &Gateway,
    endpoint: Endpoint,
    request: &Request,
    style: ApiStyle,
    rest: PlanRest,
    failed: &str,
    tokens: &PromptTokens,
) -> Option<(Decision, Response<Incoming>, String)> {
    let plan = &rest.plan;
    for target in plan.targets.iter().skip(rest.next) {
        let PlanTarget::Pool { model, workers, .. } = target else {
            continue;
        };
        let renamed = request.renamed_for(model).ok()?;
        let req = renamed.as_ref().unwrap_or(request);
        let call = worker_call(
            gw,
            endpoint,
            req,
            workers.as_deref(),
            super::exchange::Door::Http,
        )
        .ok()?;
        if call.style != style {
            continue;
        }
        let failed = vec![failed.to_string()];
        match send_to_worker(gw, &call, req, false, tokens, failed).await {
            Ok((decision, response)) => {
                if let Some(stage) = &gw.policy {
                    stage.count_sent(target, plan.burst);
                }
                tracing::info!(backend = %target.label(), worker = %decision.worker, "a broken stream continues on the plan's next pool");
                return Some((decision, response, req.model().to_string()));
            }
            Err(error) if passes_to_next_target(&error) => {
                tracing::warn!(backend = %target.label(), %error, "policy target unavailable for the stream's second chance; trying the next");
            }
            Err(error) => {
                tracing::warn!(backend = %target.label(), %error, "the stream's second chance was refused");
                return None;
            }
        }
    }
    None
}

/// A worker's non-2xx answer: its own 4xx passes on with its message, except a refusal of the
/// gateway's credentials (the client's key is not the worker's business) and a path it does not
/// serve (vLLM before 0.10 has no `/v1/responses`; a model without that task), said plainly;
/// anything else is a bad upstream.
async fn rejection(
    gw: &Gateway,
    call: &WorkerCall,
    worker: &str,
    response: Response<Incoming>,
) -> GatewayError {
    let status = response.status();
    let body = gw
        .upstream
        .read_body(worker, response.into_body())
        .await
        .unwrap_or_default();
    let message = UpstreamErrorBody::message_from(&body);
    if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
        return GatewayError::BadUpstream {
            worker: worker.to_string(),
            detail: format!(
                "the worker refused the gateway's credentials ({status}): check worker_api_key"
            ),
        };
    }
    if status == StatusCode::NOT_FOUND && message.contains("Not Found") {
        return GatewayError::UpstreamRejected {
            status,
            message: format!(
                "the workers of model `{}` do not serve {}",
                call.model, call.path
            ),
        };
    }
    if status.is_client_error() {
        GatewayError::UpstreamRejected { status, message }
    } else {
        GatewayError::BadUpstream {
            worker: worker.to_string(),
            detail: format!("status {status}: {message}"),
        }
    }
}

/// Stage "relay": the backend's answer to the client in the client's protocol, streamed or whole;
/// the settlement is fed as it passes and settled once.
pub async fn relay(
    gw: &Arc<Gateway>,
    ex: &mut Exchange,
    request: &Arc<Request>,
    forwarded: Forwarded,
) -> Result<Response<Body>, GatewayError> {
    let forwarded = match (ex.endpoint.passthrough(), forwarded) {
        (Some(route), Forwarded::Worker(answer)) => return verbatim(gw, ex, route, *answer).await,
        (_, other) => other,
    };
    // A worker answering in Anthropic's protocol got the client's own request: its answer passes
    // as it is. A provider's is translated, so the client sees the model it asked for.
    let mut resend = None;
    let (style, pass_through, label, input_tokens, response, mut headers) = match forwarded {
        Forwarded::Worker(answer) => {
            let WorkerAnswer {
                decision,
                response,
                call,
                rest,
                prefill,
            } = *answer;
            let style = call.style;
            let headers = worker_headers(&decision, prefill.as_deref(), ex);
            if let Some(s) = ex.settlement() {
                s.worker(
                    &decision.worker,
                    decision.reason,
                    decision.prompt_tokens,
                    decision.ticket,
                );
            }
            if request.stream {
                resend = Some(self::resend(
                    gw,
                    request,
                    ex,
                    call,
                    decision.worker.clone(),
                    rest,
                ));
            }
            let input = decision.prompt_tokens.unwrap_or(0) as u64;
            let pass_through = style == ApiStyle::Anthropic;
            (
                style,
                pass_through,
                decision.worker,
                input,
                response,
                headers,
            )
        }
        Forwarded::Provider(client, response) => {
            let headers = provider_headers(&client, ex);
            (
                client.api_style(),
                false,
                client.label(),
                0,
                response,
                headers,
            )
        }
    };
    if let Some(s) = &ex.settlement {
        headers.extend(s.tenancy_headers());
    }
    let spec = Spec {
        style,
        label,
        shape: match ex.endpoint {
            Endpoint::Messages => ClientShape::Anthropic {
                model: request.model().to_string(),
                input_tokens,
            },
            _ => ClientShape::OpenAi {
                pass_usage_chunk: request.client_wants_usage,
            },
        },
        protocol: ex.protocol,
        idle_timeout: gw.upstream.idle_timeout(),
        pass_through,
        limits: gw.upstream.limits(),
    };
    let mut out = if request.stream {
        let Some(mut settlement) = ex.settlement.take() else {
            return Err(GatewayError::BadUpstream {
                worker: spec.label,
                detail: "the request was already settled".into(),
            });
        };
        settlement.relaying();
        let mut out = Response::new(relay::stream(
            response.into_body(),
            spec,
            settlement,
            resend,
        ));
        out.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        out.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        out
    } else {
        let (body, usage) = relay::whole(response.into_body(), &spec).await?;
        if let Some(mut settlement) = ex.settlement.take() {
            settlement.relaying();
            settlement.finish(StatusCode::OK.as_u16(), usage.as_ref());
        }
        let mut out = Response::new(full(body));
        out.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        out
    };
    out.headers_mut().extend(headers);
    Ok(out)
}

/// A pass-through endpoint's answer, byte for byte: streamed (a response's events), or whole,
/// its usage read on the way ([`super::passthrough`]).
async fn verbatim(
    gw: &Arc<Gateway>,
    ex: &mut Exchange,
    route: crate::api::openai::passthrough::Route,
    answer: WorkerAnswer,
) -> Result<Response<Body>, GatewayError> {
    let WorkerAnswer {
        decision, response, ..
    } = answer;
    let mut headers = worker_headers(&decision, None, ex);
    let worker = decision.worker.clone();
    let Some(mut settlement) = ex.settlement.take() else {
        return Err(GatewayError::BadUpstream {
            worker,
            detail: "the request was already settled".into(),
        });
    };
    settlement.worker(
        &decision.worker,
        decision.reason,
        decision.prompt_tokens,
        decision.ticket,
    );
    headers.extend(settlement.tenancy_headers());
    settlement.relaying();
    let streamed = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let mut out = if streamed {
        let body = StreamedBody {
            body: response.into_body(),
            worker,
        };
        let mut out = Response::new(passthrough::stream(
            body,
            gw.upstream.idle_timeout(),
            settlement,
        ));
        out.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        out.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        out
    } else {
        let bytes = match gw.upstream.read_body(&worker, response.into_body()).await {
            Ok(bytes) => bytes,
            Err(error) => {
                settlement.finish(error.status().as_u16(), None);
                return Err(error);
            }
        };
        if let Some(id) = answer_id_of(route, &bytes) {
            settlement.answer_id(id);
        }
        settlement.finish(StatusCode::OK.as_u16(), usage_of(route, &bytes).as_ref());
        let mut out = Response::new(full(bytes));
        out.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        out
    };
    out.headers_mut().extend(headers);
    Ok(out)
}

/// For admins only ([`crate::access`]): `x-kinference-worker` (the worker's internal address; of a
/// split request, the decode worker's, and `x-kinference-prefill-worker` the prefill worker's) and
/// `x-kinference-decision` (when debugging).
fn worker_headers(decision: &Decision, prefill: Option<&str>, ex: &Exchange) -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    if ex.admin
        && let Ok(v) = HeaderValue::from_str(&decision.worker)
    {
        headers.insert("x-kinference-worker", v);
    }
    if ex.admin
        && let Some(v) = prefill.and_then(|p| HeaderValue::from_str(p).ok())
    {
        headers.insert("x-kinference-prefill-worker", v);
    }
    if ex.debug
        && let Some(v) = decision
            .explain
            .as_deref()
            .and_then(|e| HeaderValue::from_str(e).ok())
    {
        headers.insert("x-kinference-decision", v);
    }
    headers
}

/// `x-kinference-provider`; for admins only, `x-kinference-worker` (the provider's base URL) and
/// the policy explanation when debugging.
fn provider_headers(client: &ProviderClient, ex: &Exchange) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    if ex.admin
        && let Ok(v) = HeaderValue::from_str(client.base_url())
    {
        h.insert("x-kinference-worker", v);
    }
    if let Ok(v) = HeaderValue::from_str(client.name()) {
        h.insert("x-kinference-provider", v);
    }
    if ex.debug
        && let Some(v) = ex
            .explain
            .as_deref()
            .and_then(|e| HeaderValue::from_str(e).ok())
    {
        h.insert("x-kinference-decision", v);
    }
    h
}
