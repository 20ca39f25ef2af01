use super::*;

#[test]
fn no_driver_says_why_and_carries_on() {
    let gpu = GpuMonitor::start_with_library(Path::new("/nonexistent/libnvidia-ml.so.1"));
    let reason = gpu.unavailable_reason().expect("a reason");
    assert!(reason.contains("NVML unavailable"), "{reason}");
    let sample = gpu.sample(&[("http://127.0.0.1:8001".to_string(), 8001)]);
    assert!(sample.gpus.is_empty());
    assert_eq!(sample.unavailable_reason.as_deref(), Some(reason));
    let proto = sample.to_proto();
    assert!(proto.gpus.is_empty());
    assert!(proto.gpu_unavailable_reason.contains("NVML unavailable"));
    let mut registry = Registry::default();
    gpu.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
    assert!(text.contains("kinference_agent_gpu_available 0"), "{text}");
}

#[test]
fn gpu_processes_map_to_workers_through_their_ancestors() {
    // 100: worker A's API server (listens), 101: its engine core (uses GPU 0), 102: a grandchild.
    // 200: worker B's server, which uses the GPU itself. 300: an unrelated process under init.
    let table =
        ProcessTable::from_pairs([(100, 1), (101, 100), (102, 101), (200, 1), (300, 1), (1, 0)]);
    let workers = HashMap::from([
        ("http://a:8001".to_string(), vec![100]),
        ("http://b:8002".to_string(), vec![200]),
    ]);
    assert_eq!(
        workers_using(&[101], &workers, &table),
        vec!["http://a:8001"]
    );
    assert_eq!(
        workers_using(&[102, 200], &workers, &table),
        vec!["http://a:8001", "http://b:8002"]
    );
    assert!(workers_using(&[300], &workers, &table).is_empty());
    assert!(workers_using(&[999], &workers, &table).is_empty());
    // A parent cycle (corrupt table) terminates.
    let cyclic = ProcessTable::from_pairs([(5, 6), (6, 5)]);
    assert!(workers_using(&[5], &workers, &cyclic).is_empty());
}

#[test]
fn parses_proc_stat_and_tcp_tables() {
    assert_eq!(
        parse_ppid("42 (vllm (engine) core) S 7 42 42 0 -1"),
        Some(7)
    );
    assert_eq!(parse_ppid("garbage"), None);
    let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0\n\
   1: 0100007F:1F41 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 12346 1 0000000000000000 20 4 30 10 -1\n";
    assert_eq!(parse_listeners(tcp), vec![(8001, 12345)]);
}

#[test]
fn finds_the_process_listening_on_a_port() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let found = listening_pids(&[port]);
    assert_eq!(found.get(&port), Some(&vec![std::process::id()]));
    // The current process mapped to a worker: a GPU process that is this process or its child maps to it.
    let table = ProcessTable::from_proc();
    let workers = HashMap::from([("http://127.0.0.1".to_string(), vec![std::process::id()])]);
    assert_eq!(
        workers_using(&[std::process::id()], &workers, &table),
        vec!["http://127.0.0.1"]
    );
}
