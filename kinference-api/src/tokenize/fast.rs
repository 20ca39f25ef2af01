//! A fast path for the GPT-2/Qwen2-style byte-level BPE pipeline on ASCII text.
//!
//! `tokenizers` spends most of an encode in its Oniguruma pre-tokenizer regex and the NFC normalizer
//! (~30 ms for 8k tokens here). For the exact pipeline of Qwen2's `tokenizer.json` (NFC, the Split
//! regex below, byte-level, BPE) and ASCII input, NFC is the identity and the regex reduces to a small
//! hand-written scanner, so only the BPE model (with its word cache) is left. Anything else (another
//! pipeline, non-ASCII segments) goes through the full tokenizer, and the tests compare both paths.
//!
//! Long segments (the text between two added tokens, e.g. one chat message) are cached by content:
//! system prompts, documents and earlier turns come back in request after request, and a segment's
//! tokens do not depend on its neighbours (added tokens split the text first, as `AddedVocabulary`
//! does), so a repeated 7,000-word system prompt costs a hash and a compare instead of its BPE.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;
use tokenizers::{Model, Tokenizer};

/// Segments at least this long (bytes) are cached; shorter ones encode faster than they look up.
const CACHED_SEGMENT_MIN: usize = 1024;
/// Segment text plus token bytes the cache keeps; beyond it the least recently used quarter goes.
const CACHE_MAX_BYTES: usize = 32 << 20;

/// Tokens of recently seen long segments, by content.
#[derive(Debug, Default)]
struct SegmentCache {
    entries: HashMap<u128, CachedSegment>,
    bytes: usize,
    clock: u64,
}

#[derive(Debug)]
struct CachedSegment {
    text: Box<str>,
    ids: Arc<[u32]>,
    used: u64,
}

impl SegmentCache {
    fn get(&mut self, key: u128, text: &str) -> Option<Arc<[u32]>> {
        self.clock += 1;
        let e = self.entries.get_mut(&key)?;
        // The hash only finds the entry; the text decides.
        if &*e.text != text {
            return None;
        }
        e.used = self.clock;
        Some(Arc::clone(&e.ids))
    }

    fn insert(&mut self, key: u128, text: &str, ids: Arc<[u32]>) {
        self.clock += 1;
        let size = text.len() + ids.len() * 4;
        let entry = CachedSegment {
            text: text.into(),
            ids,
            used: self.clock,
        };
        if let Some(old) = self.entries.insert(key, entry) {
            self.bytes -= old.text.len() + old.ids.len() * 4;
        }
        self.bytes += size;
        if self.bytes > CACHE_MAX_BYTES {
            let mut by_age: Vec<(u64, u128)> =
                self.entries.iter().map(|(k, e)| (e.used, *k)).collect();
            by_age.sort_unstable();
            for (_, k) in by_age {
                if self.bytes <= CACHE_MAX_BYTES / 4 * 3 {
                    break;
                }
                if let Some(e) = self.entries.remove(&k) {
                    self.bytes -= e.text.len() + e.ids.len() * 4;
                }
            }
        }
    }
}

/// One piece of a text split at its added tokens.
enum Piece<'t> {
    /// An added token.
    Added(u32),
    /// A long segment whose tokens the cache holds.
    Cached(Arc<[u32]>),
    /// Text to encode.
    New(&'t str),
}

/// Qwen2's pre-tokenizer pattern, the only one the scanner implements.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The precomputed parts of the fast path.
#[derive(Debug)]
pub(super) struct FastPath {
    /// Added tokens (matched before anything else, as `AddedVocabulary` does), longest first.
    added: Vec<(String, u32)>,
    /// The added tokens that do not start with '<', which `encode` does not split on.
    other_added: Vec<String>,
    /// GPT-2 `bytes_to_unicode` for the 128 ASCII bytes.
    byte_char: [char; 128],
    /// Tokens of recent long segments.
    cache: Mutex<SegmentCache>,
}

