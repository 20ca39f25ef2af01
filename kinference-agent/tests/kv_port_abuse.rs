//! The agent's KV-event port under abuse by peers that finish the ZMTP handshake and then hold on:
//! idle connections filling every slot, and frames sent all but their last byte. Against the real
//! agent binary on loopback, with a real publisher beside them; the agent's memory is read from
//! `/proc` (resident now and its peak), not only its survival.

mod support;

use std::sync::Arc;
use std::time::Duration;

use kinference_agent::kv_events::encode::EventFormat;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const WAIT: Duration = Duration::from_secs(20);
const W1: &str = "http://127.0.0.1:18111";
const MIB: u64 = 1 << 20;
/// As many peers as the port admits by default (`--zmq-max-connections`).
const PEERS: usize = 64;

fn endpoint() -> String {
    format!("tcp://127.0.0.1:{}", free_port())
}

fn host_port(endpoint: &str) -> String {
    endpoint.trim_start_matches("tcp://").to_string()
}

/// An agent with one worker whose publisher connects to the agent's port (vLLM's connect mode), that
/// publisher, and a watcher that has seen its first batch.
async fn agent_with_publisher(env: &[(&str, &str)]) -> (Agent, FakeVllm, Watch, String) {
    let (events, replay) = (endpoint(), endpoint());
    let mut env = env.to_vec();
    env.push(("KINFERENCE_DISABLE_EBPF", "1"));
    let agent =
        Agent::start_with(&worker_yaml(W1, &events, true, &replay), free_port(), &env).await;
    let mut vllm =
        FakeVllm::start(&events, true, &replay, ReplayShape::V026, EventFormat::Map).await;
    let mut watch = Watch::connect(&agent.grpc).await;
    vllm.publish(vec![stored(1, 0, 4)]).await;
    watch.wait_for(W1, &keys(1, 4), WAIT).await;
    (agent, vllm, watch, host_port(&events))
}

/// A peer that completes the handshake as a PUB and then sends `then`.
async fn peer(addr: &str, then: &[u8]) -> std::io::Result<TcpStream> {
    let mut s = TcpStream::connect(addr).await?;
    let mut hello = zmtp_greeting("NULL");
    hello.extend(zmtp_ready("PUB"));
    s.write_all(&hello).await?;
    s.write_all(then).await?;
    Ok(s)
}

