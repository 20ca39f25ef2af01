use super::*;

const FIXTURE: &str = include_str!("../../../fixtures/vllm-0.32/metrics-run1.txt");

fn series_names(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn floats_print_like_prometheus_client() {
    assert_eq!(go_float(398.0), "398.0");
    assert_eq!(go_float(0.0), "0.0");
    assert_eq!(go_float(0.0826563835144043), "0.0826563835144043");
    assert_eq!(go_float(1796231660.8366878), "1.7962316608366878e+09");
    assert_eq!(go_float(2560.0), "2560.0");
}

#[test]
fn every_series_exists_in_the_live_vllm_scrape() {
    let m = Metrics::new("tiny");
    m.on_scheduled(100, 96, Duration::from_millis(3));
    m.on_first_token(100, 96, Duration::from_millis(30));
    m.on_token(Duration::from_millis(20));
    m.on_finished(FinishReason::Length, Duration::from_millis(60));
    let text = m.render(
        &[Gauges {
            running: 1,
            waiting: 2,
            kv_cache_usage: 0.5,
        }],
        &CacheInfo {
            block_size: 32,
            num_gpu_blocks: 32768,
        },
    );
    let live = series_names(FIXTURE);
    for name in series_names(&text) {
        assert!(live.contains(&name), "{name} is not a vLLM 0.32 series");
    }
    // The bucket lines are identical to vLLM's apart from the counts.
    let buckets = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| l.starts_with("vllm:time_to_first_token_seconds_bucket"))
            .map(|l| {
                l.rsplit_once(' ')
                    .map(|(k, _)| k.to_owned())
                    .unwrap_or_default()
            })
            .collect()
    };
    assert_eq!(buckets(&text), buckets(FIXTURE));
    assert!(text.contains("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"tiny\"} 96.0"));
    assert!(text.contains("vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"tiny\"} 1.0"));
    assert!(text.contains("block_size=\"32\""));
    assert!(text.contains("prefix_caching_hash_algo=\"sha256\""));
}