impl FastPath {
    /// Returns the fast path if `tokenizer.json` is exactly the pipeline it implements.
    pub(super) fn detect(json: &Value, tokenizer: &Tokenizer) -> Option<Self> {
        let pre = &json["pre_tokenizer"];
        let steps = pre["pretokenizers"].as_array()?;
        let ok = json["normalizer"]["type"] == "NFC"
            && pre["type"] == "Sequence"
            && steps.len() == 2
            && steps[0]["type"] == "Split"
            && steps[0]["pattern"]["Regex"] == QWEN2_PATTERN
            && steps[0]["behavior"] == "Isolated"
            && steps[0]["invert"] == false
            && steps[1]["type"] == "ByteLevel"
            && steps[1]["use_regex"] == false
            && steps[1]["add_prefix_space"] == false
            && json["post_processor"]["type"] == "ByteLevel"
            && json["model"]["type"] == "BPE"
            && json["model"]["byte_fallback"] != true
            && json["model"]["dropout"].is_null();
        if !ok {
            return None;
        }
        let mut added = Vec::new();
        for t in json["added_tokens"].as_array()? {
            // Flags that change how added tokens match are not implemented.
            if t["lstrip"] == true || t["rstrip"] == true || t["single_word"] == true {
                return None;
            }
            let content = t["content"].as_str()?;
            if !content.is_ascii() || content.is_empty() {
                return None;
            }
            added.push((content.to_owned(), u32::try_from(t["id"].as_u64()?).ok()?));
        }
        added.sort_by_key(|(c, _)| std::cmp::Reverse(c.len()));
        // Sanity: the model must know the byte-level symbols.
        tokenizer.token_to_id("Ġ")?;
        let mut byte_char = ['\0'; 128];
        let mut n = 0u32;
        for (b, slot) in byte_char.iter_mut().enumerate() {
            *slot = if (33..=126).contains(&b) {
                b as u8 as char
            } else {
                let c = char::from_u32(256 + n)?;
                n += 1;
                c
            };
        }
        let other_added = added
            .iter()
            .filter(|(c, _)| !c.starts_with('<'))
            .map(|(c, _)| c.clone())
            .collect();
        Some(Self {
            added,
            other_added,
            byte_char,
            cache: Mutex::default(),
        })
    }

    /// The segment cache. A poisoned lock only means another encode panicked mid-update; the map
    /// itself stays valid.
    fn cache(&self) -> MutexGuard<'_, SegmentCache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `seg` is in the segment cache.
    #[cfg(test)]
    pub(super) fn is_cached(&self, seg: &str) -> bool {
        let key = xxhash_rust::xxh3::xxh3_128(seg.as_bytes());
        self.cache()
            .entries
            .get(&key)
            .is_some_and(|e| &*e.text == seg)
    }

    /// Encodes `text` (no special tokens added) like the full pipeline does.
    pub(super) fn encode(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
    ) -> Result<Vec<u32>, tokenizers::Error> {
        Ok(self
            .encode_within(tokenizer, text, usize::MAX)?
            .unwrap_or_default())
    }

    /// Encodes `text` unless more than `max_new_bytes` of it miss the segment cache (`None` then, with
    /// no BPE done): cached text costs a lookup, new text its BPE, so a caller can keep the cheap
    /// encodes of repeated prompts on its own thread.
    pub(super) fn encode_within(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        max_new_bytes: usize,
    ) -> Result<Option<Vec<u32>>, tokenizers::Error> {
        // First the pieces and what the cache holds, so that a prompt over budget costs no BPE (a long
        // new segment that comes twice counts twice here, though the second is then a cache hit).
        let pieces = self.split(text);
        let new_bytes: usize = pieces
            .iter()
            .map(|p| match p {
                Piece::New(seg) => seg.len(),
                Piece::Added(_) | Piece::Cached(_) => 0,
            })
            .sum();
        if new_bytes > max_new_bytes {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(text.len() / 3);
        for piece in pieces {
            match piece {
                Piece::Added(id) => out.push(id),
                Piece::Cached(ids) => out.extend_from_slice(&ids),
                Piece::New(seg) => self.encode_new(tokenizer, seg, &mut out)?,
            }
        }
        Ok(Some(out))
    }

    /// Splits `text` at added tokens, as `AddedVocabulary` does, and looks the long segments up in
    /// the cache. Added tokens are matched here where they start with '<' (all of Qwen2's do): jump
    /// from one '<' to the next. A segment holding any other added token goes through the full
    /// tokenizer (`encode_uncached`).
    fn split<'t>(&self, text: &'t str) -> Vec<Piece<'t>> {
        let mut pieces = Vec::new();
        let mut seg_start = 0;
        for i in memchr::memchr_iter(b'<', text.as_bytes()) {
            if i < seg_start {
                continue; // inside the added token just matched
            }
            if let Some((tok, id)) = self
                .added
                .iter()
                .find(|(c, _)| text[i..].starts_with(c.as_str()))
            {
                pieces.push(self.segment(&text[seg_start..i]));
                pieces.push(Piece::Added(*id));
                seg_start = i + tok.len();
            }
        }
        pieces.push(self.segment(&text[seg_start..]));
        pieces
    }

    /// A segment's tokens from the cache, or the segment as new text.
    fn segment<'t>(&self, seg: &'t str) -> Piece<'t> {
        if seg.len() < CACHED_SEGMENT_MIN {
            return Piece::New(seg);
        }
        let key = xxhash_rust::xxh3::xxh3_128(seg.as_bytes());
        let hit = self.cache().get(key, seg);
        hit.map_or(Piece::New(seg), Piece::Cached)
    }

    /// Appends a new segment's tokens to `out`, and caches them when the segment is long. The cache
    /// is asked again first: the same long text may come twice in one prompt (a document pasted
    /// twice, a repeated reply), and its first occurrence has just been encoded.
    fn encode_new(
        &self,
        tokenizer: &Tokenizer,
        seg: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), tokenizers::Error> {
        if seg.len() < CACHED_SEGMENT_MIN {
            return self.encode_uncached(tokenizer, seg, out);
        }
        let key = xxhash_rust::xxh3::xxh3_128(seg.as_bytes());
        if let Some(ids) = self.cache().get(key, seg) {
            out.extend_from_slice(&ids);
            return Ok(());
        }
        let start = out.len();
        self.encode_uncached(tokenizer, seg, out)?;
        self.cache().insert(key, seg, out[start..].into());
        Ok(())
    }

    fn encode_uncached(
        &self,
        tokenizer: &Tokenizer,
        seg: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), tokenizers::Error> {
        if seg.is_empty() {
            return Ok(());
        }
        if !seg.is_ascii() || self.other_added.iter().any(|c| seg.contains(c.as_str())) {
            // Non-ASCII needs NFC and Unicode classes; added tokens not starting with '<' are rare
            // (`encode` has split off those that do).
            let enc = tokenizer.encode_fast(seg, false)?;
            out.extend_from_slice(enc.get_ids());
            return Ok(());
        }
        let model = tokenizer.get_model();
        let mut word = String::with_capacity(32);
        let mut pos = 0;
        let b = seg.as_bytes();
        while pos < b.len() {
            let end = next_piece(b, pos);
            let piece = &seg[pos..end];
            word.clear();
            word.extend(piece.bytes().map(|c| self.byte_char[c as usize]));
            for t in model.tokenize(&word)? {
                out.push(t.id);
            }
            pos = end;
        }
        Ok(())
    }
}

