//! The HTTP servers: the client-facing API and the admin port, their routes, and graceful shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};

use crate::access::Peer;
use crate::backend::health::WorkerState;
use crate::errors::{GatewayError, Protocol};
use crate::overload::ConnectionGuard;
use crate::overload::io::StallGuard;
use crate::pipeline::{self, Endpoint};
use crate::telemetry::{REQUEST_ID_HEADER, RequestContext};

pub use crate::body::{Body, full};
pub use crate::gateway::Gateway;

/// Serves one client request in its telemetry context ([`crate::telemetry`]): whatever the
/// endpoint, a worker asked on its behalf gets its `x-request-id` and `traceparent`, and the answer
/// carries the `x-request-id`.
async fn api(gw: Arc<Gateway>, req: Request<Incoming>) -> Response<Body> {
    let context = RequestContext::for_request(req.uri().path(), req.headers());
    let id = context.id.header_value();
    let mut response = context.scope(route(gw, req)).await;
    response.headers_mut().insert(REQUEST_ID_HEADER, id);
    response
}

/// Routes one client request: every endpoint of the route table through the one pipeline.
async fn route(gw: Arc<Gateway>, req: Request<Incoming>) -> Response<Body> {
    match Endpoint::of(req.method(), req.uri().path()) {
        Some(endpoint) => pipeline::handle(gw, endpoint, req).await,
        None => {
            let path = req.uri().path();
            GatewayError::NotFound {
                method: req.method().to_string(),
                path: path.to_string(),
            }
            .into_response(protocol_of(path))
        }
    }
}

