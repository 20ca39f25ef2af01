//! The eBPF programs in the real kernel against a loopback HTTP server with known per-request delays and
//! concurrency: in-flight counts and time to first byte must match what the clients see.
//!
//! Needs root (CAP_BPF, CAP_PERFMON) and the object (`cargo xtask build-ebpf` before building the agent);
//! without either the loading part prints why and returns (and fails under `CI=true`); a program the
//! kernel rejects (the verifier) always fails. Tolerance for time to first byte: 20 ms + 10%
//! of the client's own measurement (observed differences are a few ms).

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kinference_agent::node::ebpf::{
    EbpfOptions, KernelMonitor, KernelView, ProgramState, embedded_object,
};
use kinference_agent::node::gpu::GpuMonitor;
use prometheus_client::registry::Registry;

const POLL: Duration = Duration::from_millis(20);
const IDLE_GAP: Duration = Duration::from_millis(200);

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

/// A thread-per-connection HTTP/1.1 server: `GET /sleep/<ms>` sleeps that long, then answers `ok`.
/// `Connection: close` requests are answered and closed; others keep the connection open. Stops on drop.
struct SleepServer {
    port: u16,
    stop: Arc<AtomicBool>,
}

impl SleepServer {
    fn start() -> SleepServer {
        Self::start_on("127.0.0.1:0").expect("bind")
    }

    fn start_on(addr: &str) -> std::io::Result<SleepServer> {
        let listener = TcpListener::bind(addr)?;
        let port = listener.local_addr().expect("addr").port();
        listener.set_nonblocking(true).expect("nonblocking");
        let stop = Arc::new(AtomicBool::new(false));
        let stop_accept = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop_accept.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        std::thread::spawn(move || serve(stream));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Ok(SleepServer { port, stop })
    }
}

impl Drop for SleepServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn serve(stream: TcpStream) {
    let _ = stream.set_nonblocking(false);
    let mut reader = BufReader::new(match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    });
    let mut writer = stream;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
            return;
        }
        let mut close = false;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            if header.to_ascii_lowercase().starts_with("connection: close") {
                close = true;
            }
            if header == "\r\n" {
                break;
            }
        }
        let path = request_line.split_whitespace().nth(1).unwrap_or("");
        if let Some(ms) = path.strip_prefix("/sse/").and_then(|v| v.parse().ok()) {
            if serve_event_stream(&mut writer, ms).is_err() {
                return;
            }
            continue;
        }
        if path == "/empty" {
            let response = "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n";
            if writer.write_all(response.as_bytes()).is_err() {
                return;
            }
            continue;
        }
        let ms: u64 = path
            .strip_prefix("/sleep/")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        std::thread::sleep(Duration::from_millis(ms));
        let connection = if close { "close" } else { "keep-alive" };
        let response =
            format!("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: {connection}\r\n\r\nok");
        if writer.write_all(response.as_bytes()).is_err() || close {
            return;
        }
    }
}

/// A streaming answer as vLLM sends one: the header block at once, on its own, then the first event after
/// `ms` (the prefill), a second one, and the chunked body's end.
fn serve_event_stream(writer: &mut TcpStream, ms: u64) -> std::io::Result<()> {
    writer.write_all(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n",
    )?;
    std::thread::sleep(Duration::from_millis(ms));
    for event in ["data: {\"n\":1}\n\n", "data: [DONE]\n\n"] {
        writer.write_all(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes())?;
        std::thread::sleep(Duration::from_millis(10));
    }
    writer.write_all(b"0\r\n\r\n")
}

