//! The shared store against a real `redis-server` (Debian's package): two stores (two gateway
//! replicas) admitting concurrently from one bucket hold the configured rate within 5%, usage records
//! apply once however often they are sent, and the budget check sees the shared spend.
//!
//! Skips (with the reason on stderr) when `redis-server` is not installed; under `CI=true` that fails.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kinference_crds::RateLimits;
use kinference_gateway::tenancy::limits::{self, Demand, LimitVerdict, TenantSettings};
use kinference_gateway::tenancy::store::{RedisStore, RedisVerdict};
use kinference_gateway::tenancy::usage::UsageRecord;
use testkit::{ChildGuard, free_port};

struct RedisServer {
    _child: ChildGuard,
    url: String,
    _dir: std::path::PathBuf,
}

/// A private `redis-server` on a free port; `None` (a failure under CI) when it is not installed. Installed
/// but not starting is a failure everywhere.
fn start_redis() -> Option<RedisServer> {
    let binary = ["/usr/bin/redis-server", "/usr/local/bin/redis-server"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
    let Some(binary) = binary else {
        testkit::skip(
            "redis-server",
            "not installed (apt-get install -y redis-server); the shared-store test needs it",
        );
        return None;
    };
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("kinference-redis-{port}"));
    std::fs::create_dir_all(&dir).expect("redis folder");
    let child = Command::new(binary)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server starts");
    let server = RedisServer {
        _child: ChildGuard(child),
        url: format!("redis://127.0.0.1:{port}"),
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Some(server);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("redis-server did not listen on {port} within 10 s");
}

fn record(id: &str) -> UsageRecord {
    UsageRecord {
        id: id.into(),
        request_id: String::new(),
        ts_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64,
        tenant: "t".into(),
        model: "m".into(),
        pool: "p".into(),
        provider: String::new(),
        status: 200,
        requests: 1,
        input_uncached: 7,
        input_cached: 3,
        output: 5,
        cost: 2.5,
        estimated: false,
        prefill_pool: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_share_one_bucket_within_5_percent() {
    let Some(redis) = start_redis() else { return };
    let replicas = [
        RedisStore::new(&redis.url, Duration::from_millis(500)).unwrap(),
        RedisStore::new(&redis.url, Duration::from_millis(500)).unwrap(),
    ];
    // 1200 requests per minute = 20/s, capacity 20 (burst 1 s).
    let settings = TenantSettings {
        burst_seconds: Some(1.0),
        ..TenantSettings::default()
    };
    let limits = RateLimits {
        requests_per_minute: Some(1200),
        ..RateLimits::default()
    };
    let takes = limits::takes(
        "t",
        Some(&limits),
        &settings,
        "m",
        Demand {
            requests: 1.0,
            ..Demand::default()
        },
    );
    let admitted = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let run_for = Duration::from_secs(5);
    let mut tasks = Vec::new();
    for i in 0..8 {
        let store = Arc::clone(&replicas[i % 2]);
        let takes = takes.clone();
        let admitted = Arc::clone(&admitted);
        tasks.push(tokio::spawn(async move {
            while started.elapsed() < run_for {
                match store.admit(&takes, "kinf:spend:{t}:none", None).await {
                    Ok(RedisVerdict::Buckets(LimitVerdict::Admitted(_))) => {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => tokio::time::sleep(Duration::from_millis(2)).await,
                    Err(e) => panic!("redis: {e}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let got = admitted.load(Ordering::Relaxed) as f64;
    let expected = 20.0 + 20.0 * elapsed;
    eprintln!(
        "[tenancy] redis bucket, 2 stores x 4 tasks: admitted {got} in {elapsed:.2} s, expected {expected:.1} ({:+.2}%)",
        100.0 * (got / expected - 1.0)
    );
    assert!((got / expected - 1.0).abs() <= 0.05, "{got} vs {expected}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_records_apply_once_and_feed_the_budget() {
    let Some(redis) = start_redis() else { return };
    let store = RedisStore::new(&redis.url, Duration::from_millis(500)).unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let forward = tokio::spawn(Arc::clone(&store).forward_usage(rx));
    let r = record("req-1");
    // Sent three times (a retry after a lost answer, another replica replaying): applied once.
    tx.send(vec![r.clone(), r.clone()]).await.unwrap();
    tx.send(vec![r.clone(), record("req-2")]).await.unwrap();
    drop(tx);
    forward.await.unwrap();
    assert_eq!(store.pending(), 0);
    let hour = kinference_gateway::tenancy::budget::hour_key(r.ts_ms);
    let fields = store.hour(&hour).await.unwrap();
    let get = |name: &str| {
        fields
            .iter()
            .find(|(f, _)| f.ends_with(&format!("\u{1f}{name}")))
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    assert_eq!(get("requests"), "2");
    assert_eq!(get("input_uncached"), "14");
    assert_eq!(get("input_cached"), "6");
    assert_eq!(get("output"), "10");
    let spend_key = kinference_gateway::tenancy::budget::spend_key("t", r.ts_ms);
    assert_eq!(store.spent(&spend_key).await.unwrap(), 5.0);
    // A budget of 5 is spent; one of 6 is not.
    assert_eq!(
        store.admit(&[], &spend_key, Some(5.0)).await.unwrap(),
        RedisVerdict::BudgetSpent(5.0)
    );
    assert!(matches!(
        store.admit(&[], &spend_key, Some(6.0)).await.unwrap(),
        RedisVerdict::Buckets(LimitVerdict::Admitted(_))
    ));
}

/// A TCP proxy on loopback in front of `port` that counts the reads it gets from its clients: one
/// per request a client sends and waits on (commands sent together arrive in one or a few reads).
async fn counting_proxy(port: u16) -> (String, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("redis://{}", listener.local_addr().unwrap());
    let reads = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&reads);
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let counted = Arc::clone(&counted);
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = async {
                    let mut buf = vec![0u8; 64 << 10];
                    while let Ok(n) = cr.read(&mut buf).await {
                        if n == 0 || sw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        counted.fetch_add(1, Ordering::SeqCst);
                    }
                };
                let down = tokio::io::copy(&mut sr, &mut cw);
                tokio::select! {
                    _ = up => {}
                    _ = down => {}
                }
            });
        }
    });
    (url, reads)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_usage_report_reads_its_hours_from_redis_in_a_few_round_trips() {
    let Some(redis) = start_redis() else { return };
    let port: u16 = redis.url.rsplit(':').next().unwrap().parse().unwrap();
    let (url, reads) = counting_proxy(port).await;
    let store = RedisStore::new(&url, Duration::from_millis(2000)).unwrap();
    let r = record("req-hours");
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let forward = tokio::spawn(Arc::clone(&store).forward_usage(rx));
    tx.send(vec![r.clone()]).await.unwrap();
    drop(tx);
    forward.await.unwrap();
    // The longest report: 62 days of hours, this one's record among them.
    let hours: Vec<String> = (0..62 * 24 + 1)
        .map(|i| kinference_gateway::tenancy::budget::hour_key(r.ts_ms - i * 3_600_000))
        .collect();
    let before = reads.load(Ordering::SeqCst);
    let started = Instant::now();
    let answers = store.hours(&hours).await.unwrap();
    let trips = reads.load(Ordering::SeqCst) - before;
    eprintln!(
        "{} hours read in {trips} round trips, {:?}",
        hours.len(),
        started.elapsed()
    );
    assert_eq!(answers.len(), hours.len());
    assert!(
        answers[0]
            .iter()
            .any(|(f, v)| f.ends_with("\u{1f}requests") && v == "1")
    );
    assert!(answers[1..].iter().all(Vec::is_empty));
    assert!(trips <= 64, "{trips} round trips for {} hours", hours.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_records_reach_redis_summed_per_tenant_and_hour_in_few_round_trips() {
    let Some(redis) = start_redis() else { return };
    let port: u16 = redis.url.rsplit(':').next().unwrap().parse().unwrap();
    let (url, reads) = counting_proxy(port).await;
    let store = RedisStore::new(&url, Duration::from_millis(2000)).unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let forward = tokio::spawn(Arc::clone(&store).forward_usage(rx));
    // What the journal hands over: batches of up to 512 records, here of 5 tenants.
    let now = record("x").ts_ms;
    let mut sent = 0;
    for b in 0..10 {
        let batch: Vec<UsageRecord> = (0..500)
            .map(|i| {
                let mut r = record(&format!("rt-{b}-{i}"));
                r.tenant = format!("tenant-{}", i % 5);
                r.ts_ms = now;
                r
            })
            .collect();
        sent += batch.len();
        tx.send(batch).await.unwrap();
    }
    drop(tx);
    forward.await.unwrap();
    let trips = reads.load(Ordering::SeqCst);
    eprintln!("{sent} records applied in {trips} round trips");
    assert_eq!(store.pending(), 0);
    let fields = store
        .hour(&kinference_gateway::tenancy::budget::hour_key(now))
        .await
        .unwrap();
    let sum = |name: &str| -> u64 {
        fields
            .iter()
            .filter(|(f, _)| f.ends_with(&format!("\u{1f}{name}")))
            .map(|(_, v)| v.parse::<u64>().unwrap())
            .sum()
    };
    assert_eq!(sum("requests"), sent as u64);
    assert_eq!(sum("output"), 5 * sent as u64);
    for t in 0..5 {
        let key = kinference_gateway::tenancy::budget::spend_key(&format!("tenant-{t}"), now);
        assert_eq!(store.spent(&key).await.unwrap(), 2.5 * (sent / 5) as f64);
    }
    // Before: one round trip per record (5,000).
    assert!(trips <= 40, "{trips} round trips for {sent} records");
}
