//! Where tenancy state lives: the embedded usage journal (default, [`journal`]) and Redis (several
//! replicas).
//!
//! **Journal** (the embedded usage store): one JSON line per finished request, appended and
//! `fdatasync`ed in small batches, rotated and compacted into per-period totals ([`journal`]). Why a
//! journal and not a database: a finished request is an immutable fact, written once and never
//! updated, so an append-only file is the whole storage engine we need: one sequential write per
//! batch, crash-safe by construction, readable with `jq`, no dependency. Every record carries the
//! request's id (128 random bits made by the gateway); replay keeps the first record of an id, so a
//! record never counts twice when a write is retried. The window at risk on a hard crash (SIGKILL,
//! power loss) is the batch not yet synced: at most [`JOURNAL_FLUSH`] of requests. A graceful stop
//! (SIGTERM) drains and syncs everything.
//!
//! **Redis** (`tenancy.store: redis`): token buckets and monthly spend shared by all replicas, each
//! admission one Lua script (atomic: check every bucket and the budget, then debit all or none),
//! using the Redis server's clock so replicas' clocks do not matter. Usage records are applied by a
//! script that first does `SET kinf:usage:seen:<id> NX`, so re-sending a record (after a timeout
//! whose answer was lost) never counts it twice. Every call has a timeout
//! (`tenancy.redis_timeout_ms`); what happens to admissions when Redis cannot be reached is each
//! tenant's `on_store_unavailable` (open: admit; closed: 503). Usage reaches Redis summed: the
//! journal hands each synced batch to the forwarder through a channel of [`FORWARD_BATCHES`]
//! batches, the forwarder adds its records into one aggregate per tenant / model / pool /
//! provider and hour (what one record script applies), and sends the aggregates
//! [`AGGREGATES_PER_ROUND_TRIP`] to a pipelined round trip: a journal batch of 512 records of a few
//! tenants is one round trip, not 512. An aggregate sent gets a random id and keeps it until Redis
//! confirmed it, so one that is sent again after a lost answer still applies once; a record id
//! the forwarder saw lately is not added twice. What waits is bounded: at most
//! `tenancy.redis_pending_max` aggregates (a record that would open one more is dropped), and a
//! batch the channel has no room for is dropped whole; both are counted in
//! `kinference_gateway_usage_redis_pending_dropped_total`. A dropped record is still in this
//! replica's journal, but the shared aggregates and monthly spend in Redis never see it. Redis
//! Cluster is not supported (scripts touch keys of several slots); use one primary (with
//! replicas/Sentinel).

pub mod journal;

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::LazyLock;
use std::time::Duration;

use kinference_api::metrics::Described;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;

use super::limits::{Level, LimitVerdict, Take};
use super::usage::UsageRecord;

pub use journal::{JOURNAL_BATCH, JOURNAL_FLUSH, Journal, JournalConfig};
// A tenant's setting (beside `FailMode` in `limits`), also named from here by admission.
pub use super::limits::OnUnrecorded;

/// Hourly aggregates a usage report reads from Redis in one pipelined round trip: the longest report
/// (62 days, 1,489 hours) takes 24.
pub const HOURS_PER_ROUND_TRIP: usize = 64;

/// Aggregates waiting for Redis by default (`tenancy.redis_pending_max`).
pub const DEFAULT_REDIS_PENDING_MAX: usize = 100_000;

/// Journal batches (of up to [`JOURNAL_BATCH`] records) waiting for the forwarder; a batch past
/// them is dropped from forwarding (it is in the journal) and counted.
pub const FORWARD_BATCHES: usize = 256;

/// Aggregates applied in one pipelined round trip to Redis.
pub const AGGREGATES_PER_ROUND_TRIP: usize = 64;

/// Record ids the forwarder remembers, so that a record handed over twice is added once.
const RECENT_IDS: usize = 65_536;

