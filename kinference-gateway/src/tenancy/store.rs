//! Where tenancy state lives: the embedded usage journal (default) and Redis (several replicas).
//!
//! **Journal** (the embedded usage store): one JSON line per finished request, appended by one writer
//! task and `fdatasync`ed in small batches (at most [`JOURNAL_BATCH`] records or
//! [`JOURNAL_FLUSH`] after the first one), replayed at start-up. Why a journal and not a database: a
//! finished request is an immutable fact, written once and never updated, so an append-only file is
//! the whole storage engine we need: one sequential write per batch, crash-safe by construction (a
//! torn last line is detected and ignored on replay), readable with `jq`, no dependency. Every record
//! carries the request's id (128 random bits made by the gateway); replay keeps the first record of
//! an id, so a record can never count twice even if a future writer retries. The window at risk on a
//! hard crash (SIGKILL, power loss) is the batch not yet synced: at most [`JOURNAL_FLUSH`] of
//! requests. A graceful stop (SIGTERM) drains and syncs everything.
//!
//! **Redis** (`tenancy.store: redis`): token buckets and monthly spend shared by all replicas, each
//! admission one Lua script (atomic: check every bucket and the budget, then debit all or none),
//! using the Redis server's clock so replicas' clocks do not matter. Usage records are applied by a
//! script that first does `SET kinf:usage:seen:<id> NX`, so re-sending a record (after a timeout
//! whose answer was lost) never counts it twice. Every call has a timeout
//! (`tenancy.redis_timeout_ms`); what happens to admissions when Redis cannot be reached is each
//! tenant's `on_store_unavailable` (open: admit; closed: 503). Usage records that cannot be sent
//! stay queued in memory and are retried (they are in the local journal either way). Redis Cluster
//! is not supported (scripts touch keys of several slots); use one primary (with replicas/Sentinel).

use std::collections::VecDeque;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::LazyLock;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

use super::limits::{Level, Take, Verdict};
use super::usage::UsageRecord;

/// Records per journal batch (one write + one fdatasync).
pub const JOURNAL_BATCH: usize = 512;
/// Longest time a record waits for its batch to be synced.
pub const JOURNAL_FLUSH: Duration = Duration::from_millis(20);

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

enum JournalMsg {
    Record(UsageRecord),
    Flush(oneshot::Sender<()>),
}

/// The append-only usage journal's writer handle.
#[derive(Debug, Clone)]
pub struct Journal {
    tx: mpsc::UnboundedSender<JournalMsg>,
}

impl std::fmt::Debug for JournalMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JournalMsg")
    }
}

