//! The agent binary's node signals end to end.
//!
//! Where they cannot work (eBPF switched off, or its object missing; no NVML on a machine without an NVIDIA
//! driver) the agent must still serve summaries over gRPC and say why: in the summaries (`kernel_ok = false`,
//! `gpu_unavailable_reason`), on `/metrics` (`kinference_agent_ebpf_program_state`,
//! `kinference_agent_gpu_available 0`), on `/readyz` and in its log. Where eBPF does load (root, kernel BTF,
//! the object built by `cargo xtask build-ebpf`), a loopback server with slow answers shows its requests in
//! the summary's kernel figures; the test says why it skips that part otherwise (a failure under `CI=true`,
//! and always when a program was rejected, by the verifier or otherwise).

mod support;

use std::time::{Duration, Instant};

use kinference_api::summary::node_agent_client::NodeAgentClient;
use kinference_api::summary::{NodeState, WatchRequest, WorkerLoad, summary::Kind};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(15);

/// A workers file with one worker on a port nothing listens on, without KV event endpoints.
fn lone_worker(port: u16) -> (String, String) {
    let url = format!("http://127.0.0.1:{port}");
    let yaml = format!("workers:\n  - url: {url}\n    model: {MODEL}\n");
    (url, yaml)
}

/// Everything the summary stream said about one worker and the node, as the gateway would keep it.
#[derive(Default)]
struct Seen {
    snapshot: bool,
    loads: Vec<WorkerLoad>,
    node_state: Option<NodeState>,
}

/// Watches `grpc` until `done` holds for what was seen, or panics after `timeout`.
async fn watch_until(
    grpc: &str,
    worker: &str,
    timeout: Duration,
    mut done: impl FnMut(&Seen) -> bool,
) -> Seen {
    let mut client = NodeAgentClient::connect(grpc.to_string())
        .await
        .expect("gRPC connect");
    let mut stream = client
        .watch(WatchRequest {
            gateway_id: "node-signals-test".into(),
        })
        .await
        .expect("watch")
        .into_inner();
    let mut seen = Seen::default();
    let deadline = Instant::now() + timeout;
    loop {
        if done(&seen) {
            return seen;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "timed out: snapshot {}, {} loads (last {:?}), node state {:?}",
            seen.snapshot,
            seen.loads.len(),
            seen.loads.last(),
            seen.node_state
        );
        let msg = match tokio::time::timeout(left, stream.message()).await {
            Ok(Ok(Some(m))) => m,
            Ok(other) => panic!("stream ended: {other:?}"),
            Err(_) => continue,
        };
        match msg.kind {
            Some(Kind::Snapshot(s)) => {
                seen.snapshot = true;
                if s.node_state.is_some() {
                    seen.node_state = s.node_state;
                }
                for w in s.workers.into_iter().filter(|w| w.worker_id == worker) {
                    seen.loads.extend(w.load);
                }
            }
            Some(Kind::Delta(d)) => {
                if d.node_state.is_some() {
                    seen.node_state = d.node_state;
                }
                for w in d.workers.into_iter().filter(|w| w.worker_id == worker) {
                    seen.loads.extend(w.load);
                }
            }
            None => {}
        }
    }
}

/// The body of `GET url`, and whether the status was 200.
async fn get(url: &str) -> (bool, String) {
    let resp = http_get(url).await;
    let ok = resp.starts_with("HTTP/1.1 200");
    let body = resp
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    (ok, body)
}