/// Store failures.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The journal file could not be opened or read.
    #[error("usage journal {path}: {source}")]
    Journal {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Redis answered with an error or not in time.
    #[error("redis: {0}")]
    Redis(String),
}

/// What went wrong with the journal (the `error` label).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum JournalError {
    /// A batch could not be written or synced (a full disk, an I/O error).
    Write,
    /// A torn last line, cut off at start.
    TornTail,
    /// An unreadable line in the middle of a segment (or a row of the compacted totals), skipped.
    CorruptLine,
    /// An unreadable first line of the compacted totals: set aside, the file written again.
    CorruptHeader,
    /// The current segment could not be sealed.
    Rotation,
    /// A sealed segment could not be compacted.
    Compaction,
}

impl JournalError {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            JournalError::Write => "write",
            JournalError::TornTail => "torn_tail",
            JournalError::CorruptLine => "corrupt_line",
            JournalError::CorruptHeader => "corrupt_header",
            JournalError::Rotation => "rotation",
            JournalError::Compaction => "compaction",
        }
    }
}

/// `{error}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JournalErrorLabel {
    error: &'static str,
}

/// The usage stores' health metrics (`kinference_gateway_usage_*`). Clones share the series.
#[derive(Debug, Clone, Default)]
pub struct StoreMetrics {
    journal_errors: Family<JournalErrorLabel, Counter>,
    journal_lost: Counter,
    journal_buffered: Gauge,
    journal_refused: Counter,
    redis_pending: Gauge,
    redis_dropped: Counter,
}

impl StoreMetrics {
    /// Registers the series under `kinference_gateway_usage_*`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("kinference_gateway_usage");
        r.register(
            "journal_errors",
            "Usage journal failures: write (a batch not written: full disk, I/O error), torn_tail, corrupt_line, corrupt_header (of the compacted totals), rotation, compaction",
            Described(self.journal_errors.clone()),
        );
        r.register(
            "journal_records_lost",
            "Usage records never written: the journal's buffer or queue overflowed while the disk failed",
            self.journal_lost.clone(),
        );
        r.register(
            "journal_buffered_records",
            "Usage records held in memory because the journal cannot be written",
            self.journal_buffered.clone(),
        );
        r.register(
            "journal_refused_requests",
            "Requests refused (503) while the journal could not be written, of tenants with on_usage_unrecorded: refuse",
            self.journal_refused.clone(),
        );
        r.register(
            "redis_pending_records",
            "Usage records waiting to be applied in Redis",
            self.redis_pending.clone(),
        );
        r.register(
            "redis_pending_dropped",
            "Usage records never sent to Redis (still in the local journal): the forwarding channel was full, or past tenancy.redis_pending_max aggregates",
            self.redis_dropped.clone(),
        );
    }

    /// `n` records will never reach Redis (`why`); logged when dropping begins, then once per
    /// 10,000 records dropped.
    fn redis_dropped_records(&self, n: usize, why: &'static str) {
        if n == 0 {
            return;
        }
        let before = self.redis_dropped.inc_by(n as u64);
        let after = before + n as u64;
        if before == 0 || before / 10_000 != after / 10_000 {
            tracing::warn!(
                dropped = after,
                why,
                "usage records dropped from forwarding to redis; they stay in the local journal"
            );
        }
    }

    fn journal_error(&self, error: JournalError) {
        self.journal_errors
            .get_or_create(&JournalErrorLabel {
                error: error.as_str(),
            })
            .inc();
    }

    /// Journal failures of one kind so far.
    pub fn journal_errors(&self, error: JournalError) -> u64 {
        self.journal_errors
            .get_or_create(&JournalErrorLabel {
                error: error.as_str(),
            })
            .get()
    }

    /// Records lost by the journal so far.
    pub fn journal_lost(&self) -> u64 {
        self.journal_lost.get()
    }

    /// Requests refused while the journal failed, so far.
    pub fn journal_refused(&self) -> u64 {
        self.journal_refused.get()
    }

    /// Records dropped from the Redis queue so far.
    pub fn redis_dropped(&self) -> u64 {
        self.redis_dropped.get()
    }
}

