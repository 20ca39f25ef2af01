//! The router against a real tonic `NodeAgent` server on loopback: it connects, applies the snapshot
//! and deltas, routes to where the cache is, survives an agent restart (new epoch, new snapshot), and
//! degrades visibly when the agent stays away.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use futures::StreamExt;
use kinference_api::KeyHasher;
use kinference_api::summary::node_agent_server::{NodeAgent, NodeAgentServer};
use kinference_api::summary::{self as pb, Summary, WatchRequest, summary};
use kinference_api::tokenize::ModelTokenizer;
use kinference_gateway::routing::{
    ModelConfig, Prompt, RouteRequest, Router, RoutingConfig, RoutingMode, RoutingTuning,
    WorkerConfig,
};
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::{broadcast, oneshot};
use tokio_stream::wrappers::{BroadcastStream, TcpListenerStream};
use tonic::{Request, Response, Status};

/// A node agent that serves a fixed snapshot, then whatever the test broadcasts.
struct TestAgent {
    snapshot: Mutex<Summary>,
    /// `None` ends every open stream (a stopped server alone leaves its connections running).
    deltas: broadcast::Sender<Option<Summary>>,
}

#[tonic::async_trait]
impl NodeAgent for TestAgent {
    type WatchStream = Pin<Box<dyn Stream<Item = Result<Summary, Status>> + Send>>;

    async fn watch(
        &self,
        _req: Request<WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let first = self.snapshot.lock().clone();
        let rest = BroadcastStream::new(self.deltas.subscribe())
            .take_while(|d| futures::future::ready(!matches!(d, Ok(None))))
            .filter_map(|d| async move { d.ok().flatten().map(Ok) });
        let stream = futures::stream::once(async move { Ok(first) }).chain(rest);
        Ok(Response::new(Box::pin(stream)))
    }
}

/// A running test agent; dropping it stops the server.
struct AgentServer {
    agent: Arc<TestAgent>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl AgentServer {
    async fn start(listener: TcpListener, snapshot: Summary) -> Self {
        let (deltas, _) = broadcast::channel(64);
        let agent = Arc::new(TestAgent {
            snapshot: Mutex::new(snapshot),
            deltas,
        });
        let (stop, stopped) = oneshot::channel::<()>();
        let svc = NodeAgentServer::from_arc(Arc::clone(&agent));
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                    let _ = stopped.await;
                })
                .await;
        });
        Self {
            agent,
            stop: Some(stop),
            task,
        }
    }

    fn send(&self, msg: Summary) {
        let _ = self.agent.deltas.send(Some(msg));
    }

    /// Ends the open streams, then stops the server (graceful shutdown waits for them).
    async fn stop(mut self) {
        let _ = self.agent.deltas.send(None);
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut self.task).await;
    }
}

impl Drop for AgentServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn worker(url: &str, keys: Vec<u64>) -> pb::WorkerState {
    pb::WorkerState {
        worker_id: url.into(),
        model: "m".into(),
        block_size: 16,
        keys,
        role: String::new(),
        offloaded_keys: Vec::new(),
        data_parallel_rank: None,
        load: Some(pb::WorkerLoad {
            metrics_ok: true,
            ..Default::default()
        }),
    }
}

fn snapshot(epoch: u64, workers: Vec<pb::WorkerState>) -> Summary {
    Summary {
        kind: Some(summary::Kind::Snapshot(pb::Snapshot {
            node: "n1".into(),
            epoch,
            workers,
            node_state: None,
        })),
    }
}

fn delta(workers: Vec<pb::WorkerDelta>) -> Summary {
    Summary {
        kind: Some(summary::Kind::Delta(pb::Delta {
            workers,
            node_state: None,
        })),
    }
}

