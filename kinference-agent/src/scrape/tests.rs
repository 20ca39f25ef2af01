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
