//! Deterministic request sequences for the routing benchmark.
//!
//! A [`Workload`] is a list of [`Session`]s; a virtual user takes the next session and sends its turns in
//! order (a turn of a multi-turn conversation is only sent after the previous one has been answered, as a
//! real chat client would). The same seed always gives the same sequence, so every routing policy is
//! measured on exactly the same requests.
//!
//! Three workloads change *when* and *where* the shared-prefix requests run rather than what they
//! are: `bursty` sends them in bursts at fixed times ([`Workload::schedule_bursts`]: an open-loop
//! arrival schedule, the same for every policy), `heterogeneous` runs them on a mixed fleet (workers
//! of different speeds and cache sizes, one slowed halfway: `super::fleet`) and `restart` on the same
//! fleet with one worker restarted halfway instead.
//!
//! Text is drawn from a vocabulary of common English words that the Qwen2 tokenizer encodes as one token
//! each (with their leading space), so a prompt of `n` words is close to `n` tokens.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};

#[cfg(test)]
mod tests;

/// The three workloads of the published experiment, and two that stress what a hash cannot see.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// A few long shared system prompts, each followed by a short distinct question.
    SharedPrefix,
    /// Prompts of similar lengths with no shared prefix.
    Unique,
    /// Conversations whose every turn resends the growing history plus a new user message.
    MultiTurn,
    /// Shared-prefix requests on a mixed fleet: fast workers with large caches beside slow ones with
    /// small caches, one fast worker slowed halfway through the run (`super::fleet::FleetPlan`).
    Heterogeneous,
    /// Shared-prefix requests on the heterogeneous fleet with one fast worker killed halfway through
    /// the run and started again, cold, a little later (`super::fleet::FleetPlan::restart`).
    Restart,
    /// Shared-prefix requests arriving in bursts (a burst of `concurrency` requests every
    /// [`WorkloadShape::burst_period_s`]) instead of from users that each wait for their last answer.
    Bursty,
}

impl WorkloadKind {
    /// All workloads, in report order.
    pub const ALL: [WorkloadKind; 6] = [
        Self::SharedPrefix,
        Self::Unique,
        Self::MultiTurn,
        Self::Heterogeneous,
        Self::Restart,
        Self::Bursty,
    ];

    /// The TTFT service-level objective used for goodput (published: 8 s shared prefix, 4 s multi-turn).
    pub fn ttft_slo_s(self) -> f64 {
        match self {
            Self::SharedPrefix
            | Self::Unique
            | Self::Heterogeneous
            | Self::Restart
            | Self::Bursty => 8.0,
            Self::MultiTurn => 4.0,
        }
    }

    /// The name used on the command line and in the results.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SharedPrefix => "shared-prefix",
            Self::Unique => "unique",
            Self::MultiTurn => "multi-turn",
            Self::Heterogeneous => "heterogeneous",
            Self::Restart => "restart",
            Self::Bursty => "bursty",
        }
    }
}

impl fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A workload name that is not one of [`WorkloadKind::ALL`].
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown workload {0:?} (expected shared-prefix, unique, multi-turn, heterogeneous, restart or bursty)"
)]
pub struct UnknownWorkload(String);

impl FromStr for WorkloadKind {
    type Err = UnknownWorkload;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "shared-prefix" => Ok(Self::SharedPrefix),
            "unique" => Ok(Self::Unique),
            "multi-turn" => Ok(Self::MultiTurn),
            "heterogeneous" => Ok(Self::Heterogeneous),
            "restart" => Ok(Self::Restart),
            "bursty" => Ok(Self::Bursty),
            other => Err(UnknownWorkload(other.to_string())),
        }
    }
}

/// Sizes of the generated prompts (in words, about one token each).
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadShape {
    /// Number of distinct shared system prompts (shared-prefix).
    pub shared_prefixes: usize,
    /// Words per shared system prompt (shared-prefix), and the mean prompt length of `unique`.
    pub prefix_words: usize,
    /// Words per question: uniform in this range (shared-prefix; unique adds it to its prompt length).
    pub question_words: (usize, usize),
    /// Completion tokens per request (shared-prefix and unique).
    pub max_tokens: u32,
    /// Words of the first user message of a conversation (multi-turn): uniform in this range.
    pub first_turn_words: (usize, usize),
    /// Words of each later user message (multi-turn): uniform in this range.
    pub followup_words: (usize, usize),
    /// Turns per conversation (multi-turn): uniform in this range.
    pub turns: (usize, usize),
    /// Completion tokens per turn (multi-turn); the canned assistant reply in the history has as many words.
    pub turn_max_tokens: u32,
    /// Simulated seconds from one burst to the next (bursty).
    pub burst_period_s: f64,
    /// A burst's requests arrive spread uniformly over this many simulated seconds (bursty).
    pub burst_spread_s: f64,
}

