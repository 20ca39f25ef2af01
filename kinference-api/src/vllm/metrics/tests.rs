use super::*;

#[test]
fn parses_the_real_vllm_scrape() {
    let path = format!(
        "{}/../bench/fixtures/vllm-0.32/metrics-run1.txt",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).expect("fixture");
    let load = parse(&text);
    assert_eq!(
        load,
        VllmLoad {
            running: Some(0.0),
            waiting: Some(0.0),
            kv_usage: Some(0.0),
            block_size: Some(32),
            num_gpu_blocks: Some(32768),
            process_start_s: Some(1.79623158924e9),
            engines: vec![EngineLoad {
                engine: 0,
                running: 0.0,
                waiting: 0.0,
                kv_usage: 0.0,
            }],
        }
    );
}

#[test]
fn sums_engines_takes_max_usage_and_skips_garbage() {
    let text = r#"
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0 1712345678000
vllm:num_requests_waiting{engine="0",model_name="m \"quoted\", {x}"} 7
this line is garbage
vllm:num_requests_waiting{engine="1" 4
vllm:kv_cache_usage_perc{engine="0"} 0.25
vllm:kv_cache_usage_perc{engine="1"} 0.75
vllm:cache_config_info{block_size="16",engine="0",x="a\\b"} 1.0
"#;
    let load = parse(text);
    assert_eq!(load.running, Some(5.0));
    assert_eq!(load.waiting, Some(7.0), "the malformed sample is skipped");
    assert_eq!(load.kv_usage, Some(0.75));
    assert_eq!(load.block_size, Some(16));
    assert_eq!(
        load.num_gpu_blocks, None,
        "no num_gpu_blocks label: capacity unknown"
    );
    // Each engine (data-parallel rank) on its own; the malformed sample is in neither.
    let engine = |engine, running, waiting, kv_usage| EngineLoad {
        engine,
        running,
        waiting,
        kv_usage,
    };
    assert_eq!(
        load.engines,
        vec![engine(0, 3.0, 7.0, 0.25), engine(1, 2.0, 0.0, 0.75)]
    );
}

#[test]
fn engines_past_the_bound_or_unlabelled_count_in_the_totals_only() {
    let text = "vllm:num_requests_running{engine=\"999999\"} 4\n\
                vllm:num_requests_running{engine=\"x\"} 1\n\
                vllm:num_requests_running 2\n\
                vllm:num_requests_running{engine=\"3\"} 5\n";
    let load = parse(text);
    assert_eq!(load.running, Some(12.0));
    assert_eq!(load.engines.len(), 1);
    assert_eq!((load.engines[0].engine, load.engines[0].running), (3, 5.0));
}

#[test]
fn capacity_is_the_smallest_engines_and_none_until_profiled() {
    let text =
        "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"None\"} 1.0\n";
    assert_eq!(
        parse(text).num_gpu_blocks,
        None,
        "vLLM writes None before profiling"
    );
    assert_eq!(parse(text).block_size, Some(16));
    let text = "vllm:cache_config_info{engine=\"0\",num_gpu_blocks=\"4096\"} 1.0\n\
                vllm:cache_config_info{engine=\"1\",num_gpu_blocks=\"2048\"} 1.0\n\
                vllm:cache_config_info{engine=\"2\",num_gpu_blocks=\"0\"} 1.0\n";
    assert_eq!(parse(text).num_gpu_blocks, Some(2048));
}

#[test]
fn old_gpu_cache_usage_name_is_understood() {
    assert_eq!(
        parse("vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\n").kv_usage,
        Some(0.5)
    );
    assert_eq!(parse("").running, None);
}

#[test]
fn non_finite_values_and_a_zero_block_size_are_no_information() {
    let text = "vllm:num_requests_running{engine=\"0\"} NaN\n\
                vllm:num_requests_waiting 1e308\nvllm:num_requests_waiting 1e308\n\
                vllm:kv_cache_usage_perc +Inf\n\
                vllm:cache_config_info{block_size=\"0\"} 1\n";
    assert_eq!(parse(text), VllmLoad::default());
}
