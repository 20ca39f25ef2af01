use super::*;

#[test]
fn parses_the_documented_workers_file() {
    let yaml = r#"
workers:
  - url: http://127.0.0.1:8001/
    model: qwen2-sim
    kv_events_endpoint: tcp://127.0.0.1:25557
    kv_events_bind: true
    kv_replay_endpoint: tcp://127.0.0.1:25558
  - url: http://127.0.0.1:8002
    model: qwen2-sim
    kv_events_endpoint: tcp://127.0.0.1:26557
    kv_events_bind: false
"#;
    let f = WorkersFile::parse(yaml).ok().expect("parses");
    assert_eq!(f.workers.len(), 2);
    assert_eq!(
        f.workers[0].url, "http://127.0.0.1:8001",
        "trailing slash trimmed: the url is the id"
    );
    assert!(f.workers[0].kv_events_bind);
    assert_eq!(
        f.workers[0].kv_replay_endpoint.as_deref(),
        Some("tcp://127.0.0.1:25558")
    );
    assert!(!f.workers[1].kv_events_bind);
    assert_eq!(f.workers[1].kv_replay_endpoint, None);
}

#[test]
fn rejects_duplicates_and_typos() {
    let dup = "workers:\n  - {url: http://a, model: m}\n  - {url: http://a/, model: m}\n";
    assert!(matches!(
        WorkersFile::parse(dup),
        Err(ParseError::Duplicate(_))
    ));
    let typo = "workers:\n  - {url: http://a, model: m, kv_event_endpoint: tcp://x:1}\n";
    assert!(matches!(WorkersFile::parse(typo), Err(ParseError::Yaml(_))));
    assert_eq!(WorkersFile::parse("").ok(), Some(WorkersFile::default()));
    // A data-parallel size past the bound is refused, not followed with thousands of subscribers.
    let ranks =
        |n: u32| format!("workers:\n  - {{url: http://a, model: m, data_parallel_size: {n}}}\n");
    assert!(WorkersFile::parse(&ranks(MAX_DATA_PARALLEL_SIZE)).is_ok());
    assert!(matches!(
        WorkersFile::parse(&ranks(MAX_DATA_PARALLEL_SIZE + 1)),
        Err(ParseError::TooManyRanks(_, n)) if n == MAX_DATA_PARALLEL_SIZE + 1
    ));
}

#[test]
fn flags_match_the_contract() {
    let a = Args::try_parse_from([
        "kinference-agent",
        "--grpc-listen",
        "127.0.0.1:7070",
        "--metrics-listen",
        "127.0.0.1:9091",
        "--workers",
        "agent-workers.yaml",
        "--node",
        "n1",
    ])
    .expect("parses");
    assert_eq!(a.node_name(), "n1");
    assert_eq!(a.scrape_interval(), Duration::from_millis(250));
}

#[test]
fn zmq_guard_limits_that_contradict_each_other_are_refused() {
    let args = |extra: &[&str]| {
        let mut argv = vec!["kinference-agent", "--workers", "w.yaml"];
        argv.extend_from_slice(extra);
        Args::parse_from(argv)
    };
    assert!(
        args(&[]).zmq_guard().validate().is_ok(),
        "the defaults hold"
    );
    for bad in [
        // A budget smaller than the largest message would refuse every large message.
        &["--zmq-max-buffered-bytes", "1048576"][..],
        &["--zmq-idle-timeout-ms", "0"],
        &["--zmq-max-message-bytes", "0"],
    ] {
        let error = args(bad).zmq_guard().validate().expect_err("refused");
        assert!(
            error.to_string().contains("ZeroMQ guard limits"),
            "{bad:?}: {error}"
        );
    }
    assert!(
        args(&[
            "--zmq-max-buffered-bytes",
            "1048576",
            "--zmq-max-message-bytes",
            "1048576"
        ])
        .zmq_guard()
        .validate()
        .is_ok()
    );
}
