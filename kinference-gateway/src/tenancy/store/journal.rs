//! The embedded usage journal: one JSON line per finished request, bounded on disk, in memory and
//! in replay time.
//!
//! Files, for `usage_journal: /data/kinference-usage.jsonl`:
//! - `kinference-usage.jsonl`, the current segment: appended by one writer thread and
//!   `fdatasync`ed in small batches (at most [`JOURNAL_BATCH`] records, or [`JOURNAL_FLUSH`] after
//!   the first one).
//! - `kinference-usage.jsonl.000042`, a sealed segment: past `segment_max_bytes` or
//!   `segment_max_age_s` the current segment is renamed to the next number and a new one begun.
//!   The sealed segment is compacted by the compactor thread and deleted; it outlives that only
//!   while the compactor is at work, when a compaction failed or the process died, and the next
//!   rotation or start compacts it.
//! - `kinference-usage.jsonl.compacted`: totals per period (`period`: hour or day) and tenant /
//!   model / pool / provider of every compacted segment, the newest `keep_periods` periods. Its
//!   first line says through which segment number it counts, so that a segment is never counted
//!   twice (a crash between writing the totals and deleting the segment leaves a segment the next
//!   start deletes). Rewritten whole each time: temporary file, fsync, rename.
//! - `kinference-usage.jsonl.corrupt`: the torn last lines cut off at start, and unreadable first
//!   lines of the compacted file, kept for a person.
//!
//! Compaction never holds up the writer: rotation is a rename, after which the writer only nudges
//! the compactor thread (a one-place channel, never waited on) and goes on appending. The compactor
//! owns the totals and reads the sealed files, which nobody writes any more: a snapshot by
//! construction. A slow or stuck compaction (a slow disk, a huge segment) delays only the deletion
//! of sealed segments, never a usage record.
//!
//! Start-up reads the compacted totals and the current segment only, so its time is bounded by the
//! segment size, not by the journal's age. Hours and days never straddle a month (UTC), so monthly
//! spend replays exactly from the totals.
//!
//! Crash safety: a torn last line (a crash mid-write) is cut off at start, moved to `.corrupt` and
//! counted; a corrupt line in the middle is skipped up to its newline and counted, and a record
//! that a torn write ran into is still read. The compacted file is replaced whole by a rename, so
//! a crash never tears it, but a disk can: an unreadable row is skipped and counted, and an
//! unreadable first line (which says through which segment the totals count) is moved to
//! `.corrupt`, counted (`corrupt_header`) and the file written again, taking every sealed segment
//! still on disk as not yet counted (the totals' mark lost, that is the likely case: a segment is
//! deleted right after the totals that count it are written), so the gateway still starts. Each batch starts on a fresh line. Request ids are
//! deduplicated within a segment (a record written twice, by a retry after a partly failed write,
//! counts once).
//!
//! Write failures (a full disk, an I/O error): the partly written batch is cut back off the file,
//! its records stay in a bounded in-memory buffer (`max_buffered_records`) and are written with the
//! next batch, retried at least every second. Each failed batch counts in
//! `kinference_gateway_usage_journal_errors_total{error="write"}` and is logged at most every
//! 10 s; records past the buffer (the oldest first) are dropped and counted in
//! `kinference_gateway_usage_journal_records_lost_total`. While the journal fails,
//! [`Journal::healthy`] is false: tenants whose `on_usage_unrecorded` is `refuse` then get 503.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self as channel, RecvTimeoutError, TrySendError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use super::{JournalError, StoreError, StoreMetrics};
use crate::tenancy::limits::OnUnrecorded;
use crate::tenancy::usage::{Group, Totals, UsageRecord};

/// Records per journal batch (one write + one fdatasync).
pub const JOURNAL_BATCH: usize = 512;
/// Longest time a record waits for its batch to be synced.
pub const JOURNAL_FLUSH: Duration = Duration::from_millis(20);
/// How often buffered records are retried while the journal cannot be written.
const RETRY_EVERY: Duration = Duration::from_secs(1);
/// At most one write-failure log line per this interval.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The length of the compacted periods.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Period {
    /// One UTC hour (the default).
    #[default]
    Hour,
    /// One UTC day.
    Day,
}

impl Period {
    /// The period's length in milliseconds.
    pub fn ms(self) -> u64 {
        match self {
            Period::Hour => 3_600_000,
            Period::Day => 86_400_000,
        }
    }

