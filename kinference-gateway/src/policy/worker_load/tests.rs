use super::*;

#[test]
fn vllm_metrics_text_gives_queue_running_and_kv_usage() {
    let text = "# HELP vllm:num_requests_waiting Number of requests waiting.\n\
# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 5.0\n\
vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"m\",reason=\"capacity\"} 5.0\n\
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2.0\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n";
    assert_eq!(parse_metrics(text), Some((5, 2, Some(0.25))));
}

#[test]
fn engines_add_up_and_older_names_are_read() {
    let text = "vllm:num_requests_waiting{engine=\"0\"} 1\n\
vllm:num_requests_waiting{engine=\"1\"} 2\n\
vllm:gpu_cache_usage_perc{engine=\"0\"} 0.4\n";
    assert_eq!(parse_metrics(text), Some((3, 0, Some(0.4))));
    assert_eq!(parse_metrics("something_else 1\n"), None);
}
