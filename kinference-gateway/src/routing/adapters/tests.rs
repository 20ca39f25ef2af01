use std::collections::HashSet;

use super::*;
use crate::routing::{ModelConfig, RoutingConfig, RoutingMode, WorkerConfig};

fn router() -> Router {
    let worker = |url: &str| WorkerConfig {
        url: url.into(),
        model: "base".into(),
        role: Default::default(),
    };
    Router::new(RoutingConfig {
        mode: RoutingMode::Kinference,
        models: vec![ModelConfig {
            name: "base".into(),
            tokenizer_dir: None,
            serves_messages: false,
            profile: None,
        }],
        workers: vec![worker("http://a"), worker("http://b")],
        agents: vec![],
    })
    .expect("router")
}

fn candidates(r: &Router, model: &str) -> HashSet<String> {
    r.candidates(model)
        .map(|ws| ws.iter().map(|w| w.url.clone()).collect())
        .unwrap_or_default()
}

#[test]
fn an_adapter_has_as_candidates_only_the_workers_that_loaded_it() {
    let r = router();
    assert!(r.set_adapters("http://a", vec!["sql-lora".into()]));
    assert!(
        !r.set_adapters("http://a", vec!["sql-lora".into()]),
        "unchanged"
    );
    assert_eq!(
        candidates(&r, "sql-lora"),
        HashSet::from(["http://a".to_string()])
    );
    assert_eq!(candidates(&r, "base").len(), 2);
    assert!(matches!(
        r.candidates("other-lora"),
        Err(crate::routing::RouteError::UnknownModel(_))
    ));
    // Unloaded (gone from its /v1/models): no worker serves it any more.
    assert!(r.set_adapters("http://a", vec![]));
    assert!(r.candidates("sql-lora").is_err());
    assert!(!r.set_adapters("http://unknown", vec!["sql-lora".into()]));
}

#[test]
fn an_unhealthy_workers_adapter_is_no_candidate() {
    let r = router();
    r.set_adapters("http://a", vec!["sql-lora".into()]);
    r.set_adapters("http://b", vec!["sql-lora".into(), "chat-lora".into()]);
    r.set_healthy("http://b", false);
    assert_eq!(
        candidates(&r, "sql-lora"),
        HashSet::from(["http://a".to_string()])
    );
    assert!(matches!(
        r.candidates("chat-lora"),
        Err(crate::routing::RouteError::NoHealthyWorker(_))
    ));
}