/// The value of one exact sample line (`name{labels}`) in a Prometheus text exposition.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Common checks of an agent whose eBPF programs are all in `state` for `why`.
async fn serves_and_says_why(env: &[(&str, &str)], state: &str, why: &str) {
    let (url, yaml) = lone_worker(free_port());
    let agent = Agent::start_with(&yaml, free_port(), env).await;

    // Summaries flow: a snapshot listing the worker, its load without a kernel view, and the node state.
    let seen = watch_until(&agent.grpc, &url, WAIT, |s| {
        s.snapshot && !s.loads.is_empty() && s.node_state.is_some()
    })
    .await;
    assert!(
        seen.loads.iter().all(|l| !l.kernel_ok),
        "no kernel view: {:?}",
        seen.loads
    );
    let node_state = seen.node_state.expect("node state");

    let (ok, metrics) = get(&agent.metrics_url).await;
    assert!(ok, "{metrics}");
    for program in ["inet_sock_set_state", "tcp_sendmsg_locked", "sk_data_ready"] {
        let series = format!(
            "kinference_agent_ebpf_program_state{{program=\"{program}\",state=\"{state}\"}}"
        );
        assert_eq!(
            sample(&metrics, &series),
            Some(1.0),
            "{series} in\n{metrics}"
        );
    }
    let gpu_available = sample(&metrics, "kinference_agent_gpu_available");
    let log = agent.log();
    assert!(log.contains(why), "the log says {why:?}:\n{log}");
    assert!(log.contains("eBPF kernel view unavailable"), "{log}");
    match gpu_available {
        Some(0.0) => {
            // No NVML here: said once in the log, and in every summary's node state.
            assert!(node_state.gpus.is_empty());
            assert!(
                node_state.gpu_unavailable_reason.contains("NVML"),
                "{node_state:?}"
            );
            assert!(log.contains("GPU state unavailable"), "{log}");
        }
        Some(_) => eprintln!("NVML works on this machine: only the eBPF half of the check applies"),
        None => panic!("kinference_agent_gpu_available missing:\n{metrics}"),
    }

    let (ok, body) = get(&format!("{}/healthz", agent.metrics_base)).await;
    assert!(ok, "{body}");
    let (ok, body) = get(&format!("{}/readyz", agent.metrics_base)).await;
    assert!(ok, "{body}");
    assert!(body.contains("ebpf: off"), "{body}");
    assert!(body.contains(why), "{body}");
    assert!(body.contains("workers: 1"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_ebpf_disabled_the_agent_serves_summaries_and_says_why() {
    serves_and_says_why(
        &[("KINFERENCE_DISABLE_EBPF", "1")],
        "disabled",
        "disabled by KINFERENCE_DISABLE_EBPF",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_missing_ebpf_object_the_agent_serves_summaries_and_says_why() {
    serves_and_says_why(
        &[(
            "KINFERENCE_EBPF_OBJECT",
            "/nonexistent/kinference/kinference.bpf.o",
        )],
        "load_failed",
        "reading the eBPF object /nonexistent/kinference/kinference.bpf.o",
    )
    .await;
}

/// A loopback "worker": answers `/metrics` at once (the agent scrapes it) and every other request after
/// `delay`, with `Connection: close`.
async fn slow_server(delay: Duration) -> (u16, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                if !got.starts_with(b"GET /metrics") {
                    tokio::time::sleep(delay).await;
                }
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    .await;
            });
        }
    });
    (port, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_ebpf_the_kernel_figures_reach_the_summary() {
    let delay = Duration::from_millis(600);
    let (port, server) = slow_server(delay).await;
    let url = format!("http://127.0.0.1:{port}");
    let yaml = format!("workers:\n  - url: {url}\n    model: {MODEL}\n");
    let agent = Agent::start(&yaml, free_port()).await;
    let (_, metrics) = get(&agent.metrics_url).await;
    let attached = |p: &str| {
        sample(
            &metrics,
            &format!("kinference_agent_ebpf_program_state{{program=\"{p}\",state=\"attached\"}}"),
        ) == Some(1.0)
    };
    if !(attached("tcp_sendmsg_locked") || attached("sock_send_length"))
        || !(attached("sk_data_ready") || attached("sock_recv_length"))
    {
        server.abort();
        support::ebpf::not_running(&program_outcomes(&metrics, &agent.log()));
        return;
    }

    // Give the agent a few poll intervals to start watching the port.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Three requests at once, each answered after `delay`: the kernel sees three waiting requests.
    let clients: Vec<_> = (0..3)
        .map(|_| {
            let url = format!("{url}/v1/completions");
            tokio::spawn(async move { http_get(&url).await })
        })
        .collect();
    watch_until(&agent.grpc, &url, WAIT, |s| {
        s.loads
            .iter()
            .any(|l| l.kernel_ok && l.kernel_waiting >= 3 && l.kernel_in_flight >= 3)
    })
    .await;
    for c in clients {
        let resp = c.await.expect("client");
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    }
    // Once answered, the time-to-first-byte histogram holds the three slow requests (the agent's own fast
    // scrapes of the port fall in the low buckets).
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, metrics) = get(&agent.metrics_url).await;
        let worker = format!("worker=\"{url}\"");
        let find = |prefix: &str, extra: &str| {
            metrics.lines().find_map(|l| {
                (l.starts_with(prefix) && l.contains(&worker) && l.contains(extra))
                    .then(|| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .flatten()
            })
        };
        let count = find("kinference_agent_kernel_ttfb_seconds_count", "");
        let fast = find("kinference_agent_kernel_ttfb_seconds_bucket", "le=\"0.5\"");
        if let (Some(count), Some(fast)) = (count, fast)
            && count - fast >= 3.0
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no slow TTFB samples (count {count:?}, <= 0.5 s {fast:?}):\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server.abort();
}

/// Each eBPF program's `(program, state, reason)`: the state from the agent's
/// `kinference_agent_ebpf_program_state` gauge, the reason from its log lines about that program.
fn program_outcomes(metrics: &str, log: &str) -> Vec<(String, String, String)> {
    metrics
        .lines()
        .filter(|l| l.starts_with("kinference_agent_ebpf_program_state{") && l.ends_with(" 1"))
        .filter_map(|l| {
            let label = |name: &str| {
                let start = l.find(&format!("{name}=\""))? + name.len() + 2;
                let len = l[start..].find('"')?;
                Some(l[start..start + len].to_string())
            };
            let program = label("program")?;
            let reason: Vec<&str> = log
                .lines()
                .filter(|line| line.contains("eBPF") && line.contains(&program))
                .collect();
            Some((program, label("state")?, reason.join(" | ")))
        })
        .collect()
}
