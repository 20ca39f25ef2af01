//! A request waiting for a saturated pool moves on to a later pool of its plan that has room,
//! through the real `kinference-gateway` binary (`--flow-control`): a policy routes the model to
//! pool `first`, then `second`; `first`'s one worker holds each answer for a while and is full
//! with one request in flight (`--flow-max-in-flight=1`). The second request waits for `first`,
//! then leaves the queue for `second` and is answered long before `first` would have had room.
//! A plan with no later pool keeps waiting (the deadline sheds it).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use testkit::free_port;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

const MODEL: &str = "later-model";

/// How long `first`'s worker holds each answer.
const HOLD: Duration = Duration::from_millis(2500);

/// A worker answering every request with one short chat completion after `hold`; its port and how
/// many requests it got.
async fn worker(hold: Duration) -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let served = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&served);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let count = Arc::clone(&count);
            tokio::spawn(async move {
                let Some((path, _)) = support::raw_worker::read_request(&mut socket).await else {
                    return;
                };
                // Health probes and model lists are answered at once; only inference is held.
                if path == "/v1/chat/completions" {
                    count.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(hold).await;
                }
                let response = support::raw_worker::chat_completion_response(MODEL);
                let _ = socket.write_all(response.as_bytes()).await;
            });
        }
    });
    (port, served)
}

/// A gateway whose policy routes the model to `targets` (pool names) over pools `first` (worker on
/// `slow`) and `second` (worker on `quick`): its API port.
async fn gateway(
    dir: &std::path::Path,
    slow: u16,
    quick: u16,
    targets: &str,
) -> (testkit::ChildGuard, u16) {
    use support::policies;
    let url = |port: u16| policies::endpoint(&format!("http://127.0.0.1:{port}"));
    let rule = format!(
        "apiVersion: kinference.ai/v1alpha1\nkind: InferencePolicy\nmetadata: {{name: order}}\nspec:\n  priority: 0\n  rules:\n    - name: in-order\n      match: {{models: [{MODEL}]}}\n      action: {{route: {{targets: [{targets}]}}}}\n"
    );
    let policy_dir = policies::write(
        dir,
        &[
            policies::model(MODEL, None),
            policies::pool("first", MODEL, "Local", "slow", &url(slow)),
            policies::pool("second", MODEL, "Local", "quick", &url(quick)),
            rule,
        ],
    );
    let config = dir.join("gateway.yaml");
    std::fs::write(&config, policies::gateway_yaml(&policy_dir, 200)).expect("config");
    let (child, api, _admin) = support::start_gateway(
        &config,
        &[
            "--flow-control",
            "--flow-max-in-flight=1",
            "--flow-deadline-ms=1500",
        ],
    )
    .await;
    (child, api)
}

async fn chat(api: u16) -> (u16, String, Duration) {
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hello"}}],"max_tokens":2}}"#
    );
    let started = Instant::now();
    let (status, _, answer) =
        support::call("127.0.0.1", api, "POST", "/v1/chat/completions", &[], &body).await;
    (status, answer, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_for_a_saturated_pool_moves_on_to_a_later_pool_with_room() {
    let (slow, slow_served) = worker(HOLD).await;
    let (quick, quick_served) = worker(Duration::ZERO).await;
    let scratch = support::TempDir::new("flow-later-pool");
    let (_gw, api) = gateway(&scratch.0, slow, quick, "{pool: first}, {pool: second}").await;

    // The first request fills `first` (one in flight is full) for HOLD.
    let held = tokio::spawn(chat(api));
    support::wait_for("the first request at the slow worker", || {
        let n = slow_served.load(Ordering::SeqCst);
        async move { n == 1 }
    })
    .await;
    // The second waits for `first`, then moves on to `second`, long before `first` has room.
    let (status, answer, took) = chat(api).await;
    assert_eq!(status, 200, "{answer}");
    assert!(took < HOLD / 2, "moved on after {took:?}");
    assert_eq!(quick_served.load(Ordering::SeqCst), 1);
    assert_eq!(slow_served.load(Ordering::SeqCst), 1);
    let (status, _, _) = held.await.expect("first request");
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_with_no_later_pool_keeps_waiting_for_its_own() {
    let (slow, slow_served) = worker(HOLD).await;
    // `second` exists but the plan does not name it.
    let scratch = support::TempDir::new("flow-no-later-pool");
    let (_gw, api) = gateway(&scratch.0, slow, free_port(), "{pool: first}").await;
    let held = tokio::spawn(chat(api));
    support::wait_for("the first request at the slow worker", || {
        let n = slow_served.load(Ordering::SeqCst);
        async move { n == 1 }
    })
    .await;
    // Nothing else may take it: it waits its band's deadline (1.5 s) and is shed.
    let (status, answer, took) = chat(api).await;
    assert_eq!(status, 503, "{answer}");
    assert!(took >= Duration::from_millis(1400), "shed after {took:?}");
    assert_eq!(slow_served.load(Ordering::SeqCst), 1);
    let (status, _, _) = held.await.expect("first request");
    assert_eq!(status, 200);
}
