use std::collections::BTreeMap;

use serde_json::json;

use super::*;

fn pool(spec: serde_json::Value) -> InferencePoolSpec {
    let mut base = json!({
        "models": ["qwen"], "gpuClass": "l40s",
        "prices": {"cachedInputPerMillion": 0.0, "uncachedInputPerMillion": 0.0, "outputPerMillion": 0.0}
    });
    if let (Some(b), Some(s)) = (base.as_object_mut(), spec.as_object()) {
        b.extend(s.clone());
    }
    serde_json::from_value(base).expect("pool spec")
}

fn worker(url: &str, labels: &[(&str, &str)]) -> (String, PodWorker) {
    (
        url.to_string(),
        PodWorker {
            url: url.to_string(),
            model: "qwen".into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        },
    )
}

fn discovered() -> WorkerSet {
    BTreeMap::from([
        worker("http://10.0.0.1:8000", &[("pool", "a")]),
        worker(
            "http://10.0.0.2:8000",
            &[("pool", "a"), (GPU_CLASS_LABEL, "h100")],
        ),
        worker(
            "http://10.0.0.3:8000",
            &[("pool", "a"), (GPU_CLASS_LABEL, "L40S")],
        ),
        worker("http://10.0.0.4:8000", &[("pool", "b")]),
    ])
}

#[test]
fn a_selector_picks_the_workers_whose_labels_and_gpu_class_match() {
    let a = pool(json!({"selector": {"matchLabels": {"pool": "a"}, "targetPort": 8000}}));
    assert_eq!(
        members(&a, Some(&discovered())),
        Some(vec![
            "http://10.0.0.1:8000".to_string(),
            // 10.0.0.2 runs on h100, not the pool's l40s.
            "http://10.0.0.3:8000".to_string(),
        ])
    );
    let b = pool(json!({"selector": {"matchLabels": {"pool": "b"}, "targetPort": 8000}}));
    assert_eq!(
        members(&b, Some(&discovered())),
        Some(vec!["http://10.0.0.4:8000".to_string()])
    );
    let none = pool(json!({"selector": {"matchLabels": {"pool": "c"}, "targetPort": 8000}}));
    assert_eq!(
        members(&none, Some(&discovered())),
        Some(vec![]),
        "a selector that matches nothing is an empty pool, not every worker"
    );
}

#[test]
fn endpoints_are_members_with_or_without_discovery() {
    let both = pool(json!({
        "selector": {"matchLabels": {"pool": "b"}, "targetPort": 8000},
        "endpoints": [{"url": "http://127.0.0.1:9000/"}]
    }));
    assert_eq!(
        members(&both, Some(&discovered())),
        Some(vec![
            "http://10.0.0.4:8000".to_string(),
            "http://127.0.0.1:9000".to_string()
        ])
    );
    assert_eq!(
        members(&both, None),
        Some(vec!["http://127.0.0.1:9000".to_string()])
    );
    let fixed = pool(json!({"endpoints": [{"url": "http://127.0.0.1:9000"}]}));
    assert_eq!(
        members(&fixed, Some(&discovered())),
        Some(vec!["http://127.0.0.1:9000".to_string()]),
        "a pool without selector takes no discovered worker"
    );
}

#[test]
fn without_discovery_a_selector_pool_stands_for_every_worker_of_its_model() {
    let a = pool(json!({"selector": {"matchLabels": {"pool": "a"}, "targetPort": 8000}}));
    assert_eq!(members(&a, None), None);
}