const ADMIT_LUA: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local budget = tonumber(ARGV[1])
if budget >= 0 then
  local spent = tonumber(redis.call('GET', KEYS[1]) or '0')
  if spent >= budget then return {'budget', tostring(spent)} end
end
local n = #KEYS - 1
local levels = {}
local worst = -1
local refused = 0
for i = 1, n do
  local rate = tonumber(ARGV[3 * i - 1])
  local cap = tonumber(ARGV[3 * i])
  local need = math.min(tonumber(ARGV[3 * i + 1]), cap)
  local v = redis.call('HMGET', KEYS[i + 1], 'tokens', 'at')
  local level = cap
  if v[1] then
    level = math.min(cap, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * rate)
  end
  levels[i] = level
  if need > 0 and level < need then
    local wait = (need - level) / rate
    if wait > worst then
      worst = wait
      refused = i
    end
  end
end
local out = {}
if refused > 0 then
  out[1] = 'limited'
  out[2] = tostring(worst)
  out[3] = tostring(refused - 1)
  for i = 1, n do out[i + 3] = tostring(levels[i]) end
  return out
end
out[1] = 'ok'
for i = 1, n do
  local rate = tonumber(ARGV[3 * i - 1])
  local cap = tonumber(ARGV[3 * i])
  local need = math.min(tonumber(ARGV[3 * i + 1]), cap)
  local level = levels[i] - need
  redis.call('HSET', KEYS[i + 1], 'tokens', tostring(level), 'at', tostring(now))
  redis.call('EXPIRE', KEYS[i + 1], math.ceil(cap / rate) + 60)
  out[i + 1] = tostring(level)
end
return out
"#;

const ADJUST_LUA: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i = 1, #KEYS do
  local rate = tonumber(ARGV[3 * i - 2])
  local cap = tonumber(ARGV[3 * i - 1])
  local delta = tonumber(ARGV[3 * i])
  local v = redis.call('HMGET', KEYS[i], 'tokens', 'at')
  local level = cap
  if v[1] then
    level = math.min(cap, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * rate)
  end
  level = math.min(cap, level - delta)
  redis.call('HSET', KEYS[i], 'tokens', tostring(level), 'at', tostring(now))
  redis.call('EXPIRE', KEYS[i], math.ceil(cap / rate) + 60)
end
return 1
"#;

const RECORD_LUA: &str = r#"
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', tonumber(ARGV[7])) then
  local p = ARGV[1]
  redis.call('HINCRBY', KEYS[2], p .. '\31requests', ARGV[2])
  redis.call('HINCRBY', KEYS[2], p .. '\31input_uncached', ARGV[3])
  redis.call('HINCRBY', KEYS[2], p .. '\31input_cached', ARGV[4])
  redis.call('HINCRBY', KEYS[2], p .. '\31output', ARGV[5])
  redis.call('HINCRBYFLOAT', KEYS[2], p .. '\31cost', ARGV[6])
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[8]))
  redis.call('INCRBYFLOAT', KEYS[3], ARGV[6])
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[8]))
  return 1
end
return 0
"#;

static ADMIT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(ADMIT_LUA));
static ADJUST: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(ADJUST_LUA));
static RECORD: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(RECORD_LUA));

/// How long usage aggregates and request ids stay in Redis (40 days: a month plus slack).
const USAGE_TTL_S: u64 = 40 * 24 * 3600;

/// The admission's answer from Redis.
#[derive(Debug, Clone, PartialEq)]
pub enum RedisVerdict {
    /// Buckets answered.
    Buckets(LimitVerdict),
    /// The tenant's monthly spend (the amount) reached its budget.
    BudgetSpent(f64),
}

