use super::*;

fn est(ttft: f64, running: u64) -> Estimate {
    Estimate {
        cached_tokens: 0,
        prompt_tokens: 100,
        estimated_ttft_s: ttft,
        queue_prefill_tokens: 0,
        running,
        waiting: 0,
    }
}

fn named(list: &[(f64, u64)]) -> Vec<(String, Estimate)> {
    list.iter()
        .enumerate()
        .map(|(i, (t, r))| (format!("w{i}"), est(*t, *r)))
        .collect()
}

#[test]
fn the_lowest_estimate_wins_whatever_the_rotation() {
    let e = named(&[(2.0, 0), (0.3, 5), (1.0, 0)]);
    for start in 0..6 {
        assert_eq!(choose(&e, start), Some(1));
    }
}

#[test]
fn ties_go_to_the_less_busy_worker_then_rotate() {
    let e = named(&[(1.0, 2), (1.0, 1), (1.0, 1)]);
    assert_eq!(choose(&e, 0), Some(1));
    assert_eq!(choose(&e, 2), Some(2));
    let idle = named(&[(0.5, 0), (0.5, 0), (0.5, 0)]);
    let picks: Vec<_> = (0..3).filter_map(|s| choose(&idle, s)).collect();
    assert_eq!(picks, vec![0, 1, 2]);
}

#[test]
fn no_estimate_no_choice() {
    assert_eq!(choose(&[], 0), None);
}

#[test]
fn the_simulator_answer_parses() {
    let v = serde_json::json!({"cached_tokens": 96, "prompt_tokens": 100, "estimated_ttft_s": 0.12,
        "queue_prefill_tokens": 0, "running": 1, "waiting": 0});
    let e: Result<Estimate, _> = serde_json::from_value(v);
    assert_eq!(e.ok().map(|e| e.cached_tokens), Some(96));
}
