use std::io::Write;

use super::*;

fn record(id: &str, ts_ms: u64) -> UsageRecord {
    UsageRecord {
        id: id.into(),
        request_id: String::new(),
        ts_ms,
        tenant: "t".into(),
        model: "m".into(),
        pool: String::new(),
        provider: String::new(),
        status: 200,
        requests: 1,
        input_uncached: 3,
        input_cached: 2,
        output: 1,
        cost: 0.5,
        estimated: false,
        prefill_pool: String::new(),
    }
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kinference-{name}-{}", rand::random::<u64>()))
}

#[tokio::test]
async fn the_journal_survives_a_restart_and_never_counts_a_request_twice() {
    let dir = scratch("journal");
    let path = dir.join("usage.jsonl");
    let config = JournalConfig::default();
    {
        let (journal, replayed) =
            Journal::open(&path, &config, StoreMetrics::default(), None).unwrap();
        assert!(replayed.records.is_empty());
        journal.append(record("a", 1));
        journal.append(record("b", 1));
        journal.flush().await;
    }
    // A duplicate id, as a retried write leaves.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    writeln!(f, "{}", serde_json::to_string(&record("a", 1)).unwrap()).unwrap();
    drop(f);
    let (journal, replayed) = Journal::open(&path, &config, StoreMetrics::default(), None).unwrap();
    let ids: Vec<&str> = replayed.records.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["a", "b"]);
    journal.flush().await;
    let _ = std::fs::remove_dir_all(&dir);
}

fn ids(records: &[UsageRecord]) -> Vec<&str> {
    records.iter().map(|r| r.id.as_str()).collect()
}

fn line(r: &UsageRecord) -> String {
    serde_json::to_string(r).unwrap()
}

