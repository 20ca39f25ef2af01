//! Sessions: which worker served a conversation's last turn, so that its next turn can go back there.
//!
//! A client may name its conversation: the `x-session-id` header, OpenAI's `safety_identifier` or
//! `user`, Anthropic's `metadata.user_id` (translated to `user`); see
//! [`crate::pipeline::exchange::Request::session_name`]. The pipeline hashes that name together with the caller's tenant
//! ([`SessionKey::new`]): the key of one tenant's name never finds the entry another tenant's request
//! made, so no tenant can steer its requests onto another's workers (or learn where they ran).
//!
//! The router remembers the worker each key was last sent to, and the estimate uses it as a soft
//! signal ([`super::estimate::prefer_session`]): the session's worker is chosen when its cost is
//! within [`SessionsConfig::slack`] of the best candidate's, so a conversation stays where its history
//! is unless another worker is clearly faster. Why it is needed beside the KV index: the index learns
//! of the last turn's blocks (its answer's above all) from the worker's events, some tens of
//! milliseconds after they exist, and it cannot tell which of two workers listing the same prefix will
//! keep it longer; the worker a conversation used last holds its newest blocks, the last to be evicted.
//!
//! **Stored answers** are the one case where the worker is not a preference but a must. vLLM keeps a
//! `/v1/responses` answer made with `store` (when it runs with `VLLM_ENABLE_RESPONSES_API_STORE=1`)
//! in the memory of the worker that made it, and a request naming it as `previous_response_id` fails
//! with 404 on any other worker. So the router also remembers which worker made each answer (the
//! settlement reads its id, [`crate::routing::InFlight::answered`]) and whose it is ([`Owner`], the
//! tenant hashed), and a request that continues one goes to that worker whatever the estimate says
//! ([`Answers`]); a request naming another tenant's answer is refused as not found (vLLM itself checks
//! no owner), and one naming an answer this gateway never saw is routed as any other. Answers are
//! remembered even when `sessions.enabled` is false (that switch turns off the soft signal only);
//! `max_entries: 0` remembers none. Each replica knows the answers it relayed itself, and behind a
//! Service the other replicas learn of it through the replicas' notes (`replicas.peers`,
//! [`super::replicas::Note::Answer`]); without them, another replica routes a follow-up as any request.
//!
//! Memory is bounded: at most [`SessionsConfig::max_entries`] keys, conversations and answers
//! together (the least recently used go first), and none older than [`SessionsConfig::ttl_s`];
//! `kinference_routing_sessions` counts them.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hash, Hasher};
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::kv_index::WorkerId;

#[cfg(test)]
mod tests;

/// `sessions:` of `gateway.yaml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionsConfig {
    /// Route a conversation's turns back to the worker of its previous turn (a soft signal in the
    /// estimate); false ignores every session key.
    #[serde(default = "default_enabled")]
    pub enabled: bool,
    /// Sessions remembered at most; the least recently used are forgotten first.
    #[serde(default = "default_max_entries")]
    pub max_entries: usize,
    /// A session unused this long is forgotten, seconds.
    #[serde(default = "default_ttl_s")]
    pub ttl_s: u64,
    /// How much slower the session's worker may be estimated than the best one and still be chosen:
    /// its cost may exceed the best by this fraction (plus 50 ms).
    #[serde(default = "default_slack")]
    pub slack: f64,
}

fn default_enabled() -> bool {
    true
}

fn default_max_entries() -> usize {
    100_000
}

fn default_ttl_s() -> u64 {
    600
}

fn default_slack() -> f64 {
    0.25
}

impl Default for SessionsConfig {
    fn default() -> Self {
        Self {
            enabled: default_enabled(),
            max_entries: default_max_entries(),
            ttl_s: default_ttl_s(),
            slack: default_slack(),
        }
    }
}

/// A conversation's name hashed with its tenant: what the router remembers sessions by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SessionKey(u64);

/// The process's hash seed: keys are never shared outside the process, so a random seed costs
/// nothing and keeps a client from crafting names that collide with another's.
fn seed() -> &'static std::collections::hash_map::RandomState {
    static SEED: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    SEED.get_or_init(std::collections::hash_map::RandomState::new)
}

/// What a key names: a conversation, or a stored answer. Hashed first, so the two never meet.
#[derive(Hash)]
enum Named {
    Conversation,
    Answer,
}

impl SessionKey {
    /// The key of conversation `name` of `tenant` (`None` for an empty name).
    pub fn new(tenant: &str, name: &str) -> Option<Self> {
        if name.is_empty() {
            return None;
        }
        let mut h = seed().build_hasher();
        Named::Conversation.hash(&mut h);
        // `str` hashes with a terminator: ("ab", "c") and ("a", "bc") differ.
        tenant.hash(&mut h);
        name.hash(&mut h);
        Some(Self(h.finish()))
    }

    /// The key of the stored answer whose id is `id` (`None` for an empty id). Not the tenant's:
    /// an answer's entry says whose it is ([`Owner`]), so that another tenant's use is told apart
    /// from an unknown id.
    pub fn answer(id: &str) -> Option<Self> {
        if id.is_empty() {
            return None;
        }
        let mut h = seed().build_hasher();
        Named::Answer.hash(&mut h);
        id.hash(&mut h);
        Some(Self(h.finish()))
    }
}