/// Routes one admin request.
async fn admin(gw: Arc<Gateway>, req: Request<Incoming>) -> Response<Body> {
    let admin = gw
        .access
        .admin_port_admin(req.headers(), req.extensions().get::<Peer>());
    if req.method() == Method::POST && req.uri().path() == crate::routing::replicas::PATH {
        return if admin {
            replica_batch(&gw, req).await
        } else {
            unauthorized()
        };
    }
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => {
            if gw.access.metrics_need_key() && !admin {
                return unauthorized();
            }
            gw.metrics
                .refresh_fleet(&gw.router, &gw.pool_members())
                .await;
            let mut response = Response::new(full(gw.metrics.encode()));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            response
        }
        (&Method::GET, "/admin/usage") => usage(&gw, &req, admin).await,
        (&Method::GET, "/healthz") => text_response(StatusCode::OK, "ok\n"),
        (&Method::GET, "/readyz") => {
            if gw.ready() {
                text_response(StatusCode::OK, "ready\n")
            } else {
                text_response(StatusCode::SERVICE_UNAVAILABLE, "draining\n")
            }
        }
        (&Method::GET, "/healthz/workers") if admin => {
            json_response(StatusCode::OK, workers_health(&gw).await)
        }
        (&Method::GET, "/healthz/workers") => unauthorized(),
        _ => text_response(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// `POST /internal/replicas`: another gateway replica's dispatches, first tokens and ends
/// ([`crate::routing::replicas`]); at most [`crate::routing::replicas::MAX_BATCH_BYTES`].
async fn replica_batch(gw: &Gateway, req: Request<Incoming>) -> Response<Body> {
    use http_body_util::BodyExt as _;
    let limit = crate::routing::replicas::MAX_BATCH_BYTES;
    let body = match http_body_util::Limited::new(req.into_body(), limit)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => return text_response(StatusCode::BAD_REQUEST, "unreadable or too large\n"),
    };
    match serde_json::from_slice::<crate::routing::replicas::Batch>(&body) {
        Ok(batch) => {
            gw.router.apply_replica_batch(batch);
            text_response(StatusCode::OK, "ok\n")
        }
        Err(_) => text_response(StatusCode::BAD_REQUEST, "not a replica batch\n"),
    }
}

/// `/admin/usage`: every tenant's usage for an admin; a tenant's own for its API key (asking for
/// another tenant's is 403); 401 for anyone else.
async fn usage(gw: &Gateway, req: &Request<Incoming>, admin: bool) -> Response<Body> {
    let query = req.uri().query().unwrap_or("");
    let only = if admin {
        None
    } else {
        match gw.tenancy.authenticate(req.headers()) {
            Ok(caller) if caller.tenant().is_some() => Some(caller.name().to_string()),
            _ => return unauthorized(),
        }
    };
    match gw.tenancy.usage_report(query, only.as_deref()).await {
        Ok(report) => json_response(StatusCode::OK, report.to_string()),
        Err(error) => json_response(
            error.status(),
            serde_json::json!({ "error": error.to_string() }).to_string(),
        ),
    }
}

/// 401 on the admin port: the admin key (or, on `/admin/usage`, a tenant's key) is missing.
fn unauthorized() -> Response<Body> {
    let mut response = json_response(
        StatusCode::UNAUTHORIZED,
        serde_json::json!({
            "error": "admin credential required: send the admin key (or, for /admin/usage, a tenant's API key) as `Authorization: Bearer <key>`"
        })
        .to_string(),
    );
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// `/healthz/workers`: each worker's probed health, apart from `/readyz` (a gateway whose workers are
/// all busy or loading can still serve: it answers 503 itself, quickly, and stays in its Service),
/// its health state (`crate::backend::health`), and the routing signals the router has for it
/// (`crate::metrics::fleet`).
async fn workers_health(gw: &Gateway) -> String {
    let states: std::collections::HashMap<String, WorkerState> =
        gw.health.states().into_iter().collect();
    let workers: Vec<serde_json::Value> = gw
        .metrics
        .refresh_fleet(&gw.router, &gw.pool_members())
        .await
        .workers
        .iter()
        .map(|w| {
            serde_json::json!({
                "url": w.view.url,
                "model": w.view.model,
                "healthy": w.view.healthy,
                // healthy, ejected (by probes or refused connections), outlier, spared.
                "state": states.get(&w.view.url).map_or("unknown", |s| s.as_str()),
                "in_flight": w.view.in_flight,
                "agent_live": w.view.agent_live,
                "signals": w.signals_json(),
            })
        })
        .collect();
    let healthy = workers.iter().filter(|w| w["healthy"] == true).count();
    serde_json::json!({ "healthy": healthy, "workers": workers }).to_string()
}

fn text_response(status: StatusCode, text: &'static str) -> Response<Body> {
    let mut response = Response::new(full(Bytes::from_static(text.as_bytes())));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}

fn json_response(status: StatusCode, json: String) -> Response<Body> {
    let mut response = Response::new(full(json));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Which of the two servers.
#[derive(Debug, Clone, Copy)]
pub enum Port {
    /// Client-facing API.
    Api,
    /// `/metrics`, `/healthz`, `/readyz`, `/healthz/workers`, `/admin/usage`.
    Admin,
}

/// Serves `listener` until `shutdown` resolves; then closes the listening socket and idle keep-alive
/// connections, and lets requests in flight finish for at most `drain` before cutting them.
pub async fn serve(
    listener: TcpListener,
    gw: Arc<Gateway>,
    port: Port,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) {
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .keep_alive(true)
        .header_read_timeout(Duration::from_secs(30));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(conn) => conn,
                    Err(error) => {
                        // EMFILE and the like: back off instead of spinning.
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let Some(place) = connection_place(&gw, port, stream) else {
                    continue;
                };
                let stream = place.stream;
                let gw = Arc::clone(&gw);
                let service = service_fn(move |mut req: Request<Incoming>| {
                    // Who connected decides who is an admin when no admin key is set.
                    req.extensions_mut().insert(Peer(peer));
                    let gw = Arc::clone(&gw);
                    async move {
                        Ok::<_, Infallible>(match port {
                            Port::Api => api(gw, req).await,
                            Port::Admin => admin(gw, req).await,
                        })
                    }
                });
                let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
                let open = place.open;
                tokio::spawn(async move {
                    let _open = open;
                    if let Err(error) = conn.await {
                        tracing::debug!(%peer, %error, "connection ended with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    // Graceful shutdown closes idle keep-alive connections and those that have not sent a request
    // yet, and answers the in-flight requests with `Connection: close`.
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(drain) => {
            tracing::warn!(?port, ?drain, "connections still open after the drain timeout; closing them");
        }
    }
}

/// An accepted connection with its place under the port's connection limit.
struct Place {
    stream: StallGuard<TcpStream>,
    open: ConnectionGuard,
}

/// A place for `stream` under its port's connection limit, its writes guarded by the client write
/// deadline. Past the limit: one quick 503 (in the client's protocol on the API port) and the
/// connection is closed, or closed at once when too many are being answered so already.
fn connection_place(gw: &Arc<Gateway>, port: Port, stream: TcpStream) -> Option<Place> {
    let limit = match port {
        Port::Api => &gw.overload.api,
        Port::Admin => &gw.overload.admin,
    };
    if let Some(open) = limit.try_open() {
        let stream = StallGuard::new(stream, gw.settings.client_write_timeout());
        return Some(Place { stream, open });
    }
    let refused = gw.overload.connection_refused();
    // Without a place to answer, dropping the stream closes it.
    let answering = limit.try_refuse()?;
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .keep_alive(false)
        .header_read_timeout(Duration::from_secs(2));
    let service = service_fn(move |req: Request<Incoming>| async move {
        Ok::<_, Infallible>(match port {
            Port::Api => GatewayError::from(refused).into_response(protocol_of(req.uri().path())),
            Port::Admin => text_response(StatusCode::SERVICE_UNAVAILABLE, "overloaded\n"),
        })
    });
    let conn = http.serve_connection(TokioIo::new(stream), service);
    tokio::spawn(async move {
        let _answering = answering;
        let _ = conn.await;
    });
    None
}

/// The protocol a request to `path` speaks (its errors are answered in it).
fn protocol_of(path: &str) -> Protocol {
    if path.starts_with("/v1/messages") {
        Protocol::Anthropic
    } else {
        Protocol::OpenAi
    }
}

/// Binds `addr`, with a clear error when it is taken.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("binding {addr}: {e}")))
}