impl Journal {
    /// Reads every record of `path` (created if missing, with its directory), deduplicated by request
    /// id, then starts the writer task. `after_sync` gets each synced batch (Redis forwarding).
    pub fn open(
        path: &Path,
        after_sync: Option<mpsc::UnboundedSender<Vec<UsageRecord>>>,
    ) -> Result<(Journal, Vec<UsageRecord>), StoreError> {
        let err = |source| StoreError::Journal {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let records = replay(path).map_err(err)?;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)
            .map_err(err)?;
        // A torn last line (crash mid-write) must not swallow the next record: start a new line.
        if ends_without_newline(&mut file).map_err(err)? {
            file.write_all(b"\n")
                .and_then(|()| file.sync_data())
                .map_err(err)?;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let path = path.to_owned();
        std::thread::Builder::new()
            .name("usage-journal".into())
            .spawn(move || writer(file, path, rx, after_sync))
            .map_err(err)?;
        Ok((Journal { tx }, records))
    }

    /// Queues a record (written and synced within [`JOURNAL_FLUSH`]).
    pub fn append(&self, record: UsageRecord) {
        if self.tx.send(JournalMsg::Record(record)).is_err() {
            tracing::error!("usage journal writer is gone; a usage record was lost");
        }
    }

    /// Waits until everything queued so far is on disk.
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(JournalMsg::Flush(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

fn ends_without_newline(file: &mut std::fs::File) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let len = file.metadata()?.len();
    if len == 0 {
        return Ok(false);
    }
    file.seek(SeekFrom::Start(len - 1))?;
    let mut last = [0u8; 1];
    file.read_exact(&mut last)?;
    Ok(last[0] != b'\n')
}

/// The records of a journal file, first record of each id only; a torn or corrupt line is skipped.
pub fn replay(path: &Path) -> std::io::Result<Vec<UsageRecord>> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    let mut skipped = 0usize;
    for line in std::io::BufReader::new(file).split(b'\n') {
        let line = line?;
        if line.trim_ascii().is_empty() {
            continue;
        }
        match serde_json::from_slice::<UsageRecord>(&line) {
            Ok(r) => {
                if seen.insert(r.id.clone()) {
                    out.push(r);
                }
            }
            Err(_) => skipped += 1,
        }
    }
    if skipped > 0 {
        tracing::warn!(path = %path.display(), skipped, "usage journal: unreadable lines skipped (a torn write at a crash)");
    }
    Ok(out)
}

fn writer(
    mut file: std::fs::File,
    path: PathBuf,
    mut rx: mpsc::UnboundedReceiver<JournalMsg>,
    after_sync: Option<mpsc::UnboundedSender<Vec<UsageRecord>>>,
) {
    let mut buf = Vec::with_capacity(64 * 1024);
    loop {
        // Block for the first message, then take what arrives within the flush window.
        let Some(first) = rx.blocking_recv() else {
            return;
        };
        let mut batch = Vec::new();
        let mut waiters = Vec::new();
        let deadline = std::time::Instant::now() + JOURNAL_FLUSH;
        let mut next = Some(first);
        loop {
            match next.take() {
                Some(JournalMsg::Record(r)) => batch.push(r),
                Some(JournalMsg::Flush(w)) => {
                    waiters.push(w);
                    break;
                }
                None => {}
            }
            if batch.len() >= JOURNAL_BATCH {
                break;
            }
            match rx.try_recv() {
                Ok(m) => next = Some(m),
                Err(mpsc::error::TryRecvError::Empty) => {
                    if std::time::Instant::now() >= deadline {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(mpsc::error::TryRecvError::Disconnected) => break,
            }
        }
        if !batch.is_empty() {
            buf.clear();
            for r in &batch {
                // Serializing a plain struct into a Vec cannot fail.
                let _ = serde_json::to_writer(&mut buf, r);
                buf.push(b'\n');
            }
            if let Err(error) = file.write_all(&buf).and_then(|()| file.sync_data()) {
                tracing::error!(path = %path.display(), %error, records = batch.len(), "usage journal write failed");
            }
            if let Some(tx) = &after_sync {
                let _ = tx.send(batch);
            }
        }
        for w in waiters {
            let _ = w.send(());
        }
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
    Buckets(Verdict),
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
    pending: Mutex<VecDeque<UsageRecord>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("timeout", &self.timeout)
            .field("pending", &self.pending.lock().len())
            .finish()
    }
}

impl RedisStore {
    /// A store for `url` (connects lazily; an unreachable Redis is not a start-up error).
    pub fn new(url: &str, timeout: Duration) -> Result<Arc<Self>, StoreError> {
        let client = redis::Client::open(url).map_err(|e| StoreError::Redis(e.to_string()))?;
        Ok(Arc::new(RedisStore {
            client,
            conn: Mutex::new(None),
            retry_at: Mutex::new(None),
            timeout,
            pending: Mutex::new(VecDeque::new()),
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

    /// Applies one usage record once (by request id).
    async fn record(&self, r: &UsageRecord) -> Result<bool, StoreError> {
        let mut inv = RECORD.prepare_invoke();
        inv.key(format!("kinf:usage:seen:{}", r.id))
            .key(format!("kinf:usage:h:{}", super::budget::hour_key(r.ts_ms)))
            .key(super::budget::spend_key(&r.tenant, r.ts_ms))
            .arg(r.group_field())
            .arg(r.requests)
            .arg(r.input_uncached)
            .arg(r.input_cached)
            .arg(r.output)
            .arg(r.cost.to_string())
            .arg(USAGE_TTL_S)
            .arg(USAGE_TTL_S);
        let applied: i64 = self.run(inv).await?;
        Ok(applied == 1)
    }

    /// Forwards synced journal batches to Redis, retrying what fails (each record applies once).
    pub async fn forward_usage(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<Vec<UsageRecord>>) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                batch = rx.recv() => match batch {
                    Some(b) => self.pending.lock().extend(b),
                    None => { self.drain().await; return; }
                },
                _ = tick.tick() => {}
            }
            self.drain().await;
        }
    }

    async fn drain(&self) {
        loop {
            let Some(next) = self.pending.lock().front().cloned() else {
                return;
            };
            match self.record(&next).await {
                Ok(_) => {
                    self.pending.lock().pop_front();
                }
                Err(error) => {
                    let queued = self.pending.lock().len();
                    tracing::warn!(%error, queued, "usage records not yet in redis; retrying");
                    return;
                }
            }
        }
    }

    /// Records not yet applied in Redis.
    pub fn pending(&self) -> usize {
        self.pending.lock().len()
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
            (levels.len() == n).then_some(RedisVerdict::Buckets(Verdict::Admitted(levels)))
        }
        "limited" => {
            let levels = out
                .get(3..)?
                .iter()
                .map(|s| num(s).map(|remaining| Level { remaining }))
                .collect::<Option<Vec<_>>>()?;
            Some(RedisVerdict::Buckets(Verdict::Limited {
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
