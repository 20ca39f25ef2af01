use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kinference_api::KeyHasher;

use super::{Batch, MAX_BATCH_BYTES, MAX_KEYS, Note, PATH, ReplicasConfig};
use crate::routing::{ModelConfig, Router, RoutingConfig, RoutingMode, WorkerConfig};

fn router() -> Router {
    Router::new(RoutingConfig {
        workers: ["http://w1", "http://w2"]
            .iter()
            .map(|url| WorkerConfig {
                url: url.to_string(),
                model: "m".into(),
                role: Default::default(),
            })
            .collect(),
        models: vec![ModelConfig {
            name: "m".into(),
            tokenizer_dir: None,
            serves_messages: false,
            profile: None,
        }],
        agents: vec![],
        mode: RoutingMode::Kinference,
    })
    .unwrap()
}

/// A 2,048-token prompt (128 blocks of 16) and its block keys as the router computes them.
fn prompt(seed: u32) -> (Vec<u32>, Vec<u64>) {
    let tokens: Vec<u32> = (0..2048).map(|i| seed * 100_000 + i).collect();
    let keys = KeyHasher::for_model("m").keys(None, &tokens, 16);
    (tokens, keys)
}

fn dispatch(id: u64, worker: &str, keys: Vec<u64>) -> Note {
    Note::Dispatch {
        id,
        worker: worker.into(),
        dp_rank: None,
        keys,
        uncached_tokens: 2048.0,
        est_ttft_s: 0.5,
    }
}

fn in_flight(router: &Router, url: &str) -> usize {
    router
        .workers()
        .into_iter()
        .find(|w| w.url == url)
        .map_or(0, |w| w.in_flight)
}

#[test]
fn a_peers_dispatch_is_in_the_ledger_and_draws_its_prompt_until_it_ends() {
    let router = router();
    let (tokens, keys) = prompt(1);
    router.apply_replica_batch(Batch {
        from: "peer-a".into(),
        notes: vec![dispatch(7, "http://w2", keys)],
    });
    assert_eq!(in_flight(&router, "http://w2"), 1);
    assert_eq!(router.replica_requests_in_flight(), 1);
    // The same prompt follows the peer's request: w2 is about to hold its 128 blocks, w1 none.
    let d = router.pick_tokens("m", &tokens, true).unwrap();
    assert_eq!(d.worker, "http://w2", "{:?}", d.explain);
    drop(d);
    router.apply_replica_batch(Batch {
        from: "peer-a".into(),
        notes: vec![Note::FirstToken { id: 7 }, Note::End { id: 7 }],
    });
    assert_eq!(in_flight(&router, "http://w2"), 0);
    assert_eq!(router.replica_requests_in_flight(), 0);
    // An end for a request never dispatched, or twice, changes nothing.
    router.apply_replica_batch(Batch {
        from: "peer-a".into(),
        notes: vec![Note::End { id: 7 }, Note::End { id: 99 }],
    });
    assert_eq!(in_flight(&router, "http://w2"), 0);
}

#[test]
fn a_silent_peers_requests_are_forgotten_after_the_bound_and_not_before() {
    let router = router();
    let (_, keys) = prompt(2);
    let sent = Instant::now();
    router.apply_replica_batch(Batch {
        from: "peer-b".into(),
        notes: vec![
            dispatch(1, "http://w1", keys.clone()),
            dispatch(2, "http://w1", keys),
            // A worker this router does not know is skipped.
            dispatch(3, "http://elsewhere", vec![1, 2, 3]),
        ],
    });
    assert_eq!(in_flight(&router, "http://w1"), 2);
    let bound = Duration::from_secs(1);
    router.forget_silent_replicas(sent + Duration::from_millis(500), bound);
    assert_eq!(in_flight(&router, "http://w1"), 2);
    router.forget_silent_replicas(sent + Duration::from_millis(1500), bound);
    assert_eq!(in_flight(&router, "http://w1"), 0);
    assert_eq!(router.replica_requests_in_flight(), 0);
}

