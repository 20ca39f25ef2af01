use super::*;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn none_hash_is_vllms_fixed_seed() {
    assert_eq!(
        hex(none_hash()),
        "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    );
}

#[test]
fn pickle_bytes_equal_cpython() {
    // Expected bytes: CPython 3.11 `pickle.dumps((parent, tuple(tokens), None), protocol=5).hex()`.
    let cases: [(&[u32], &str); 4] = [
        (&[1, 2], "4b014b0286944e87942e"),
        (&[], "294e87942e"),
        (
            &[255, 256, 65535, 65536],
            "284bff4d00014dffff4a0000010074944e87942e",
        ),
        (&[3_000_000_000], "8a05005ed0b20085944e87942e"),
    ];
    for (tokens, tail) in cases {
        let parent = [0u8; 32];
        let mut out = Vec::new();
        hash::pickle_block(&parent, tokens, &mut out);
        let body_len = out.len() - 11;
        let expected = format!(
            "800595{}4320{}94{tail}",
            hex(&(body_len as u64).to_le_bytes()),
            hex(&parent)
        );
        assert_eq!(hex(&out), expected, "tokens {tokens:?}");
    }
}

#[test]
fn first_block_of_live_capture() {
    let tokens: Vec<u32> = (2000..2096).collect();
    let got: Vec<u64> = hash_blocks(None, &tokens, 32)
        .iter()
        .map(event_hash)
        .collect();
    assert_eq!(
        got,
        vec![
            5664945049465125586,
            9368186330673276797,
            2774320024382329566
        ]
    );
}

fn digests(start: u32, n_blocks: usize, bs: usize) -> (Vec<u32>, Vec<BlockDigest>) {
    let tokens: Vec<u32> = (start..start + (n_blocks * bs) as u32).collect();
    let h = hash_blocks(None, &tokens, bs);
    (tokens, h)
}

#[test]
fn hit_evict_and_parent_follow_vllm() {
    // 5 blocks: the null block plus 4 usable ones.
    let mut pool = BlockPool::new(5, 4);
    assert_eq!(pool.num_free(), 4);
    let (ta, ha) = digests(100, 3, 4);
    let a = pool.allocate(3).expect("room");
    pool.cache_full_blocks(&a, &ha, &ta, 0, 3, BlockExtras::default());
    let ev = pool.take_events();
    assert!(
        matches!(&ev[..], [KvCacheEvent::BlockStored { parent_block_hash: None, block_hashes, .. }] if block_hashes.len() == 3)
    );
    pool.free(&a);
    assert_eq!(pool.num_free(), 4);
    assert_eq!(pool.find_prefix(&ha).len(), 3);

    // A new 2-block sequence evicts the unused free block first, then A's tail block.
    let (tb, hb) = digests(900, 2, 4);
    let b = pool.allocate(2).expect("room");
    pool.cache_full_blocks(&b, &hb, &tb, 0, 2, BlockExtras::default());
    let ev = pool.take_events();
    assert_eq!(
        ev[0],
        KvCacheEvent::BlockRemoved {
            block_hashes: vec![event_hash(&ha[2])]
        }
    );
    assert_eq!(pool.find_prefix(&ha).len(), 2);

    // A again: 2 blocks hit, its third is re-stored with the second as parent.
    let hit = pool.find_prefix(&ha);
    assert_eq!(pool.num_evictable(&hit), 2);
    pool.touch(&hit);
    let mut blocks = hit.clone();
    pool.free(&b);
    blocks.extend(pool.allocate(1).expect("room"));
    pool.cache_full_blocks(&blocks, &ha, &ta, 2, 3, BlockExtras::default());
    let ev = pool.take_events();
    let stored = ev
        .iter()
        .find_map(|e| match e {
            KvCacheEvent::BlockStored {
                parent_block_hash,
                token_ids,
                ..
            } => Some((*parent_block_hash, token_ids.clone())),
            _ => None,
        })
        .expect("stored");
    assert_eq!(stored.0, Some(event_hash(&ha[1])));
    assert_eq!(stored.1, ta[8..12].to_vec());
    assert!(pool.usage() > 0.5);
}

#[test]
fn reset_refused_while_in_use_then_clears() {
    let mut pool = BlockPool::new(4, 2);
    let (t, h) = digests(1, 1, 2);
    let a = pool.allocate(1).expect("room");
    pool.cache_full_blocks(&a, &h, &t, 0, 1, BlockExtras::default());
    assert!(!pool.reset());
    pool.free(&a);
    assert!(pool.reset());
    assert!(pool.find_prefix(&h).is_empty());
    assert_eq!(
        pool.take_events().last(),
        Some(&KvCacheEvent::AllBlocksCleared)
    );
}
