use std::time::{Duration, Instant};

use super::*;

fn key(name: &str) -> SessionKey {
    SessionKey::new("tenant-a", name).unwrap()
}

fn table(max_entries: usize, ttl_s: u64) -> Sessions {
    Sessions::new(&SessionsConfig {
        max_entries,
        ttl_s,
        ..SessionsConfig::default()
    })
}

#[test]
fn a_session_remembers_the_worker_of_its_last_turn() {
    let mut s = table(10, 60);
    let now = Instant::now();
    assert_eq!(s.worker(key("c1"), now), None);
    s.record(key("c1"), 2, now);
    s.record(key("c2"), 0, now);
    assert_eq!(s.worker(key("c1"), now), Some(2));
    s.record(key("c1"), 1, now);
    assert_eq!(s.worker(key("c1"), now), Some(1));
    assert_eq!(s.len(), 2);
}

#[test]
fn one_tenants_name_is_another_key_for_another_tenant() {
    let a = SessionKey::new("tenant-a", "conversation-7");
    assert_eq!(a, SessionKey::new("tenant-a", "conversation-7"));
    assert_ne!(a, SessionKey::new("tenant-b", "conversation-7"));
    // The tenant and the name do not run into each other.
    assert_ne!(SessionKey::new("ab", "c"), SessionKey::new("a", "bc"));
    assert_eq!(SessionKey::new("tenant-a", ""), None);

    let mut s = table(10, 60);
    let now = Instant::now();
    s.record(a.unwrap(), 3, now);
    let other = SessionKey::new("tenant-b", "conversation-7").unwrap();
    assert_eq!(s.worker(other, now), None);
}

#[test]
fn the_least_recently_used_session_goes_first_when_full() {
    let mut s = table(3, 600);
    let now = Instant::now();
    for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
        s.record(key(name), i as WorkerId, now);
    }
    // "a" used again: "b" is now the least recently used.
    s.record(key("a"), 0, now);
    s.record(key("d"), 3, now);
    assert_eq!(s.len(), 3);
    assert_eq!(s.worker(key("b"), now), None);
    assert_eq!(s.worker(key("a"), now), Some(0));
    assert_eq!(s.worker(key("d"), now), Some(3));
    assert_eq!(s.forgotten(), 1);
}

#[test]
fn a_session_unused_past_its_ttl_is_forgotten() {
    let mut s = table(100, 10);
    let t0 = Instant::now();
    s.record(key("old"), 1, t0);
    assert_eq!(s.worker(key("old"), t0 + Duration::from_secs(10)), Some(1));
    assert_eq!(s.worker(key("old"), t0 + Duration::from_secs(11)), None);
    // Expired entries leave the table on the next record.
    s.record(key("new"), 2, t0 + Duration::from_secs(11));
    assert_eq!(s.len(), 1);
    assert_eq!(s.forgotten(), 1);
}

#[test]
fn a_zero_bound_remembers_nothing() {
    let mut s = table(0, 60);
    s.record(key("a"), 1, Instant::now());
    assert!(s.is_empty());
}

#[test]
fn an_answer_is_held_for_its_owner_only() {
    let mut s = table(10, 60);
    let now = Instant::now();
    let (acme, other) = (Owner::of("acme"), Owner::of("other"));
    let id = SessionKey::answer("resp_1").unwrap();
    let asks = |owner| Answers {
        owner: Some(owner),
        continues: Some(id),
    };
    assert_eq!(s.answer(&asks(acme), now), Held::Unknown);
    s.record_answer(id, acme, 4, now);
    assert_eq!(s.answer(&asks(acme), now), Held::By(4));
    assert_eq!(s.answer(&asks(other), now), Held::Foreign);
    // A request on an endpoint that stores nothing has no owner: never another's answer.
    let ownerless = Answers {
        owner: None,
        continues: Some(id),
    };
    assert_eq!(s.answer(&ownerless, now), Held::Foreign);
    assert_eq!(s.answer(&Answers::default(), now), Held::Unknown);
    // An answer is no conversation: the same name finds nothing as one.
    assert_eq!(s.worker(id, now), None);
    assert_ne!(Some(id), SessionKey::new("acme", "resp_1"));
    assert_eq!(SessionKey::answer(""), None);
}

#[test]
fn a_forgotten_answer_is_unknown_again() {
    let mut s = table(10, 1);
    let now = Instant::now();
    let id = SessionKey::answer("resp_1").unwrap();
    s.record_answer(id, Owner::of("acme"), 2, now);
    let asks = Answers {
        owner: Some(Owner::of("acme")),
        continues: Some(id),
    };
    assert_eq!(s.answer(&asks, now + Duration::from_secs(2)), Held::Unknown);
}