    /// The start of the period holding `ts_ms`.
    pub fn start(self, ts_ms: u64) -> u64 {
        ts_ms - ts_ms % self.ms()
    }
}

/// `tenancy.journal:` in `gateway.yaml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JournalConfig {
    /// The current segment is sealed and compacted past this size (default 64 MiB).
    pub segment_max_bytes: u64,
    /// ... or when it is this old, in seconds (default 3600).
    pub segment_max_age_s: u64,
    /// The compacted totals' period: `hour` (default) or `day`.
    pub period: Period,
    /// Compacted periods kept on disk (default 1488: 62 days of hours, so that this month's and
    /// last month's spend survive a restart). Older ones are dropped at compaction.
    pub keep_periods: u64,
    /// Records held in memory while the disk cannot be written (default 100000); also the most
    /// records queued for the writer.
    pub max_buffered_records: usize,
    /// The default of every tenant's `on_usage_unrecorded`: `serve` (default) or `refuse`.
    pub on_usage_unrecorded: OnUnrecorded,
}

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig {
            segment_max_bytes: 64 << 20,
            segment_max_age_s: 3600,
            period: Period::Hour,
            keep_periods: 1488,
            max_buffered_records: 100_000,
            on_usage_unrecorded: OnUnrecorded::Serve,
        }
    }
}

/// One line of the compacted file: a group's totals in one period.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeriodTotals {
    /// The period's start, Unix milliseconds.
    pub start_ms: u64,
    /// Tenant, model, pool, provider.
    #[serde(flatten)]
    pub group: Group,
    /// The summed records.
    #[serde(flatten)]
    pub totals: Totals,
}

/// What start-up reads back: compacted totals plus the records of the segments not compacted.
#[derive(Debug, Default)]
pub struct Replayed {
    /// Totals per period and group.
    pub periods: Vec<PeriodTotals>,
    /// Single records (the current segment; first record of each id).
    pub records: Vec<UsageRecord>,
}

enum JournalMsg {
    /// Boxed: the queue reserves every one of its `max_buffered_records` places up front, and a
    /// place holds a whole message (a pointer, not the record's 200-odd bytes: 1.6 MB, not 21 MB).
    Record(Box<UsageRecord>),
    Flush(oneshot::Sender<()>),
}

/// State the writer thread shares with the handles.
#[derive(Debug)]
struct Shared {
    healthy: AtomicBool,
    /// Compaction rounds the writer asked for (one per rotation).
    compactions_asked: AtomicU64,
    /// Of those, the rounds the compactor has finished (done or failed).
    compactions_done: AtomicU64,
    /// Set by a test to stall the compactor, as a hung disk would.
    #[cfg(test)]
    compaction_stalled: AtomicBool,
    /// No write-failure log line before this many milliseconds since `epoch`.
    quiet_until_ms: AtomicU64,
    epoch: Instant,
    metrics: StoreMetrics,
}

