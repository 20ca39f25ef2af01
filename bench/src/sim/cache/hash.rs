//! vLLM's default prefix-cache block hash (`--prefix-caching-hash-algo sha256`, vLLM >= 0.29 without
//! `PYTHONHASHSEED`): `sha256(pickle.dumps((parent_digest, tuple(token_ids), None), protocol=5))`,
//! chained through the *full* 32-byte digest, with `NONE_HASH = sha256(pickle.dumps("vllm-none-hash"))`
//! as the parent of a sequence's first block. Events carry only the low 64 bits of each digest.
//!
//! A request's `cache_salt` is the one extra key the simulator hashes: vLLM (0.31 - 0.34) puts
//! `(("cache_salt", salt),)` in place of `None` in its prompt's *first* block only, so the salt reaches
//! every later block through the chain.
//!
//! The pickle encoder writes exactly the opcodes CPython's C pickler emits for these shapes
//! (checked byte for byte against `pickle.dumps`; see the tests), so no Python is needed at run time.

use std::sync::OnceLock;

use sha2::{Digest, Sha256};

/// A block's full sha256 digest: the chain's parent value and the cache key.
pub type BlockDigest = [u8; 32];

// Pickle opcodes (Lib/pickle.py).
const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const SHORT_BINBYTES: u8 = b'C';
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const MEMOIZE: u8 = 0x94;
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const EMPTY_TUPLE: u8 = b')';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const NONE: u8 = b'N';
const STOP: u8 = b'.';

/// `NONE_HASH`: the parent digest of every sequence's first block.
pub fn none_hash() -> &'static BlockDigest {
    static NONE_HASH: OnceLock<BlockDigest> = OnceLock::new();
    NONE_HASH.get_or_init(|| {
        let seed = b"vllm-none-hash";
        let mut body = Vec::with_capacity(seed.len() + 4);
        body.push(SHORT_BINUNICODE);
        body.push(seed.len() as u8);
        body.extend_from_slice(seed);
        body.push(MEMOIZE);
        body.push(STOP);
        Sha256::digest(framed(&body)).into()
    })
}

/// The digest of one full block, chained from `parent` (`None` for a sequence's first block).
pub fn hash_block_tokens(parent: Option<&BlockDigest>, tokens: &[u32]) -> BlockDigest {
    hash_block_salted(parent, tokens, None)
}

/// [`hash_block_tokens`] of a block hashed with a `cache_salt` (a request's first block).
pub fn hash_block_salted(
    parent: Option<&BlockDigest>,
    tokens: &[u32],
    salt: Option<&str>,
) -> BlockDigest {
    let mut buf = Vec::with_capacity(64 + tokens.len() * 5);
    pickle_block_salted(
        parent.unwrap_or_else(|| none_hash()),
        tokens,
        salt,
        &mut buf,
    );
    Sha256::digest(&buf).into()
}

/// [`hash_blocks`] of a prompt sent with `cache_salt` `salt` (`None`: unsalted): the salt is hashed
/// into the first block only, as vLLM's `generate_block_hash_extra_keys` does for `start_token_idx
/// == 0`.
pub fn hash_blocks_salted(
    parent: Option<&BlockDigest>,
    tokens: &[u32],
    block_size: usize,
    salt: Option<&str>,
) -> Vec<BlockDigest> {
    let mut out: Vec<BlockDigest> = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut prev = parent.copied();
    for (i, chunk) in tokens.chunks_exact(block_size.max(1)).enumerate() {
        let d = hash_block_salted(prev.as_ref(), chunk, salt.filter(|_| i == 0));
        out.push(d);
        prev = Some(d);
    }
    out
}

/// Digests of every *full* block of `tokens`, chained from `parent` (vLLM ignores a partial tail).
pub fn hash_blocks(
    parent: Option<&BlockDigest>,
    tokens: &[u32],
    block_size: usize,
) -> Vec<BlockDigest> {
    let mut out: Vec<BlockDigest> = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut prev = parent.copied();
    for chunk in tokens.chunks_exact(block_size.max(1)) {
        let d = hash_block_tokens(prev.as_ref(), chunk);
        out.push(d);
        prev = Some(d);
    }
    out
}

