use std::collections::HashSet;

use super::*;
use crate::config::WorkerSpec;
use crate::kv_events::{KvEvent, Medium};

fn spec(url: &str) -> WorkerSpec {
    WorkerSpec {
        url: url.into(),
        model: "m".into(),
        kv_events_endpoint: None,
        kv_events_bind: true,
        kv_replay_endpoint: None,
        kv_topic: None,
        role: None,
        data_parallel_size: None,
    }
}

fn store(first_hash: u64, parent: Option<u64>, n: u64, bs: u32) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: (first_hash..first_hash + n).collect(),
        parent_block_hash: parent,
        token_ids: (0..(n as u32 * bs))
            .map(|t| t.wrapping_mul(2654435761) ^ first_hash as u32)
            .collect(),
        block_size: bs,
        medium: Medium::Gpu,
        lora: None,
        extra_keys: Vec::new(),
    }
}

fn setup(queue: usize) -> (Arc<Registry>, Arc<Broadcaster>) {
    let registry = Arc::new(Registry::default());
    let b = Broadcaster::new(
        registry.clone(),
        AgentMetrics::default(),
        "n1".into(),
        queue,
    );
    (registry, b)
}

fn recv_now(rx: &mut mpsc::Receiver<Result<pb::Summary, Status>>) -> Option<Kind> {
    rx.try_recv().ok().and_then(|r| r.ok()).and_then(|s| s.kind)
}

/// Applies a message to a gateway-side view, as a gateway would.
fn apply(view: &mut HashMap<String, HashSet<u64>>, kind: &Kind) {
    match kind {
        Kind::Snapshot(s) => {
            view.clear();
            for w in &s.workers {
                view.insert(w.worker_id.clone(), w.keys.iter().copied().collect());
            }
        }
        Kind::Delta(d) => {
            for w in &d.workers {
                if w.gone {
                    view.remove(&w.worker_id);
                    continue;
                }
                let set = view.entry(w.worker_id.clone()).or_default();
                if w.cleared {
                    set.clear();
                }
                w.removed.iter().for_each(|k| {
                    set.remove(k);
                });
                set.extend(w.added.iter().copied());
            }
        }
    }
}

#[test]
fn snapshot_first_then_deltas_keep_a_gateway_exact() {
    let (registry, b) = setup(16);
    let w1 = registry.upsert(spec("http://w1"), 1000);
    w1.kv().lock().apply(&store(1, None, 4, 16));
    let mut announced = HashMap::new();
    let mut rx = b.add_watcher("g1".into());
    b.tick(&mut announced);
    let mut view = HashMap::new();
    let first = recv_now(&mut rx).expect("a message");
    assert!(
        matches!(first, Kind::Snapshot(ref s) if s.node == "n1" && s.workers.len() == 1 && s.workers[0].keys.len() == 4)
    );
    apply(&mut view, &first);

    w1.kv().lock().apply(&store(5, Some(4), 2, 16));
    w1.kv().lock().apply(&KvEvent::BlockRemoved {
        block_hashes: vec![1],
        medium: Medium::Gpu,
    });
    let w2 = registry.upsert(spec("http://w2"), 1000);
    w2.kv().lock().apply(&store(100, None, 3, 16));
    b.tick(&mut announced);
    let d = recv_now(&mut rx).expect("delta");
    assert!(matches!(d, Kind::Delta(_)));
    apply(&mut view, &d);
    assert_eq!(
        view["http://w1"],
        w1.kv().lock().keys().into_iter().collect::<HashSet<_>>()
    );
    assert_eq!(
        view["http://w2"],
        w2.kv().lock().keys().into_iter().collect::<HashSet<_>>()
    );

    registry.remove("http://w2");
    b.tick(&mut announced);
    apply(&mut view, &recv_now(&mut rx).expect("gone"));
    assert!(!view.contains_key("http://w2"));
}