impl Shared {
    /// Whether a log line may be written now (at most one per [`LOG_EVERY`]).
    fn may_log(&self) -> bool {
        let now = self.epoch.elapsed().as_millis() as u64;
        let quiet_until = self.quiet_until_ms.load(Ordering::Relaxed);
        let next = now + LOG_EVERY.as_millis() as u64;
        now >= quiet_until
            && self
                .quiet_until_ms
                .compare_exchange(quiet_until, next, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

/// The usage journal's writer handle.
#[derive(Debug, Clone)]
pub struct Journal {
    tx: channel::SyncSender<JournalMsg>,
    shared: Arc<Shared>,
    /// The writer thread, woken by [`Journal::flush`] (a record never wakes it: see [`Writer::run`]).
    writer: std::thread::Thread,
}

impl Journal {
    /// Reads the compacted totals and the current segment of `path` (created if missing, with its
    /// directory), compacting sealed segments a crash left behind and cutting off a torn last
    /// line, then starts the writer thread. `after_sync` gets each synced batch (Redis forwarding).
    pub fn open(
        path: &Path,
        config: &JournalConfig,
        metrics: StoreMetrics,
        after_sync: Option<mpsc::Sender<Vec<UsageRecord>>>,
    ) -> Result<(Journal, Replayed), StoreError> {
        let err = |source| StoreError::Journal {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let mut compacted = Compacted::load(path, config, &metrics).map_err(err)?;
        let (next_seq, uncompacted) = compacted.absorb_sealed(path, &metrics).map_err(err)?;
        let current = read_segment(path, &metrics).map_err(err)?;
        let len = repair_tail(path, &current, &metrics).map_err(err)?;
        let file = open_append(path).map_err(err)?;
        let mut records = uncompacted;
        records.extend(current.records);
        let replayed = Replayed {
            periods: compacted.rows(),
            records,
        };
        let shared = Arc::new(Shared {
            healthy: AtomicBool::new(true),
            compactions_asked: AtomicU64::new(0),
            compactions_done: AtomicU64::new(0),
            #[cfg(test)]
            compaction_stalled: AtomicBool::new(false),
            quiet_until_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            metrics,
        });
        let (tx, rx) = channel::sync_channel(config.max_buffered_records.max(JOURNAL_BATCH));
        // One place: a nudge already waiting covers every segment sealed since.
        let (compactor, nudges) = channel::sync_channel(1);
        let compaction = Compactor {
            journal: path.to_owned(),
            compacted,
            shared: Arc::clone(&shared),
        };
        std::thread::Builder::new()
            .name("usage-compactor".into())
            .spawn(move || compaction.run(nudges))
            .map_err(err)?;
        let writer = Writer {
            path: path.to_owned(),
            file,
            len,
            opened: Instant::now(),
            torn: false,
            config: config.clone(),
            compactor,
            next_seq,
            buffer: VecDeque::new(),
            shared: Arc::clone(&shared),
            after_sync,
        };
        let writer = std::thread::Builder::new()
            .name("usage-journal".into())
            .spawn(move || writer.run(rx))
            .map_err(err)?
            .thread()
            .clone();
        Ok((Journal { tx, shared, writer }, replayed))
    }

    /// Queues a record (written and synced within [`JOURNAL_FLUSH`]). When the writer's queue is
    /// full (the disk has stalled) the record is dropped and counted.
    pub fn append(&self, record: UsageRecord) {
        match self.tx.try_send(JournalMsg::Record(Box::new(record))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.shared.metrics.journal_lost.inc();
                self.shared.healthy.store(false, Ordering::Relaxed);
                if self.shared.may_log() {
                    tracing::error!(
                        "usage journal queue full (the disk is stalled); usage records are lost"
                    );
                }
            }
            Err(TrySendError::Disconnected(_)) => {
                self.shared.metrics.journal_lost.inc();
                tracing::error!("usage journal writer is gone; a usage record was lost");
            }
        }
    }

    /// Counts a request refused because its usage could not be recorded.
    pub fn refused(&self) {
        self.shared.metrics.journal_refused.inc();
    }

    /// Whether the last write succeeded (false while the disk is full or failing).
    pub fn healthy(&self) -> bool {
        self.shared.healthy.load(Ordering::Relaxed)
    }

    /// Waits until the compactor has finished every round asked of it so far, done or failed (tests
    /// and benchmarks that read the files; serving never waits for compaction).
    pub async fn compacted(&self) {
        let shared = &self.shared;
        while shared.compactions_done.load(Ordering::Acquire)
            < shared.compactions_asked.load(Ordering::Acquire)
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits until everything queued so far was written (or, on a failing disk, tried once and
    /// kept in the buffer).
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        let mut msg = JournalMsg::Flush(tx);
        loop {
            match self.tx.try_send(msg) {
                Ok(()) => {
                    // The writer may be sleeping out its batch window.
                    self.writer.unpark();
                    break;
                }
                Err(TrySendError::Full(back)) => {
                    msg = back;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err(TrySendError::Disconnected(_)) => return,
            }
        }
        let _ = rx.await;
    }
}

/// The writer thread's state.
struct Writer {
    path: PathBuf,
    file: std::fs::File,
    /// Bytes of the current segment known to be whole lines.
    len: u64,
    opened: Instant,
    /// A failed write could not be cut back off: the next write starts with a newline.
    torn: bool,
    config: JournalConfig,
    /// Nudges the compactor after a rotation (never blocks).
    compactor: channel::SyncSender<()>,
    next_seq: u64,
    /// Records not yet written (a failing disk), oldest first; at most `max_buffered_records`.
    buffer: VecDeque<UsageRecord>,
    shared: Arc<Shared>,
    /// The Redis forwarder, when there is one: a synced batch it has no room for is dropped from
    /// forwarding (it stays in the journal) and counted.
    after_sync: Option<mpsc::Sender<Vec<UsageRecord>>>,
}

impl Writer {
    fn run(mut self, rx: channel::Receiver<JournalMsg>) {
        loop {
            // Wake at least every second: buffered records are retried, an old segment rotated.
            let first = match rx.recv_timeout(RETRY_EVERY) {
                Ok(msg) => Some(msg),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => {
                    self.write(Vec::new());
                    return;
                }
            };
            let mut batch = Vec::new();
            let mut waiters = Vec::new();
            let deadline = Instant::now() + JOURNAL_FLUSH;
            let mut slept = false;
            let mut next = first;
            loop {
                match next.take() {
                    Some(JournalMsg::Record(r)) => batch.push(*r),
                    Some(JournalMsg::Flush(w)) => {
                        waiters.push(w);
                        break;
                    }
                    // The batch window is spent, or the channel is empty for good.
                    None if slept => break,
                    None => {
                        // Sleep out the window instead of waiting on the channel: a sender wakes a
                        // receiver parked on the channel (a futex call and a thread switch on the
                        // request path, for every record), never a sleeping thread. A flush
                        // unparks the writer, so it is not held up.
                        std::thread::park_timeout(
                            deadline.saturating_duration_since(Instant::now()),
                        );
                        slept = true;
                    }
                }
                if batch.len() >= JOURNAL_BATCH {
                    break;
                }
                next = rx.try_recv().ok();
            }
            self.write(batch);
            self.rotate_if_due();
            for w in waiters {
                let _ = w.send(());
            }
        }
    }

    /// Writes the buffered records and `batch` in one write + fdatasync.
    fn write(&mut self, batch: Vec<UsageRecord>) {
        if batch.is_empty() && self.buffer.is_empty() {
            return;
        }
        let metrics = &self.shared.metrics;
        self.buffer.extend(batch);
        let over = self
            .buffer
            .len()
            .saturating_sub(self.config.max_buffered_records.max(1));
        if over > 0 {
            self.buffer.drain(..over);
            metrics.journal_lost.inc_by(over as u64);
        }
        let mut buf = Vec::with_capacity(self.buffer.len() * 256 + 1);
        if self.torn {
            buf.push(b'\n');
        }
        for r in &self.buffer {
            // Serializing a plain struct into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut buf, r);
            buf.push(b'\n');
        }
        match self
            .file
            .write_all(&buf)
            .and_then(|()| self.file.sync_data())
        {
            Ok(()) => {
                self.len += buf.len() as u64;
                if self.torn {
                    // The uncut bytes of the failed write lie before this batch: count them too,
                    // so that a later cut never reaches into whole lines.
                    self.len = self.file.metadata().map_or(self.len, |m| m.len());
                    self.torn = false;
                }
                let written: Vec<UsageRecord> = self.buffer.drain(..).collect();
                metrics.journal_buffered.set(0);
                if !self.shared.healthy.swap(true, Ordering::Relaxed) {
                    tracing::info!(path = %self.path.display(), records = written.len(),
                        "usage journal writes again; buffered records written");
                }
                if let Some(tx) = &self.after_sync
                    && let Err(mpsc::error::TrySendError::Full(batch)) = tx.try_send(written)
                {
                    metrics.redis_dropped_records(batch.len(), "the forwarding channel is full");
                }
            }
            Err(error) => {
                metrics.journal_error(JournalError::Write);
                metrics.journal_buffered.set(self.buffer.len() as i64);
                self.shared.healthy.store(false, Ordering::Relaxed);
                // Cut a partial batch back off, so that the retry never lands after a torn line.
                if self.file.set_len(self.len).is_err() {
                    self.torn = true;
                }
                if self.shared.may_log() {
                    tracing::error!(path = %self.path.display(), %error, buffered = self.buffer.len(),
                        "usage journal write failed; records kept in memory and retried");
                }
            }
        }
    }

    fn rotate_if_due(&mut self) {
        let too_old = self.opened.elapsed() >= Duration::from_secs(self.config.segment_max_age_s);
        let due = self.len > 0 && (self.len >= self.config.segment_max_bytes || too_old);
        if !due || !self.buffer.is_empty() {
            return;
        }
        if let Err(error) = self.rotate() {
            self.shared.metrics.journal_error(JournalError::Rotation);
            tracing::error!(path = %self.path.display(), %error, "usage journal rotation failed");
            return;
        }
        self.shared.compactions_asked.fetch_add(1, Ordering::AcqRel);
        // Full: a nudge is already waiting, and its round will find this segment too.
        let _ = self.compactor.try_send(());
    }

    /// Seals the current segment under the next number and begins a new one.
    fn rotate(&mut self) -> std::io::Result<()> {
        let sealed = segment_path(&self.path, self.next_seq);
        std::fs::rename(&self.path, &sealed)?;
        match open_append(&self.path).and_then(|f| sync_dir(&self.path).map(|()| f)) {
            Ok(file) => {
                self.file = file;
                self.len = 0;
                self.opened = Instant::now();
                self.next_seq += 1;
                Ok(())
            }
            Err(error) => {
                // Keep writing where the handle points, under the journal's own name again.
                let _ = std::fs::rename(&sealed, &self.path);
                Err(error)
            }
        }
    }
}

/// The compactor thread: folds sealed segments into the compacted totals, off the write path.
struct Compactor {
    journal: PathBuf,
    compacted: Compacted,
    shared: Arc<Shared>,
}

impl Compactor {
    /// One round per nudge until the writer is gone.
    fn run(mut self, nudges: channel::Receiver<()>) {
        while nudges.recv().is_ok() {
            // Every rotation asked for so far is covered by this round's directory listing.
            let asked = self.shared.compactions_asked.load(Ordering::Acquire);
            #[cfg(test)]
            while self.shared.compaction_stalled.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(5));
            }
            if let Err(error) = self
                .compacted
                .absorb_sealed(&self.journal, &self.shared.metrics)
            {
                self.shared.metrics.journal_error(JournalError::Compaction);
                tracing::error!(path = %self.journal.display(), %error,
                    "usage journal compaction failed; retried at the next rotation");
            }
            self.shared
                .compactions_done
                .fetch_max(asked, Ordering::AcqRel);
        }
    }
}

/// The compacted totals: in memory in the compactor, on disk in `<journal>.compacted`.
struct Compacted {
    path: PathBuf,
    /// Every segment numbered up to this one is counted in `totals`.
    through: u64,
    period: Period,
    keep: u64,
    totals: BTreeMap<(u64, Group), Totals>,
}

/// The compacted file's first line.
#[derive(Serialize, Deserialize)]
struct Header {
    through_segment: u64,
}

impl Compacted {
    fn load(
        journal: &Path,
        config: &JournalConfig,
        metrics: &StoreMetrics,
    ) -> std::io::Result<Self> {
        let mut me = Compacted {
            path: with_suffix(journal, ".compacted"),
            through: 0,
            period: config.period,
            keep: config.keep_periods.max(1),
            totals: BTreeMap::new(),
        };
        let file = match std::fs::File::open(&me.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(me),
            Err(e) => return Err(e),
        };
        if let Some(bad) = me.read(std::io::BufReader::new(file), metrics)? {
            me.repair_header(journal, &bad, metrics)?;
        }
        Ok(me)
    }

    /// Reads the file's lines into the totals; returns the first line when it is no header.
    fn read(
        &mut self,
        reader: impl BufRead,
        metrics: &StoreMetrics,
    ) -> std::io::Result<Option<Vec<u8>>> {
        // Bytes, not text: a damaged block need not even be UTF-8.
        let mut lines = reader.split(b'\n');
        let mut lost_header = None;
        if let Some(first) = lines.next() {
            let first = first?;
            match serde_json::from_slice::<Header>(&first) {
                Ok(header) => self.through = header.through_segment,
                Err(_) => lost_header = Some(first),
            }
        }
        for line in lines {
            let line = line?;
            if line.trim_ascii().is_empty() {
                continue;
            }
            match serde_json::from_slice::<PeriodTotals>(&line) {
                Ok(row) => self.add_row(row),
                Err(_) => metrics.journal_error(JournalError::CorruptLine),
            }
        }
        Ok(lost_header)
    }

    fn add_row(&mut self, row: PeriodTotals) {
        self.totals
            .entry((row.start_ms, row.group))
            .or_default()
            .merge(&row.totals);
    }

    /// The first line, `bad`, is no header: it is set aside (a row whose header was lost is kept
    /// as a row), every sealed segment on disk is taken as not yet counted, and the file is
    /// written again with that mark.
    fn repair_header(
        &mut self,
        journal: &Path,
        bad: &[u8],
        metrics: &StoreMetrics,
    ) -> std::io::Result<()> {
        metrics.journal_error(JournalError::CorruptHeader);
        if let Ok(row) = serde_json::from_slice::<PeriodTotals>(bad) {
            self.add_row(row);
        }
        let side = with_suffix(journal, ".corrupt");
        let saved = open_append(&side).and_then(|mut f| {
            f.write_all(bad)?;
            f.write_all(b"\n")?;
            f.sync_data()
        });
        if let Err(error) = saved {
            tracing::warn!(side = %side.display(), %error, "usage journal: unreadable header not saved aside");
        }
        self.through = sealed_segments(journal)?
            .first()
            .map_or(0, |(seq, _)| seq - 1);
        let totals = std::mem::take(&mut self.totals);
        self.write(self.through, &totals)?;
        self.totals = totals;
        tracing::error!(path = %self.path.display(), bytes = bad.len(), side = %side.display(),
            through_segment = self.through,
            "usage journal: the compacted totals' first line was unreadable; set aside, the sealed segments on disk counted as new");
        Ok(())
    }

    fn rows(&self) -> Vec<PeriodTotals> {
        self.totals
            .iter()
            .map(|((start_ms, group), totals)| PeriodTotals {
                start_ms: *start_ms,
                group: group.clone(),
                totals: *totals,
            })
            .collect()
    }

    /// Compacts every sealed segment beside `journal` (deleting those already counted). Returns the
    /// next segment number and the records of segments that could not be compacted (their files
    /// stay for the next try).
    ///
    /// A segment is summed line by line as it is read: its records are never all in memory at
    /// once. (Read whole, a 16 MiB segment took 23 MB of heap for the moment of its compaction,
    /// and the compactor thread's allocator arena kept those pages: the gateway's resident memory
    /// stepped up at its first compactions in the soak benchmark.)
    fn absorb_sealed(
        &mut self,
        journal: &Path,
        metrics: &StoreMetrics,
    ) -> std::io::Result<(u64, Vec<UsageRecord>)> {
        let mut left = Vec::new();
        let sealed = sealed_segments(journal)?;
        let next = sealed.last().map_or(0, |(seq, _)| *seq).max(self.through) + 1;
        for (seq, path) in sealed {
            if seq <= self.through {
                std::fs::remove_file(&path)?;
                continue;
            }
            let mut totals = self.totals.clone();
            let period = self.period;
            scan_segment(&path, metrics, |r| {
                totals
                    .entry((period.start(r.ts_ms), Group::of(&r)))
                    .or_default()
                    .add(&r);
            })?;
            if let Err(error) = self.absorb(seq, totals) {
                metrics.journal_error(JournalError::Compaction);
                tracing::error!(path = %path.display(), %error, "usage journal segment not compacted; replayed whole");
                // Its corrupt lines were counted by the first reading.
                left.extend(read_segment(&path, &StoreMetrics::default())?.records);
                continue;
            }
            std::fs::remove_file(&path)?;
        }
        Ok((next, left))
    }

    /// Takes `totals` (the kept totals with segment `seq`'s records added), drops periods past
    /// `keep`, and writes the file.
    fn absorb(
        &mut self,
        seq: u64,
        mut totals: BTreeMap<(u64, Group), Totals>,
    ) -> std::io::Result<()> {
        if let Some(newest) = totals.keys().map(|(start, _)| *start).max() {
            let oldest_kept = self
                .period
                .start(newest)
                .saturating_sub((self.keep - 1) * self.period.ms());
            totals.retain(|(start, _), _| *start >= oldest_kept);
        }
        self.write(seq, &totals)?;
        self.totals = totals;
        self.through = seq;
        Ok(())
    }

    /// Writes `totals` with the mark `through` as the whole file: temporary file, fsync, rename.
    fn write(&self, through: u64, totals: &BTreeMap<(u64, Group), Totals>) -> std::io::Result<()> {
        let mut out = serde_json::to_vec(&Header {
            through_segment: through,
        })
        .map_err(std::io::Error::other)?;
        out.push(b'\n');
        for ((start_ms, group), t) in totals {
            let row = PeriodTotals {
                start_ms: *start_ms,
                group: group.clone(),
                totals: *t,
            };
            serde_json::to_writer(&mut out, &row).map_err(std::io::Error::other)?;
            out.push(b'\n');
        }
        let tmp = with_suffix(&self.path, ".tmp");
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(&out).and_then(|()| file.sync_data())?;
        std::fs::rename(&tmp, &self.path)?;
        sync_dir(&self.path)
    }
}

/// A segment read back.
#[derive(Debug, Default)]
struct SegmentRead {
    /// First record of each id.
    records: Vec<UsageRecord>,
    /// Where its whole lines end.
    end: SegmentEnd,
}

/// How a segment ends, as reading it found.
#[derive(Debug, Default)]
struct SegmentEnd {
    /// Bytes up to the end of the last whole line.
    whole_len: u64,
    /// A last line with no newline: a record (whole) or torn bytes.
    tail: Option<Tail>,
}

#[derive(Debug)]
enum Tail {
    /// A readable record whose newline was not written.
    Unterminated,
    /// A write cut short by a crash.
    Torn(Vec<u8>),
}

/// One line's reading.
enum Line {
    Blank,
    Record(UsageRecord),
    /// Unreadable; a record a torn write ran into, if any.
    Corrupt(Option<UsageRecord>),
}

fn parse_line(line: &[u8]) -> Line {
    let line = line.trim_ascii();
    if line.is_empty() {
        return Line::Blank;
    }
    if let Ok(r) = serde_json::from_slice(line) {
        return Line::Record(r);
    }
    // A torn write followed by a whole record on the same line: resynchronise on the record's
    // opening (every record begins with its id).
    const START: &[u8] = b"{\"id\":";
    let resync = (1..line.len())
        .rev()
        .filter(|&i| line[i..].starts_with(START))
        .find_map(|i| serde_json::from_slice(&line[i..]).ok());
    Line::Corrupt(resync)
}

/// The records of a segment file, first record of each id only; corrupt lines skipped and counted.
fn read_segment(path: &Path, metrics: &StoreMetrics) -> std::io::Result<SegmentRead> {
    let mut records = Vec::new();
    let end = scan_segment(path, metrics, |r| records.push(r))?;
    Ok(SegmentRead { records, end })
}

/// Hands `keep` the records of a segment file as they are read, first record of each id only;
/// corrupt lines skipped and counted. Returns how the file ends.
fn scan_segment(
    path: &Path,
    metrics: &StoreMetrics,
    keep: impl FnMut(UsageRecord),
) -> std::io::Result<SegmentEnd> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(SegmentEnd::default()),
        Err(e) => return Err(e),
    };
    let (end, corrupt) = scan_lines(std::io::BufReader::new(file), metrics, keep)?;
    if corrupt > 0 {
        tracing::warn!(path = %path.display(), corrupt, "usage journal: corrupt lines skipped");
    }
    Ok(end)
}

/// [`scan_segment`] of any reader: how the bytes end, and how many corrupt lines were skipped.
fn scan_lines(
    mut reader: impl BufRead,
    metrics: &StoreMetrics,
    mut keep: impl FnMut(UsageRecord),
) -> std::io::Result<(SegmentEnd, usize)> {
    let mut end = SegmentEnd::default();
    let mut seen = SeenIds::default();
    let mut keep = |r: UsageRecord| {
        if seen.first(&r.id) {
            keep(r);
        }
    };
    let mut line = Vec::new();
    let mut corrupt = 0usize;
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line)?;
        if n == 0 {
            break;
        }
        let whole = line.last() == Some(&b'\n');
        match parse_line(&line) {
            Line::Blank => {}
            Line::Record(r) => {
                keep(r);
                if !whole {
                    end.tail = Some(Tail::Unterminated);
                }
            }
            Line::Corrupt(resynced) if whole => {
                corrupt += 1;
                metrics.journal_error(JournalError::CorruptLine);
                if let Some(r) = resynced {
                    keep(r);
                }
            }
            Line::Corrupt(_) => end.tail = Some(Tail::Torn(line.clone())),
        }
        if whole {
            end.whole_len += n as u64;
        }
    }
    Ok((end, corrupt))
}