/// A shared store in Redis.
pub struct RedisStore {
    client: redis::Client,
    conn: Mutex<Option<redis::aio::MultiplexedConnection>>,
    /// No reconnection attempt before this instant (fail fast while Redis is down).
    retry_at: Mutex<Option<std::time::Instant>>,
    timeout: Duration,
    pending: Mutex<Pending>,
    /// At most this many aggregates wait for Redis; past it new ones are dropped.
    pending_max: usize,
    metrics: StoreMetrics,
}

/// A tenant / model / pool / provider's usage in one hour, summed from records.
#[derive(Debug, Clone, Default)]
struct Sums {
    tenant: String,
    requests: u64,
    input_uncached: u64,
    input_cached: u64,
    output: u64,
    cost: f64,
    /// Records summed.
    records: usize,
}

/// An aggregate given its id for sending: once sent, sent again with the same id until Redis
/// confirms it (a lost answer may hide that it was applied).
#[derive(Debug, Clone)]
struct Sealed {
    id: String,
    field: String,
    hour_ms: u64,
    sums: Sums,
    /// Sent at least once (else it may still take more records).
    sent: bool,
}

/// Usage waiting for Redis.
#[derive(Debug, Default)]
struct Pending {
    /// Still adding records: (group field, hour start) -> sums.
    open: BTreeMap<(String, u64), Sums>,
    /// Sent, oldest first.
    sealed: VecDeque<Sealed>,
    /// Records in `open` and `sealed`.
    records: usize,
    /// Record ids seen lately, oldest first.
    recent: VecDeque<String>,
    recent_set: HashSet<String>,
}

impl Pending {
    fn aggregates(&self) -> usize {
        self.open.len() + self.sealed.len()
    }

    /// Whether `id` was not seen lately (it is remembered).
    fn first(&mut self, id: &str) -> bool {
        if self.recent_set.contains(id) {
            return false;
        }
        if self.recent.len() >= RECENT_IDS
            && let Some(old) = self.recent.pop_front()
        {
            self.recent_set.remove(&old);
        }
        self.recent.push_back(id.to_string());
        self.recent_set.insert(id.to_string());
        true
    }

    /// Seals every open aggregate (each gets its id) behind those already sealed.
    fn seal(&mut self) {
        for ((field, hour_ms), sums) in std::mem::take(&mut self.open) {
            self.sealed.push_back(Sealed {
                id: format!("{:032x}", rand::random::<u128>()),
                field,
                hour_ms,
                sums,
                sent: false,
            });
        }
    }

    /// Takes the sealed aggregates never sent back into the open ones (Redis could not be reached:
    /// they keep taking records instead of one more aggregate per group at every retry).
    fn unseal_unsent(&mut self) {
        let (sent, unsent): (VecDeque<Sealed>, VecDeque<Sealed>) = std::mem::take(&mut self.sealed)
            .into_iter()
            .partition(|a| a.sent);
        self.sealed = sent;
        for a in unsent {
            let sums = self
                .open
                .entry((a.field, a.hour_ms))
                .or_insert_with(|| Sums {
                    tenant: a.sums.tenant.clone(),
                    ..Sums::default()
                });
            sums.requests += a.sums.requests;
            sums.input_uncached += a.sums.input_uncached;
            sums.input_cached += a.sums.input_cached;
            sums.output += a.sums.output;
            sums.cost += a.sums.cost;
            sums.records += a.sums.records;
        }
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("timeout", &self.timeout)
            .field("pending", &self.pending.lock().records)
            .finish()
    }
}

impl RedisStore {
    /// A store for `url` (connects lazily; an unreachable Redis is not a start-up error), with
    /// the default queue bound and unregistered metrics.
    pub fn new(url: &str, timeout: Duration) -> Result<Arc<Self>, StoreError> {
        Self::bounded(
            url,
            timeout,
            DEFAULT_REDIS_PENDING_MAX,
            StoreMetrics::default(),
        )
    }

