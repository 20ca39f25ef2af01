//! The endpoints passed to a worker of the requested model as they are ([`Route`]):
//! `/v1/embeddings` and vLLM's `/tokenize` and `/detokenize` go to the model's least loaded worker
//! (there is no prompt cache to exploit), `/v1/responses` to the worker the router picks for the
//! input's text. Authentication, the in-flight limit and, for what generates or embeds, the tenant's
//! admission and billing are the same stages as chat's; the answer comes back byte for byte, its
//! usage read on the way (a streamed response's from its `response.completed` event).
//!
//! The policy stage does not run here: these requests only ever go to the model's own workers,
//! never to a provider.

use std::convert::Infallible;

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Request as HttpRequest, Response, StatusCode, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};

use super::exchange::read_body;
use super::settle::Settlement;
use crate::access::Peer;
use crate::api::openai::passthrough::{PassthroughRequest, Route, usage_of};
use crate::api::openai::{UpstreamErrorBody, Usage};
use crate::backend::relay::{Meter, next_frame};
use crate::backend::sse::SseParser;
use crate::body::{Body, full};
use crate::errors::{GatewayError, Protocol};
use crate::gateway::Gateway;
use crate::policy::model::{PolicySet, Requested};
use crate::routing::{Decision, Prompt, RouteError, RouteRequest, Router};
use crate::tenancy::Tenancy;

/// Serves one request to a pass-through endpoint; errors in OpenAI's shape.
pub async fn handle(gw: &Gateway, route: Route, req: HttpRequest<Incoming>) -> Response<Body> {
    let admin = gw
        .access
        .serving_port_admin(req.headers(), req.extensions().get::<Peer>());
    let mut settlement = Settlement::new(&gw.metrics, Protocol::OpenAi);
    match run(gw, route, admin, &mut settlement, req).await {
        Ok(Answer::Whole(response, usage)) => {
            settlement.relaying();
            settlement.finish(StatusCode::OK.as_u16(), usage.as_ref());
            response
        }
        Ok(Answer::Streamed(response, body)) => {
            settlement.relaying();
            let mut response = response;
            *response.body_mut() = stream(body, gw.upstream.idle_timeout(), settlement);
            response
        }
        Err(error) => {
            tracing::debug!(kind = error.kind(), %error, path = route.path(), "request failed");
            settlement.finish(error.status().as_u16(), None);
            error.into_response(Protocol::OpenAi)
        }
    }
}

/// A worker's answer: whole (with its usage), or the response head and the worker's body to stream.
enum Answer {
    Whole(Response<Body>, Option<Usage>),
    Streamed(Response<Body>, StreamedBody),
}

/// A streamed worker body with the worker's label, for errors.
struct StreamedBody {
    body: Incoming,
    worker: String,
}

async fn run(
    gw: &Gateway,
    route: Route,
    admin: bool,
    settlement: &mut Settlement,
    req: HttpRequest<Incoming>,
) -> Result<Answer, GatewayError> {
    let caller = gw.tenancy.authenticate(req.headers())?;
    if let Some(slot) = gw.overload.admit(caller.priority()).await? {
        settlement.hold(slot);
    }
    let debug = admin
        && req
            .headers()
            .get("x-kinference-debug")
            .is_some_and(|v| v.as_bytes() == b"1");
    let body = read_body(
        req,
        gw.settings.body_limit_bytes,
        gw.settings.body_read_timeout(),
    )
    .await?;
    let mut request = PassthroughRequest::parse(route, &body)?;
    let body = served_as(gw, route, &mut request, body)?;
    settlement.model(&request.model);
    let text = request.text();
    if route.billed() {
        let (input, output) = token_demand(&gw.tenancy, route, &request, &text);
        let admission = gw
            .tenancy
            .admit(&caller, &request.model, input, output, Protocol::OpenAi)
            .await?;
        settlement.admitted(admission);
    }
    let decision = pick(&gw.router, route, &request, &text, debug).await?;
    let worker = decision.worker.clone();
    let mut headers = settlement.tenancy_headers();
    if admin && let Ok(v) = HeaderValue::from_str(&worker) {
        headers.insert("x-kinference-worker", v);
    }
    if let Some(v) = decision
        .explain
        .as_deref()
        .and_then(|e| HeaderValue::from_str(e).ok())
    {
        headers.insert("x-kinference-decision", v);
    }
    settlement.worker(
        &worker,
        decision.reason,
        decision.prompt_tokens,
        decision.ticket,
    );
    let response = match gw.upstream.post_json(&worker, route.path(), body).await {
        Ok(response) => response,
        Err(error @ GatewayError::WorkerUnreachable { .. }) => {
            gw.health.connect_failed(&worker);
            return Err(error);
        }
        Err(error) => {
            gw.health.observe(&worker, false);
            return Err(error);
        }
    };
    let status = response.status();
    gw.health.observe(&worker, !status.is_server_error());
    if !status.is_success() {
        let body = gw
            .upstream
            .read_body(&worker, response.into_body())
            .await
            .unwrap_or_default();
        return Err(rejection(route, &request.model, &worker, status, &body));
    }
    let streamed = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let content_type = if streamed {
        HeaderValue::from_static("text/event-stream")
    } else {
        HeaderValue::from_static("application/json")
    };
    headers.insert(header::CONTENT_TYPE, content_type);
    if streamed {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        let mut out = Response::new(full(Bytes::new()));
        *out.headers_mut() = headers;
        let body = StreamedBody {
            body: response.into_body(),
            worker,
        };
        return Ok(Answer::Streamed(out, body));
    }
    let bytes = gw.upstream.read_body(&worker, response.into_body()).await?;
    let usage = usage_of(route, &bytes);
    let mut out = Response::new(full(bytes));
    *out.headers_mut() = headers;
    Ok(Answer::Whole(out, usage))
}

