use super::*;

fn request(metrics: &Metrics, model: &str, worker: &str) {
    metrics.request(RequestLabels {
        model: model.to_string(),
        worker: worker.to_string(),
        status: 404,
        protocol: "openai",
    });
}

#[test]
fn unknown_models_fold_into_other_and_the_exposition_stays_flat() {
    let metrics = Metrics::new();
    metrics.serve_models(["served".to_string()]);
    request(&metrics, "served", "");
    request(&metrics, "warm-up", "");
    let before = metrics.encode();
    for i in 0..5_000 {
        request(&metrics, &format!("random-{i}-{}", "x".repeat(200)), "");
    }
    let text = metrics.encode();
    assert!(text.contains("model=\"served\""), "{text}");
    assert!(
        !text.contains("random-"),
        "a client-chosen name became a label"
    );
    // Only the `other` counter's value grew (1 -> 5001): no new series, a few more digits.
    assert_eq!(text.lines().count(), before.lines().count(), "new series");
    assert!(
        text.len() <= before.len() + 8,
        "{} -> {} bytes",
        before.len(),
        text.len()
    );
}

#[test]
fn a_name_a_backend_took_is_kept_up_to_the_cap() {
    let metrics = Metrics::new();
    for i in 0..MAX_MODEL_LABELS + 50 {
        let labels = ModelWorkerLabels {
            model: format!("alias-{i}"),
            worker: "http://w:8000".into(),
        };
        metrics.e2e(&labels, 0.1);
        request(&metrics, &labels.model, &labels.worker);
    }
    let text = metrics.encode();
    assert!(text.contains("model=\"alias-0\""));
    assert!(!text.contains(&format!("model=\"alias-{}\"", MAX_MODEL_LABELS + 10)));
    assert!(text.contains("model=\"other\""));
    let distinct: HashSet<&str> = text
        .lines()
        .filter_map(|l| l.split("model=\"").nth(1))
        .filter_map(|rest| rest.split('"').next())
        .collect();
    assert!(distinct.len() <= MAX_MODEL_LABELS + 1, "{}", distinct.len());
}

#[test]
fn a_known_name_is_kept_for_requests_that_never_reached_a_backend() {
    let metrics = Metrics::new();
    request(&metrics, "late", "");
    assert!(metrics.encode().contains("model=\"other\""));
    metrics.serve_models(["late".to_string()]);
    request(&metrics, "late", "");
    assert!(metrics.encode().contains("model=\"late\""));
}
