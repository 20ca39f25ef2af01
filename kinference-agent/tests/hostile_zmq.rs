//! Hostile clients against a running agent binary: giant declared frames (2^40 bytes), truncated
//! greetings, wrong security mechanisms, garbage, 1,000 idle connections, and a hostile "worker" that the
//! agent dials. The agent must stay up, keep routing data flowing from well-behaved publishers to the
//! gateway's gRPC stream, and count every refusal in `kinference_agent_rejected_total`.

mod support;

use std::time::Duration;

use kinference_agent::kv_events::encode::EventFormat;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const WAIT: Duration = Duration::from_secs(20);
const W1: &str = "http://127.0.0.1:18101";
const W2: &str = "http://127.0.0.1:18102";
const W3: &str = "http://127.0.0.1:18103";

/// A ZMTP 3.0 greeting with the given mechanism.
fn greeting(mechanism: &str) -> Vec<u8> {
    let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0];
    let mut mech = mechanism.as_bytes().to_vec();
    mech.resize(20, 0);
    g.extend(mech);
    g.push(0);
    g.extend([0u8; 31]);
    assert_eq!(g.len(), 64);
    g
}

/// A READY command from a socket of type `ty`.
fn ready(ty: &str) -> Vec<u8> {
    let mut body = vec![5];
    body.extend(b"READY");
    body.push(11);
    body.extend(b"Socket-Type");
    body.extend((ty.len() as u32).to_be_bytes());
    body.extend(ty.as_bytes());
    let mut f = vec![0x04, body.len() as u8];
    f.extend(body);
    f
}

/// A message frame header declaring 2^40 bytes, and a few of them.
fn giant_frame() -> Vec<u8> {
    let mut f = vec![0x02];
    f.extend((1u64 << 40).to_be_bytes());
    f.extend(b"only these bytes follow");
    f
}

fn host_port(endpoint: &str) -> String {
    endpoint.trim_start_matches("tcp://").to_string()
}

/// Sends `bytes` and reports whether the agent then closed the connection within `within`.
async fn send_and_expect_close(addr: &str, bytes: &[u8], within: Duration) -> bool {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let _ = s.write_all(bytes).await;
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            // The agent's own greeting and READY: keep reading.
            Ok(Ok(_)) => {}
        }
    }
}

