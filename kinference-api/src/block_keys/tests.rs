use super::*;
use proptest::prelude::*;

#[test]
fn only_full_blocks_get_keys() {
    let h = KeyHasher::for_model("m");
    let tokens: Vec<u32> = (0..100).collect();
    assert_eq!(h.keys(None, &tokens, 32).len(), 3);
    assert!(h.keys(None, &tokens[..31], 32).is_empty());
    assert!(h.keys(None, &tokens, 0).is_empty());
}

#[test]
fn models_do_not_collide() {
    let tokens: Vec<u32> = (0..64).collect();
    let a = KeyHasher::for_model("a").keys(None, &tokens, 32);
    let b = KeyHasher::for_model("b").keys(None, &tokens, 32);
    assert_ne!(a, b);
}

#[test]
fn a_block_key_depends_on_its_prefix() {
    let h = KeyHasher::for_model("m");
    let x: Vec<u32> = (0..64).collect();
    let mut y = x.clone();
    y[0] = 999;
    let kx = h.keys(None, &x, 32);
    let ky = h.keys(None, &y, 32);
    // Same tokens in the second block, different first block: the second keys differ too.
    assert_eq!(x[32..], y[32..]);
    assert_ne!(kx[1], ky[1]);
}

#[test]
fn large_blocks_hash_like_small_ones_would_chain() {
    let h = KeyHasher::for_model("m");
    let tokens: Vec<u32> = (0..1024).collect();
    let one = h.keys(None, &tokens, 512);
    assert_eq!(one.len(), 2);
    assert_eq!(one[1], h.block_key(Some(one[0]), &tokens[512..]));
}

proptest! {
    /// The fixed-size loops (16, 32, 64, 128) and the general one compute the same chain as
    /// hashing block by block.
    #[test]
    fn every_block_size_chains_like_block_key(tokens in prop::collection::vec(any::<u32>(), 0..600), pick in 0usize..7) {
        let h = KeyHasher::for_model("qwen");
        let bs = [1, 15, 16, 32, 64, 128, 200][pick];
        let mut parent = None;
        let mut chained = Vec::new();
        for block in tokens.chunks_exact(bs) {
            let key = h.block_key(parent, block);
            chained.push(key);
            parent = Some(key);
        }
        prop_assert_eq!(h.keys(None, &tokens, bs), chained);
    }

    /// Keys of a sequence computed in one go equal keys computed block by block from a parent,
    /// which is how the agent sees them (a `BlockStored` event with a `parent_block_hash`).
    #[test]
    fn chaining_from_a_parent_matches_one_pass(tokens in prop::collection::vec(any::<u32>(), 0..400), split in 0usize..12) {
        let h = KeyHasher::for_model("qwen");
        let bs = 16;
        let all = h.keys(None, &tokens, bs);
        let split = split.min(all.len());
        let head = h.keys(None, &tokens[..split * bs], bs);
        let parent = head.last().copied();
        let tail = h.keys(parent, &tokens[split * bs..], bs);
        let mut joined = head;
        joined.extend(tail);
        prop_assert_eq!(all, joined);
    }
}

/// Keys are a wire-level contract between agents and gateways of different builds: pinned values.
#[test]
fn keys_are_stable_across_builds() {
    let h = KeyHasher::for_model("qwen");
    let tokens: Vec<u32> = (0..48).map(|i| i * 7919).collect();
    let expected = [
        0x211b_61af_9633_aeee,
        0xcd35_1759_8153_4b1c,
        0xb379_37ee_931d_b2cd,
    ];
    assert_eq!(h.keys(None, &tokens, 16), expected);
    // One block at a time, as the agent computes them from events, gives the same keys.
    assert_eq!(h.block_key(None, &tokens[..16]), expected[0]);
    assert_eq!(h.block_key(Some(expected[1]), &tokens[32..]), expected[2]);
    // A block larger than the stack buffer takes the other path and still chains the same way.
    let big: Vec<u32> = (0..600).collect();
    let two = h.keys(None, &big, 300);
    assert_eq!(two[1], h.block_key(Some(two[0]), &big[300..]));
}

#[test]
fn a_salt_changes_the_first_key_and_so_every_key_after_it() {
    let h = KeyHasher::for_model("m");
    let tokens: Vec<u32> = (0..100).collect();
    let plain = h.keys(None, &tokens, 32);
    assert_eq!(h.salted_keys(None, &tokens, 32), plain);
    let a = h.salted_keys(Some("a"), &tokens, 32);
    let b = h.salted_keys(Some("b"), &tokens, 32);
    assert_eq!(a.len(), 3);
    for (i, k) in a.iter().enumerate() {
        assert!(!plain.contains(k) && !b.contains(k), "block {i}");
    }
    // Only the first block carries the salt: the rest chain from it as plain blocks do.
    assert_eq!(h.keys(Some(a[0]), &tokens[32..], 32), a[1..]);
    let mut extra = Vec::new();
    str_extra_key("a", &mut extra);
    assert_eq!(a[0], with_extra_keys(plain[0], &extra));
    assert!(h.salted_keys(Some("a"), &tokens[..31], 32).is_empty());
}
