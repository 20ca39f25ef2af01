use std::sync::Arc;
use std::time::Duration;

use kinference_crds::TenantPriority::{High, Low, Medium};
use prometheus_client::metrics::gauge::Gauge;

use super::{Gate, GateSettings, Shed};

/// Limit 10, reserve 2: high up to 10, medium up to 8, low up to 6.
fn gate(queue_capacity: usize, queue_timeout_ms: u64) -> (Arc<Gate>, Gauge, Gauge) {
    let (in_flight, queued) = (Gauge::default(), Gauge::default());
    let settings = GateSettings {
        limit: 10,
        reserve: 2,
        queue_capacity,
        queue_timeout: Duration::from_millis(queue_timeout_ms),
    };
    (
        Gate::new(settings, in_flight.clone(), queued.clone()),
        in_flight,
        queued,
    )
}

#[tokio::test]
async fn each_priority_is_admitted_up_to_its_ceiling_and_low_is_shed_first() {
    let (gate, in_flight, _) = gate(0, 0);
    let mut held = Vec::new();
    for _ in 0..6 {
        held.push(gate.admit(Low).await.expect("low under its ceiling"));
    }
    assert_eq!(gate.admit(Low).await.unwrap_err(), Shed::QueueFull);
    for _ in 0..2 {
        held.push(gate.admit(Medium).await.expect("medium under its ceiling"));
    }
    assert_eq!(gate.admit(Medium).await.unwrap_err(), Shed::QueueFull);
    assert_eq!(gate.admit(Low).await.unwrap_err(), Shed::QueueFull);
    for _ in 0..2 {
        held.push(gate.admit(High).await.expect("high up to the limit"));
    }
    assert_eq!(gate.admit(High).await.unwrap_err(), Shed::QueueFull);
    assert_eq!(in_flight.get(), 10);
    drop(held);
    assert_eq!(gate.in_flight(), 0);
    assert_eq!(in_flight.get(), 0);
}

#[tokio::test]
async fn a_waiter_is_shed_after_the_queue_timeout_and_leaves_the_queue() {
    let (gate, _, queued) = gate(4, 50);
    let _held: Vec<_> = futures::future::join_all((0..6).map(|_| gate.admit(Low)))
        .await
        .into_iter()
        .map(|s| s.expect("admitted"))
        .collect();
    let started = std::time::Instant::now();
    assert_eq!(gate.admit(Low).await.unwrap_err(), Shed::QueueTimeout);
    assert!(started.elapsed() >= Duration::from_millis(50));
    assert_eq!(queued.get(), 0);
}

#[tokio::test]
async fn the_queue_is_bounded() {
    let (gate, _, queued) = gate(2, 5_000);
    let _held: Vec<_> = futures::future::join_all((0..6).map(|_| gate.admit(Low)))
        .await
        .into_iter()
        .map(|s| s.expect("admitted"))
        .collect();
    let waiting: Vec<_> = (0..2)
        .map(|_| {
            let gate = Arc::clone(&gate);
            tokio::spawn(async move { gate.admit(Low).await.map(drop) })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(queued.get(), 2);
    assert_eq!(gate.admit(Low).await.unwrap_err(), Shed::QueueFull);
    // Waiters the client abandons leave the queue.
    for w in waiting {
        w.abort();
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(queued.get(), 0);
}

#[tokio::test]
async fn a_freed_slot_goes_to_the_higher_priority_waiter() {
    let (gate, _, _) = gate(8, 5_000);
    let mut held = Vec::new();
    for _ in 0..10 {
        held.push(gate.admit(High).await.expect("admitted"));
    }
    let low = {
        let gate = Arc::clone(&gate);
        tokio::spawn(async move { gate.admit(Low).await })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    let high = {
        let gate = Arc::clone(&gate);
        tokio::spawn(async move { gate.admit(High).await })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    // One slot frees: in flight 9, which only high may use.
    held.pop();
    let high = tokio::time::timeout(Duration::from_secs(1), high)
        .await
        .expect("the high waiter got the slot")
        .expect("task");
    assert!(high.is_ok());
    assert!(!low.is_finished(), "the low waiter jumped the queue");
    // The low waiter gets in once in flight is under its ceiling (6).
    held.truncate(4);
    let low = tokio::time::timeout(Duration::from_secs(1), low)
        .await
        .expect("the low waiter got a slot")
        .expect("task");
    assert!(low.is_ok());
    drop(low);
    drop(high);
    drop(held);
    assert_eq!(gate.in_flight(), 0);
}

#[tokio::test]
async fn a_slot_handed_to_an_abandoned_waiter_is_not_lost() {
    let (gate, _, _) = gate(8, 5_000);
    for round in 0..50 {
        let held: Vec<_> = futures::future::join_all((0..10).map(|_| gate.admit(High)))
            .await
            .into_iter()
            .map(|s| s.expect("admitted"))
            .collect();
        let waiter = {
            let gate = Arc::clone(&gate);
            tokio::spawn(async move { gate.admit(High).await.map(drop) })
        };
        tokio::task::yield_now().await;
        // Free a slot and abandon the waiter at about the same time.
        if round % 2 == 0 {
            waiter.abort();
            drop(held);
        } else {
            drop(held);
            waiter.abort();
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert_eq!(gate.in_flight(), 0, "round {round}");
    }
}