/// Sends `GET /sse/<ms>` on `stream`; returns the times from the request's first byte to the response's
/// first byte (its headers) and to its first body byte.
fn request_event_stream(stream: &mut TcpStream, ms: u64) -> (Duration, Duration) {
    let req = format!("GET /sse/{ms} HTTP/1.1\r\nHost: test\r\n\r\n");
    let start = Instant::now();
    stream.write_all(req.as_bytes()).expect("write");
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    let (mut headers, mut body) = (None, None);
    while !got.ends_with(b"0\r\n\r\n") || body.is_none() {
        let n = stream.read(&mut buf).expect("read");
        assert!(n > 0, "connection closed mid-response: {got:?}");
        got.extend_from_slice(&buf[..n]);
        headers.get_or_insert_with(|| start.elapsed());
        let end = got.windows(4).position(|w| w == b"\r\n\r\n");
        if body.is_none() && end.is_some_and(|e| got.len() > e + 4) {
            body = Some(start.elapsed());
        }
    }
    (headers.expect("headers"), body.expect("body"))
}

/// Sends one request on `stream` and returns the time from the request's first byte to the response's.
fn request(stream: &mut TcpStream, ms: u64, close: bool) -> Duration {
    let connection = if close { "Connection: close\r\n" } else { "" };
    let req = format!("GET /sleep/{ms} HTTP/1.1\r\nHost: test\r\n{connection}\r\n");
    let start = Instant::now();
    stream.write_all(req.as_bytes()).expect("write");
    let mut first = [0u8; 1];
    stream.read_exact(&mut first).expect("first byte");
    let ttfb = start.elapsed();
    // Read the rest of the (fixed-size) response: "HTTP/1.1 200 OK..." up to the 2-byte body.
    let mut rest = Vec::new();
    let mut buf = [0u8; 256];
    while !rest.ends_with(b"\r\n\r\nok") {
        let n = stream.read(&mut buf).expect("read");
        if n == 0 {
            break;
        }
        rest.extend_from_slice(&buf[..n]);
    }
    ttfb
}

/// A server the monitor watches (given a few polls to take it up), and its worker URL.
fn watched_server(monitor: &KernelMonitor) -> (SleepServer, String) {
    let server = SleepServer::start();
    let worker = format!("http://127.0.0.1:{}", server.port);
    assert!(monitor.watch(&worker));
    std::thread::sleep(POLL * 5);
    (server, worker)
}

/// One client thread per delay, each on its own connection to `port`, running `send(stream, delay)`.
fn spawn_clients<T: Send + 'static>(
    port: u16,
    delays: &[u64],
    send: fn(&mut TcpStream, u64) -> T,
) -> Vec<std::thread::JoinHandle<T>> {
    delays
        .iter()
        .map(|&ms| {
            std::thread::spawn(move || {
                let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
                send(&mut stream, ms)
            })
        })
        .collect()
}

fn view(monitor: &KernelMonitor, worker: &str) -> KernelView {
    std::thread::sleep(POLL * 3);
    monitor.view(worker).unwrap_or_default()
}

fn within_tolerance(kernel: Duration, client: Duration) -> bool {
    let diff = kernel.abs_diff(client);
    diff <= Duration::from_millis(20) + client / 10
}

/// The monitor with the programs loaded, or `None` where this machine cannot load them (not root, the agent
/// built without the object, no capability): a skip locally, a failure under CI. A program that fails for
/// its own reasons (a verifier rejection above all) fails the test everywhere.
fn loaded_monitor() -> Option<KernelMonitor> {
    if !testkit::require(
        is_root(),
        "eBPF",
        "not root (the kernel part needs CAP_BPF and CAP_PERFMON)",
    ) {
        return None;
    }
    let options = EbpfOptions {
        poll_interval: POLL,
        idle_gap: IDLE_GAP,
        ..EbpfOptions::from_env()
    };
    if !testkit::require(
        options.object_path.is_some() || embedded_object().is_some(),
        "eBPF object",
        "agent built without it (run `cargo xtask build-ebpf`, then rebuild)",
    ) {
        return None;
    }
    let monitor = KernelMonitor::start(options);
    let status = monitor.status().clone();
    for p in &status.programs {
        eprintln!(
            "program {}: {} {}",
            p.program,
            p.state.as_str(),
            p.reason.as_deref().unwrap_or("")
        );
    }
    let outcomes: Vec<(String, String, String)> = status
        .programs
        .iter()
        .map(|p| {
            (
                p.program.to_string(),
                p.state.as_str().to_string(),
                p.reason.clone().unwrap_or_default(),
            )
        })
        .collect();
    if !status.active {
        support::ebpf::not_running(&outcomes);
        return None;
    }
    // Active, yet a program the kernel could have run may still have been rejected.
    let broken: Vec<_> = outcomes
        .iter()
        .filter(|(_, state, reason)| !support::ebpf::environmental(state, reason))
        .collect();
    assert!(broken.is_empty(), "eBPF programs failed: {broken:?}");
    Some(monitor)
}

