//! The usage journal end to end: the real `kinference-gateway` binary in front of a real `vllm-sim`
//! worker, its journal on a "disk" of a few KiB (the gateway runs under `prlimit --fsize`, SIGXFSZ
//! ignored, so a write past the limit fails as on a full disk).
//!
//! - a journal left with a torn last line (a crash mid-write) is repaired at start: no record lost,
//!   `kinference_gateway_usage_journal_errors_total{error="torn_tail"}` is 1;
//! - once the disk is full, write failures are counted, tenant `strict` (`on_usage_unrecorded:
//!   refuse`) gets 503 in its protocol, tenant `lenient` (the default, `serve`) is still served;
//! - a restart without the limit reads back every record that was written, and no torn line.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use testkit::{ChildGuard, free_port};

mod support;

use support::metric;

const MODEL: &str = "journal-model";
const STRICT_KEY: &str = "sk-strict-journal-test";
const LENIENT_KEY: &str = "sk-lenient-journal-test";
/// Room left on the "disk" past the seeded journal: a dozen records.
const ROOM_BYTES: u64 = 3 * 1024;

/// One HTTP/1.1 exchange on a fresh loopback connection: (status, body).
async fn call(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let (status, _, body) = support::call("127.0.0.1", port, method, path, headers, body).await;
    (status, body)
}

async fn chat(port: u16, key: &str) -> (u16, String) {
    let auth = format!("Bearer {key}");
    let (status, _, body) = support::chat(port, MODEL, &[("authorization", &auth)]).await;
    (status, body)
}

async fn messages(port: u16, key: &str) -> (u16, String) {
    let body = format!(
        r#"{{"model":"{MODEL}","max_tokens":2,"messages":[{{"role":"user","content":"hello there"}}]}}"#
    );
    call(port, "POST", "/v1/messages", &[("x-api-key", key)], &body).await
}

/// Requests of tenant `lenient` in `/admin/usage` (loopback: an admin).
async fn lenient_requests(admin: u16) -> u64 {
    // From a day back (a report covers at most 62 days): the requests are from now.
    let day_ago = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        - 86_400;
    let path = format!("/admin/usage?tenant=lenient&from={day_ago}");
    let (status, body) = call(admin, "GET", &path, &[], "").await;
    assert_eq!(status, 200, "{body}");
    let json: serde_json::Value = serde_json::from_str(&body).expect("usage JSON");
    json["total"]["requests"].as_u64().expect("total requests")
}

/// Starts the gateway (under a file-size limit when `limit` is given) and waits until it serves.
async fn gateway(config: &std::path::Path, limit: Option<u64>) -> (ChildGuard, u16, u16) {
    let (api, admin) = (free_port(), free_port());
    let mut command = match limit {
        Some(bytes) => {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg("trap '' XFSZ; exec prlimit --fsize=\"$0\" -- \"$@\"")
                .arg(bytes.to_string())
                .arg(env!("CARGO_BIN_EXE_kinference-gateway"));
            c
        }
        None => Command::new(env!("CARGO_BIN_EXE_kinference-gateway")),
    };
    command
        .args(support::gateway_args("127.0.0.1", api, admin, config))
        .env_remove("KINFERENCE_ADMIN_KEY")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = ChildGuard(command.spawn().expect("starting kinference-gateway"));
    support::wait_until_ready(&mut child, admin).await;
    (child, api, admin)
}

fn record_line(id: &str, ts_ms: u128) -> String {
    format!(
        r#"{{"id":"{id}","ts_ms":{ts_ms},"tenant":"lenient","model":"{MODEL}","pool":"","provider":"","status":200,"requests":1,"input_uncached":10,"input_cached":0,"output":2,"cost":0.0}}"#
    )
}

