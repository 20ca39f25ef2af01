use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::{ExternalClassifier, ExternalError, OnError};

/// A real HTTP server on loopback answering every request with `body` after `delay`.
async fn serve(status: u16, body: &'static str, delay: Duration) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut seen = Vec::new();
                // Read until the end of the request body (content-length given by hyper).
                loop {
                    let Ok(n) = sock.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&seen);
                    if let Some(head_end) = text.find("\r\n\r\n") {
                        let len = text[..head_end]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                            })
                            .unwrap_or(0);
                        if seen.len() >= head_end + 4 + len {
                            break;
                        }
                    }
                }
                tokio::time::sleep(delay).await;
                let response = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(response.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}/classify")
}

#[tokio::test]
async fn tags_from_the_classifier_are_sanitised() {
    let url = serve(
        200,
        r#"{"tags": ["PII", "medical", "bad tag!"]}"#,
        Duration::ZERO,
    )
    .await;
    let c = ExternalClassifier::new(&url, Duration::from_secs(2), OnError::Ignore).expect("client");
    let tags = c.classify("my record", "m").await.expect("tags");
    assert_eq!(
        tags.into_iter().collect::<Vec<_>>(),
        ["bad", "medical", "pii"]
    );
}

#[tokio::test]
async fn a_slow_classifier_times_out_and_fails_closed() {
    let url = serve(200, r#"{"tags": []}"#, Duration::from_secs(5)).await;
    let c =
        ExternalClassifier::new(&url, Duration::from_millis(100), OnError::TagPii).expect("client");
    let started = std::time::Instant::now();
    assert!(matches!(
        c.classify("x", "m").await,
        Err(ExternalError::Timeout(_))
    ));
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(c.classify_or_fallback("x", "m").await.contains("pii"));
}

#[tokio::test]
async fn errors_follow_on_error() {
    let url = serve(500, "{}", Duration::ZERO).await;
    let closed =
        ExternalClassifier::new(&url, Duration::from_secs(2), OnError::TagPii).expect("client");
    assert!(matches!(
        closed.classify("x", "m").await,
        Err(ExternalError::Status(500))
    ));
    let open =
        ExternalClassifier::new(&url, Duration::from_secs(2), OnError::Ignore).expect("client");
    let tags = open.classify_or_fallback("x", "m").await;
    assert!(!tags.contains("pii") && tags.contains("classifier-unavailable"));
    assert!(ExternalClassifier::new("ftp://x", Duration::from_secs(1), OnError::Ignore).is_err());
    assert!(ExternalClassifier::new("https://x", Duration::from_secs(1), OnError::Ignore).is_ok());
}

/// The metrics text of `classifier`.
fn metrics_text(classifier: &crate::policy::classify::Classifier) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    classifier.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    text
}

fn config(
    url: &str,
    timeout_ms: u64,
    on_error: OnError,
) -> crate::policy::classify::ClassifierConfig {
    crate::policy::classify::ClassifierConfig {
        external: Some(super::ExternalConfig {
            url: url.to_string(),
            ca_file: None,
            timeout_ms,
            on_error,
        }),
    }
}

#[tokio::test]
async fn the_classifier_is_asked_before_the_plan_and_its_tags_join_the_facts() {
    let url = serve(200, r#"{"tags": ["medical"]}"#, Duration::ZERO).await;
    let classifier = crate::policy::classify::Classifier::default();
    assert!(classifier.configure(&config(&url, 2000, OnError::TagPii)));
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "my scan results"}]});
    let (facts, _) = classifier
        .facts(&body, None, None, &|_| None)
        .await
        .expect("facts");
    assert!(facts.tags.contains("medical"), "{:?}", facts.tags);
    assert!(!facts.tags.contains("pii"), "{:?}", facts.tags);
    assert!(
        metrics_text(&classifier).contains("classifier_external_requests_total{outcome=\"ok\"} 1")
    );
}

#[tokio::test]
async fn a_slow_or_failing_classifier_makes_the_request_local_only() {
    let body =
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hello"}]});
    let slow = serve(200, r#"{"tags": []}"#, Duration::from_secs(5)).await;
    let failing = serve(503, "{}", Duration::ZERO).await;
    for (url, outcome) in [(&slow, "timeout"), (&failing, "error")] {
        let classifier = crate::policy::classify::Classifier::default();
        classifier.configure(&config(url, 150, OnError::TagPii));
        let started = std::time::Instant::now();
        let (facts, _) = classifier
            .facts(&body, None, None, &|_| None)
            .await
            .expect("facts");
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(
            facts.tags.contains("pii") && facts.tags.contains("classifier-unavailable"),
            "{outcome}: {:?}",
            facts.tags
        );
        let metrics = metrics_text(&classifier);
        assert!(
            metrics.contains(&format!(
                "classifier_external_requests_total{{outcome=\"{outcome}\"}} 1"
            )),
            "{metrics}"
        );
    }
    // Only an explicit `on_error: ignore` lets the request go on without the answer.
    let open = crate::policy::classify::Classifier::default();
    open.configure(&config(&failing, 150, OnError::Ignore));
    let (facts, _) = open
        .facts(&body, None, None, &|_| None)
        .await
        .expect("facts");
    assert!(!facts.tags.contains("pii") && facts.tags.contains("classifier-unavailable"));
}

#[tokio::test]
async fn an_unusable_classifier_url_fails_closed() {
    let bad = config("ftp://classifier.example/v1", 100, OnError::Ignore);
    assert!(bad.validate().is_err());
    let classifier = crate::policy::classify::Classifier::default();
    classifier.configure(&bad);
    let body =
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hello"}]});
    let (facts, _) = classifier
        .facts(&body, None, None, &|_| None)
        .await
        .expect("facts");
    assert!(facts.tags.contains("pii"), "{:?}", facts.tags);
}