#[test]
fn a_gateway_that_falls_behind_gets_a_fresh_snapshot() {
    let (registry, b) = setup(2);
    let w1 = registry.upsert(spec("http://w1"), 100_000);
    let mut announced = HashMap::new();
    let mut slow = b.add_watcher("slow".into());
    let mut fast = b.add_watcher("fast".into());
    let mut fast_view = HashMap::new();
    for i in 0..10 {
        w1.kv().lock().apply(&store(
            1 + 10 * i,
            if i == 0 { None } else { Some(10 * i) },
            10,
            16,
        ));
        b.tick(&mut announced);
        while let Some(k) = recv_now(&mut fast) {
            apply(&mut fast_view, &k);
        }
    }
    // The slow one read nothing: its queue (2) filled; ingestion was never blocked.
    let mut slow_view = HashMap::new();
    while let Some(k) = recv_now(&mut slow) {
        apply(&mut slow_view, &k);
    }
    b.tick(&mut announced);
    let k = recv_now(&mut slow).expect("resync");
    assert!(
        matches!(k, Kind::Snapshot(_)),
        "a lagging gateway is resent a snapshot"
    );
    apply(&mut slow_view, &k);
    let truth: HashSet<u64> = w1.kv().lock().keys().into_iter().collect();
    assert_eq!(truth.len(), 100);
    assert_eq!(slow_view["http://w1"], truth);
    assert_eq!(fast_view["http://w1"], truth);
}

#[test]
fn summary_bandwidth_per_block_event_is_under_ten_bytes() {
    // A busy worker: 4-block prompts stored, older blocks evicted, 5 ms of events per message.
    let (registry, b) = setup(1024);
    let url = "http://10.0.0.7:8000";
    let w = registry.upsert(spec(url), 1 << 20);
    let mut announced = HashMap::new();
    let mut rx = b.add_watcher("g".into());
    b.tick(&mut announced);
    let _snapshot = recv_now(&mut rx);
    let (mut block_events, mut bytes, mut messages) = (0u64, 0usize, 0usize);
    let mut next_hash = 1u64;
    for window in 0..200u64 {
        // ~40 block events per window (e.g. 8 prompts x 4 blocks stored + 8 evictions).
        for _ in 0..8 {
            let e = store(next_hash, None, 4, 16);
            block_events += e.block_events() as u64;
            w.kv().lock().apply(&e);
            next_hash += 4;
        }
        if window > 2 {
            let old: Vec<u64> = (next_hash - 96..next_hash - 88).collect();
            let e = KvEvent::BlockRemoved {
                block_hashes: old,
                medium: Medium::Gpu,
            };
            block_events += e.block_events() as u64;
            w.kv().lock().apply(&e);
        }
        b.tick(&mut announced);
        while let Ok(Ok(m)) = rx.try_recv() {
            bytes += m.encoded_len() + 5; // + gRPC message framing
            messages += 1;
        }
    }
    let per_event = bytes as f64 / block_events as f64;
    println!(
        "summary bandwidth: {bytes} B in {messages} messages for {block_events} block events = {per_event:.2} B/event"
    );
    assert!(per_event <= 10.0, "{per_event:.2} bytes per block event");
}