impl Default for WorkloadShape {
    /// Sized against the calibrated `l40s-27b-fp8` worker (4,096 blocks of 16 tokens = 65,536 tokens of
    /// KV cache): the 20 shared prompts of ~7,500 tokens (~150k tokens) do not fit in one worker's cache
    /// but do fit in three when each prompt lives on one worker, the situation in which routing decides
    /// between a cache hit and a 2-second prefill. Multi-turn histories grow to ~5-8k tokens.
    fn default() -> Self {
        Self {
            shared_prefixes: 20,
            prefix_words: 7000,
            question_words: (20, 60),
            max_tokens: 64,
            first_turn_words: (3000, 5000),
            followup_words: (100, 300),
            turns: (4, 8),
            turn_max_tokens: 96,
            // Long enough for three workers to drain a burst of 8-16 mostly cached requests (each
            // ~2-3 s of decode), short enough that a burst of 32 overlaps the next one.
            burst_period_s: 6.0,
            burst_spread_s: 0.5,
        }
    }
}

impl WorkloadShape {
    /// Mean turns of a multi-turn conversation.
    pub fn mean_turns(&self) -> usize {
        (self.turns.0 + self.turns.1).div_ceil(2).max(1)
    }
}

/// One chat message in OpenAI format.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: &'static str,
    /// The text.
    pub content: String,
}

/// One request of the sequence: an OpenAI chat completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatRequest {
    /// Index of the session (conversation) it belongs to.
    pub session: usize,
    /// Turn within the session, from 0.
    pub turn: usize,
    /// The whole conversation so far, ending with the new user message.
    pub messages: Vec<Message>,
    /// Completion tokens asked for.
    pub max_tokens: u32,
}

impl ChatRequest {
    /// The request body for `POST /v1/chat/completions` (streaming with usage when `stream`).
    pub fn body(&self, model: &str, stream: bool) -> Value {
        let mut body = json!({
            "model": model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        });
        if stream {
            body["stream"] = Value::Bool(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    }

    /// Total words of the conversation (about its prompt tokens, without the chat template).
    pub fn words(&self) -> usize {
        self.messages
            .iter()
            .map(|m| m.content.split_whitespace().count())
            .sum()
    }
}

/// A sequence of requests sent one after the other by one virtual user.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    /// The turns, in order.
    pub requests: Vec<ChatRequest>,
    /// When the session arrives, in simulated seconds after the run starts (an open-loop schedule:
    /// TTFT then counts from this moment, even if every virtual user was still busy). `None`: as soon
    /// as a virtual user is free.
    pub arrival_s: Option<f64>,
}

/// A deterministic request sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// Which workload this is.
    pub kind: WorkloadKind,
    /// Sessions in the order virtual users take them.
    pub sessions: Vec<Session>,
}

impl Workload {
    /// Generates exactly `requests` requests of `kind` from `seed`.
    ///
    /// A longer sequence from the same seed starts with the shorter one (the runs at low concurrency use
    /// a prefix of the sequence used at high concurrency).
    pub fn generate(kind: WorkloadKind, shape: &WorkloadShape, seed: u64, requests: usize) -> Self {
        let sessions = match kind {
            WorkloadKind::SharedPrefix
            | WorkloadKind::Heterogeneous
            | WorkloadKind::Restart
            | WorkloadKind::Bursty => shared_prefix(shape, seed, requests),
            WorkloadKind::Unique => unique(shape, seed, requests),
            WorkloadKind::MultiTurn => multi_turn(shape, seed, requests),
        };
        Self { kind, sessions }
    }

    /// Number of requests over all sessions.
    pub fn len(&self) -> usize {
        self.sessions.iter().map(|s| s.requests.len()).sum()
    }