fn is_letter(c: u8) -> bool {
    c.is_ascii_alphabetic()
}

fn is_digit(c: u8) -> bool {
    c.is_ascii_digit()
}

/// Oniguruma's `\s` on ASCII.
fn is_space(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

fn is_newline(c: u8) -> bool {
    c == b'\r' || c == b'\n'
}

/// End of the regex match starting at `i` (the alternatives tried in order, as a backtracking engine
/// does). Every position matches some alternative, so pieces tile the input.
fn next_piece(b: &[u8], i: usize) -> usize {
    let n = b.len();
    let at = |k: usize| b.get(k).copied();
    // 1. Contractions.
    if b[i] == b'\'' {
        let lower = |k: usize| at(k).map(|c| c.to_ascii_lowercase());
        match (lower(i + 1), lower(i + 2)) {
            (Some(b's' | b't' | b'm' | b'd'), _) => return i + 2,
            (Some(b'r'), Some(b'e')) | (Some(b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => {
                return i + 3;
            }
            _ => {}
        }
    }
    let letters_from = |mut k: usize| {
        while k < n && is_letter(b[k]) {
            k += 1;
        }
        k
    };
    // 2. An optional non-letter/digit/newline character, then letters.
    let c = b[i];
    if !is_newline(c) && !is_letter(c) && !is_digit(c) && at(i + 1).is_some_and(is_letter) {
        return letters_from(i + 1);
    }
    if is_letter(c) {
        return letters_from(i);
    }
    // 3. One digit.
    if is_digit(c) {
        return i + 1;
    }
    // 4. An optional space, punctuation, trailing newlines.
    let punct = |c: u8| !is_space(c) && !is_letter(c) && !is_digit(c);
    let start = if c == b' ' && at(i + 1).is_some_and(punct) {
        Some(i + 1)
    } else if punct(c) {
        Some(i)
    } else {
        None
    };
    if let Some(mut k) = start {
        while k < n && punct(b[k]) {
            k += 1;
        }
        while k < n && is_newline(b[k]) {
            k += 1;
        }
        return k;
    }
    // Whitespace run from i (c is whitespace here).
    let mut j = i;
    while j < n && is_space(b[j]) {
        j += 1;
    }
    // 5. `\s*[\r\n]+`: up to the last newline of the run, plus the newlines right after it.
    if let Some(last) = (i..j).rev().find(|&k| is_newline(b[k])) {
        return last + 1;
    }
    // 6. `\s+(?!\S)`: the run, minus its last character when a non-space follows.
    if j == n {
        return j;
    }
    if j - i >= 2 {
        return j - 1;
    }
    // 7. `\s+`.
    j
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_segment_cache_stays_within_its_bytes_and_keeps_the_recent_ones() {
        let mut cache = SegmentCache::default();
        let text = "x".repeat(64 * 1024);
        let ids: Arc<[u32]> = vec![7; 16 * 1024].into();
        let per_entry = text.len() + ids.len() * 4;
        let n = CACHE_MAX_BYTES / per_entry * 2;
        for k in 0..n as u128 {
            cache.insert(k, &text, Arc::clone(&ids));
            assert!(cache.bytes <= CACHE_MAX_BYTES, "{} bytes", cache.bytes);
        }
        let newest = n as u128 - 1;
        assert!(cache.get(newest, &text).is_some(), "the newest entry stays");
        assert!(cache.get(0, &text).is_none(), "the oldest went");
        assert!(
            cache.get(newest, "y").is_none(),
            "a hash match with other text is a miss"
        );
        let counted: usize = cache
            .entries
            .values()
            .map(|e| e.text.len() + e.ids.len() * 4)
            .sum();
        assert_eq!(counted, cache.bytes);
    }
}