/// A tenant, hashed: who may continue a stored answer. The hash is the same in every replica
/// (64-bit FNV-1a of the name), so that replicas can tell each other whose an answer is
/// ([`super::replicas::Note::Answer`]); tenant names come from the operator, not from clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Owner(u64);

impl Owner {
    /// The owner `tenant` is.
    pub fn of(tenant: &str) -> Self {
        const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
        const PRIME: u64 = 0x0000_0100_0000_01b3;
        Self(
            tenant
                .bytes()
                .fold(OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME)),
        )
    }

    /// The hash, as replicas send it.
    pub fn to_wire(self) -> u64 {
        self.0
    }

    /// The owner a replica sent.
    pub fn from_wire(hash: u64) -> Self {
        Self(hash)
    }
}

/// The stored answers one request touches (`/v1/responses`; empty for every other endpoint).
#[derive(Clone, Copy, Debug, Default)]
pub struct Answers {
    /// The caller: owner of the answer the request makes, and the one who may continue
    /// `continues`. `None`: the endpoint stores no answer.
    pub owner: Option<Owner>,
    /// The answer the request continues (`previous_response_id`).
    pub continues: Option<SessionKey>,
}

/// Where the answer a request continues is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// The request continues no answer, or one this gateway has not seen made (or forgot).
    Unknown,
    /// By this worker, for the request's own tenant.
    By(WorkerId),
    /// It is another tenant's answer.
    Foreign,
}

/// One remembered session.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// The worker (its table id) the last turn went to, or that made the answer.
    worker: WorkerId,
    /// A stored answer's owner; `None` for a conversation (its key holds the tenant already).
    owner: Option<Owner>,
    /// Its place in the use order ([`Sessions::by_use`]).
    stamp: u64,
    /// When it was last used.
    at: Instant,
}

/// The sessions a router remembers: key to the worker of its last turn, least recently used first out.
#[derive(Debug)]
pub struct Sessions {
    entries: HashMap<SessionKey, Entry>,
    /// Keys by their last use: the first is the least recently used.
    by_use: BTreeMap<u64, SessionKey>,
    next_stamp: u64,
    max_entries: usize,
    ttl: Duration,
    forgotten: u64,
}

impl Sessions {
    /// An empty table with `config`'s bounds.
    pub fn new(config: &SessionsConfig) -> Self {
        Self {
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            next_stamp: 0,
            max_entries: config.max_entries,
            ttl: Duration::from_secs(config.ttl_s),
            forgotten: 0,
        }
    }

    /// The worker `key`'s last turn went to, unless that was longer than the TTL before `now`.
    pub fn worker(&self, key: SessionKey, now: Instant) -> Option<WorkerId> {
        let e = self.entries.get(&key).filter(|e| e.owner.is_none())?;
        (now.saturating_duration_since(e.at) <= self.ttl).then_some(e.worker)
    }

    /// Where the answer `answers` continues is held, as `answers.owner` may see it at `now`.
    pub fn answer(&self, answers: &Answers, now: Instant) -> Held {
        let Some(e) = answers.continues.and_then(|key| self.entries.get(&key)) else {
            return Held::Unknown;
        };
        if now.saturating_duration_since(e.at) > self.ttl {
            return Held::Unknown;
        }
        match e.owner {
            Some(owner) if Some(owner) == answers.owner => Held::By(e.worker),
            _ => Held::Foreign,
        }
    }

    /// Remembers that `key`'s turn went to `worker` at `now`; forgets what the bounds no longer hold.
    pub fn record(&mut self, key: SessionKey, worker: WorkerId, now: Instant) {
        self.insert(key, worker, None, now);
    }

    /// Remembers that `worker` made the stored answer `key` of `owner`, at `now`.
    pub fn record_answer(&mut self, key: SessionKey, owner: Owner, worker: WorkerId, now: Instant) {
        self.insert(key, worker, Some(owner), now);
    }

    fn insert(&mut self, key: SessionKey, worker: WorkerId, owner: Option<Owner>, now: Instant) {
        if self.max_entries == 0 {
            return;
        }
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        if let Some(old) = self.entries.insert(
            key,
            Entry {
                worker,
                owner,
                stamp,
                at: now,
            },
        ) {
            self.by_use.remove(&old.stamp);
        }
        self.by_use.insert(stamp, key);
        // Uses come in time order, so the expired ones are at the front.
        while let Some((&first, &oldest)) = self.by_use.first_key_value() {
            let expired = self
                .entries
                .get(&oldest)
                .is_none_or(|e| now.saturating_duration_since(e.at) > self.ttl);
            if !expired && self.entries.len() <= self.max_entries {
                break;
            }
            self.by_use.remove(&first);
            self.entries.remove(&oldest);
            self.forgotten += 1;
        }
    }

    /// Sessions remembered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sessions forgotten so far (over the size bound or the TTL).
    pub fn forgotten(&self) -> u64 {
        self.forgotten
    }
}