/// One `kinference_agent_rejected_total` series (0 when absent).
async fn rejected(agent: &Agent, listener: &str, reason: &str) -> f64 {
    let text = http_get(&agent.metrics_url).await;
    let want =
        format!("kinference_agent_rejected_total{{listener=\"{listener}\",reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&want)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The agent answers on its metrics port (the process is alive and serving).
async fn assert_alive(agent: &Agent) {
    let health = try_http_get(&format!("{}/healthz", agent.metrics_base))
        .await
        .expect("the agent still answers /healthz");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    let log = agent.log();
    assert!(
        !log.contains("memory allocation") && !log.contains("panicked"),
        "agent log shows a crash:\n{log}"
    );
}

/// A worker that binds its KV-event port, as vLLM with `tcp://*:port` does, but answers the agent's
/// connection with a valid handshake and then a frame declaring 2^40 bytes, every time it is dialled.
async fn hostile_worker(listener: TcpListener) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let mut bytes = greeting("NULL");
            bytes.extend(ready("PUB"));
            bytes.extend(giant_frame());
            let _ = s.write_all(&bytes).await;
            let mut buf = [0u8; 1024];
            while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_zmq_clients_neither_crash_the_agent_nor_stop_routing_data() {
    let ep = || format!("tcp://127.0.0.1:{}", free_port());
    let (events1, replay1) = (ep(), ep());
    let (events2, replay2) = (ep(), ep());
    let (events3, replay3) = (ep(), ep());
    let hostile = TcpListener::bind(host_port(&events3)).await.expect("bind");
    tokio::spawn(hostile_worker(hostile));
    // W1 and W2: vLLM's connect mode (the agent binds a public port). W3: the agent dials a hostile worker.
    let yaml = format!(
        "workers:\n\
         - {{url: {W1}, model: {MODEL}, kv_events_endpoint: '{events1}', kv_events_bind: true, kv_replay_endpoint: '{replay1}'}}\n\
         - {{url: {W2}, model: {MODEL}, kv_events_endpoint: '{events2}', kv_events_bind: true, kv_replay_endpoint: '{replay2}'}}\n\
         - {{url: {W3}, model: {MODEL}, kv_events_endpoint: '{events3}', kv_events_bind: false, kv_replay_endpoint: '{replay3}'}}\n"
    );
    let agent = Agent::start_with(
        &yaml,
        free_port(),
        &[
            ("KINFERENCE_DISABLE_EBPF", "1"),
            ("KINFERENCE_AGENT_ZMQ_HANDSHAKE_TIMEOUT_MS", "1500"),
        ],
    )
    .await;
    let mut vllm1 = FakeVllm::start(
        &events1,
        true,
        &replay1,
        ReplayShape::V026,
        EventFormat::Map,
    )
    .await;
    let mut watch = Watch::connect(&agent.grpc).await;
    vllm1.publish(vec![stored(1, 0, 4)]).await;
    watch.wait_for(W1, &keys(1, 4), WAIT).await;

    let port1 = host_port(&events1);
    let port2 = host_port(&events2);

    // 1. A valid handshake, then one frame declaring 2^40 bytes (this aborted the agent before).
    let mut giant = greeting("NULL");
    giant.extend(ready("PUB"));
    giant.extend(giant_frame());
    assert!(
        send_and_expect_close(&port1, &giant, WAIT).await,
        "the giant frame's connection is closed"
    );
    // The same as the first bytes after the greeting: a message before READY.
    let mut early = greeting("NULL");
    early.extend(giant_frame());
    assert!(send_and_expect_close(&port1, &early, WAIT).await);
    // A 2^40-byte command (READY's frame).
    let mut giant_command = greeting("NULL");
    giant_command.push(0x06);
    giant_command.extend((1u64 << 40).to_be_bytes());
    assert!(send_and_expect_close(&port1, &giant_command, WAIT).await);
    // A multi-frame message whose frames each pass but whose sum does not.
    let mut many = greeting("NULL");
    many.extend(ready("PUB"));
    many.push(0x03);
    many.extend((10u64 << 20).to_be_bytes());
    many.resize(many.len() + (10 << 20), 0);
    many.push(0x02);
    many.extend((10u64 << 20).to_be_bytes());
    assert!(send_and_expect_close(&port1, &many, WAIT).await);

    // 2. Wrong security mechanisms and versions.
    for mech in ["CURVE", "PLAIN", "GSSAPI", "NULLX"] {
        assert!(
            send_and_expect_close(&port1, &greeting(mech), WAIT).await,
            "{mech} is refused"
        );
    }
    let mut v2 = greeting("NULL");
    v2[10] = 2;
    assert!(send_and_expect_close(&port1, &v2, WAIT).await);

    // 3. Truncated greetings: cut off and closed, or cut off and left hanging (the handshake deadline).
    for cut in [1, 10, 11, 33, 63] {
        let mut s = TcpStream::connect(&port1).await.expect("connect");
        s.write_all(&greeting("NULL")[..cut]).await.expect("write");
        drop(s);
    }
    assert!(
        send_and_expect_close(&port1, &greeting("NULL")[..20], WAIT).await,
        "a half greeting is dropped at the handshake deadline"
    );

    // 4. Garbage: HTTP, random bytes, a bad flags byte after a good handshake.
    assert!(send_and_expect_close(&port1, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", WAIT).await);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let noise: Vec<u8> = (0..8192)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    assert!(send_and_expect_close(&port1, &noise, WAIT).await);
    let mut bad_flags = greeting("NULL");
    bad_flags.extend(ready("PUB"));
    bad_flags.extend([0xf0, 1, 0]);
    assert!(send_and_expect_close(&port1, &bad_flags, WAIT).await);

    // Routing data from the established publisher keeps flowing.
    vllm1.publish(vec![stored(2, 0, 3)]).await;
    let mut expected = keys(1, 4);
    expected.extend(keys(2, 3));
    watch.wait_for(W1, &expected, WAIT).await;

    // 5. 1,000 idle connections on W2's port, held open; then W2's real publisher connects.
    let mut idle = Vec::with_capacity(1000);
    for _ in 0..1000 {
        idle.push(TcpStream::connect(&port2).await.expect("idle connect"));
    }
    let mut vllm2 = FakeVllm::start(
        &events2,
        true,
        &replay2,
        ReplayShape::V025,
        EventFormat::Array,
    )
    .await;
    vllm2.publish(vec![stored(3, 0, 2)]).await;
    // A PUB drops messages until its peer has subscribed: keep publishing until one is routed.
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut n = 3;
    while watch.view.get(W2).is_none_or(|v| v.is_empty()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "W2's events never arrived behind 1,000 idle connections"
        );
        n += 1;
        vllm2.publish(vec![stored(n, 0, 2)]).await;
        watch.step(Duration::from_millis(200)).await;
    }
    // And W1's keeps flowing too.
    vllm1.publish(vec![stored(50, 0, 1)]).await;
    expected.extend(keys(50, 1));
    watch.wait_for(W1, &expected, WAIT).await;
    drop(idle);

    // 6. The gRPC and metrics ports take garbage and oversized heads without falling over.
    let grpc_addr = agent.grpc.trim_start_matches("http://").to_string();
    assert!(send_and_expect_close(&grpc_addr, &noise, WAIT).await);
    let metrics_addr = agent.metrics_base.trim_start_matches("http://").to_string();
    let mut huge_head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
    huge_head.extend(std::iter::repeat_n(b'a', 1 << 20));
    assert!(send_and_expect_close(&metrics_addr, &huge_head, WAIT).await);

    // Every refusal was counted, by reason; the hostile worker W3 (dialled by the agent) too.
    assert_alive(&agent).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while rejected(&agent, "kv_events", "handshake_evicted").await < 1.0
        || rejected(&agent, "kv_events", "handshake_timeout").await < 1.0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "idle connections were not dropped"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        rejected(&agent, "kv_events", "frame_too_large").await >= 2.0,
        "own port + W3"
    );
    assert!(rejected(&agent, "kv_events", "message_too_large").await >= 1.0);
    assert!(rejected(&agent, "kv_events", "command_too_large").await >= 1.0);
    assert!(rejected(&agent, "kv_events", "mechanism").await >= 4.0);
    assert!(rejected(&agent, "kv_events", "version").await >= 1.0);
    assert!(rejected(&agent, "kv_events", "protocol").await >= 3.0);
    assert!(agent.metric("kinference_agent_kv_batches_total").await >= 3.0);
    // The log is rate limited: far fewer lines than refusals.
    let lines = agent
        .log()
        .lines()
        .filter(|l| l.contains("refused at the trust boundary"))
        .count();
    assert!((1..20).contains(&lines), "{lines} refusal log lines");

    // Still alive, still routing.
    vllm1.publish(vec![stored(60, 0, 1)]).await;
    expected.extend(keys(60, 1));
    watch.wait_for(W1, &expected, WAIT).await;
    assert_alive(&agent).await;
}