    /// A store for `url` holding at most `pending_max` records not yet applied.
    pub fn bounded(
        url: &str,
        timeout: Duration,
        pending_max: usize,
        metrics: StoreMetrics,
    ) -> Result<Arc<Self>, StoreError> {
        let client = redis::Client::open(url).map_err(|e| StoreError::Redis(e.to_string()))?;
        Ok(Arc::new(RedisStore {
            client,
            conn: Mutex::new(None),
            retry_at: Mutex::new(None),
            timeout,
            pending: Mutex::new(Pending::default()),
            pending_max: pending_max.max(1),
            metrics,
        }))
    }

    async fn connection(&self) -> Result<redis::aio::MultiplexedConnection, StoreError> {
        if let Some(c) = self.conn.lock().clone() {
            return Ok(c);
        }
        if self
            .retry_at
            .lock()
            .is_some_and(|t| std::time::Instant::now() < t)
        {
            return Err(StoreError::Redis(
                "unreachable (waiting to reconnect)".into(),
            ));
        }
        let connected = tokio::time::timeout(
            self.timeout.max(Duration::from_millis(500)),
            self.client.get_multiplexed_async_connection(),
        )
        .await;
        match connected {
            Ok(Ok(c)) => {
                *self.conn.lock() = Some(c.clone());
                *self.retry_at.lock() = None;
                Ok(c)
            }
            Ok(Err(e)) => Err(self.down(e.to_string())),
            Err(_) => Err(self.down("connect timed out".into())),
        }
    }

    fn down(&self, why: String) -> StoreError {
        *self.conn.lock() = None;
        *self.retry_at.lock() = Some(std::time::Instant::now() + Duration::from_secs(1));
        StoreError::Redis(why)
    }