#[test]
fn kernel_figures_travel_in_the_load_and_a_change_is_sent_at_once() {
    let (registry, b) = setup(16);
    let w1 = registry.upsert(spec("http://w1"), 1000);
    let mut announced = HashMap::new();
    let mut rx = b.add_watcher("g1".into());
    b.tick(&mut announced);
    let Some(Kind::Snapshot(s)) = recv_now(&mut rx) else {
        panic!("a snapshot first")
    };
    let load = s.workers[0].load.expect("load");
    assert!(!load.kernel_ok, "no kernel view yet: kernel_ok is false");

    let figures = KernelFigures {
        in_flight: 3,
        idle_gap_ms: 500,
        waiting: 2,
        waits_for_body: true,
        accept_backlog: 1,
        accept_backlog_max: 4096,
        ttfb_p50_us: 2500,
    };
    w1.load.lock().kernel = Some(figures);
    b.tick(&mut announced);
    let Some(Kind::Delta(d)) = recv_now(&mut rx) else {
        panic!("a delta for the new kernel figures")
    };
    let load = d.workers[0].load.expect("load in the delta");
    assert!(load.kernel_ok);
    assert_eq!(
        (
            load.kernel_in_flight,
            load.kernel_waiting,
            load.accept_backlog,
            load.accept_backlog_max,
            load.kernel_ttfb_p50_us,
            load.kernel_idle_gap_ms,
            load.kernel_waits_for_body
        ),
        (3, 2, 1, 4096, 2500, 500, true)
    );

    // Unchanged figures are not resent before the refresh interval.
    b.tick(&mut announced);
    assert!(recv_now(&mut rx).is_none());
}

#[test]
fn node_state_is_in_snapshots_and_in_the_delta_after_a_change() {
    let (registry, b) = setup(16);
    registry.upsert(spec("http://w1"), 1000);
    let state = |util: u32| pb::NodeState {
        gpus: vec![pb::GpuState {
            index: 0,
            name: "H200".into(),
            utilization_pct: util,
            memory_used_bytes: 1 << 30,
            memory_total_bytes: 141 << 30,
            worker_ids: vec!["http://w1".into()],
        }],
        gpu_unavailable_reason: String::new(),
    };
    assert!(registry.set_node_state(state(10)));
    assert!(
        !registry.set_node_state(state(10)),
        "an equal state is no change"
    );
    let mut announced = HashMap::new();
    let mut rx = b.add_watcher("g1".into());
    b.tick(&mut announced);
    let Some(Kind::Snapshot(s)) = recv_now(&mut rx) else {
        panic!("a snapshot first")
    };
    assert_eq!(s.node_state, Some(state(10)));

    b.tick(&mut announced);
    assert!(recv_now(&mut rx).is_none(), "nothing changed");

    registry.set_node_state(state(55));
    b.tick(&mut announced);
    let Some(Kind::Delta(d)) = recv_now(&mut rx) else {
        panic!("a delta for the new GPU state")
    };
    assert!(d.workers.is_empty());
    assert_eq!(d.node_state, Some(state(55)));
}

#[test]
fn a_worker_role_travels_in_the_snapshot_and_in_its_first_delta() {
    let (registry, b) = setup(16);
    let mut prefill = spec("http://p1");
    prefill.role = Some(kinference_api::WorkerRole::Prefill);
    registry.upsert(prefill, 1000);
    let mut announced = HashMap::new();
    let mut rx = b.add_watcher("g1".into());
    b.tick(&mut announced);
    let Some(Kind::Snapshot(s)) = recv_now(&mut rx) else {
        panic!("a snapshot first");
    };
    assert_eq!(s.workers[0].role, "prefill");
    // A worker announced after the snapshot carries its role with its model; one without a role
    // sends "" (the gateways keep the role they were given).
    let mut decode = spec("http://d1");
    decode.role = Some(kinference_api::WorkerRole::Decode);
    registry.upsert(decode, 1000);
    registry.upsert(spec("http://w1"), 1000);
    b.tick(&mut announced);
    let Some(Kind::Delta(d)) = recv_now(&mut rx) else {
        panic!("a delta");
    };
    let role = |url: &str| {
        d.workers
            .iter()
            .find(|w| w.worker_id == url)
            .map(|w| (w.model.clone(), w.role.clone()))
    };
    assert_eq!(role("http://d1"), Some(("m".into(), "decode".into())));
    assert_eq!(role("http://w1"), Some(("m".into(), String::new())));
}