/// The value vLLM publishes in KV events: the low 64 bits of the digest (last 8 bytes, big-endian).
pub fn event_hash(digest: &BlockDigest) -> u64 {
    let mut low = [0u8; 8];
    low.copy_from_slice(&digest[24..]);
    u64::from_be_bytes(low)
}

/// `pickle.dumps((parent, tuple(tokens), None), protocol=5)` into `out`.
pub fn pickle_block(parent: &BlockDigest, tokens: &[u32], out: &mut Vec<u8>) {
    pickle_block_salted(parent, tokens, None, out);
}

/// [`pickle_block`] with `(("cache_salt", salt),)` as the extra keys when `salt` is given.
pub fn pickle_block_salted(
    parent: &BlockDigest,
    tokens: &[u32],
    salt: Option<&str>,
    out: &mut Vec<u8>,
) {
    let mut body = Vec::with_capacity(48 + tokens.len() * 5);
    body.push(SHORT_BINBYTES);
    body.push(parent.len() as u8);
    body.extend_from_slice(parent);
    body.push(MEMOIZE);
    match tokens.len() {
        // The empty tuple is a singleton: written without MEMOIZE.
        0 => body.push(EMPTY_TUPLE),
        n @ 1..=3 => {
            tokens.iter().for_each(|&t| push_int(&mut body, t));
            body.push([TUPLE1, TUPLE2, TUPLE3][n - 1]);
            body.push(MEMOIZE);
        }
        _ => {
            body.push(MARK);
            tokens.iter().for_each(|&t| push_int(&mut body, t));
            body.push(TUPLE);
            body.push(MEMOIZE);
        }
    }
    match salt {
        None => body.push(NONE),
        Some(salt) => {
            push_str(&mut body, "cache_salt");
            push_str(&mut body, salt);
            body.extend_from_slice(&[TUPLE2, MEMOIZE, TUPLE1, MEMOIZE]);
        }
    }
    body.push(TUPLE3);
    body.push(MEMOIZE);
    body.push(STOP);
    out.extend_from_slice(&framed(&body));
}

/// Protocol-5 header plus one FRAME around `body` (CPython frames any pickle of 4 bytes or more;
/// ours stay far below the 64 KiB frame target, so one frame always suffices).
fn framed(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 11);
    out.extend_from_slice(&[PROTO, 5]);
    if body.len() >= 4 {
        out.push(FRAME);
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    }
    out.extend_from_slice(body);
    out
}

/// `save_str`: a memoized unicode string (SHORT_BINUNICODE up to 255 UTF-8 bytes, else BINUNICODE).
fn push_str(out: &mut Vec<u8>, s: &str) {
    match u8::try_from(s.len()) {
        Ok(n) => out.extend_from_slice(&[SHORT_BINUNICODE, n]),
        Err(_) => {
            out.push(BINUNICODE);
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        }
    }
    out.extend_from_slice(s.as_bytes());
    out.push(MEMOIZE);
}

/// `save_long` for a non-negative int: the smallest of BININT1 / BININT2 / BININT, else LONG1.
fn push_int(out: &mut Vec<u8>, v: u32) {
    if v <= 0xff {
        out.extend_from_slice(&[BININT1, v as u8]);
    } else if v <= 0xffff {
        out.push(BININT2);
        out.extend_from_slice(&(v as u16).to_le_bytes());
    } else if v <= 0x7fff_ffff {
        out.push(BININT);
        out.extend_from_slice(&v.to_le_bytes());
    } else {
        // Two's complement little-endian with a sign byte, as `encode_long` writes it.
        out.extend_from_slice(&[LONG1, 5]);
        out.extend_from_slice(&v.to_le_bytes());
        out.push(0);
    }
}