/// Whether the agent closed `s` within `within` (what it sent meanwhile is read and dropped).
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_frames_stay_within_the_agents_buffer_budget() {
    let (agent, mut vllm, mut watch, addr) = agent_with_publisher(&[]).await;
    let before = agent.memory("VmRSS");
    // Each peer: a frame header declaring 16 MiB (the largest frame allowed), then all of it but
    // its last byte, and then nothing. The frame never completes; whatever holds it, holds it.
    let mut header = vec![0x02];
    header.extend((16 * MIB).to_be_bytes());
    let body = Arc::new(vec![0u8; (16 * MIB - 1) as usize]);
    let started = std::time::Instant::now();
    // Connected one at a time, so that none is dropped while still in its handshake (at most 16
    // may be at once): each of them reaches the frame.
    let mut streams = Vec::new();
    for _ in 0..PEERS {
        streams.push(peer(&addr, &header).await.expect("peer connects"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let peers = futures::future::join_all(streams.into_iter().map(|mut s| {
        let body = Arc::clone(&body);
        tokio::spawn(async move {
            // A peer the agent cuts off gets a write error: that is the point.
            let _ = s.write_all(&body).await;
            s
        })
    }))
    .await;
    let sent = started.elapsed();
    // What the agent holds once every peer has sent what it will: its resident memory no longer
    // grows (the last bytes may still be in the sockets' buffers when the writes return).
    let mut rss = agent.memory("VmRSS");
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = agent.memory("VmRSS");
        if now.abs_diff(rss) < MIB {
            break;
        }
        rss = now;
    }
    let (rss, peak) = (agent.memory("VmRSS"), agent.memory("VmHWM"));
    let port: u16 = addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    let unread = tcp_unread(port);
    let evicted = agent.rejected("kv_events", "buffer_evicted").await
        + agent.rejected("kv_events", "buffer_full").await;
    eprintln!(
        "{PEERS} peers x a 16 MiB frame less one byte, sent in {sent:?}: agent RSS {} MiB before, \
         {} MiB after, peak {} MiB, and {} MiB unread in its sockets; {evicted} connections cut \
         for the buffer budget",
        before / MIB,
        rss / MIB,
        peak / MIB,
        unread / MIB
    );
    // What the frames cost the pod: the agent's heap and the kernel's buffers of its connections.
    let held = peak.saturating_sub(before) + unread;
    assert!(
        held <= 128 * MIB,
        "{PEERS} half-sent 16 MiB frames hold {} MiB (resident {} MiB + unread {} MiB)",
        held / MIB,
        peak.saturating_sub(before) / MIB,
        unread / MIB
    );
    assert!(
        evicted >= (PEERS - 2) as f64,
        "a 32 MiB budget holds two 16 MiB frames: the other peers are cut ({evicted})"
    );
    // The real publisher's batches still arrive.
    vllm.publish(vec![stored(2, 0, 3)]).await;
    let mut expected = keys(1, 4);
    expected.extend(keys(2, 3));
    watch.wait_for(W1, &expected, WAIT).await;
    assert_eq!(agent.rejected("kv_events", "handshake_evicted").await, 0.0);
    drop(peers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_peers_neither_lock_a_reconnecting_publisher_out_nor_stay_forever() {
    let idle_timeout = Duration::from_secs(6);
    let ms = idle_timeout.as_millis().to_string();
    let (events, replay) = (endpoint(), endpoint());
    let agent = Agent::start_with(
        &worker_yaml(W1, &events, true, &replay),
        free_port(),
        &[
            ("KINFERENCE_DISABLE_EBPF", "1"),
            ("KINFERENCE_AGENT_ZMQ_IDLE_TIMEOUT_MS", &ms),
        ],
    )
    .await;
    let addr = host_port(&events);
    // Every established slot taken by a peer that finished its handshake and says nothing more.
    // One at a time, so that none is dropped while still in its handshake (at most 16 may be).
    let mut idle = Vec::new();
    for _ in 0..PEERS {
        idle.push(peer(&addr, b"").await.expect("idle peer connects"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(agent.rejected("kv_events", "handshake_evicted").await, 0.0);
    assert_eq!(
        agent.rejected("kv_events", "too_many_connections").await,
        0.0
    );
    // Then the worker's publisher (re)connects: its batches must arrive well before any idle
    // timeout could have freed a slot.
    let connected = std::time::Instant::now();
    let mut vllm =
        FakeVllm::start(&events, true, &replay, ReplayShape::V026, EventFormat::Map).await;
    let mut watch = Watch::connect(&agent.grpc).await;
    let mut n = 0;
    while watch.view.get(W1).is_none_or(|v| v.is_empty()) {
        assert!(
            connected.elapsed() < idle_timeout / 2,
            "the publisher's batches did not arrive behind {PEERS} idle peers"
        );
        n += 1;
        vllm.publish(vec![stored(n, 0, 2)]).await;
        watch.step(Duration::from_millis(200)).await;
    }
    eprintln!("publisher through after {:?}", connected.elapsed());
    assert!(agent.rejected("kv_events", "idle_evicted").await >= 1.0);
    // The idle peers are closed once idle for the timeout; the publisher, publishing, stays.
    let publishing = tokio::spawn(async move {
        loop {
            n += 1;
            vllm.publish(vec![stored(n, 0, 1)]).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    let mut closed = 0;
    for s in &mut idle {
        closed += usize::from(closed_within(s, idle_timeout + Duration::from_secs(5)).await);
    }
    assert_eq!(closed, PEERS, "every idle peer is closed");
    assert!(agent.rejected("kv_events", "idle_timeout").await >= 1.0);
    let before = watch.view.get(W1).map_or(0, |v| v.len());
    let deadline = tokio::time::Instant::now() + WAIT;
    while watch.view.get(W1).map_or(0, |v| v.len()) <= before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the publisher was cut off"
        );
        watch.step(Duration::from_millis(200)).await;
    }
    publishing.abort();
}