    async fn run<T: redis::FromRedisValue>(
        &self,
        invocation: redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let mut conn = self.connection().await?;
        let answer: Result<redis::RedisResult<T>, _> =
            tokio::time::timeout(self.timeout, invocation.invoke_async(&mut conn)).await;
        match answer {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) if e.is_io_error() || e.is_connection_dropped() => {
                Err(self.down(e.to_string()))
            }
            Ok(Err(e)) => Err(StoreError::Redis(e.to_string())),
            Err(_) => Err(self.down("timed out".into())),
        }
    }

    /// Atomically: the budget (when `budget` is given, against `spend_key`), then every bucket.
    pub async fn admit(
        &self,
        takes: &[Take],
        spend_key: &str,
        budget: Option<f64>,
    ) -> Result<RedisVerdict, StoreError> {
        let mut inv = ADMIT.prepare_invoke();
        inv.key(spend_key);
        inv.arg(budget.map_or_else(|| "-1".to_string(), |b| b.to_string()));
        for t in takes {
            inv.key(&t.key)
                .arg(t.rate_per_s.to_string())
                .arg(t.capacity.to_string())
                .arg(t.amount.to_string());
        }
        let out: Vec<String> = self.run(inv).await?;
        parse_admit(&out, takes.len())
            .ok_or_else(|| StoreError::Redis(format!("unexpected admission answer {out:?}")))
    }

    /// Debits or refunds without checking (reconciliation).
    pub async fn adjust(&self, takes: &[Take]) -> Result<(), StoreError> {
        let takes: Vec<&Take> = takes.iter().filter(|t| t.amount != 0.0).collect();
        if takes.is_empty() {
            return Ok(());
        }
        let mut inv = ADJUST.prepare_invoke();
        for t in takes {
            inv.key(&t.key)
                .arg(t.rate_per_s.to_string())
                .arg(t.capacity.to_string())
                .arg(t.amount.to_string());
        }
        let _: i64 = self.run(inv).await?;
        Ok(())
    }

    /// The command applying one aggregate once (by its id).
    fn record_cmd(a: &Sealed) -> redis::Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(RECORD.get_hash())
            .arg(3)
            .arg(format!("kinf:usage:seen:{}", a.id))
            .arg(format!(
                "kinf:usage:h:{}",
                super::budget::hour_key(a.hour_ms)
            ))
            .arg(super::budget::spend_key(&a.sums.tenant, a.hour_ms))
            .arg(&a.field)
            .arg(a.sums.requests)
            .arg(a.sums.input_uncached)
            .arg(a.sums.input_cached)
            .arg(a.sums.output)
            .arg(a.sums.cost.to_string())
            .arg(USAGE_TTL_S)
            .arg(USAGE_TTL_S);
        cmd
    }

    /// Applies `batch` in one pipelined round trip (the script loaded first, in the same trip, so a
    /// restarted Redis needs nothing more). The error says whether anything may have been sent.
    async fn apply(&self, batch: &[Sealed]) -> Result<(), (StoreError, bool)> {
        let mut conn = self.connection().await.map_err(|e| (e, false))?;
        let mut pipe = redis::pipe();
        pipe.cmd("SCRIPT").arg("LOAD").arg(RECORD_LUA).ignore();
        for a in batch {
            pipe.add_command(Self::record_cmd(a)).ignore();
        }
        let answer: Result<redis::RedisResult<()>, _> =
            tokio::time::timeout(self.timeout, pipe.query_async(&mut conn)).await;
        match answer {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) if e.is_io_error() || e.is_connection_dropped() => {
                Err((self.down(e.to_string()), true))
            }
            Ok(Err(e)) => Err((StoreError::Redis(e.to_string()), true)),
            Err(_) => Err((self.down("timed out".into()), true)),
        }
    }

    /// Forwards synced journal batches to Redis, summed per tenant and hour, retrying what fails
    /// (each aggregate applies once).
    pub async fn forward_usage(self: Arc<Self>, mut rx: mpsc::Receiver<Vec<UsageRecord>>) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            let open = tokio::select! {
                batch = rx.recv() => match batch {
                    Some(b) => { self.enqueue(b); true }
                    None => false,
                },
                _ = tick.tick() => true,
            };
            // What else is already waiting joins the same round trips.
            while let Ok(b) = rx.try_recv() {
                self.enqueue(b);
            }
            self.drain().await;
            if !open {
                return;
            }
        }
    }

    /// Adds records to their aggregates; a record that would open one past `pending_max` is
    /// dropped (and counted).
    fn enqueue(&self, records: Vec<UsageRecord>) {
        let mut dropped = 0;
        let mut pending = self.pending.lock();
        for r in records {
            if !pending.first(&r.id) {
                continue;
            }
            let hour_ms = r.ts_ms - r.ts_ms % 3_600_000;
            let key = (r.group_field(), hour_ms);
            if !pending.open.contains_key(&key) && pending.aggregates() >= self.pending_max {
                dropped += 1;
                continue;
            }
            let sums = pending.open.entry(key).or_insert_with(|| Sums {
                tenant: r.tenant.clone(),
                ..Sums::default()
            });
            sums.requests += r.requests;
            sums.input_uncached += r.input_uncached;
            sums.input_cached += r.input_cached;
            sums.output += r.output;
            sums.cost += r.cost;
            sums.records += 1;
            pending.records += 1;
        }
        self.metrics.redis_pending.set(pending.records as i64);
        drop(pending);
        self.metrics
            .redis_dropped_records(dropped, "past tenancy.redis_pending_max aggregates");
    }

    async fn drain(&self) {
        loop {
            let batch: Vec<Sealed> = {
                let mut pending = self.pending.lock();
                pending.seal();
                pending
                    .sealed
                    .iter()
                    .take(AGGREGATES_PER_ROUND_TRIP)
                    .cloned()
                    .collect()
            };
            if batch.is_empty() {
                return;
            }
            match self.apply(&batch).await {
                Ok(()) => {
                    let mut pending = self.pending.lock();
                    let applied: usize = pending
                        .sealed
                        .drain(..batch.len())
                        .map(|a| a.sums.records)
                        .sum();
                    pending.records -= applied;
                    self.metrics.redis_pending.set(pending.records as i64);
                }
                Err((error, sent)) => {
                    let mut pending = self.pending.lock();
                    if sent {
                        for a in pending.sealed.iter_mut().take(batch.len()) {
                            a.sent = true;
                        }
                    }
                    pending.unseal_unsent();
                    let queued = pending.records;
                    drop(pending);
                    tracing::warn!(%error, queued, "usage records not yet in redis; retrying");
                    return;
                }
            }
        }
    }

    /// Records not yet applied in Redis.
    pub fn pending(&self) -> usize {
        self.pending.lock().records
    }

    /// This month's spend of a tenant as Redis has it.
    pub async fn spent(&self, spend_key: &str) -> Result<f64, StoreError> {
        let mut conn = self.connection().await?;
        let cmd = redis::cmd("GET").arg(spend_key).clone();
        let v: Option<String> = tokio::time::timeout(self.timeout, cmd.query_async(&mut conn))
            .await
            .map_err(|_| self.down("timed out".into()))?
            .map_err(|e| StoreError::Redis(e.to_string()))?;
        Ok(v.and_then(|s| s.parse().ok()).unwrap_or(0.0))
    }

    /// The aggregates of each of `hours` (`YYYYMMDDHH`), in order: field -> value. Read
    /// [`HOURS_PER_ROUND_TRIP`] to a pipelined round trip, each within the timeout.
    pub async fn hours(&self, hours: &[String]) -> Result<Vec<Vec<(String, String)>>, StoreError> {
        let mut out = Vec::with_capacity(hours.len());
        for batch in hours.chunks(HOURS_PER_ROUND_TRIP) {
            let mut conn = self.connection().await?;
            let mut pipe = redis::pipe();
            for hour in batch {
                pipe.cmd("HGETALL").arg(format!("kinf:usage:h:{hour}"));
            }
            let answers: Vec<Vec<(String, String)>> =
                tokio::time::timeout(self.timeout, pipe.query_async(&mut conn))
                    .await
                    .map_err(|_| self.down("timed out".into()))?
                    .map_err(|e| StoreError::Redis(e.to_string()))?;
            out.extend(answers);
        }
        Ok(out)
    }

    /// The aggregates of one hour (`YYYYMMDDHH`): field -> value.
    pub async fn hour(&self, hour: &str) -> Result<Vec<(String, String)>, StoreError> {
        let mut conn = self.connection().await?;
        let cmd = redis::cmd("HGETALL")
            .arg(format!("kinf:usage:h:{hour}"))
            .clone();
        tokio::time::timeout(self.timeout, cmd.query_async(&mut conn))
            .await
            .map_err(|_| self.down("timed out".into()))?
            .map_err(|e| StoreError::Redis(e.to_string()))
    }
}

fn parse_admit(out: &[String], n: usize) -> Option<RedisVerdict> {
    let num = |s: &String| s.parse::<f64>().ok();
    match out.first()?.as_str() {
        "budget" => Some(RedisVerdict::BudgetSpent(num(out.get(1)?)?)),
        "ok" => {
            let levels = out[1..]
                .iter()
                .map(|s| num(s).map(|remaining| Level { remaining }))
                .collect::<Option<Vec<_>>>()?;
            (levels.len() == n).then_some(RedisVerdict::Buckets(LimitVerdict::Admitted(levels)))
        }
        "limited" => {
            let levels = out
                .get(3..)?
                .iter()
                .map(|s| num(s).map(|remaining| Level { remaining }))
                .collect::<Option<Vec<_>>>()?;
            Some(RedisVerdict::Buckets(LimitVerdict::Limited {
                retry_after_s: num(out.get(1)?)?,
                refused: out.get(2)?.parse().ok()?,
                levels,
            }))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests;