/// `body` for the served name of `request.model` under policies, resolved as chat resolves it: an
/// `InferenceModel`'s name or alias is its served name; a class is one of its local models (see
/// [`class_member`]). The workers know only served names. Anything else (a model only workers
/// name, a LoRA adapter) is left as sent.
fn served_as(
    gw: &Gateway,
    route: Route,
    request: &mut PassthroughRequest,
    body: Bytes,
) -> Result<Bytes, GatewayError> {
    let Some(stage) = &gw.policy else {
        return Ok(body);
    };
    let set = stage.current();
    let served = match set.resolve(&request.model) {
        Requested::Model(name) => match set.models.get(&name) {
            Some(model) => model.spec.served_name.clone(),
            None => return Ok(body),
        },
        Requested::Class(class) => {
            let workers: Vec<String> = gw.router.workers().into_iter().map(|w| w.model).collect();
            class_member(&set, route, &class, &workers)?
        }
        Requested::Unknown(_) => return Ok(body),
    };
    if served == request.model {
        return Ok(body);
    }
    let mut json: serde_json::Value = crate::api::openai::parse_body(&body)?;
    json["model"] = serde_json::Value::String(served.clone());
    request.model = served;
    serde_json::to_vec(&json)
        .map(Bytes::from)
        .map_err(|e| GatewayError::MalformedJson(e.to_string()))
}

/// The served name a model class stands for on `route`: the first of its local models (in name
/// order) that some worker serves. Token ids and embedding vectors mean different things for
/// different models, so `/tokenize`, `/detokenize` and `/v1/embeddings` take a class only when it
/// has a single local model; a class only providers serve has no worker here (pass-through
/// requests never go to a provider).
fn class_member(
    set: &PolicySet,
    route: Route,
    class: &str,
    worker_models: &[String],
) -> Result<String, GatewayError> {
    let members: Vec<&str> = set
        .models_in_class(class)
        .filter_map(|m| set.models.get(m))
        .map(|m| m.spec.served_name.as_str())
        .collect();
    if members.len() > 1 && route != Route::Responses {
        return Err(GatewayError::invalid(
            "model",
            format!(
                "model class {class:?} has several models ({}); {} needs one model, since \
                 each has its own {}: name one of them",
                members.join(", "),
                route.path(),
                if route == Route::Embeddings {
                    "embeddings"
                } else {
                    "token ids"
                },
            ),
        ));
    }
    members
        .iter()
        .find(|m| worker_models.iter().any(|w| w == *m))
        .or(members.first())
        .map(|m| m.to_string())
        .ok_or_else(|| {
            GatewayError::invalid(
                "model",
                format!(
                    "model class {class:?} has no local model: {} is served by the gateway's own \
                     workers only, never by a provider",
                    route.path()
                ),
            )
        })
}

