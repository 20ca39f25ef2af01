use std::path::PathBuf;

use super::*;

fn ctx() -> PeerContext {
    PeerContext {
        workers: (1..=3)
            .map(|i| WorkerEndpoints {
                url: format!("http://127.0.0.1:800{i}"),
                kv_events: format!("tcp://127.0.0.1:2555{i}"),
                kv_replay: format!("tcp://127.0.0.1:2556{i}"),
            })
            .collect(),
        model: "qwen2-sim".into(),
        block_size: 16,
        port: 30000,
        metrics_port: 29101,
        work_dir: PathBuf::from("/tmp/w"),
    }
}

fn after<'a>(args: &'a [String], flag: &str) -> Vec<&'a str> {
    args.iter()
        .enumerate()
        .filter(|(_, a)| *a == flag)
        .filter_map(|(i, _)| args.get(i + 1).map(String::as_str))
        .collect()
}

#[test]
fn every_peer_policy_has_a_package_and_a_plan() {
    for p in Policy::PEERS {
        let (router, _) = PeerRouter::of(p).expect("peer");
        assert!(router.requirement().contains(router.version()));
        let plan = plan(p, &ctx()).expect("plan");
        assert!(plan.args.iter().any(|a| a == "30000"), "{p}: port");
    }
    assert!(PeerRouter::of(Policy::Kinference).is_none());
    assert!(plan(Policy::Random, &ctx()).is_none());
    assert_eq!(PeerRouter::Litellm.requirement(), "litellm[proxy]==1.108.7");
    assert_eq!(PeerRouter::VllmRouter.venv_name(), "vllm-router-0.1.17");
}

#[test]
fn vllm_router_kv_aware_gets_each_workers_events_replay_and_block_size() {
    let plan = plan(Policy::VllmRouterKvAware, &ctx()).expect("plan");
    assert_eq!(plan.program, "vllm-router");
    assert_eq!(after(&plan.args, "--policy"), ["kv_aware"]);
    assert_eq!(
        after(&plan.args, "--kv-event-source"),
        [
            "http://127.0.0.1:8001=tcp://127.0.0.1:25551",
            "http://127.0.0.1:8002=tcp://127.0.0.1:25552",
            "http://127.0.0.1:8003=tcp://127.0.0.1:25553",
        ]
    );
    assert_eq!(
        after(&plan.args, "--kv-event-replay-source")[2],
        "http://127.0.0.1:8003=tcp://127.0.0.1:25563"
    );
    assert_eq!(after(&plan.args, "--kv-event-block-size"), ["16"]);
    assert_eq!(after(&plan.args, "--kv-event-model"), ["qwen2-sim"]);
    assert_eq!(after(&plan.args, "--prometheus-port"), ["29101"]);
    // The three worker URLs follow --worker-urls.
    let i = plan
        .args
        .iter()
        .position(|a| a == "--worker-urls")
        .expect("flag");
    assert_eq!(plan.args[i + 3], "http://127.0.0.1:8003");
    assert!(plan.api_key.is_none());

    // cache_aware: no event sources.
    let plan = super::plan(Policy::VllmRouterCacheAware, &ctx()).expect("plan");
    assert_eq!(after(&plan.args, "--policy"), ["cache_aware"]);
    assert!(after(&plan.args, "--kv-event-source").is_empty());
}

#[test]
fn smg_and_sglang_router_are_launched_with_their_policy() {
    let smg = plan(Policy::SmgPrefixHash, &ctx()).expect("plan");
    assert_eq!(smg.program, "smg");
    assert_eq!(smg.args[0], "launch");
    assert_eq!(after(&smg.args, "--policy"), ["prefix_hash"]);
    let old = plan(Policy::SglangRouterCacheAware, &ctx()).expect("plan");
    assert_eq!(old.program, "sglang-router");
    assert_eq!(old.args[0], "launch");
    assert_eq!(after(&old.args, "--policy"), ["cache_aware"]);
    assert_eq!(after(&old.args, "--log-level"), ["warn"]);
}

#[test]
fn litellm_config_lists_every_worker_with_the_strategy_and_key() {
    let plan = plan(Policy::LitellmLeastBusy, &ctx()).expect("plan");
    assert_eq!(plan.program, "litellm");
    assert_eq!(plan.api_key.as_deref(), Some(LITELLM_MASTER_KEY));
    assert!(
        plan.env
            .iter()
            .any(|(k, v)| k == "LITELLM_LOCAL_MODEL_COST_MAP" && v == "True")
    );
    assert_eq!(after(&plan.args, "--num_workers"), ["1"]);
    let (path, text) = &plan.files[0];
    assert_eq!(after(&plan.args, "--config"), [path.display().to_string()]);
    let yaml: Value = serde_yaml::from_str(text).expect("yaml");
    let list = yaml["model_list"].as_array().expect("model_list");
    assert_eq!(list.len(), 3);
    assert_eq!(list[0]["model_name"], "qwen2-sim");
    assert_eq!(list[0]["litellm_params"]["model"], "hosted_vllm/qwen2-sim");
    assert_eq!(
        list[2]["litellm_params"]["api_base"],
        "http://127.0.0.1:8003/v1"
    );
    assert_eq!(yaml["router_settings"]["routing_strategy"], "least-busy");
    assert_eq!(yaml["general_settings"]["master_key"], LITELLM_MASTER_KEY);
    assert!(matches!(
        plan.route(30000),
        Route::Authorized { ref base, .. } if base == "http://127.0.0.1:30000"
    ));
}

#[test]
fn peers_parse_from_all_packages_and_policy_names() {
    assert_eq!(parse_peers("all").expect("all"), Policy::PEERS.to_vec());
    assert_eq!(
        parse_peers("smg,litellm-least-busy").expect("list"),
        vec![
            Policy::SmgCacheAware,
            Policy::SmgPrefixHash,
            Policy::LitellmLeastBusy
        ]
    );
    assert_eq!(
        parse_peers("smg-prefix-hash,smg").expect("dedup"),
        vec![Policy::SmgPrefixHash, Policy::SmgCacheAware]
    );
    assert!(parse_peers("kinference").is_err());
    assert!(parse_peers("nginx").is_err());
}

#[test]
fn block_size_and_cpu_come_from_metrics_and_proc() {
    let metrics = "# HELP x\nvllm:cache_config_info{block_size=\"32\",enable_prefix_caching=\"True\",model_name=\"m\"} 1.0\n";
    assert_eq!(block_size_from_metrics(metrics), Some(32));
    assert_eq!(block_size_from_metrics("vllm:other 1"), None);

    // A command name with spaces and parentheses.
    let stat =
        "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 500 0 0 0 150 25 0 0 20 0 4 0 100 0 0";
    assert_eq!(parse_stat(stat), Some((4242, 175)));
    // This test process has spent some CPU.
    let me = std::process::id();
    let own = std::fs::read_to_string(format!("/proc/{me}/stat")).expect("own stat");
    assert!(parse_stat(&own).is_some());
    assert!(process_cpu_seconds(me).is_some());
}
