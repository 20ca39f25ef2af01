use super::*;

#[tokio::test]
async fn unreachable_worker_is_an_error_within_the_timeout() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    let client = client();
    let r = scrape_once(
        &client,
        &format!("http://127.0.0.1:{port}"),
        Duration::from_secs(2),
    )
    .await;
    assert!(r.is_err());
}

#[test]
fn a_failing_worker_is_scraped_less_often_until_it_answers() {
    let interval = Duration::from_millis(250);
    let gaps: Vec<u64> = (0..6)
        .map(|f| failing_gap(interval, f).as_millis() as u64)
        .collect();
    assert_eq!(gaps, [250, 500, 1000, 2000, 2000, 2000]);
    // An interval longer than the cap is kept as it is.
    assert_eq!(
        failing_gap(Duration::from_secs(5), 3),
        Duration::from_secs(5)
    );
    assert_eq!(failing_gap(interval, u32::MAX), FAILING_MAX_GAP);
}
