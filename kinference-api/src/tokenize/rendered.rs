//! Rendered chat prompts, kept so that a message list sent again exactly (a retried request, a
//! batch job's or a load test's repeated prompt) is not rendered by the template a second time.
//!
//! The chat template is the costliest step of tokenizing a short chat (minijinja evaluates the
//! whole template per request). A hit is exact: entries are found by a hash of the inputs and
//! then compared field by field, so a collision is only a miss (renders are deterministic:
//! `strftime_now` answers a fixed date). The cache is bounded in entries and in each entry's size;
//! when full it starts over, which bounds it without a recency list on every hit.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use serde_json::Value;
use xxhash_rust::xxh3::Xxh3;

/// Entries kept at most.
const ENTRIES: usize = 128;
/// Longest rendered prompt kept, in bytes (with its messages, an entry holds about twice that).
const MAX_TEXT: usize = 32 << 10;

/// The inputs of one render.
pub(super) struct RenderInput<'a> {
    pub messages: &'a Value,
    pub add_generation_prompt: bool,
    pub kwargs: Option<&'a Value>,
}

impl RenderInput<'_> {
    fn hash(&self) -> u64 {
        let mut h = Xxh3::new();
        self.messages.hash(&mut h);
        self.add_generation_prompt.hash(&mut h);
        self.kwargs.hash(&mut h);
        h.finish()
    }
}

/// A rendered prompt and what it was rendered from.
struct Entry {
    messages: Value,
    add_generation_prompt: bool,
    kwargs: Option<Value>,
    text: String,
}

impl Entry {
    fn renders(&self, input: &RenderInput<'_>) -> bool {
        self.add_generation_prompt == input.add_generation_prompt
            && self.kwargs.as_ref() == input.kwargs
            && &self.messages == input.messages
    }
}

/// Recently rendered prompts of one chat template.
#[derive(Default)]
pub(super) struct RenderCache {
    entries: Mutex<HashMap<u64, Entry>>,
}

impl RenderCache {
    /// The text `input` rendered to before, if it is kept; else the hash to [`Self::put`] it under.
    pub(super) fn get(&self, input: &RenderInput<'_>) -> Result<String, u64> {
        let hash = input.hash();
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        match entries.get(&hash) {
            Some(entry) if entry.renders(input) => Ok(entry.text.clone()),
            _ => Err(hash),
        }
    }

    /// Keeps `text` as what `input` (hashed to `hash` by [`Self::get`]) renders to.
    pub(super) fn put(&self, hash: u64, input: &RenderInput<'_>, text: &str) {
        if text.len() > MAX_TEXT {
            return;
        }
        let entry = Entry {
            messages: input.messages.clone(),
            add_generation_prompt: input.add_generation_prompt,
            kwargs: input.kwargs.cloned(),
            text: text.to_owned(),
        };
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.len() >= ENTRIES {
            entries.clear();
        }
        entries.insert(hash, entry);
    }
}