/// A worker's non-2xx answer: a route it does not serve (404 on `/v1/responses`: vLLM before
/// 0.10, or a model without that task) is said plainly; a refusal of the gateway's own credentials
/// is a bad upstream (502), not the client's 401; its other 4xx pass on with its message; anything
/// else is a bad upstream.
fn rejection(
    route: Route,
    model: &str,
    worker: &str,
    status: StatusCode,
    body: &[u8],
) -> GatewayError {
    let message = UpstreamErrorBody::message_from(body);
    if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
        // The worker refused the gateway's credentials (`worker_api_key`), not the client's.
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
                "the workers of model `{model}` do not serve {}",
                route.path()
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

/// The worker's event stream passed on byte for byte; `meter` hears each text delta and, at the
/// end, the usage of the `response.completed` event. A stream that stalls, breaks or ends without
/// a final event ends with an OpenAI error event.
fn stream<M: Meter>(body: StreamedBody, idle: std::time::Duration, meter: M) -> Body {
    let state = Passing {
        body,
        idle,
        parser: SseParser::new(),
        usage: None,
        complete: false,
        meter: Some(meter),
    };
    let frames = futures::stream::unfold(state, |mut s| async move {
        let bytes = s.next().await?;
        Some((Ok::<_, Infallible>(Frame::data(bytes)), s))
    });
    StreamBody::new(frames).boxed_unsync()
}

/// One passed-on stream.
struct Passing<M: Meter> {
    body: StreamedBody,
    idle: std::time::Duration,
    parser: SseParser,
    usage: Option<Usage>,
    /// A final event (`response.completed`, `.incomplete`, `.failed`) passed.
    complete: bool,
    /// Taken when the stream ends; dropped (the request abandoned) when the client leaves first.
    meter: Option<M>,
}

impl<M: Meter> Passing<M> {
    async fn next(&mut self) -> Option<Bytes> {
        let meter = self.meter.as_mut()?;
        match next_frame(&mut self.body.body, self.idle, &self.body.worker).await {
            Ok(Some(frame)) => {
                let Ok(data) = frame.into_data() else {
                    return Some(Bytes::new());
                };
                self.parser.feed(&data);
                while let Some(event) = self.parser.next_event() {
                    let kind = event.event.as_deref().unwrap_or_default();
                    if kind == "response.output_text.delta" {
                        meter.text_chunk();
                    } else if matches!(
                        kind,
                        "response.completed" | "response.incomplete" | "response.failed"
                    ) {
                        self.complete = true;
                        self.usage = usage_of(Route::Responses, &event.data);
                    }
                }
                Some(data)
            }
            Ok(None) if self.complete => {
                let usage = self.usage;
                meter.finish(StatusCode::OK.as_u16(), usage.as_ref());
                self.meter = None;
                None
            }
            Ok(None) => Some(self.fail(GatewayError::BadUpstream {
                worker: self.body.worker.clone(),
                detail: "the worker closed the stream before it was complete".into(),
            })),
            Err(error) => Some(self.fail(error)),
        }
    }

    fn fail(&mut self, error: GatewayError) -> Bytes {
        tracing::warn!(backend = %self.body.worker, %error, "stream ended with an error");
        if let Some(mut meter) = self.meter.take() {
            meter.finish(error.status().as_u16(), self.usage.as_ref());
        }
        let mut out = BytesMut::new();
        out.extend_from_slice(&error.stream_event(Protocol::OpenAi));
        out.freeze()
    }
}

#[cfg(test)]
mod tests;

/// What a billed pass-through request asks of its tenant: the prompt's estimated tokens (of `text`,
/// [`PassthroughRequest::text`]) and the output reservation (a response's `max_output_tokens`, as a chat
/// turn's limit; an embedding generates nothing). Shared with the ext_proc handler.
pub(crate) fn token_demand(
    tenancy: &Tenancy,
    route: Route,
    request: &PassthroughRequest,
    text: &str,
) -> (u64, u64) {
    let estimate = Prompt::Text(text).estimated_tokens();
    match route {
        Route::Responses => {
            let mut fields = serde_json::Map::new();
            if let Some(n) = request.max_output_tokens {
                fields.insert("max_tokens".into(), n.into());
            }
            tenancy.demand(estimate, &fields, false)
        }
        _ => (estimate, 0),
    }
}

/// The worker for a pass-through request: a response by the estimate over its prompt (`text`), the
/// other endpoints to the least-loaded worker of the model. Shared with the ext_proc handler.
pub(crate) async fn pick(
    router: &Router,
    route: Route,
    request: &PassthroughRequest,
    text: &str,
    debug: bool,
) -> Result<Decision, RouteError> {
    match route {
        Route::Responses => {
            router
                .pick(RouteRequest {
                    model: &request.model,
                    prompt: Prompt::Text(text),
                    debug,
                    tokens: None,
                })
                .await
        }
        _ => router.pick_least_loaded(&request.model, debug),
    }
}
