use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::{HttpSettings, Upstream};

/// A worker on loopback that answers every request after `delay`; counts the connections it
/// accepted and the most it held open at once.
async fn slow_worker(delay: Duration) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let (accepted, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let open = Arc::new(AtomicUsize::new(0));
    let (a, p) = (Arc::clone(&accepted), Arc::clone(&peak));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            a.fetch_add(1, Ordering::SeqCst);
            let now = open.fetch_add(1, Ordering::SeqCst) + 1;
            p.fetch_max(now, Ordering::SeqCst);
            let open = Arc::clone(&open);
            tokio::spawn(async move {
                let service = service_fn(move |_req| async move {
                    tokio::time::sleep(delay).await;
                    Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                        Bytes::from_static(b"{}"),
                    )))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
                open.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    (url, accepted, peak)
}

#[tokio::test]
async fn a_worker_never_gets_more_connections_than_the_limit() {
    let (url, accepted, peak) = slow_worker(Duration::from_millis(100)).await;
    let settings = HttpSettings {
        upstream_max_connections_per_worker: 2,
        ..HttpSettings::default()
    };
    let upstream = Upstream::new(&settings);
    let started = std::time::Instant::now();
    let requests = (0..6).map(|_| {
        let upstream = upstream.clone();
        let url = url.clone();
        async move {
            let response = upstream
                .post_json(&url, "/v1/chat/completions", Bytes::from_static(b"{}"))
                .await
                .expect("answered");
            upstream
                .read_body(&url, response.into_body())
                .await
                .expect("body")
        }
    });
    let bodies = futures::future::join_all(requests).await;
    assert_eq!(bodies.len(), 6);
    // Six requests over two connections: three rounds of 100 ms, no third connection.
    assert!(peak.load(Ordering::SeqCst) <= 2, "peak {peak:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    assert!(started.elapsed() >= Duration::from_millis(300));
}

#[tokio::test]
async fn a_body_past_the_limit_is_a_bad_upstream_read_no_further() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(Bytes::from(
                        vec![b'x'; 4 << 20],
                    ))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    let read = |max: usize| {
        let url = url.clone();
        async move {
            let settings = HttpSettings {
                upstream_max_body_bytes: max,
                ..HttpSettings::default()
            };
            let upstream = Upstream::new(&settings);
            let response = upstream
                .post_json(&url, "/v1/chat/completions", Bytes::from_static(b"{}"))
                .await
                .expect("answered");
            upstream.read_body(&url, response.into_body()).await
        }
    };
    let error = read(1 << 20).await.expect_err("4 MiB over a 1 MiB limit");
    assert_eq!(error.status(), http::StatusCode::BAD_GATEWAY);
    assert!(error.to_string().contains("1048576"), "{error}");
    assert_eq!(read(4 << 20).await.expect("within").len(), 4 << 20);
}

#[test]
fn a_line_limit_over_the_event_limit_is_refused() {
    let settings = HttpSettings {
        upstream_max_line_bytes: 2 << 20,
        upstream_max_event_bytes: 1 << 20,
        ..HttpSettings::default()
    };
    assert!(settings.validate().is_err());
    assert!(HttpSettings::default().validate().is_ok());
}
