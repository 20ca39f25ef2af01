use super::*;

#[test]
fn admission_answers_parse() {
    let ok = parse_admit(&["ok".into(), "1.5".into(), "-2".into()], 2);
    assert_eq!(
        ok,
        Some(RedisVerdict::Buckets(LimitVerdict::Admitted(vec![
            Level { remaining: 1.5 },
            Level { remaining: -2.0 }
        ])))
    );
    let limited = parse_admit(
        &[
            "limited".into(),
            "0.25".into(),
            "1".into(),
            "3".into(),
            "0.5".into(),
        ],
        2,
    );
    assert!(matches!(
        limited,
        Some(RedisVerdict::Buckets(LimitVerdict::Limited {
            refused: 1,
            ..
        }))
    ));
    assert_eq!(
        parse_admit(&["budget".into(), "12.5".into()], 0),
        Some(RedisVerdict::BudgetSpent(12.5))
    );
    assert_eq!(parse_admit(&["ok".into()], 1), None);
}

#[tokio::test]
async fn the_redis_queue_is_bounded_and_counts_what_it_drops() {
    // Nothing listens on the port: every aggregate stays queued, up to the bound of 100 aggregates.
    let port = testkit::free_port();
    let metrics = StoreMetrics::default();
    let store = RedisStore::bounded(
        &format!("redis://127.0.0.1:{port}"),
        Duration::from_millis(50),
        100,
        metrics.clone(),
    )
    .unwrap();
    let (tx, rx) = mpsc::channel(16);
    let forward = tokio::spawn(Arc::clone(&store).forward_usage(rx));
    // One tenant per record: each opens an aggregate of its own.
    let record = |i: usize| UsageRecord {
        id: format!("r{i}"),
        request_id: String::new(),
        ts_ms: 1,
        tenant: format!("t{i}"),
        model: "m".into(),
        pool: String::new(),
        provider: String::new(),
        status: 200,
        requests: 1,
        input_uncached: 1,
        input_cached: 0,
        output: 1,
        cost: 0.0,
        estimated: false,
        prefill_pool: String::new(),
    };
    for batch in 0..3 {
        tx.send((0..50).map(|i| record(batch * 50 + i)).collect())
            .await
            .unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while metrics.redis_dropped() < 50 {
        assert!(std::time::Instant::now() < deadline, "nothing dropped");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(store.pending(), 100);
    assert_eq!(metrics.redis_dropped(), 50);
    // A record of an aggregate already waiting joins it: nothing more is dropped.
    let mut again = record(7);
    again.id = "r7-again".into();
    tx.send(vec![again]).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while store.pending() < 101 {
        assert!(std::time::Instant::now() < deadline, "not added");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(metrics.redis_dropped(), 50);
    forward.abort();
}