#[test]
fn a_ranked_worker_is_summarised_rank_by_rank() {
    let (registry, b) = setup(16);
    let dp = registry.upsert(
        WorkerSpec {
            data_parallel_size: Some(2),
            ..spec("http://dp")
        },
        1000,
    );
    let plain = registry.upsert(spec("http://plain"), 1000);
    dp.ranks()[0].lock().apply(&store(1, None, 4, 16));
    dp.ranks()[1].lock().apply(&store(100, None, 2, 16));
    plain.kv().lock().apply(&store(200, None, 1, 16));
    let mut announced = HashMap::new();
    let mut rx = b.add_watcher("g1".into());
    b.tick(&mut announced);
    let Some(Kind::Snapshot(snap)) = recv_now(&mut rx) else {
        panic!("a snapshot first")
    };
    let entry = |url: &str, rank: Option<u32>| {
        snap.workers
            .iter()
            .find(|w| w.worker_id == url && w.data_parallel_rank == rank)
            .unwrap_or_else(|| panic!("{url} rank {rank:?} in {snap:?}"))
    };
    // Each rank is its own cache: its own keys only, none of the other rank's.
    let rank0: HashSet<u64> = entry("http://dp", Some(0)).keys.iter().copied().collect();
    let rank1: HashSet<u64> = entry("http://dp", Some(1)).keys.iter().copied().collect();
    assert_eq!((rank0.len(), rank1.len()), (4, 2));
    assert!(rank0.is_disjoint(&rank1));
    // A rank-less worker stays rank-less: one entry, no rank.
    assert_eq!(entry("http://plain", None).keys.len(), 1);
    assert_eq!(snap.workers.len(), 3);

    // A change on rank 1 is a delta for rank 1 alone.
    dp.ranks()[1].lock().apply(&store(102, Some(101), 1, 16));
    b.tick(&mut announced);
    let Some(Kind::Delta(delta)) = recv_now(&mut rx) else {
        panic!("a delta")
    };
    let keyed: Vec<_> = delta
        .workers
        .iter()
        .filter(|w| !w.added.is_empty())
        .map(|w| (w.worker_id.as_str(), w.data_parallel_rank, w.added.len()))
        .collect();
    assert_eq!(keyed, vec![("http://dp", Some(1), 1)]);
}

#[test]
fn a_ranked_workers_load_is_split_over_its_ranks() {
    let load = pb::WorkerLoad {
        running: 5,
        waiting: 2,
        kv_usage: 0.5,
        ..Default::default()
    };
    let share = share_of_load(load, 2);
    assert_eq!((share.running, share.waiting, share.kv_usage), (3, 1, 0.5));
    assert_eq!(share_of_load(load, 1), load);
}

#[test]
fn a_rank_whose_engine_reports_gets_its_own_load() {
    use kinference_api::vllm::metrics::EngineLoad;
    let whole = pb::WorkerLoad {
        running: 5,
        waiting: 4,
        kv_usage: 0.9,
        kernel_in_flight: 10,
        ..Default::default()
    };
    let engines = [
        EngineLoad {
            engine: 0,
            running: 5.0,
            waiting: 4.0,
            kv_usage: 0.9,
        },
        EngineLoad {
            engine: 1,
            running: 0.0,
            waiting: 0.0,
            kv_usage: 0.1,
        },
    ];
    let busy = rank_load(whole, &engines, Some(0), 3);
    let idle = rank_load(whole, &engines, Some(1), 3);
    assert_eq!((busy.running, busy.waiting, busy.kv_usage), (5, 4, 0.9));
    assert_eq!((idle.running, idle.waiting, idle.kv_usage), (0, 0, 0.1));
    // The kernel's view is the endpoint's: shared evenly either way.
    assert_eq!((busy.kernel_in_flight, idle.kernel_in_flight), (4, 4));
    // A rank the metrics do not name, and a rank-less worker, fall back to the even share.
    assert_eq!(
        rank_load(whole, &engines, Some(2), 3),
        share_of_load(whole, 3)
    );
    assert_eq!(rank_load(whole, &engines, None, 1), whole);
}