#[tokio::test]
async fn a_torn_last_line_is_cut_off_at_start_counted_and_loses_no_record() {
    let dir = scratch("journal-torn");
    let path = dir.join("usage.jsonl");
    std::fs::create_dir_all(&dir).unwrap();
    let torn = &line(&record("c", 1))[..20];
    std::fs::write(
        &path,
        format!(
            "{}\n{}\n{torn}",
            line(&record("a", 1)),
            line(&record("b", 1))
        ),
    )
    .unwrap();
    let whole_len = std::fs::metadata(&path).unwrap().len() - torn.len() as u64;

    let metrics = StoreMetrics::default();
    let config = JournalConfig::default();
    let (journal, replayed) = Journal::open(&path, &config, metrics.clone(), None).unwrap();
    assert_eq!(ids(&replayed.records), ["a", "b"]);
    assert_eq!(metrics.journal_errors(JournalError::TornTail), 1);
    assert_eq!(metrics.journal_errors(JournalError::CorruptLine), 0);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), whole_len);
    let side = std::fs::read_to_string(dir.join("usage.jsonl.corrupt")).unwrap();
    assert_eq!(side, format!("{torn}\n"));

    // The next record lands on its own line: a restart reads all three, nothing to repair.
    journal.append(record("d", 1));
    journal.flush().await;
    let again = StoreMetrics::default();
    let (_journal, replayed) = Journal::open(&path, &config, again.clone(), None).unwrap();
    assert_eq!(ids(&replayed.records), ["a", "b", "d"]);
    assert_eq!(again.journal_errors(JournalError::TornTail), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_corrupt_line_in_the_middle_never_swallows_the_next_record() {
    let dir = scratch("journal-corrupt");
    let path = dir.join("usage.jsonl");
    std::fs::create_dir_all(&dir).unwrap();
    let torn = &line(&record("x", 1))[..25];
    // A torn write that a later record ran into (no newline between them), then garbage, then a
    // whole record, and a last record whose newline was never written.
    std::fs::write(
        &path,
        format!(
            "{}\n{torn}{}\nnot json at all\n{}\n{}",
            line(&record("a", 1)),
            line(&record("b", 1)),
            line(&record("c", 1)),
            line(&record("d", 1)),
        ),
    )
    .unwrap();
    let metrics = StoreMetrics::default();
    let (_journal, replayed) =
        Journal::open(&path, &JournalConfig::default(), metrics.clone(), None).unwrap();
    assert_eq!(ids(&replayed.records), ["a", "b", "c", "d"]);
    assert_eq!(metrics.journal_errors(JournalError::CorruptLine), 2);
    assert_eq!(metrics.journal_errors(JournalError::TornTail), 0);
    assert!(std::fs::read_to_string(&path).unwrap().ends_with("}\n"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The sum of every group and period of a replay.
fn replay_totals(replayed: &Replayed) -> Totals {
    let mut sum = Totals::default();
    for p in &replayed.periods {
        sum.merge(&p.totals);
    }
    for r in &replayed.records {
        sum.add(r);
    }
    sum
}

#[tokio::test]
async fn rotation_compacts_old_segments_into_period_totals_with_equal_totals() {
    let dir = scratch("journal-compact");
    let path = dir.join("usage.jsonl");
    let hour = 3_600_000;
    let config = JournalConfig {
        segment_max_bytes: 4096,
        ..JournalConfig::default()
    };
    let metrics = StoreMetrics::default();
    let (journal, _) = Journal::open(&path, &config, metrics.clone(), None).unwrap();
    let mut written = Totals::default();
    // 600 records over ten hours, in batches so that the 4 KiB segments rotate many times.
    for i in 0..600u64 {
        let mut r = record(&format!("r{i}"), i * hour / 60);
        r.tenant = format!("t{}", i % 3);
        r.input_cached = i % 7;
        r.cost = i as f64 * 0.25;
        written.add(&r);
        journal.append(r);
        if i % 50 == 49 {
            journal.flush().await;
        }
    }
    journal.flush().await;
    journal.compacted().await;
    drop(journal);

    let compacted = std::fs::read_to_string(dir.join("usage.jsonl.compacted")).unwrap();
    assert!(
        compacted.starts_with("{\"through_segment\":"),
        "{compacted}"
    );
    let sealed = sealed_segments(&path).unwrap();
    assert!(sealed.is_empty(), "sealed segments left: {sealed:?}");
    let (_journal, replayed) = Journal::open(&path, &config, metrics.clone(), None).unwrap();
    // Bounded replay: single records only of the current segment, the rest as period totals.
    assert!(replayed.records.len() < 50, "{}", replayed.records.len());
    assert!(
        replayed.periods.len() <= 10 * 3,
        "{}",
        replayed.periods.len()
    );
    let replayed_totals = replay_totals(&replayed);
    assert_eq!(replayed_totals.requests, written.requests);
    assert_eq!(
        replayed_totals.input_cached_tokens,
        written.input_cached_tokens
    );
    assert_eq!(
        replayed_totals.input_uncached_tokens,
        written.input_uncached_tokens
    );
    assert_eq!(replayed_totals.output_tokens, written.output_tokens);
    assert!((replayed_totals.cost - written.cost).abs() < 1e-9);
    assert_eq!(metrics.journal_errors(JournalError::Compaction), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_stuck_compaction_never_holds_up_the_writer() {
    let dir = scratch("journal-stuck-compaction");
    let path = dir.join("usage.jsonl");
    let config = JournalConfig {
        segment_max_bytes: 2048,
        ..JournalConfig::default()
    };
    let (journal, _) = Journal::open(&path, &config, StoreMetrics::default(), None).unwrap();
    journal
        .shared
        .compaction_stalled
        .store(true, Ordering::Release);
    // Many rotations while the compactor is stuck: every append and flush still completes.
    let written = tokio::time::timeout(Duration::from_secs(60), async {
        for i in 0..300u64 {
            journal.append(record(&format!("r{i}"), 1));
            if i % 20 == 19 {
                journal.flush().await;
            }
        }
        journal.flush().await;
    })
    .await;
    assert!(
        written.is_ok(),
        "the writer waited for the stuck compaction"
    );
    assert!(journal.healthy());
    // Nothing compacted yet: every record is still in the sealed segments and the current one.
    let sealed = sealed_segments(&path).unwrap();
    assert!(sealed.len() >= 2, "segments sealed: {sealed:?}");
    let mut on_disk = 0;
    for file in sealed.iter().map(|(_, p)| p.clone()).chain([path.clone()]) {
        on_disk += read_segment(&file, &StoreMetrics::default())
            .unwrap()
            .records
            .len();
    }
    assert_eq!(on_disk, 300);

    // Unstick it: the compactor catches up in the background and deletes the sealed segments.
    journal
        .shared
        .compaction_stalled
        .store(false, Ordering::Release);
    tokio::time::timeout(Duration::from_secs(60), journal.compacted())
        .await
        .expect("the compactor caught up once the disk answered");
    assert!(sealed_segments(&path).unwrap().is_empty());
    let compacted = std::fs::read_to_string(dir.join("usage.jsonl.compacted")).unwrap();
    assert!(
        compacted.starts_with("{\"through_segment\":"),
        "{compacted}"
    );
    drop(journal);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_sealed_segment_left_by_a_crash_is_compacted_once_at_start_and_old_periods_dropped() {
    let dir = scratch("journal-sealed");
    let path = dir.join("usage.jsonl");
    std::fs::create_dir_all(&dir).unwrap();
    let hour = 3_600_000;
    let config = JournalConfig {
        keep_periods: 2,
        ..JournalConfig::default()
    };
    // Segment 1 holds hours 0..4; the crash came before it was compacted.
    let segment: String = (0..4)
        .map(|h| line(&record(&format!("s{h}"), h * hour + 5)) + "\n")
        .collect();
    std::fs::write(segment_path(&path, 1), segment).unwrap();
    std::fs::write(&path, line(&record("now", 3 * hour + 9)) + "\n").unwrap();
    let metrics = StoreMetrics::default();
    let (_journal, replayed) = Journal::open(&path, &config, metrics.clone(), None).unwrap();
    // Hours 2 and 3 kept (keep_periods: 2), 0 and 1 dropped; the current segment read whole.
    let starts: Vec<u64> = replayed.periods.iter().map(|p| p.start_ms).collect();
    assert_eq!(starts, [2 * hour, 3 * hour]);
    assert_eq!(ids(&replayed.records), ["now"]);
    assert!(sealed_segments(&path).unwrap().is_empty());

    // A segment numbered at or below the compacted file's mark was counted already: deleted, not
    // counted again.
    std::fs::write(segment_path(&path, 1), line(&record("s9", 3 * hour)) + "\n").unwrap();
    let (_journal, again) = Journal::open(&path, &config, metrics, None).unwrap();
    assert_eq!(again.periods, replayed.periods);
    assert!(sealed_segments(&path).unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_compacted_segment_counts_each_record_once_however_its_id_is_spelled() {
    // Compaction remembers the gateway's ids (32 lower-case hex digits) as numbers: a duplicate is
    // still caught, and an id that reads as the same number (upper case, a sign) is another record.
    let dir = scratch("journal-ids");
    let path = dir.join("usage.jsonl");
    std::fs::create_dir_all(&dir).unwrap();
    let id = format!("{:032x}", (0xabcdef_u128 << 64) | 42);
    let upper = id.to_uppercase();
    let signed = format!("+{}", &id[1..]);
    assert_eq!(
        u128::from_str_radix(&signed, 16).ok(),
        u128::from_str_radix(&id, 16).ok()
    );
    let segment: String = [id.as_str(), &id, &upper, &signed, "r1", "r1"]
        .iter()
        .map(|id| line(&record(id, 5)) + "\n")
        .collect();
    std::fs::write(segment_path(&path, 1), segment).unwrap();
    let (_journal, replayed) = Journal::open(
        &path,
        &JournalConfig::default(),
        StoreMetrics::default(),
        None,
    )
    .unwrap();
    assert!(sealed_segments(&path).unwrap().is_empty());
    assert!(replayed.records.is_empty());
    assert_eq!(replay_totals(&replayed).requests, 4);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Set in the child process that runs [`a_full_disk_is_counted_and_its_records_kept_in_a_bounded_buffer`]
/// under a file-size limit: the directory of its journal.
const FULL_DISK_DIR: &str = "KINFERENCE_TEST_JOURNAL_FULL_DISK_DIR";
/// The file-size limit of that child (a "disk" of 16 KiB: about 70 records).
const FULL_DISK_BYTES: u64 = 16 * 1024;

/// Runs the test named `name` of this test binary alone, in a child process whose files cannot
/// grow past `limit_bytes` (`prlimit`; SIGXFSZ ignored, so a write past the limit fails with EFBIG
/// as it would with ENOSPC on a full disk).
pub(crate) fn run_with_file_size_limit(name: &str, limit_bytes: u64, env: (&str, &Path)) {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg("trap '' XFSZ; exec prlimit --fsize=\"$0\" -- \"$@\"")
        .arg(limit_bytes.to_string())
        .arg(&exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(env.0, env.1)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child {name} under a {limit_bytes}-byte file limit failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether `prlimit` (util-linux) can run here; required under `CI=true`.
pub(crate) fn prlimit_available() -> bool {
    let found = std::process::Command::new("prlimit")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    testkit::require(
        found,
        "prlimit",
        "the full-disk tests limit a child's file size with it (util-linux)",
    )
}

#[test]
fn a_full_disk_is_counted_and_its_records_kept_in_a_bounded_buffer() {
    if let Some(dir) = std::env::var_os(FULL_DISK_DIR) {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        return runtime.block_on(full_disk_child(PathBuf::from(dir)));
    }
    if !prlimit_available() {
        return;
    }
    let dir = scratch("journal-full");
    std::fs::create_dir_all(&dir).unwrap();
    run_with_file_size_limit(
        "tenancy::store::journal::tests::a_full_disk_is_counted_and_its_records_kept_in_a_bounded_buffer",
        FULL_DISK_BYTES,
        (FULL_DISK_DIR, &dir),
    );
    // What the child left on its full "disk" is whole lines only: the partly written batches were
    // cut back off, and a restart (without the limit) reads every record that was written.
    let path = dir.join("usage.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.len() as u64 <= FULL_DISK_BYTES);
    assert!(text.ends_with('\n'));
    let metrics = StoreMetrics::default();
    let (_journal, replayed) =
        Journal::open(&path, &JournalConfig::default(), metrics.clone(), None).unwrap();
    assert_eq!(replayed.records.len(), text.lines().count());
    assert_eq!(metrics.journal_errors(JournalError::TornTail), 0);
    assert_eq!(metrics.journal_errors(JournalError::CorruptLine), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// In the child: fill the 16 KiB "disk", then keep appending.
async fn full_disk_child(dir: PathBuf) {
    let config = JournalConfig {
        max_buffered_records: 100,
        ..JournalConfig::default()
    };
    let metrics = StoreMetrics::default();
    let (journal, _) =
        Journal::open(&dir.join("usage.jsonl"), &config, metrics.clone(), None).unwrap();
    let mut appended = 0;
    while journal.healthy() {
        assert!(appended < 1000, "a 16 KiB file limit never failed a write");
        for _ in 0..10 {
            journal.append(record(&format!("r{appended}"), 1));
            appended += 1;
        }
        journal.flush().await;
    }
    assert!(metrics.journal_errors(JournalError::Write) >= 1);
    assert_eq!(metrics.journal_lost(), 0);
    // Still failing: records wait in the buffer (100), the oldest past it are dropped and counted.
    for i in 0..150 {
        journal.append(record(&format!("more{i}"), 1));
    }
    journal.flush().await;
    assert!(!journal.healthy());
    assert!(
        metrics.journal_lost() >= 50,
        "{} lost",
        metrics.journal_lost()
    );
    assert!(metrics.journal_errors(JournalError::Write) >= 2);
}

#[test]
fn the_example_alert_rules_name_only_metrics_the_gateway_exports() {
    let rules = testkit::repo_root().join("deploy/examples/prometheus-rules.yaml");
    let rules = std::fs::read_to_string(&rules).unwrap();
    let metrics = StoreMetrics::default();
    for error in [JournalError::Write, JournalError::Compaction] {
        metrics.journal_error(error);
    }
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let mut exported = String::new();
    prometheus_client::encoding::text::encode(&mut exported, &registry).unwrap();
    let named: Vec<&str> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("kinference_gateway_"))
        .collect();
    assert!(named.len() >= 4, "{named:?}");
    for name in named {
        assert!(
            exported.lines().any(|l| l.starts_with(name)),
            "the alert rules name {name}, which the gateway does not export:\n{exported}"
        );
    }
}

/// Set in the child that runs [`a_full_disk_refuses_tenants_that_say_refuse_and_serves_the_others`].
const FULL_DISK_TENANCY_DIR: &str = "KINFERENCE_TEST_TENANCY_FULL_DISK_DIR";

const TWO_TENANTS: &str = r#"
apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata:
  name: strict
spec:
  apiKeys:
    - secretRef: {name: strict, key: api-key}
---
apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata:
  name: lenient
spec:
  apiKeys:
    - secretRef: {name: lenient, key: api-key}
"#;

#[test]
fn a_full_disk_refuses_tenants_that_say_refuse_and_serves_the_others() {
    if let Some(dir) = std::env::var_os(FULL_DISK_TENANCY_DIR) {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        return runtime.block_on(full_disk_tenancy_child(PathBuf::from(dir)));
    }
    if !prlimit_available() {
        return;
    }
    let dir = scratch("tenancy-full");
    std::fs::create_dir_all(&dir).unwrap();
    run_with_file_size_limit(
        "tenancy::store::journal::tests::a_full_disk_refuses_tenants_that_say_refuse_and_serves_the_others",
        FULL_DISK_BYTES,
        (FULL_DISK_TENANCY_DIR, &dir),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// In the child: two tenants, `strict` (`on_usage_unrecorded: refuse`) and `lenient` (the default,
/// `serve`), on a 16 KiB "disk".
async fn full_disk_tenancy_child(dir: PathBuf) {
    use crate::errors::Protocol;
    use crate::tenancy::limits::TenantSettings;
    use crate::tenancy::{Tenancy, TenancyConfig};

    std::fs::write(dir.join("tenants.yaml"), TWO_TENANTS).unwrap();
    for name in ["strict", "lenient"] {
        std::fs::create_dir_all(dir.join("secrets").join(name)).unwrap();
        std::fs::write(
            dir.join("secrets").join(name).join("api-key"),
            format!("sk-{name}-key"),
        )
        .unwrap();
    }
    let mut config = TenancyConfig {
        tenants_dir: Some(dir.join("tenants.yaml")),
        secrets_dir: Some(dir.join("secrets")),
        usage_journal: Some(dir.join("usage.jsonl")),
        journal: JournalConfig {
            max_buffered_records: 50,
            ..JournalConfig::default()
        },
        ..TenancyConfig::default()
    };
    config.tenants.insert(
        "strict".into(),
        TenantSettings {
            on_usage_unrecorded: Some(OnUnrecorded::Refuse),
            ..TenantSettings::default()
        },
    );
    let mut registry = prometheus_client::registry::Registry::default();
    let t = Tenancy::start(
        config,
        &dir.join("gateway.yaml"),
        None,
        vec!["m".into()],
        &mut registry,
    )
    .unwrap();
    let key = |name: &str| {
        let mut h = http::HeaderMap::new();
        h.insert(
            "authorization",
            format!("Bearer sk-{name}-key").parse().unwrap(),
        );
        t.authenticate(&h).unwrap()
    };
    let (strict, lenient) = (key("strict"), key("lenient"));
    let usage = crate::api::openai::Usage {
        prompt_tokens: 1000,
        completion_tokens: 10,
        total_tokens: 1010,
        prompt_tokens_details: None,
    };
    let serve = |caller| {
        let t = Arc::clone(&t);
        async move {
            let mut a = t.admit(caller, "m", 1000, 10, Protocol::OpenAi).await?;
            a.routed("http://worker", "least_loaded", Some(1000));
            a.settle(200, Some(&usage));
            t.flush().await;
            Ok::<(), crate::errors::GatewayError>(())
        }
    };
    // Both are served while the disk has room; the lenient one fills it.
    serve(&strict).await.unwrap();
    let mut served = 0;
    while t.journal.healthy() {
        assert!(served < 1000, "a 16 KiB file limit never failed a write");
        serve(&lenient).await.unwrap();
        served += 1;
    }
    // Full: `strict` gets 503 in its protocol, `lenient` is still served and its record buffered.
    let refused = t
        .admit(&strict, "m", 1, 1, Protocol::OpenAi)
        .await
        .unwrap_err();
    assert_eq!(refused.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused.body(Protocol::OpenAi)["error"]["code"],
        "usage_unrecorded"
    );
    let refused = t
        .admit(&strict, "m", 1, 1, Protocol::Anthropic)
        .await
        .unwrap_err();
    assert_eq!(
        refused.body(Protocol::Anthropic)["error"]["type"],
        "overloaded_error"
    );
    serve(&lenient).await.unwrap();
    let mut exported = String::new();
    prometheus_client::encoding::text::encode(&mut exported, &registry).unwrap();
    let value = |series: &str| -> f64 {
        exported
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{exported}"))
    };
    assert!(value("kinference_gateway_usage_journal_errors_total{error=\"write\"}") >= 2.0);
    assert_eq!(
        value("kinference_gateway_usage_journal_refused_requests_total"),
        2.0
    );
    assert!(value("kinference_gateway_usage_journal_buffered_records") >= 1.0);
    // The in-memory view still counts every served request, recorded or not.
    let report = t.usage_report("", None).await.unwrap();
    assert_eq!(report["total"]["requests"], served + 2);
}

#[test]
fn a_queued_record_costs_the_queue_a_pointer_not_the_record() {
    // The writer's queue reserves all of its places when the journal opens (100,000 by default):
    // a place the size of a whole record would cost the idle gateway about 20 MB.
    assert!(std::mem::size_of::<UsageRecord>() > 100);
    assert!(std::mem::size_of::<JournalMsg>() <= 2 * std::mem::size_of::<usize>());
}

#[tokio::test]
async fn batches_the_redis_forwarder_cannot_take_are_dropped_and_counted() {
    let dir = scratch("journal-forward");
    let path = dir.join("usage.jsonl");
    let metrics = StoreMetrics::default();
    // A forwarder that takes nothing (Redis stuck), behind a channel of one batch.
    let (tx, mut rx) = mpsc::channel(1);
    let (journal, _) =
        Journal::open(&path, &JournalConfig::default(), metrics.clone(), Some(tx)).unwrap();
    for batch in 0..4 {
        for i in 0..3 {
            journal.append(record(&format!("f{batch}-{i}"), 1));
        }
        journal.flush().await;
    }
    // Every record is in the journal; the first batch waits in the channel, the others were
    // dropped from forwarding, and counted.
    assert_eq!(metrics.redis_dropped(), 9);
    assert_eq!(rx.recv().await.map(|b| b.len()), Some(3));
    drop(journal);
    let (_journal, replayed) = Journal::open(
        &path,
        &JournalConfig::default(),
        StoreMetrics::default(),
        None,
    )
    .unwrap();
    assert_eq!(replayed.records.len(), 12);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_corrupt_header_of_the_compacted_file_is_set_aside_not_fatal() {
    let hour = 3_600_000;
    let config = JournalConfig::default();
    let row = |start_ms: u64, requests: u64| {
        let totals = Totals {
            requests,
            ..Totals::default()
        };
        serde_json::to_string(&PeriodTotals {
            start_ms,
            group: Group::of(&record("x", start_ms)),
            totals,
        })
        .unwrap()
    };
    let headers: [&[u8]; 4] = [
        b"{\"through_segm",                 // cut short (a disk that lost a block)
        b"\xff\xfe\x00garbage",             // not even UTF-8
        b"{\"through_segment\":\"seven\"}", // the wrong type
        b"",                                // empty
    ];
    for (n, header) in headers.into_iter().enumerate() {
        let dir = scratch("journal-header");
        let path = dir.join("usage.jsonl");
        std::fs::create_dir_all(&dir).unwrap();
        let mut compacted = header.to_vec();
        compacted.push(b'\n');
        for line in [row(0, 3), row(hour, 4)] {
            compacted.extend(line.as_bytes());
            compacted.push(b'\n');
        }
        std::fs::write(with_suffix(&path, ".compacted"), &compacted).unwrap();
        // A sealed segment not yet compacted when the header was lost: counted once.
        std::fs::write(segment_path(&path, 7), line(&record("s", hour + 5)) + "\n").unwrap();
        let metrics = StoreMetrics::default();
        let (journal, replayed) = Journal::open(&path, &config, metrics.clone(), None)
            .unwrap_or_else(|e| panic!("header {n}: the gateway does not start: {e}"));
        drop(journal);
        let requests: Vec<(u64, u64)> = replayed
            .periods
            .iter()
            .map(|p| (p.start_ms, p.totals.requests))
            .collect();
        assert_eq!(requests, [(0, 3), (hour, 5)], "header {n}");
        assert_eq!(
            metrics.journal_errors(JournalError::CorruptHeader),
            1,
            "header {n}"
        );
        // The bad line is kept for a person; the file has a good header again.
        let side = std::fs::read(with_suffix(&path, ".corrupt")).unwrap();
        assert!(side.starts_with(header), "header {n}");
        let again = std::fs::read_to_string(with_suffix(&path, ".compacted")).unwrap();
        assert!(
            again.starts_with("{\"through_segment\":7}"),
            "header {n}: {again}"
        );
        // A second start finds nothing to repair and the same totals.
        let metrics = StoreMetrics::default();
        let (_journal, second) = Journal::open(&path, &config, metrics.clone(), None).unwrap();
        assert_eq!(second.periods, replayed.periods, "header {n}");
        assert_eq!(metrics.journal_errors(JournalError::CorruptHeader), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