#[tokio::test]
async fn a_torn_journal_is_repaired_and_a_full_disk_is_counted_and_handled_per_tenant() {
    let Some(sim) = support::vllm_sim_binary() else {
        return;
    };
    let prlimit = Command::new("prlimit")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !testkit::require(
        prlimit,
        "prlimit",
        "the full disk is a file-size limit (util-linux)",
    ) {
        return;
    }
    let (_worker, worker_port) = support::spawn_vllm_sim(&sim, MODEL);
    let dir = std::env::temp_dir().join(format!("kinference-usage-journal-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    support::write_tenants(
        &dir,
        &[("strict", STRICT_KEY), ("lenient", LENIENT_KEY)],
        "",
    );
    // Two records and a torn third, as a crash mid-write leaves them.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let journal = dir.join("usage.jsonl");
    let torn = &record_line("torn", now)[..40];
    let seeded = format!(
        "{}\n{}\n",
        record_line("seed-1", now),
        record_line("seed-2", now)
    );
    std::fs::write(&journal, format!("{seeded}{torn}")).unwrap();
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - name: {MODEL}\nworkers:\n  - url: http://127.0.0.1:{worker_port}\n    model: {MODEL}\ntenancy:\n  tenants_dir: {tenants}\n  secrets_dir: {secrets}\n  usage_journal: {journal}\n  tenants:\n    strict: {{on_usage_unrecorded: refuse}}\n",
            tenants = dir.join("tenants.yaml").display(),
            secrets = dir.join("secrets").display(),
            journal = journal.display(),
        ),
    )
    .unwrap();

    let limit = seeded.len() as u64 + ROOM_BYTES;
    let (gw, api, admin) = gateway(&config, Some(limit)).await;
    let torn_tail = "kinference_gateway_usage_journal_errors_total{error=\"torn_tail\"}";
    let write_errors = "kinference_gateway_usage_journal_errors_total{error=\"write\"}";
    assert_eq!(metric(admin, torn_tail).await, 1.0);
    assert_eq!(lenient_requests(admin).await, 2, "a seeded record was lost");
    assert_eq!(std::fs::read_to_string(&journal).unwrap(), seeded);

    // Both tenants are served while the disk has room; `lenient` fills it.
    // (The worker's first health probe may still be on its way: wait for it.)
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = chat(api, STRICT_KEY).await;
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "never served: {status} {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut served = 0;
    while metric(admin, write_errors).await == 0.0 {
        assert!(
            served < 200,
            "a {limit}-byte file limit never failed a write"
        );
        let (status, body) = chat(api, LENIENT_KEY).await;
        assert_eq!(status, 200, "{body}");
        served += 1;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }

    // Full: `strict` is refused in both protocols, `lenient` served, everything counted.
    let (status, body) = chat(api, STRICT_KEY).await;
    assert_eq!(status, 503, "{body}");
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "usage_unrecorded", "{body}");
    let (status, body) = messages(api, STRICT_KEY).await;
    assert_eq!(status, 503, "{body}");
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["type"], "overloaded_error", "{body}");
    assert_eq!(chat(api, LENIENT_KEY).await.0, 200);
    assert_eq!(
        metric(
            admin,
            "kinference_gateway_usage_journal_refused_requests_total"
        )
        .await,
        2.0
    );
    assert!(metric(admin, "kinference_gateway_usage_journal_buffered_records").await >= 1.0);
    // The gateway's own view still counts every served request.
    assert_eq!(lenient_requests(admin).await, 2 + served + 1);
    drop(gw);

    // Restarted with room: every written line reads back, none torn.
    let text = std::fs::read_to_string(&journal).unwrap();
    assert!(text.len() as u64 <= limit && text.ends_with('\n'));
    let written = text
        .lines()
        .filter(|l| l.contains("\"tenant\":\"lenient\""))
        .count() as u64;
    let (_gw, _api, admin) = gateway(&config, None).await;
    assert_eq!(metric(admin, torn_tail).await, 0.0);
    assert_eq!(
        metric(
            admin,
            "kinference_gateway_usage_journal_errors_total{error=\"corrupt_line\"}"
        )
        .await,
        0.0
    );
    assert_eq!(lenient_requests(admin).await, written);
    let _ = std::fs::remove_dir_all(&dir);
}
