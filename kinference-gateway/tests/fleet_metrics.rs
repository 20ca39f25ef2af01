//! The fleet gauges and routing signals through the real `kinference-gateway` binary in front of a
//! real `vllm-sim` worker: one-command mode (`--worker`) reports its missing agent signals as
//! `absent`, a gateway whose agent cannot be reached as `stale`, both in `/metrics` and in
//! `/healthz/workers`; the per-tenant histograms appear only when turned on.

use testkit::{ChildGuard, free_port, tokenizer_dir};

mod support;

use support::call;

const MODEL: &str = "fleet-model";

async fn get(port: u16, path: &str) -> (u16, String) {
    let (status, _, body) = call("127.0.0.1", port, "GET", path, &[], "").await;
    (status, body)
}

async fn chat(port: u16) -> u16 {
    support::chat(port, MODEL, &[]).await.0
}

/// A `vllm-sim` worker serving [`MODEL`], answering; None when vllm-sim is not built (a failure
/// under `CI=true`).
async fn worker() -> Option<(ChildGuard, u16)> {
    let (child, port) = support::spawn_vllm_sim(&support::vllm_sim_binary()?, MODEL);
    support::wait_until_ok(port, "/v1/models").await;
    Some((child, port))
}

/// The gateway in front of the worker (`--worker`), with `config`; waits until it serves a chat.
async fn gateway(dir: &std::path::Path, config: &str, worker: u16) -> (ChildGuard, u16, u16) {
    let path = dir.join("gateway.yaml");
    std::fs::write(&path, config).unwrap();
    let worker_url = format!("http://127.0.0.1:{worker}");
    let tokenizer = tokenizer_dir();
    let (mut child, api, admin) = support::spawn_gateway_with(
        &path,
        &[
            "--worker",
            &worker_url,
            "--tokenizer-dir",
            tokenizer.to_str().unwrap(),
        ],
    );
    support::wait_while_running(&mut child, "the gateway serving a chat", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", api))
            .await
            .is_ok()
            && chat(api).await == 200
    })
    .await;
    (child, api, admin)
}

/// Sample lines of the exposition that carry the open gateway's tenant.
fn tenant_series(text: &str) -> usize {
    text.lines()
        .filter(|l| !l.starts_with('#') && l.contains("tenant=\"anonymous\""))
        .count()
}

/// The signals `/healthz/workers` lists for the one worker.
async fn signals(admin: u16) -> serde_json::Value {
    let (status, body) = get(admin, "/healthz/workers").await;
    assert_eq!(status, 200, "{body}");
    let json: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    json["workers"][0]["signals"].clone()
}

#[tokio::test]
async fn one_command_mode_reports_its_signals_and_the_pool_gauges() {
    let Some((_worker, worker_port)) = worker().await else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kinference-fleet-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();

    // One-command mode: no agent, the gateway's own tokenizer.
    let (gw, api, admin) = gateway(&dir, "{}\n", worker_port).await;
    assert_eq!(chat(api).await, 200);
    let (status, text) = get(admin, "/metrics").await;
    assert_eq!(status, 200);
    for line in [
        format!(
            "kinference_gateway_pool_workers{{model=\"{MODEL}\",pool=\"\",state=\"healthy\"}} 1"
        ),
        format!(
            "kinference_gateway_routing_signal{{model=\"{MODEL}\",signal=\"kv_events\",state=\"absent\"}} 1"
        ),
        format!(
            "kinference_gateway_routing_signal{{model=\"{MODEL}\",signal=\"engine_metrics\",state=\"absent\"}} 1"
        ),
        format!(
            "kinference_gateway_routing_signal{{model=\"{MODEL}\",signal=\"tokenizer\",state=\"live\"}} 1"
        ),
        format!("kinference_gateway_pool_requests_in_flight{{model=\"{MODEL}\",pool=\"\"}} "),
        // Open gateway: the per-tenant counters are there.
        "kinference_gateway_tenant_requests_total{tenant=\"anonymous\"".to_string(),
    ] {
        assert!(text.contains(&line), "{line} missing:\n{text}");
    }
    let ttft: f64 = text
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!(
                "kinference_gateway_pool_estimated_ttft_seconds{{model=\"{MODEL}\",pool=\"\"}} "
            ))
        })
        .unwrap_or_else(|| panic!("no estimated TTFT:\n{text}"))
        .parse()
        .unwrap();
    assert!(ttft > 0.0 && ttft.is_finite(), "{ttft}");
    // No agent: no engine figures, rather than zeros.
    assert!(!text.contains("kinference_gateway_pool_requests_waiting{"));
    // Per-tenant histograms are off by default.
    assert!(!text.contains("kinference_gateway_tenant_e2e_request_latency_seconds"));
    let tenant_series_off = tenant_series(&text);
    let s = signals(admin).await;
    assert_eq!(
        (
            s["kv_events"].as_str(),
            s["engine_metrics"].as_str(),
            s["ebpf"].as_str(),
            s["tokenizer"].as_str()
        ),
        (Some("absent"), Some("absent"), Some("absent"), Some("live")),
        "{s}"
    );
    drop(gw);

    // An agent configured but unreachable: its signals are stale; histograms turned on.
    let dead_agent = free_port();
    let config = format!(
        "agents: [\"http://127.0.0.1:{dead_agent}\"]\ntenancy:\n  per_tenant_histograms: true\n"
    );
    let (_gw, api, admin) = gateway(&dir, &config, worker_port).await;
    assert_eq!(chat(api).await, 200);
    let (_, text) = get(admin, "/metrics").await;
    for line in [
        format!(
            "kinference_gateway_routing_signal{{model=\"{MODEL}\",signal=\"kv_events\",state=\"stale\"}} 1"
        ),
        format!(
            "kinference_gateway_routing_signal{{model=\"{MODEL}\",signal=\"engine_metrics\",state=\"stale\"}} 1"
        ),
        "kinference_gateway_tenant_e2e_request_latency_seconds_count{tenant=\"anonymous\""
            .to_string(),
    ] {
        assert!(text.contains(&line), "{line} missing:\n{text}");
    }
    assert_eq!(signals(admin).await["kv_events"], "stale");
    let tenant_series_on = tenant_series(&text);
    // Non-streamed chats: the end-to-end and the two size histograms (TTFT and ITL need a stream).
    assert!(
        tenant_series_on > tenant_series_off + 3 * 16,
        "{tenant_series_off} -> {tenant_series_on}"
    );
    eprintln!(
        "series of tenant anonymous after non-streamed chats: {tenant_series_off} without per-tenant histograms, {tenant_series_on} with"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
