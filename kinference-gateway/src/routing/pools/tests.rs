use std::path::PathBuf;

use super::super::{ModelConfig, Prompt, RoutingConfig, RoutingMode, WorkerConfig};
use super::*;

fn tokenizer_dir() -> PathBuf {
    let dir = std::env::var_os("KINFERENCE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.assets/qwen2")));
    assert!(
        dir.join("tokenizer.json").exists(),
        "no tokenizer at {}: run `cargo xtask setup`",
        dir.display()
    );
    dir
}

fn router() -> Router {
    Router::new(RoutingConfig {
        workers: (0..3)
            .map(|i| WorkerConfig {
                url: format!("http://w{i}"),
                model: "m".into(),
                role: Default::default(),
            })
            .collect(),
        models: vec![ModelConfig {
            name: "m".into(),
            tokenizer_dir: Some(tokenizer_dir()),
            serves_messages: false,
            profile: None,
        }],
        agents: vec![],
        mode: RoutingMode::Kinference,
    })
    .unwrap()
}

fn req(prompt: &str) -> RouteRequest<'_> {
    RouteRequest {
        model: "m",
        prompt: Prompt::Text(prompt),
        debug: false,
        tokens: None,
        salt: None,
        session: None,
        answers: Default::default(),
    }
}

#[tokio::test]
async fn estimates_record_nothing_and_see_the_cache_of_a_routed_prompt() {
    let router = router();
    let prompt = "A long shared system prompt about shipping policies. ".repeat(30);
    let before = router.estimate_workers(req(&prompt), None).await.unwrap();
    assert_eq!(before.len(), 3);
    assert!(
        before
            .iter()
            .all(|e| e.ttft_s.is_some() && e.cached_tokens == 0)
    );
    assert_eq!(
        router.workers().iter().map(|w| w.in_flight).sum::<usize>(),
        0
    );

    // Routed once to w1 only: w1 now holds the prompt (speculative credit) and has work in flight.
    let only = vec!["http://w1".to_string()];
    let decision = router.pick_among(req(&prompt), &only).await.unwrap();
    assert_eq!(decision.worker, "http://w1");
    let after = router.estimate_workers(req(&prompt), None).await.unwrap();
    let w1 = after.iter().find(|e| e.worker == "http://w1").unwrap();
    let w0 = after.iter().find(|e| e.worker == "http://w0").unwrap();
    assert!(w1.cached_tokens > 0, "{w1:?}");
    assert_eq!(w1.in_flight, 1);
    assert_eq!(w0.cached_tokens, 0);
    decision.ticket.finish(true, 1, None);
}

#[tokio::test]
async fn pick_among_outside_the_model_is_no_healthy_worker() {
    let router = router();
    let err = router
        .pick_among(req("hi"), &["http://elsewhere".to_string()])
        .await
        .unwrap_err();
    assert_eq!(err, RouteError::NoHealthyWorker("m".into()));
    router.set_healthy("http://w2", false);
    let left = router.estimate_workers(req("hi"), None).await.unwrap();
    assert_eq!(left.len(), 2);
}

#[tokio::test]
async fn pick_except_passes_over_the_failed_worker() {
    let router = router();
    let prompt = "a prompt the first pick caches on one worker";
    let first = router.pick(req(prompt)).await.unwrap();
    first.ticket.finish(false, 0, None);
    // The same prompt again would go where its prefix is; with that worker avoided it goes elsewhere.
    let avoid = vec![first.worker.clone()];
    for _ in 0..5 {
        let retry = router.pick_except(req(prompt), None, &avoid).await.unwrap();
        assert_ne!(retry.worker, first.worker);
        retry.ticket.finish(true, 1, None);
    }
    // Within a pool of only the avoided worker nothing is left.
    let err = router
        .pick_except(req(prompt), Some(&avoid), &avoid)
        .await
        .unwrap_err();
    assert_eq!(err, RouteError::NoHealthyWorker("m".into()));
}

#[tokio::test]
async fn a_pool_names_its_workers_by_url_with_or_without_a_trailing_slash() {
    let router = router();
    // A URL the router does not know is no member; a trailing slash names the same worker.
    let pool = vec!["http://elsewhere".to_string(), "http://w2/".to_string()];
    for prompt in ["one prompt", "another prompt", "a third one"] {
        let decision = router.pick_among(req(prompt), &pool).await.unwrap();
        assert_eq!(decision.worker, "http://w2");
        decision.ticket.finish(true, 1, None);
    }
    // Avoiding it by the other spelling leaves the pool empty.
    let err = router
        .pick_except(req("hi"), Some(&pool), &["http://w2".to_string()])
        .await
        .unwrap_err();
    assert_eq!(err, RouteError::NoHealthyWorker("m".into()));
}