fn router(agent: SocketAddr, tuning: RoutingTuning) -> Router {
    let config = RoutingConfig {
        workers: (0..3)
            .map(|i| WorkerConfig {
                url: format!("http://w{i}"),
                model: "m".into(),
                role: Default::default(),
            })
            .collect(),
        models: vec![ModelConfig {
            name: "m".into(),
            tokenizer_dir: Some(testkit::tokenizer_dir()),
            serves_messages: false,
            profile: None,
        }],
        agents: vec![format!("http://{agent}")],
        mode: RoutingMode::Kinference,
    };
    Router::with_tuning(config, tuning).expect("router")
}

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn blocks(router: &Router, url: &str) -> usize {
    router
        .workers()
        .iter()
        .find(|w| w.url == url)
        .map_or(0, |w| w.cached_blocks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_follows_a_real_agent_stream() {
    let system =
        "You are a careful assistant for an airline. Quote the fare rules exactly. ".repeat(40);
    let tok = ModelTokenizer::from_dir(testkit::tokenizer_dir()).unwrap();
    let keys = KeyHasher::for_model("m").keys(None, &tok.encode_text(&system, true).unwrap(), 16);
    let prompt = format!("{system}Can I change my flight?");
    let req = || RouteRequest {
        model: "m",
        prompt: Prompt::Text(&prompt),
        debug: true,
        tokens: None,
        salt: None,
        session: None,
        answers: Default::default(),
    };

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = AgentServer::start(
        listener,
        snapshot(
            1,
            vec![
                worker("http://w0", vec![]),
                worker("http://w1", keys.clone()),
            ],
        ),
    )
    .await;
    let tuning = RoutingTuning {
        stale_after: Duration::from_millis(1_500),
        ..RoutingTuning::default()
    };
    let router = router(addr, tuning);

    // Snapshot: w1 holds the prefix.
    eventually("snapshot applied", || {
        blocks(&router, "http://w1") == keys.len()
    })
    .await;
    let d = router.pick(req()).await.unwrap();
    assert_eq!(
        (d.worker.as_str(), d.reason),
        ("http://w1", "cache_hit"),
        "{:?}",
        d.explain
    );
    d.ticket.finish(true, 1, None);

    // Deltas: w1's cache is cleared, w2 (new to this agent) stores the blocks.
    server.send(delta(vec![
        pb::WorkerDelta {
            worker_id: "http://w1".into(),
            cleared: true,
            ..Default::default()
        },
        pb::WorkerDelta {
            worker_id: "http://w2".into(),
            model: "m".into(),
            block_size: 16,
            added: keys.clone(),
            ..Default::default()
        },
    ]));
    eventually("delta applied", || {
        blocks(&router, "http://w2") == keys.len() && blocks(&router, "http://w1") == 0
    })
    .await;
    // (The first pick's speculative credit still covers w1 for a few seconds; the index shows w2.)
    let d = router.pick(req()).await.unwrap();
    let explain = d.explain.clone().unwrap();
    assert!(
        explain.contains(&format!("http://w2 cached={}", keys.len() * 16)),
        "{explain}"
    );
    d.ticket.finish(true, 1, None);

    // The agent restarts with a new epoch and a different picture: the router reconnects and replaces.
    server.stop().await;
    let listener = TcpListener::bind(addr).await.unwrap();
    let server = AgentServer::start(
        listener,
        snapshot(2, vec![worker("http://w0", keys.clone())]),
    )
    .await;
    eventually("new snapshot applied", || {
        blocks(&router, "http://w0") == keys.len() && blocks(&router, "http://w2") == 0
    })
    .await;
    let d = router.pick(req()).await.unwrap();
    let explain = d.explain.clone().unwrap();
    assert!(
        explain.contains(&format!("http://w0 cached={}", keys.len() * 16)),
        "{explain}"
    );
    assert!(explain.contains("agent=live"), "{explain}");
    // w2 left this agent's picture: only this gateway's own short-lived credit can speak for it now.
    assert!(
        explain.contains("http://w2 cached=") && explain.contains("agent=none"),
        "{explain}"
    );
    d.ticket.finish(true, 1, None);

    // The agent goes away for good: after the stale timeout its data is dropped and decisions say so.
    server.stop().await;
    eventually("agent data dropped", || blocks(&router, "http://w0") == 0).await;
    let d = router
        .pick(RouteRequest {
            model: "m",
            prompt: Prompt::Text("unrelated"),
            debug: false,
            tokens: None,
            salt: None,
            session: None,
            answers: Default::default(),
        })
        .await
        .unwrap();
    assert_eq!(d.reason, "degraded_stale");
}
