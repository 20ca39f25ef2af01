use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::io::StallGuard;
use super::{Overload, OverloadSettings};

#[tokio::test]
async fn a_write_blocked_past_the_deadline_fails() {
    let (ours, _theirs) = tokio::io::duplex(1024);
    let mut guarded = StallGuard::new(ours, Duration::from_millis(100));
    let started = std::time::Instant::now();
    let chunk = [0u8; 512];
    let error = loop {
        match tokio::time::timeout(Duration::from_secs(5), guarded.write_all(&chunk)).await {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => break e,
            Err(_) => panic!("the blocked write never failed"),
        }
    };
    assert_eq!(error.kind(), std::io::ErrorKind::TimedOut);
    assert!(started.elapsed() >= Duration::from_millis(100));
}

#[tokio::test]
async fn a_reader_that_keeps_up_is_never_cut() {
    let (ours, mut theirs) = tokio::io::duplex(1024);
    let mut guarded = StallGuard::new(ours, Duration::from_millis(100));
    let reader = tokio::spawn(async move {
        let mut total = 0;
        let mut buf = [0u8; 256];
        loop {
            tokio::time::sleep(Duration::from_millis(5)).await;
            match theirs.read(&mut buf).await {
                Ok(0) | Err(_) => return total,
                Ok(n) => total += n,
            }
        }
    });
    // Slower than the reader's pace overall, but never blocked for 100 ms at a time.
    for _ in 0..40 {
        guarded.write_all(&[1u8; 256]).await.expect("write");
    }
    guarded.shutdown().await.expect("shutdown");
    drop(guarded);
    assert_eq!(reader.await.expect("reader"), 40 * 256);
}

#[test]
fn connection_limits_hold_and_free() {
    let settings = OverloadSettings {
        max_connections: 2,
        ..OverloadSettings::default()
    };
    let overload = Overload::new(settings, &mut Registry::default());
    let a = overload.api.try_open().expect("first");
    let _b = overload.api.try_open().expect("second");
    assert!(overload.api.try_open().is_none(), "third past the limit");
    // The admin port's limit is its own.
    assert!(overload.admin.try_open().is_some());
    drop(a);
    assert!(
        overload.api.try_open().is_some(),
        "a closed connection frees its place"
    );
    // Over-limit connections get a bounded number of quick answers.
    let refusals: Vec<_> = std::iter::from_fn(|| overload.api.try_refuse())
        .take(100)
        .collect();
    assert_eq!(refusals.len(), 16);
}

#[test]
fn the_reserve_leaves_every_priority_some_room_and_zero_disables_the_gate() {
    let settings = OverloadSettings::default();
    let gate = settings.gate().expect("a limit by default");
    assert_eq!(gate.limit, 4_096);
    assert_eq!(gate.reserve, 409);
    let off = OverloadSettings {
        max_in_flight: 0,
        ..OverloadSettings::default()
    };
    assert!(off.gate().is_none());
}
