use super::*;

fn runs(index: &KvIndex, keys: &[BlockKey], candidates: &[WorkerId]) -> Vec<usize> {
    let mut out = Vec::new();
    index.leading_runs(keys, candidates, |_, _| {}, &mut out);
    out
}

#[test]
fn insert_remove_and_counts() {
    let mut idx = KvIndex::new(1_000);
    assert!(idx.insert(1, 0));
    assert!(!idx.insert(1, 0));
    assert!(idx.insert(1, 3));
    assert!(idx.insert(2, 3));
    assert_eq!(idx.pairs(), 3);
    assert_eq!(idx.keys(), 2);
    assert_eq!(idx.worker_blocks(3), 2);
    assert!(idx.contains(1, 0) && idx.contains(1, 3) && !idx.contains(2, 0));
    assert!(idx.remove(1, 0));
    assert!(!idx.remove(1, 0));
    assert!(idx.remove(1, 3));
    assert_eq!(idx.keys(), 1, "a key with no holder left is gone");
    assert_eq!(idx.pairs(), 1);
}

#[test]
fn holder_sets_spill_past_four_and_come_back() {
    let mut idx = KvIndex::new(1_000);
    for w in [0, 1, 2, 3, 70, 130] {
        assert!(idx.insert(9, w));
    }
    for w in [0, 1, 2, 3, 70, 130] {
        assert!(idx.contains(9, w), "worker {w}");
    }
    assert!(!idx.contains(9, 4));
    assert_eq!(idx.pairs(), 6);
    assert!(idx.remove(9, 130));
    assert!(idx.remove(9, 0));
    // Four left: inline again, and the slab slot is free for reuse.
    assert_eq!(idx.spill_free.len(), 1);
    for w in [1, 2, 3, 70] {
        assert!(idx.contains(9, w));
    }
    for w in [1, 2, 3, 70] {
        assert!(idx.remove(9, w));
    }
    assert_eq!(idx.keys(), 0);
    assert_eq!(idx.pairs(), 0);
}

#[test]
fn clear_workers_drops_only_theirs() {
    let mut idx = KvIndex::new(10_000);
    for k in 0..100u64 {
        idx.insert(k, 1);
        idx.insert(k, 2);
        if k % 2 == 0 {
            for w in 10..16 {
                idx.insert(k, w);
            }
        }
    }
    idx.clear_workers(&[1, 10, 11]);
    assert_eq!(idx.worker_blocks(1), 0);
    assert_eq!(idx.worker_blocks(2), 100);
    assert_eq!(idx.pairs(), 100 + 50 * 4);
    assert!(!idx.contains(4, 10) && idx.contains(4, 12) && idx.contains(4, 2));
    idx.clear_workers(&[2, 12, 13, 14, 15]);
    assert_eq!(idx.pairs(), 0);
    assert_eq!(idx.keys(), 0);
}

#[test]
fn leading_runs_per_candidate_in_one_pass() {
    let mut idx = KvIndex::new(10_000);
    let keys: Vec<BlockKey> = (100..110).collect();
    for k in &keys[..7] {
        idx.insert(*k, 0);
    }
    for k in &keys[..3] {
        idx.insert(*k, 5);
    }
    // Worker 7 holds a later block but not the first: no prefix.
    idx.insert(keys[4], 7);
    // Worker 200 (another bitset word) holds everything.
    for k in &keys {
        idx.insert(*k, 200);
    }
    assert_eq!(runs(&idx, &keys, &[0, 5, 7, 200, 9]), vec![7, 3, 0, 10, 0]);
    assert_eq!(runs(&idx, &keys, &[5]), vec![3]);
    assert_eq!(runs(&idx, &[], &[5, 0]), vec![0, 0]);
    // A hole stops the run even when later blocks are there.
    idx.remove(keys[1], 0);
    assert_eq!(runs(&idx, &keys, &[0]), vec![1]);
}

#[test]
fn leading_runs_count_extra_holders() {
    let mut idx = KvIndex::new(100);
    idx.insert(1, 0);
    let mut out = Vec::new();
    idx.leading_runs(
        &[1, 2, 3],
        &[0, 1],
        |k, bits| {
            if k <= 2 {
                set_bit(bits, 0);
                set_bit(bits, 1);
            }
        },
        &mut out,
    );
    assert_eq!(out, vec![2, 2]);
}

#[test]
fn memory_cap_evicts_and_counts() {
    let mut idx = KvIndex::new(1_000);
    for k in 0..5_000u64 {
        idx.insert(k.wrapping_mul(0x9e37_79b9_7f4a_7c15), (k % 3) as WorkerId);
    }
    assert!(idx.pairs() <= 1_000);
    assert!(idx.evictions() >= 4_000);
    let per_worker: usize = (0..3).map(|w| idx.worker_blocks(w)).sum();
    assert_eq!(per_worker, idx.pairs());
}

#[test]
fn memory_per_pair_is_compact() {
    // 100 workers, 20k blocks each; a tenth of each worker's blocks is a prefix shared by all.
    let mut idx = KvIndex::new(10_000_000);
    for w in 0..100u16 {
        for b in 0..18_000u64 {
            idx.insert(
                (u64::from(w) << 32 | b).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                w,
            );
        }
        for b in 0..2_000u64 {
            idx.insert(b.wrapping_mul(0xff51_afd7_ed55_8ccd) | 1, w);
        }
    }
    let per_pair = idx.memory_bytes() as f64 / idx.pairs() as f64;
    assert!(per_pair < 32.0, "{per_pair} bytes per (block, worker)");
}

#[test]
fn bisection_matches_the_scan_on_a_known_layout() {
    let mut idx = KvIndex::new(100_000);
    let keys: Vec<BlockKey> = (1000..3000).collect();
    for k in &keys[..1500] {
        idx.insert(*k, 7);
    }
    for w in 10..20 {
        for k in &keys[..500] {
            idx.insert(*k, w);
        }
    }
    for k in &keys[..1] {
        idx.insert(*k, 99);
    }
    let cands: Vec<WorkerId> = (0..100).collect();
    let mut bis = Vec::new();
    idx.leading_runs_bisect(&keys, &cands, &mut bis);
    assert_eq!(bis, runs(&idx, &keys, &cands));
    assert_eq!(bis[7], 1500);
    assert_eq!(bis[15], 500);
    assert_eq!(bis[99], 1);
    assert_eq!(bis[0], 0);
}

proptest::proptest! {
    #[test]
    fn bisection_equals_the_scan_on_prefix_closed_sets(
        n in 0usize..300,
        runs_by_worker in proptest::collection::vec(0usize..320, 1..70),
        noise in proptest::collection::vec(0u64..1_000_000, 0..200),
    ) {
        let keys: Vec<BlockKey> = (0..n as u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1).collect();
        let mut idx = KvIndex::new(1_000_000);
        for (w, run) in runs_by_worker.iter().enumerate() {
            for k in &keys[..(*run).min(n)] {
                idx.insert(*k, w as WorkerId);
            }
        }
        for (i, k) in noise.iter().enumerate() {
            idx.insert(k << 20, (i % 70) as WorkerId);
        }
        let cands: Vec<WorkerId> = (0..runs_by_worker.len() as WorkerId).rev().collect();
        let mut bis = Vec::new();
        idx.leading_runs_bisect(&keys, &cands, &mut bis);
        proptest::prop_assert_eq!(&bis, &runs(&idx, &keys, &cands));
    }
}
