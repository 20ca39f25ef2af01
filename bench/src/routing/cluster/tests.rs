use super::*;

#[test]
fn metric_sum_adds_every_label_set_and_only_the_exact_name() {
    let text = "\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"qwen2-sim\"} 96.0
vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"qwen2-sim\"} 4
vllm:prefix_cache_hits_total_created{engine=\"0\"} 1.7e9
vllm:prefix_cache_queries_total 200
";
    assert_eq!(metric_sum(text, "vllm:prefix_cache_hits_total"), 100.0);
    assert_eq!(metric_sum(text, "vllm:prefix_cache_queries_total"), 200.0);
    assert_eq!(metric_sum(text, "vllm:missing"), 0.0);
}

#[test]
fn hit_share_is_computed_on_the_difference() {
    let before = CacheCounters {
        hits: 10.0,
        queries: 100.0,
    };
    let after = CacheCounters {
        hits: 85.0,
        queries: 200.0,
    };
    assert!((after.hit_share_since(&before) - 0.75).abs() < 1e-12);
    assert_eq!(before.hit_share_since(&before), 0.0);
}

#[test]
fn config_files_follow_the_process_contract() {
    let workers = [WorkerPorts {
        http: 8001,
        kv_events: 25557,
        kv_replay: 25558,
    }];
    let agent = agent_workers_yaml(&workers, true, None);
    assert_eq!(agent["workers"][0]["url"], "http://127.0.0.1:8001");
    assert!(agent["workers"][0].get("data_parallel_size").is_none());
    let ranked = agent_workers_yaml(&workers, true, Some(2));
    assert_eq!(ranked["workers"][0]["data_parallel_size"], 2);
    assert_eq!(
        agent["workers"][0]["kv_events_endpoint"],
        "tcp://127.0.0.1:25557"
    );
    assert_eq!(agent["workers"][0]["kv_events_bind"], true);
    assert_eq!(
        agent["workers"][0]["kv_replay_endpoint"],
        "tcp://127.0.0.1:25558"
    );
    let gw = gateway_yaml(
        &["http://127.0.0.1:8001".to_string()],
        Path::new("/t/qwen2"),
        "127.0.0.1:7070",
    );
    assert_eq!(gw["models"][0]["name"], MODEL);
    assert_eq!(gw["models"][0]["tokenizer_dir"], "/t/qwen2");
    assert_eq!(gw["workers"][0]["model"], MODEL);
    assert_eq!(gw["agents"][0], "http://127.0.0.1:7070");
}

#[test]
fn a_missing_binary_is_reported_with_how_to_build_it() {
    let config = ClusterConfig {
        bin_dir: PathBuf::from("/nonexistent"),
        tokenizer_dir: default_tokenizer_dir(),
        workers: 1,
        preset: "fast".into(),
        time_scale: 1.0,
        worker_args: vec![],
        gateway_modes: vec![],
        work_dir: std::env::temp_dir().join("kinference-cluster-test"),
        ready_timeout: Duration::from_secs(1),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let Ok(rt) = rt else { return };
    let err = rt
        .block_on(Cluster::start(&config, HttpClient::new()))
        .err();
    let message = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(message.contains("vllm-sim"), "{message}");
    assert!(message.contains("cargo build"), "{message}");
}