#[test]
fn verifier_rejections_are_never_a_skip() {
    use support::ebpf::environmental;
    let rejected = "the BPF_PROG_LOAD syscall returned Permission denied (os error 13). Verifier output: \
                    R1 invalid mem access 'scalar'";
    assert!(!environmental("load_failed", rejected));
    assert!(!environmental(
        "load_failed",
        "the BPF_PROG_LOAD syscall returned Permission denied (os error 13). Verifier output: "
    ));
    assert!(environmental(
        "load_failed",
        "the BPF_PROG_LOAD syscall returned Operation not permitted (os error 1). Verifier output: "
    ));
    assert!(environmental(
        "load_failed",
        "loading the eBPF object: Operation not permitted (os error 1)"
    ));
    assert!(environmental(
        "not_built",
        "agent built without the eBPF object"
    ));
    assert!(environmental(
        "unsupported",
        "kernel has no BTF tracepoint x"
    ));
    assert!(environmental(
        "attach_failed",
        "Operation not supported (os error 95)"
    ));
    assert!(!environmental(
        "attach_failed",
        "Invalid argument (os error 22)"
    ));
    assert!(!environmental(
        "load_failed",
        "map EVENTS missing from the object"
    ));
}

#[test]
fn kernel_view_matches_the_clients() {
    let Some(monitor) = loaded_monitor() else {
        return;
    };
    let status = monitor.status().clone();
    let attached = |tp: &str| {
        status
            .programs
            .iter()
            .any(|p| p.program == tp && p.state == ProgramState::Attached)
    };
    assert!(attached("inet_sock_set_state"), "{:?}", status.programs);

    let (server, worker) = watched_server(&monitor);
    let idle = view(&monitor, &worker);
    assert_eq!(idle.in_flight, 0, "{idle:?}");

    // Phase 1: 6 concurrent clients, one request per connection, delays 300..1800 ms (wide margins around the
    // sampling times, for a loaded CI machine).
    let delays: Vec<u64> = (1..=6).map(|i| i * 300).collect();
    let started = Instant::now();
    let clients = spawn_clients(server.port, &delays, |stream, ms| request(stream, ms, true));
    // All six are waiting at ~150 ms; three remain at ~1050 ms (300, 600, 900 answered).
    std::thread::sleep(Duration::from_millis(90).saturating_sub(started.elapsed()));
    let early = view(&monitor, &worker);
    std::thread::sleep(Duration::from_millis(1000).saturating_sub(started.elapsed()));
    let middle = view(&monitor, &worker);
    let mut client_ttfb: Vec<Duration> = clients
        .into_iter()
        .map(|c| c.join().expect("client"))
        .collect();
    std::thread::sleep(IDLE_GAP + POLL * 3);
    let after = view(&monitor, &worker);
    eprintln!("early {early:?}\nmiddle {middle:?}\nafter {after:?}\nclients {client_ttfb:?}");
    assert_eq!(
        early.in_flight, 6,
        "all six requests in flight at ~150 ms: {early:?}"
    );
    assert_eq!(early.waiting, 6, "{early:?}");
    assert_eq!(middle.in_flight, 3, "three left at ~1050 ms: {middle:?}");
    assert_eq!(after.in_flight, 0, "{after:?}");
    assert_eq!(after.requests_total, 6, "{after:?}");
    assert_eq!(after.responses_total, 6, "{after:?}");
    let mut kernel_ttfb = after.ttfb_recent.clone();
    assert_eq!(kernel_ttfb.len(), 6, "{after:?}");
    kernel_ttfb.sort();
    client_ttfb.sort();
    for ((k, c), ms) in kernel_ttfb.iter().zip(&client_ttfb).zip(&delays) {
        assert!(
            within_tolerance(*k, *c),
            "kernel {k:?} vs client {c:?} (delay {ms} ms)"
        );
        assert!(
            *k >= Duration::from_millis(*ms),
            "kernel {k:?} shorter than the server's delay {ms} ms"
        );
    }
    let p50 = after.ttfb_p50.expect("p50");
    assert!(
        within_tolerance(p50, client_ttfb[3]),
        "p50 {p50:?} vs {:?}",
        client_ttfb[3]
    );
    if attached("sys_exit") {
        let wait = after.accept_wait_p50.expect("accept wait samples");
        assert!(
            wait < Duration::from_millis(200),
            "accept wait {wait:?} on an idle accept loop"
        );
    }
    if attached("sk_data_ready") || attached("sys_exit") {
        assert_eq!(
            after.accept_backlog_max, 128,
            "std's listen() backlog: {after:?}"
        );
    }

    // Phase 2: one keep-alive connection, three sequential requests; in flight is 1 during each and 0 once the
    // response has been idle for longer than the idle gap.
    let stream = TcpStream::connect(("127.0.0.1", server.port)).expect("connect");
    let mut keepalive_client = Vec::new();
    for ms in [150u64, 300, 450] {
        let handle = {
            let mut s = stream.try_clone().expect("clone");
            std::thread::spawn(move || request(&mut s, ms, false))
        };
        std::thread::sleep(Duration::from_millis(80));
        let during = view(&monitor, &worker);
        assert_eq!(during.in_flight, 1, "during a {ms} ms request: {during:?}");
        assert_eq!(during.waiting, 1, "{during:?}");
        keepalive_client.push(handle.join().expect("client"));
        std::thread::sleep(IDLE_GAP + POLL * 3);
        let between = view(&monitor, &worker);
        assert_eq!(
            between.in_flight, 0,
            "after the {ms} ms response: {between:?}"
        );
        assert_eq!(
            between.connections, 1,
            "the keep-alive connection stays open: {between:?}"
        );
    }
    let end = view(&monitor, &worker);
    let recent = &end.ttfb_recent[end.ttfb_recent.len() - 3..];
    for (k, c) in recent.iter().zip(&keepalive_client) {
        assert!(
            within_tolerance(*k, *c),
            "keep-alive: kernel {k:?} vs client {c:?}"
        );
    }
    assert_eq!(end.requests_total, 9, "{end:?}");
    drop(stream);
    std::thread::sleep(Duration::from_millis(100));
    let closed = view(&monitor, &worker);
    assert_eq!(closed.connections, 0, "{closed:?}");

    let mut registry = Registry::default();
    monitor.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    assert!(
        text.contains(r#"kinference_agent_ebpf_program_state{program="inet_sock_set_state",state="attached"} 1"#),
        "{text}"
    );
    assert!(
        text.contains("kinference_agent_kernel_ttfb_seconds_count"),
        "{text}"
    );
}

/// A streaming response whose header block goes out alone before the first event (as vLLM sends one) counts
/// as waiting until its first body byte, and its time to first byte is taken there; a response with an
/// empty body (headers only, not an event stream) ends its wait at once. Where the kernel lacks the
/// `tcp_sendmsg_locked` tracepoint the agent says so (`waits_for_body` false) and the headers end the wait.
#[test]
fn an_event_stream_waits_until_its_first_body_byte() {
    let Some(monitor) = loaded_monitor() else {
        return;
    };
    let (server, worker) = watched_server(&monitor);
    let waits_for_body = view(&monitor, &worker).waits_for_body;
    eprintln!("waits_for_body: {waits_for_body}");

    let delays = [400u64, 800, 1200];
    let started = Instant::now();
    let clients = spawn_clients(server.port, &delays, request_event_stream);
    // At ~200 ms all three sent their headers and none its first event; at ~1000 ms one is left.
    std::thread::sleep(Duration::from_millis(140).saturating_sub(started.elapsed()));
    let early = view(&monitor, &worker);
    std::thread::sleep(Duration::from_millis(940).saturating_sub(started.elapsed()));
    let middle = view(&monitor, &worker);
    let mut client: Vec<(Duration, Duration)> = clients
        .into_iter()
        .map(|c| c.join().expect("client"))
        .collect();
    client.sort_by_key(|&(_, body)| body);
    let after = view(&monitor, &worker);
    eprintln!("early {early:?}\nmiddle {middle:?}\nafter {after:?}\nclients {client:?}");
    assert_eq!(early.in_flight, 3, "{early:?}");
    let mut kernel_ttfb = after.ttfb_recent.clone();
    kernel_ttfb.sort();
    assert_eq!(kernel_ttfb.len(), 3, "{after:?}");
    if waits_for_body {
        assert_eq!(early.waiting, 3, "headers sent, no event yet: {early:?}");
        assert_eq!(middle.waiting, 1, "two first events sent: {middle:?}");
        for ((k, (_, body)), ms) in kernel_ttfb.iter().zip(&client).zip(&delays) {
            assert!(
                within_tolerance(*k, *body) && *k >= Duration::from_millis(*ms),
                "kernel {k:?} vs the client's first body byte {body:?} (delay {ms} ms)"
            );
        }
    } else {
        eprintln!("this kernel's send hook cannot read the send: the headers end the wait");
        assert_eq!(early.waiting, 0, "{early:?}");
        for k in &kernel_ttfb {
            assert!(*k < Duration::from_millis(100), "kernel {k:?}: the headers");
        }
    }

    // A headers-only response that is not an event stream (an empty body) is answered at once.
    let mut stream = TcpStream::connect(("127.0.0.1", server.port)).expect("connect");
    stream
        .write_all(b"GET /empty HTTP/1.1\r\nHost: test\r\n\r\n")
        .expect("write");
    let mut buf = [0u8; 256];
    let mut got = Vec::new();
    while !got.ends_with(b"\r\n\r\n") {
        let n = stream.read(&mut buf).expect("read");
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    let empty = view(&monitor, &worker);
    assert_eq!(empty.waiting, 0, "an empty body is not awaited: {empty:?}");
    assert_eq!(empty.responses_total, 4, "{empty:?}");
}

/// Two workers on the same port at different local addresses (two pods on one node) are measured apart:
/// one watched by its own IP, the other through the any-address entry.
#[test]
fn workers_on_one_port_are_told_apart_by_address() {
    // A non-loopback address of this machine (no packet is sent by a UDP connect).
    let local_ip = std::net::UdpSocket::bind("0.0.0.0:0")
        .and_then(|u| u.connect("10.255.255.255:9").map(|_| u))
        .and_then(|u| u.local_addr())
        .map(|a| a.ip())
        .ok()
        .filter(|ip| ip.is_ipv4() && !ip.is_loopback() && !ip.is_unspecified());
    let Some(local_ip) = local_ip else {
        testkit::skip("a non-loopback IPv4 address", "this machine has none");
        return;
    };
    let Some(monitor) = loaded_monitor() else {
        return;
    };
    let Ok(pod) = SleepServer::start_on(&format!("{local_ip}:0")) else {
        testkit::skip(
            "a bindable local address",
            format_args!("cannot bind {local_ip}"),
        );
        return;
    };
    let Ok(other) = SleepServer::start_on(&format!("127.0.0.1:{}", pod.port)) else {
        testkit::skip(
            "a free loopback port",
            format_args!("port {} taken on loopback", pod.port),
        );
        return;
    };
    let pod_url = format!("http://{local_ip}:{}", pod.port);
    let other_url = format!("http://127.0.0.1:{}", other.port);
    assert!(monitor.watch(&pod_url));
    assert!(monitor.watch(&other_url));
    std::thread::sleep(POLL * 5);

    let started = Instant::now();
    let targets = [
        (local_ip.to_string(), 600u64),
        (local_ip.to_string(), 600),
        ("127.0.0.1".to_string(), 600),
    ];
    let clients: Vec<_> = targets
        .into_iter()
        .map(|(host, ms)| {
            let port = pod.port;
            std::thread::spawn(move || {
                let mut stream = TcpStream::connect((host.as_str(), port)).expect("connect");
                request(&mut stream, ms, true)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(150).saturating_sub(started.elapsed()));
    let pod_view = view(&monitor, &pod_url);
    let other_view = monitor.view(&other_url).unwrap_or_default();
    for c in clients {
        c.join().expect("client");
    }
    std::thread::sleep(POLL * 3);
    let pod_after = view(&monitor, &pod_url);
    let other_after = monitor.view(&other_url).unwrap_or_default();
    eprintln!("pod {pod_view:?}\nother {other_view:?}");
    assert_eq!(pod_view.in_flight, 2, "{pod_view:?}");
    assert_eq!(other_view.in_flight, 1, "{other_view:?}");
    assert_eq!(pod_after.requests_total, 2, "{pod_after:?}");
    assert_eq!(other_after.requests_total, 1, "{other_after:?}");
    assert_eq!(pod_after.ttfb_recent.len(), 2, "{pod_after:?}");
    assert_eq!(other_after.ttfb_recent.len(), 1, "{other_after:?}");
}

/// Where eBPF cannot load (no object here) and NVML is absent, both say why and the views are simply empty.
#[test]
fn without_ebpf_and_nvml_the_agent_says_why() {
    let monitor = KernelMonitor::start(EbpfOptions {
        object_path: Some("/nonexistent/kinference.bpf.o".into()),
        ..EbpfOptions::default()
    });
    assert!(!monitor.active());
    let reason = monitor.status().reason.clone().unwrap_or_default();
    assert!(reason.contains("/nonexistent/kinference.bpf.o"), "{reason}");
    assert!(monitor.watch("http://127.0.0.1:8001"));
    std::thread::sleep(Duration::from_millis(50));
    assert!(monitor.view("http://127.0.0.1:8001").is_none());

    let disabled = KernelMonitor::start(EbpfOptions {
        disabled: true,
        ..EbpfOptions::default()
    });
    assert!(
        disabled
            .status()
            .programs
            .iter()
            .all(|p| p.state == ProgramState::Disabled)
    );

    let gpu =
        GpuMonitor::start_with_library(std::path::Path::new("/nonexistent/libnvidia-ml.so.1"));
    let node = gpu
        .sample(&[("http://127.0.0.1:8001".into(), 8001)])
        .to_proto();
    assert!(node.gpus.is_empty());
    assert!(
        node.gpu_unavailable_reason.contains("NVML unavailable"),
        "{}",
        node.gpu_unavailable_reason
    );

    let mut registry = Registry::default();
    monitor.register_metrics(&mut registry);
    gpu.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    assert!(
        text.contains(
            r#"kinference_agent_ebpf_program_state{program="sys_exit",state="load_failed"} 1"#
        ),
        "{text}"
    );
    assert!(text.contains("kinference_agent_gpu_available 0"), "{text}");
}