    /// Whether there is no request at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Splits off the first sessions holding at least `requests` requests (a warm-up phase) from the
    /// rest.
    pub fn split_at_requests(mut self, requests: usize) -> (Workload, Workload) {
        let mut taken = 0;
        let mut cut = 0;
        while cut < self.sessions.len() && taken < requests {
            taken += self.sessions[cut].requests.len();
            cut += 1;
        }
        let rest = Workload {
            kind: self.kind,
            sessions: self.sessions.split_off(cut),
        };
        (self, rest)
    }

    /// Gives the sessions an arrival schedule: bursts of `burst_size` sessions, one every
    /// `shape.burst_period_s` simulated seconds from 0, each session of a burst arriving at a time drawn
    /// uniformly from the burst's first `shape.burst_spread_s` seconds (from `seed`: the same schedule
    /// for every policy), sorted so that virtual users take them in arrival order.
    pub fn schedule_bursts(&mut self, shape: &WorkloadShape, burst_size: usize, seed: u64) {
        let burst_size = burst_size.max(1);
        let mut rng = rng_for(seed, 5);
        for (i, session) in self.sessions.iter_mut().enumerate() {
            let burst = (i / burst_size) as f64;
            let offset = if shape.burst_spread_s > 0.0 {
                rng.random_range(0.0..shape.burst_spread_s)
            } else {
                0.0
            };
            session.arrival_s = Some(burst * shape.burst_period_s + offset);
        }
        self.sessions.sort_by(|a, b| {
            a.arrival_s
                .unwrap_or(0.0)
                .total_cmp(&b.arrival_s.unwrap_or(0.0))
        });
    }

    /// All requests in session order.
    pub fn requests(&self) -> impl Iterator<Item = &ChatRequest> {
        self.sessions.iter().flat_map(|s| s.requests.iter())
    }
}

/// Common English words the Qwen2 tokenizer encodes as one token each (after a space).
const VOCABULARY: &str = "\
the of and to in is that for it as was with be by on not he this are or his from at which but \
have an had they you were their one all we can her has there been if more when will would who so \
no she other its may these what them than some him time into only do could new about two first \
then also any my now such like our over man me even most made after many must before years back \
through much where your way down should because each just those people how too good very make \
world still own see work long get here between both life being under never day same another know \
while last might great old year off come since against go came right used take three house use \
during without again place around however home small found thought went say part once general \
high upon school every don does got united left number course war until always away something \
fact water though less public put think almost hand enough far took head yet government system \
better set told nothing night end why called didn eyes find going look asked later knew point \
next program city business give group toward young let room side social present given several \
order national second possible rather per face among form important often things looked early \
white case become large need big four within felt along children saw best church ever least \
power development light thing seemed family interest want members mind country area others done \
turned although open problem certain kind different door thus help sense means whole matter \
perhaps itself york times law human line above name example action company hands local show five \
history whether gave either today act feet across taken past quite anything seen having death \
week experience body word half really field am car words already themselves information tell \
together college shall money period held keep sure real probably free seems political cannot \
behind miss question air office making brought whose special major heard problems federal became \
study ago moment known result street economic boy position reason change south board individual \
job areas society west close turn love community true court force full seem wife age future \
voice center woman control common policy necessary following front sometimes six girl clear \
further land run students provide feel party able mother music education university child effect \
level stood military town short morning total outside rate figure class art century washington \
north usually leave therefore evidence plan million sound top black strong hard various believe \
type value play surface soon mean near lines table peace modern tax road red book personal \
process situation minutes increase idea english alone women gone nor living america started \
longer cut finally third nature private secretary section greater call fire expected needed kept \
ground view values everything pressure basis east required spirit union father";

/// [`VOCABULARY`] as a list.
fn words() -> &'static [&'static str] {
    static WORDS: OnceLock<Vec<&'static str>> = OnceLock::new();
    WORDS.get_or_init(|| VOCABULARY.split_whitespace().collect())
}

/// Appends `n` pseudo-random words (with a sentence break now and then) to `out`.
fn push_words(rng: &mut StdRng, out: &mut String, n: usize) {
    let words = words();
    for i in 0..n {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(words[rng.random_range(0..words.len())]);
        // A full stop every ~12 words keeps the text looking like prose (and tokenizing like it).
        if i + 1 < n && rng.random_range(0..12) == 0 {
            out.push('.');
        }
    }
    out.push('.');
}