#[test]
fn the_batch_wire_format_is_tagged_json() {
    let batch = Batch {
        from: "g1".into(),
        notes: vec![dispatch(1, "http://w1", vec![5, 6]), Note::End { id: 1 }],
    };
    let text = serde_json::to_string(&batch).unwrap();
    assert!(text.contains(r#""kind":"dispatch""#), "{text}");
    assert!(text.contains(r#"{"kind":"end","id":1}"#), "{text}");
    let back: Batch = serde_json::from_str(&text).unwrap();
    assert_eq!(back.notes, batch.notes);
}

/// Serves `PATH` on loopback for `router` as the gateway's admin port does.
async fn serve(router: Arc<Router>) -> SocketAddr {
    use http_body_util::BodyExt as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let router = Arc::clone(&router);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let router = Arc::clone(&router);
                        async move {
                            assert_eq!(req.uri().path(), PATH);
                            // The peers share the admin key, and present it.
                            assert_eq!(
                                req.headers()
                                    .get(hyper::header::AUTHORIZATION)
                                    .and_then(|v| v.to_str().ok()),
                                Some(concat!("Bearer ", "replicas-admin-key-0123456789"))
                            );
                            // The admin port's limit: a larger batch is refused whole.
                            let limited =
                                http_body_util::Limited::new(req.into_body(), MAX_BATCH_BYTES);
                            let mut answer =
                                hyper::Response::new(http_body_util::Empty::<bytes::Bytes>::new());
                            match limited.collect().await {
                                Ok(body) => {
                                    let batch: Batch =
                                        serde_json::from_slice(&body.to_bytes()).unwrap();
                                    router.apply_replica_batch(batch);
                                }
                                Err(_) => *answer.status_mut() = hyper::StatusCode::BAD_REQUEST,
                            }
                            Ok::<_, hyper::Error>(answer)
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(5), "{what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_lost_mid_run_is_forgotten_by_the_others_within_the_bound() {
    let b = Arc::new(router());
    let config = ReplicasConfig {
        peers: vec![],
        heartbeat_ms: 20,
        forget_after_ms: 200,
    };
    b.share_with_replicas(&config, None, None);
    let addr = serve(Arc::clone(&b)).await;
    // Replica A runs in a runtime of its own, so that dropping that runtime loses it at once, tasks
    // and all, as a killed process would: no end is ever sent for its requests.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let a_thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let a = router();
            a.share_with_replicas(
                &ReplicasConfig {
                    peers: vec![format!("http://{addr}")],
                    heartbeat_ms: 20,
                    forget_after_ms: 200,
                },
                Some("replicas-admin-key-0123456789".into()),
                None,
            );
            let (tokens, _) = prompt(3);
            let done = a.pick_tokens("m", &tokens, false).unwrap();
            let mut open = a.pick_tokens("m", &tokens, false).unwrap();
            open.ticket.first_token();
            done.ticket.finish(true, 8, None);
            // Keep the open request (and the replica) alive until the test says stop.
            tokio::task::spawn_blocking(move || rx.recv()).await.ok();
            std::mem::forget(open);
        });
        rt.shutdown_background();
    });
    // B holds A's open request, and no longer the finished one.
    wait_for("B hears of A's requests", || {
        b.replica_requests_in_flight() == 1
    })
    .await;
    // A stays alive for several forget bounds: its heartbeats keep its request in B's ledger.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(b.replica_requests_in_flight(), 1);
    tx.send(()).unwrap();
    a_thread.join().unwrap();
    let lost = Instant::now();
    wait_for("B forgets lost A", || b.replica_requests_in_flight() == 0).await;
    // Forgotten within the bound (200 ms) plus a sweep period (20 ms) and scheduling slack.
    assert!(
        lost.elapsed() < Duration::from_millis(1000),
        "{:?}",
        lost.elapsed()
    );
    assert!(
        lost.elapsed() >= Duration::from_millis(150),
        "{:?}",
        lost.elapsed()
    );
    assert_eq!(b.workers().iter().map(|w| w.in_flight).sum::<usize>(), 0);
}

#[tokio::test]
async fn a_burst_of_long_prompts_reaches_the_peer_in_batches_it_takes() {
    // A thousand dispatches of 16k-token prompts queued before the sender runs: about 20 MB of
    // notes, more than one batch may carry. Each arrives (batches stay under the admin port's
    // limit), nothing is counted as dropped.
    let b = Arc::new(router());
    let addr = serve(Arc::clone(&b)).await;
    let a = router();
    a.share_with_replicas(
        &ReplicasConfig {
            peers: vec![format!("http://{addr}")],
            heartbeat_ms: 50,
            forget_after_ms: 10_000,
        },
        Some("replicas-admin-key-0123456789".into()),
        None,
    );
    let outbox = a.shared.outbox.get().expect("sharing started");
    let keys: Vec<u64> = (0..MAX_KEYS as u64).map(|k| u64::MAX - k).collect();
    for id in 0..1000 {
        outbox.send(dispatch(id, "http://w1", keys.clone()));
    }
    let start = Instant::now();
    while b.replica_requests_in_flight() < 1000 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the peer holds {} of 1000 dispatches",
            b.replica_requests_in_flight()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut text = String::new();
    let mut registry = prometheus_client::registry::Registry::default();
    a.shared.metrics.register(&mut registry);
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(!text.contains("replica_notes_dropped_total{"), "{text}");
}

#[test]
fn discovered_peers_join_the_fixed_ones_less_this_pods_address() {
    let (tx, rx) = tokio::sync::watch::channel(std::collections::BTreeSet::from([
        "http://10.0.0.5:9090".to_string(),
        "http://10.0.0.6:9090".to_string(),
    ]));
    let peers = super::Peers {
        fixed: vec!["http://static:9090/".into()],
        discovered: Some(rx),
        own_ip: Some("10.0.0.5".into()),
    };
    assert_eq!(
        peers.urls(),
        vec![
            format!("http://10.0.0.6:9090{PATH}"),
            format!("http://static:9090{PATH}")
        ]
    );
    // A replica that joins is posted to from the next batch on.
    tx.send_modify(|set| {
        set.insert("http://10.0.0.7:9090".into());
    });
    assert_eq!(peers.urls().len(), 3);
}

#[tokio::test]
async fn a_replicas_own_batch_is_not_taken_as_a_peers() {
    // With discovered peers the sender is in its own list (until POD_IP leaves it out): its batches
    // must not enter its own ledger twice.
    let a = router();
    let (_tx, rx) = tokio::sync::watch::channel(std::collections::BTreeSet::new());
    a.share_with_replicas(&ReplicasConfig::default(), None, Some(rx));
    let own = a.shared.outbox.get().expect("sharing started").from.clone();
    let (_, keys) = prompt(7);
    a.apply_replica_batch(Batch {
        from: own,
        notes: vec![dispatch(1, "http://w1", keys.clone())],
    });
    assert_eq!(a.replica_requests_in_flight(), 0);
    a.apply_replica_batch(Batch {
        from: "another".into(),
        notes: vec![dispatch(1, "http://w1", keys)],
    });
    assert_eq!(a.replica_requests_in_flight(), 1);
}

#[test]
fn replicas_that_have_not_heard_from_each_other_break_near_ties_alike() {
    // Two replicas with the same idle workers and nothing shared: every new prompt is a near-tie, and
    // each one goes to the same worker on both (a random draw would agree half the time), while the
    // prompts still spread over both workers.
    let (a, b) = (router(), router());
    let mut used = std::collections::BTreeSet::new();
    for seed in 0..32 {
        let (tokens, _) = prompt(100 + seed);
        let on_a = a.pick_tokens("m", &tokens, false).unwrap().worker;
        let on_b = b.pick_tokens("m", &tokens, false).unwrap().worker;
        assert_eq!(on_a, on_b, "prompt {seed}");
        used.insert(on_a);
    }
    assert_eq!(used.len(), 2, "{used:?}");
}

#[tokio::test]
async fn a_peers_stored_answer_pins_its_follow_ups_here_too() {
    use crate::routing::sessions::{Answers, Held, Owner, SessionKey};
    use crate::routing::{Prompt, RouteRequest};
    let router = router();
    let answer = |id: &str, worker: &str| Note::Answer {
        id: id.into(),
        owner: Owner::of("acme").to_wire(),
        worker: worker.into(),
        dp_rank: None,
    };
    router.apply_replica_batch(Batch {
        from: "peer-a".into(),
        notes: vec![
            answer("resp_1", "http://w2"),
            // A worker this router does not know, and an id no worker makes, are skipped.
            answer("resp_2", "http://elsewhere"),
            answer(&"r".repeat(300), "http://w1"),
        ],
    });
    let asks = |tenant: &str, id: &str| Answers {
        owner: Some(Owner::of(tenant)),
        continues: SessionKey::answer(id),
    };
    assert_eq!(router.answer_held(&asks("other", "resp_1")), Held::Foreign);
    assert_eq!(router.answer_held(&asks("acme", "resp_2")), Held::Unknown);
    assert_eq!(
        router.answer_held(&asks("acme", &"r".repeat(300))),
        Held::Unknown
    );
    // Whatever the estimate would say, acme's follow-ups go to w2.
    for i in 0..4 {
        let text = format!("follow-up {i}");
        let d = router
            .pick(RouteRequest {
                model: "m",
                prompt: Prompt::Text(&text),
                debug: false,
                tokens: None,
                salt: None,
                session: None,
                answers: asks("acme", "resp_1"),
            })
            .await
            .unwrap();
        assert_eq!(
            (d.worker.as_str(), d.reason),
            ("http://w2", "previous_response")
        );
    }
}
