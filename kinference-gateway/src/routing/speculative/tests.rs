use std::time::Duration;

use kinference_api::KeyHasher;

use super::*;

fn chain(tokens: &[u32]) -> Vec<BlockKey> {
    KeyHasher::for_model("m").keys(None, tokens, 4)
}

#[test]
fn lcp_of_chained_keys() {
    let a = chain(&(0..40).collect::<Vec<_>>());
    let mut t: Vec<u32> = (0..40).collect();
    t[21] = 999;
    let b = chain(&t);
    assert_eq!(lcp(&a, &b), 5);
    assert_eq!(lcp(&a, &a), 10);
    assert_eq!(lcp(&a, &a[..3]), 3);
    assert_eq!(lcp(&a, &[]), 0);
    assert_eq!(lcp(&a, &chain(&[7, 7, 7, 7])), 0);
}

#[test]
fn credit_is_seen_until_it_expires() {
    let mut spec = Speculative::new(1_000);
    let now = Instant::now();
    let keys: Arc<[BlockKey]> = chain(&(0..32).collect::<Vec<_>>()).into();
    spec.credit(keys.clone(), 3, now, now + Duration::from_secs(2));
    let prompt = chain(&(0..24).chain(100..108).collect::<Vec<_>>());
    let mut seen = Vec::new();
    spec.runs(&prompt, now, |w, run| seen.push((w, run)));
    assert_eq!(seen, vec![(3, 6)]);
    seen.clear();
    spec.runs(&prompt, now + Duration::from_secs(3), |w, run| {
        seen.push((w, run))
    });
    assert!(seen.is_empty());
}

#[test]
fn next_turn_subsumes_previous_and_cap_holds() {
    let mut spec = Speculative::new(100);
    let now = Instant::now();
    let later = now + Duration::from_secs(60);
    let turn1: Arc<[BlockKey]> = chain(&(0..40).collect::<Vec<_>>()).into();
    let turn2: Arc<[BlockKey]> = chain(&(0..80).collect::<Vec<_>>()).into();
    spec.credit(turn1, 1, now, later);
    spec.credit(turn2, 1, now, later);
    assert_eq!(spec.entries(), 1);
    assert_eq!(spec.total_keys(), 20);
    for i in 0..50u32 {
        let keys: Arc<[BlockKey]> = chain(&(i * 1000..i * 1000 + 40).collect::<Vec<_>>()).into();
        spec.credit(keys, 2, now, later + Duration::from_millis(u64::from(i)));
    }
    assert!(spec.total_keys() <= 100, "{}", spec.total_keys());
    spec.forget_worker(2);
    assert!(spec.total_keys() <= 20);
}

#[test]
fn end_by_shortens_only_the_given_chain_on_its_worker() {
    let mut spec = Speculative::new(1_000);
    let now = Instant::now();
    let later = now + Duration::from_secs(60);
    let keys: Arc<[BlockKey]> = chain(&(0..32).collect::<Vec<_>>()).into();
    let same_keys_elsewhere: Arc<[BlockKey]> = keys.to_vec().into();
    spec.credit(keys.clone(), 1, now, later);
    spec.credit(same_keys_elsewhere, 2, now, later);
    spec.end_by(&keys, 1, now + Duration::from_millis(100));
    // A later end never extends a credit.
    spec.end_by(&keys, 1, now + Duration::from_secs(600));
    let mut seen = Vec::new();
    spec.runs(&keys, now + Duration::from_millis(200), |w, run| {
        seen.push((w, run))
    });
    assert_eq!(
        seen,
        vec![(2, 8)],
        "worker 1's credit ended, worker 2's stands"
    );
}