/// What start-up makes of some bytes, read as a journal segment and as the compacted totals: the
/// entry of the `journal_replay` fuzz target ([`crate::untrusted::journal_replay`]).
#[derive(Debug)]
pub(crate) struct BytesReplayed {
    /// The segment's records (first of each id).
    pub records: Vec<UsageRecord>,
    /// The bytes up to the end of its last whole line.
    pub whole_len: u64,
    /// Its last line had no newline: a record (kept) or torn bytes (to be cut off).
    pub unterminated: bool,
    /// The torn last line, if that is how it ends.
    pub torn: Option<Vec<u8>>,
    /// Corrupt lines skipped in the middle.
    pub corrupt: usize,
    /// Read as the compacted totals: its mark, or the first line when it is no header.
    pub header: Result<u64, Vec<u8>>,
    /// ... and its rows (merged per period and group).
    pub rows: Vec<PeriodTotals>,
}

/// Reads `data` as start-up reads a segment and the compacted totals (no file, no repair).
pub(crate) fn replay_bytes(data: &[u8]) -> std::io::Result<BytesReplayed> {
    let metrics = StoreMetrics::default();
    let mut records = Vec::new();
    let (end, corrupt) = scan_lines(data, &metrics, |r| records.push(r))?;
    let mut compacted = Compacted {
        path: PathBuf::new(),
        through: 0,
        period: Period::Hour,
        keep: 1,
        totals: BTreeMap::new(),
    };
    let header = match compacted.read(data, &metrics)? {
        Some(bad) => Err(bad),
        None => Ok(compacted.through),
    };
    Ok(BytesReplayed {
        records,
        whole_len: end.whole_len,
        unterminated: matches!(end.tail, Some(Tail::Unterminated)),
        torn: match end.tail {
            Some(Tail::Torn(bytes)) => Some(bytes),
            _ => None,
        },
        corrupt,
        header,
        rows: compacted.rows(),
    })
}