fn uniform(rng: &mut StdRng, (lo, hi): (usize, usize)) -> usize {
    if hi <= lo {
        lo
    } else {
        rng.random_range(lo..=hi)
    }
}

/// A text that starts with a label no other text shares, so that distinct texts share no prefix block.
fn labelled_text(rng: &mut StdRng, label: &str, words: usize) -> String {
    let mut text = format!("{label}:");
    push_words(rng, &mut text, words);
    text
}

/// Stream ids keep the parts of a workload independent: adding requests never changes the prefixes.
fn rng_for(seed: u64, stream: u64) -> StdRng {
    StdRng::seed_from_u64(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn shared_prefix(shape: &WorkloadShape, seed: u64, requests: usize) -> Vec<Session> {
    let mut prefix_rng = rng_for(seed, 1);
    let prefixes: Vec<String> = (0..shape.shared_prefixes.max(1))
        .map(|p| {
            labelled_text(
                &mut prefix_rng,
                &format!("System prompt {p} of seed {seed}"),
                shape.prefix_words,
            )
        })
        .collect();
    let mut rng = rng_for(seed, 2);
    (0..requests)
        .map(|i| {
            let prefix = &prefixes[rng.random_range(0..prefixes.len())];
            let words = uniform(&mut rng, shape.question_words);
            let question = labelled_text(&mut rng, &format!("Question {i}"), words);
            Session {
                requests: vec![ChatRequest {
                    session: i,
                    turn: 0,
                    messages: vec![
                        Message {
                            role: "system",
                            content: prefix.clone(),
                        },
                        Message {
                            role: "user",
                            content: question,
                        },
                    ],
                    max_tokens: shape.max_tokens,
                }],
                arrival_s: None,
            }
        })
        .collect()
}

fn unique(shape: &WorkloadShape, seed: u64, requests: usize) -> Vec<Session> {
    let mut rng = rng_for(seed, 3);
    (0..requests)
        .map(|i| {
            // Same length distribution as a shared-prefix request, but nothing shared.
            let words = shape.prefix_words + uniform(&mut rng, shape.question_words);
            let content = labelled_text(
                &mut rng,
                &format!("Unique prompt {i} of seed {seed}"),
                words,
            );
            Session {
                requests: vec![ChatRequest {
                    session: i,
                    turn: 0,
                    messages: vec![Message {
                        role: "user",
                        content,
                    }],
                    max_tokens: shape.max_tokens,
                }],
                arrival_s: None,
            }
        })
        .collect()
}

fn multi_turn(shape: &WorkloadShape, seed: u64, requests: usize) -> Vec<Session> {
    let mut rng = rng_for(seed, 4);
    let mut sessions = Vec::new();
    let mut left = requests;
    while left > 0 {
        let session = sessions.len();
        let turns = uniform(&mut rng, shape.turns).max(1).min(left);
        let mut history: Vec<Message> = Vec::new();
        let mut session_requests = Vec::with_capacity(turns);
        for turn in 0..turns {
            let words = if turn == 0 {
                uniform(&mut rng, shape.first_turn_words)
            } else {
                uniform(&mut rng, shape.followup_words)
            };
            history.push(Message {
                role: "user",
                content: labelled_text(
                    &mut rng,
                    &format!("Conversation {session} of seed {seed}, turn {turn}"),
                    words,
                ),
            });
            session_requests.push(ChatRequest {
                session,
                turn,
                messages: history.clone(),
                max_tokens: shape.turn_max_tokens,
            });
            // The reply the client puts in the history is canned (not the simulator's actual output), so
            // the sequence stays identical for every policy; the prompt blocks of the previous turn are
            // still a prefix of the next turn's prompt, which is what the cache reuses.
            let mut reply = String::new();
            push_words(&mut rng, &mut reply, shape.turn_max_tokens as usize);
            history.push(Message {
                role: "assistant",
                content: reply,
            });
        }
        left -= session_requests.len();
        sessions.push(Session {
            requests: session_requests,
            arrival_s: None,
        });
    }
    sessions
}
