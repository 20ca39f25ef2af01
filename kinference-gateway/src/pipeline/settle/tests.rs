use super::*;

fn count(metrics: &Metrics, status: u16) -> usize {
    metrics
        .encode()
        .lines()
        .filter(|l| {
            l.starts_with("kinference_gateway_requests")
                && l.contains(&format!("status=\"{status}\""))
        })
        .map(|l| {
            l.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0) as usize
        })
        .sum()
}

#[test]
fn finish_settles_once() {
    let metrics = Metrics::new();
    let mut s = Settlement::new(&metrics, Protocol::OpenAi);
    s.model("m");
    assert_eq!(metrics.in_flight_now(), 1);
    s.finish(200, None);
    s.finish(500, None);
    drop(s);
    assert_eq!(count(&metrics, 200), 1);
    assert_eq!(count(&metrics, 500), 0, "a second finish is ignored");
    assert_eq!(
        count(&metrics, 499),
        0,
        "a finished settlement is not abandoned"
    );
    assert_eq!(metrics.in_flight_now(), 0);
}

#[test]
fn a_dropped_settlement_is_an_abandoned_request_once() {
    let metrics = Metrics::new();
    let mut s = Settlement::new(&metrics, Protocol::Anthropic);
    s.model("m");
    s.chunk();
    s.chunk();
    drop(s);
    assert_eq!(count(&metrics, 499), 1);
    assert_eq!(metrics.in_flight_now(), 0);
}
