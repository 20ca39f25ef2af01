use super::*;

fn config(mode: RoutingMode) -> RoutingConfig {
    RoutingConfig {
        workers: vec![
            WorkerConfig {
                url: "http://w1".into(),
                model: "m".into(),
            },
            WorkerConfig {
                url: "http://w2".into(),
                model: "m".into(),
            },
        ],
        models: vec![ModelConfig {
            name: "m".into(),
            tokenizer_dir: None,
        }],
        agents: vec![],
        mode,
    }
}

fn req(prompt: &str) -> RouteRequest<'_> {
    RouteRequest {
        model: "m",
        prompt: Prompt::Text(prompt),
        debug: true,
    }
}

#[tokio::test]
async fn least_outstanding_spreads_and_tickets_release() {
    let router = Router::new(config(RoutingMode::LeastOutstanding)).unwrap();
    let a = router.pick(req("hello")).await.unwrap();
    let b = router.pick(req("hello")).await.unwrap();
    assert_ne!(a.worker, b.worker);
    assert_eq!(
        router.workers().iter().map(|w| w.in_flight).sum::<usize>(),
        2
    );
    a.ticket.finish(true, 16, None);
    drop(b);
    assert_eq!(
        router.workers().iter().map(|w| w.in_flight).sum::<usize>(),
        0
    );
}

#[tokio::test]
async fn unknown_model_is_an_error() {
    let router = Router::new(config(RoutingMode::Kinference)).unwrap();
    let err = router
        .pick(RouteRequest {
            model: "other",
            prompt: Prompt::Text("x"),
            debug: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err, RouteError::UnknownModel("other".into()));
}

#[test]
fn modes_parse_from_config_names() {
    for mode in [
        RoutingMode::Kinference,
        RoutingMode::LeastOutstanding,
        RoutingMode::Random,
        RoutingMode::RoundRobin,
        RoutingMode::PrefixHash,
    ] {
        assert_eq!(mode.as_str().parse::<RoutingMode>().unwrap(), mode);
    }
}