/// The record ids a segment has shown so far, to count each record once. The gateway's own ids
/// (32 lowercase hex digits, a random `u128`) are kept as 16-byte numbers rather than strings: a
/// 64 MiB segment holds some 270,000 of them.
#[derive(Debug, Default)]
struct SeenIds {
    hex: HashSet<u128>,
    other: HashSet<String>,
}

impl SeenIds {
    /// Whether `id` is seen for the first time (it is remembered).
    fn first(&mut self, id: &str) -> bool {
        // Only the exact form the gateway writes, so that two different strings never map to
        // one number (`u128::from_str_radix` would also take a sign or upper-case digits).
        let gateway_made =
            id.len() == 32 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        match u128::from_str_radix(id, 16) {
            Ok(n) if gateway_made => self.hex.insert(n),
            _ => self.other.insert(id.to_owned()),
        }
    }
}

/// Cuts a torn last line off the current segment (appending it to `<journal>.corrupt`) or ends an
/// unterminated last record with its newline. Returns the segment's length after.
fn repair_tail(path: &Path, read: &SegmentRead, metrics: &StoreMetrics) -> std::io::Result<u64> {
    match &read.end.tail {
        None => Ok(read.end.whole_len),
        Some(Tail::Unterminated) => {
            let mut file = open_append(path)?;
            file.write_all(b"\n").and_then(|()| file.sync_data())?;
            Ok(std::fs::metadata(path)?.len())
        }
        Some(Tail::Torn(bytes)) => {
            metrics.journal_error(JournalError::TornTail);
            // Kept for a person when the disk allows; the cut happens either way (a full disk
            // must not stop the start).
            let side = with_suffix(path, ".corrupt");
            let saved = open_append(&side).and_then(|mut f| {
                f.write_all(bytes)?;
                f.write_all(b"\n")?;
                f.sync_data()
            });
            if let Err(error) = saved {
                tracing::warn!(side = %side.display(), %error, "usage journal: torn line not saved aside");
            }
            let file = std::fs::OpenOptions::new().write(true).open(path)?;
            file.set_len(read.end.whole_len)?;
            file.sync_data()?;
            tracing::warn!(path = %path.display(), bytes = bytes.len(), side = %side.display(),
                "usage journal: torn last line (a crash mid-write) cut off");
            Ok(read.end.whole_len)
        }
    }
}

fn open_append(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
}

/// `path` with `suffix` appended to its file name.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// The name of sealed segment `seq`.
fn segment_path(journal: &Path, seq: u64) -> PathBuf {
    with_suffix(journal, &format!(".{seq:06}"))
}

/// The sealed segments beside `journal`, by number.
fn sealed_segments(journal: &Path) -> std::io::Result<Vec<(u64, PathBuf)>> {
    let dir = match journal.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Some(name) = journal.file_name().and_then(|n| n.to_str()) else {
        return Ok(Vec::new());
    };
    let prefix = format!("{name}.");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let file = entry.file_name();
        let seq = file
            .to_str()
            .and_then(|f| f.strip_prefix(&prefix))
            .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse::<u64>().ok());
        if let Some(seq) = seq {
            out.push((seq, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Makes a rename in `path`'s directory durable.
fn sync_dir(path: &Path) -> std::io::Result<()> {
    match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => std::fs::File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests;
