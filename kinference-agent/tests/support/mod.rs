//! Test harness: a publisher that speaks vLLM's exact KV-event protocol (PUB + replay ROUTER), the real
//! agent binary as a child process, and a gateway-side watcher that applies the summary stream.
#![allow(dead_code)]

pub mod ebpf;

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kinference_agent::kv_events::encode::{EncodeOptions, EventFormat, encode_batch};
use kinference_agent::kv_events::{EventBatch, KvEvent, Medium};
use kinference_api::KeyHasher;
use kinference_api::summary::node_agent_client::NodeAgentClient;
use kinference_api::summary::{Summary, WatchRequest, WorkerLoad, summary::Kind};
use parking_lot::Mutex;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

pub const MODEL: &str = "qwen2-sim";
pub const BS: u32 = 16;

/// The engine's replay buffer: `(seq, payload)` in publish order.
type ReplayBuffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

pub use testkit::free_port;

/// The replay reply shape of a vLLM version.
#[derive(Clone, Copy, Debug)]
pub enum ReplayShape {
    /// <= 0.25: `[seq, payload]`, end `[ff*8, b""]`.
    V025,
    /// >= 0.26: `[topic, seq, payload]`, end `[b"", ff*8, b""]`.
    V026,
}

/// A stand-in for one vLLM engine's KV event publisher.
pub struct FakeVllm {
    pub topic: String,
    publisher: PubSocket,
    buffer: ReplayBuffer,
    next_seq: u64,
    opts: EncodeOptions,
    replay_task: tokio::task::JoinHandle<()>,
    pub replay_endpoint: String,
}

impl FakeVllm {
    /// `connect`: the PUB connects to `events_endpoint` (vLLM's connect mode; the agent binds), else it binds.
    pub async fn start(
        events_endpoint: &str,
        connect: bool,
        replay_endpoint: &str,
        shape: ReplayShape,
        format: EventFormat,
    ) -> Self {
        let mut publisher = PubSocket::new();
        if connect {
            publisher
                .connect(events_endpoint)
                .await
                .expect("PUB connects to the agent's SUB");
        } else {
            publisher.bind(events_endpoint).await.expect("PUB binds");
        }
        let mut router = RouterSocket::new();
        router.bind(replay_endpoint).await.expect("ROUTER binds");
        let buffer: ReplayBuffer = Arc::default();
        let topic = "kv@w1@qwen2-sim".to_string();
        let replay_task = tokio::spawn(serve_replay(router, buffer.clone(), topic.clone(), shape));
        Self {
            topic,
            publisher,
            buffer,
            next_seq: 0,
            opts: EncodeOptions {
                format,
                bin_hashes: false,
            },
            replay_task,
            replay_endpoint: replay_endpoint.to_string(),
        }
    }

    fn encode(&self, events: Vec<KvEvent>) -> Vec<u8> {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("time")
            .as_secs_f64();
        encode_batch(
            &EventBatch {
                ts,
                events,
                data_parallel_rank: Some(0),
            },
            self.opts,
        )
    }

    /// Publishes one batch (buffered for replay first, as vLLM does); returns its sequence number.
    pub async fn publish(&mut self, events: Vec<KvEvent>) -> u64 {
        let (seq, payload) = self.buffer_only(events);
        let msg = ZmqMessage::try_from(vec![
            Bytes::from(self.topic.clone()),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ])
        .expect("3 frames");
        self.publisher.send(msg).await.expect("PUB send");
        seq
    }

    /// Buffers a batch for replay without sending it live: the agent sees a gap at the next message.
    pub fn buffer_only(&mut self, events: Vec<KvEvent>) -> (u64, Vec<u8>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = self.encode(events);
        self.buffer.lock().push((seq, payload.clone()));
        (seq, payload)
    }

    /// The engine restarts: the sequence starts again at 0 and the replay buffer is empty.
    pub fn restart_engine(&mut self) {
        self.next_seq = 0;
        self.buffer.lock().clear();
    }
}

impl Drop for FakeVllm {
    fn drop(&mut self) {
        self.replay_task.abort();
    }
}

/// vLLM's replay loop: `[identity, b"", start_seq]` in, every buffered batch from `start_seq` out, then the end marker.
async fn serve_replay(
    mut router: RouterSocket,
    buffer: ReplayBuffer,
    topic: String,
    shape: ReplayShape,
) {
    const END: [u8; 8] = [0xff; 8];
    loop {
        let Ok(req) = router.recv().await else {
            continue;
        };
        let frames = req.into_vec();
        let [identity, _empty, start] = frames.as_slice() else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            continue;
        };
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Vec<u8>)> = buffer
            .lock()
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        for (seq, payload) in batches {
            let mut f = vec![identity.clone(), Bytes::new()];
            if matches!(shape, ReplayShape::V026) {
                f.push(Bytes::from(topic.clone()));
            }
            f.push(Bytes::copy_from_slice(&seq.to_be_bytes()));
            f.push(Bytes::from(payload));
            let _ = router.send(ZmqMessage::try_from(f).expect("frames")).await;
        }
        let end = match shape {
            ReplayShape::V025 => vec![
                identity.clone(),
                Bytes::new(),
                Bytes::copy_from_slice(&END),
                Bytes::new(),
            ],
            ReplayShape::V026 => {
                vec![
                    identity.clone(),
                    Bytes::new(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&END),
                    Bytes::new(),
                ]
            }
        };
        let _ = router
            .send(ZmqMessage::try_from(end).expect("frames"))
            .await;
    }
}

/// The tokens of prompt `id`: `blocks` full blocks.
pub fn prompt(id: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BS).map(|t| id * 100_000 + t).collect()
}

/// The engine hash vLLM would publish for block `b` of prompt `id` (any unique value does).
pub fn engine_hash(id: u32, b: u32) -> u64 {
    0xdead_0000_0000_0000 | ((id as u64) << 16) | b as u64
}

/// `BlockStored` for blocks `from..to` of prompt `id`, chained to block `from - 1`.
pub fn stored(id: u32, from: u32, to: u32) -> KvEvent {
    let tokens = prompt(id, to);
    KvEvent::BlockStored {
        block_hashes: (from..to).map(|b| engine_hash(id, b)).collect(),
        parent_block_hash: (from > 0).then(|| engine_hash(id, from - 1)),
        token_ids: tokens[(from * BS) as usize..].to_vec(),
        block_size: BS,
        medium: Medium::Gpu,
        lora: None,
        extra_keys: Vec::new(),
    }
}

pub fn removed(id: u32, blocks: &[u32]) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: blocks.iter().map(|&b| engine_hash(id, b)).collect(),
        medium: Medium::Gpu,
    }
}

/// The Kinference keys the gateway computes for blocks `..n` of prompt `id`.
pub fn keys(id: u32, n: u32) -> Vec<u64> {
    KeyHasher::for_model(MODEL).keys(None, &prompt(id, n), BS as usize)
}

/// The real agent binary, killed on drop.
pub struct Agent {
    child: Child,
    pub grpc: String,
    pub metrics_url: String,
    /// `http://127.0.0.1:<metrics port>` (also serves `/healthz` and `/readyz`).
    pub metrics_base: String,
    dir: std::path::PathBuf,
    log: std::path::PathBuf,
}

impl Agent {
    /// Starts the agent with one worker entry, on the given gRPC port.
    pub async fn start(worker_yaml: &str, grpc_port: u16) -> Self {
        Self::start_with(worker_yaml, grpc_port, &[]).await
    }

    /// The same with extra environment variables (e.g. `KINFERENCE_DISABLE_EBPF`). Its log goes to a file
    /// ([`Agent::log`]), or to the test's stderr when `AGENT_LOG` is set.
    pub async fn start_with(worker_yaml: &str, grpc_port: u16, env: &[(&str, &str)]) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kinference-agent-test-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let workers = dir.join("workers.yaml");
        std::fs::write(&workers, worker_yaml).expect("write workers file");
        let log = dir.join("agent.log");
        // tracing writes to stdout; panics and early errors go to stderr.
        let (stdout, stderr) = if std::env::var_os("AGENT_LOG").is_some() {
            (Stdio::inherit(), Stdio::inherit())
        } else {
            let file = std::fs::File::create(&log).expect("log file");
            let copy = file.try_clone().expect("log file handle");
            (Stdio::from(file), Stdio::from(copy))
        };
        let metrics_port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_kinference-agent"))
            .args(["--grpc-listen", &format!("127.0.0.1:{grpc_port}")])
            .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
            .arg("--workers")
            .arg(&workers)
            .args(["--node", "test-node"])
            .env("RUST_LOG", "info,kinference_agent=debug")
            // Plain text in the log file, so tests can search it.
            .env("NO_COLOR", "1")
            .envs(env.iter().copied())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .expect("agent binary starts");
        let agent = Self {
            child,
            grpc: format!("http://127.0.0.1:{grpc_port}"),
            metrics_url: format!("http://127.0.0.1:{metrics_port}/metrics"),
            metrics_base: format!("http://127.0.0.1:{metrics_port}"),
            dir,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(("127.0.0.1", grpc_port))
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "agent did not listen on {grpc_port}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        agent
    }

    /// What the agent logged so far (empty when it logs to the test's stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Scrapes the agent's own `/metrics` and returns one sample's value (summed over labels).
    pub async fn metric(&self, name: &str) -> f64 {
        let text = http_get(&self.metrics_url).await;
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// One `kinference_agent_rejected_total` series (0 when absent).
    pub async fn rejected(&self, listener: &str, reason: &str) -> f64 {
        let text = http_get(&self.metrics_url).await;
        let want = format!(
            "kinference_agent_rejected_total{{listener=\"{listener}\",reason=\"{reason}\"}} "
        );
        text.lines()
            .find_map(|l| l.strip_prefix(&want)?.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// The agent's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A memory figure of the agent's process from `/proc/<pid>/status`, in bytes (`VmRSS`: resident
    /// now, `VmHWM`: the most it was ever resident).
    pub fn memory(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("the agent's /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or_else(|| panic!("no {field} in /proc/<pid>/status"))
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Bytes received by the kernel on `port`'s established TCP connections and not yet read by the
/// process that accepted them (`rx_queue` in `/proc/net/tcp` and `tcp6`). Socket buffers are the
/// kernel's memory, not the process's resident set, but a cgroup v2 pod is charged for them.
pub fn tcp_unread(port: u16) -> u64 {
    let mut total = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(state), Some(queues)) = (cols.get(1), cols.get(3), cols.get(4))
            else {
                continue;
            };
            let local_port = local
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            // 01: ESTABLISHED.
            if local_port != Some(port) || *state != "01" {
                continue;
            }
            if let Some(rx) = queues
                .split(':')
                .nth(1)
                .and_then(|q| u64::from_str_radix(q, 16).ok())
            {
                total += rx;
            }
        }
    }
    total
}

/// A minimal HTTP GET over a raw socket (tests only).
pub async fn http_get(url: &str) -> String {
    try_http_get(url)
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
}

/// [`http_get`], or the connection error (a server still starting).
pub async fn try_http_get(url: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").expect("http url");
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let mut s = tokio::net::TcpStream::connect(host).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    Ok(out)
}

/// A gateway's view of one agent, built only from the summary stream.
pub struct Watch {
    stream: tonic::Streaming<Summary>,
    pub view: HashMap<String, HashSet<u64>>,
    pub kinds: Vec<&'static str>,
    pub epoch: u64,
    pub block_size: HashMap<String, u32>,
    /// Each worker's KV capacity in blocks, as its latest load reported it (absent: never, or 0).
    pub capacity: HashMap<String, u32>,
}

impl Watch {
    pub async fn connect(url: &str) -> Self {
        let mut client = NodeAgentClient::connect(url.to_string())
            .await
            .expect("gRPC connect");
        let stream = client
            .watch(WatchRequest {
                gateway_id: "test-gateway".into(),
            })
            .await
            .expect("watch")
            .into_inner();
        Self {
            stream,
            view: HashMap::new(),
            kinds: Vec::new(),
            epoch: 0,
            block_size: HashMap::new(),
            capacity: HashMap::new(),
        }
    }

    fn note_capacity(&mut self, worker: &str, load: Option<&WorkerLoad>) {
        if let Some(blocks) = load.map(|l| l.num_gpu_blocks).filter(|&b| b > 0) {
            self.capacity.insert(worker.to_string(), blocks);
        }
    }

    /// Applies the next message; false if none came within `timeout`.
    pub async fn step(&mut self, timeout: Duration) -> bool {
        let msg = match tokio::time::timeout(timeout, self.stream.message()).await {
            Ok(Ok(Some(m))) => m,
            _ => return false,
        };
        match msg.kind {
            Some(Kind::Snapshot(s)) => {
                self.kinds.push("snapshot");
                self.epoch = s.epoch;
                self.view.clear();
                for w in s.workers {
                    self.block_size.insert(w.worker_id.clone(), w.block_size);
                    self.note_capacity(&w.worker_id, w.load.as_ref());
                    self.view.insert(w.worker_id, w.keys.into_iter().collect());
                }
            }
            Some(Kind::Delta(d)) => {
                self.kinds.push("delta");
                for w in d.workers {
                    if w.gone {
                        self.view.remove(&w.worker_id);
                        continue;
                    }
                    if w.block_size != 0 {
                        self.block_size.insert(w.worker_id.clone(), w.block_size);
                    }
                    self.note_capacity(&w.worker_id, w.load.as_ref());
                    let set = self.view.entry(w.worker_id).or_default();
                    if w.cleared {
                        set.clear();
                    }
                    for k in w.removed {
                        set.remove(&k);
                    }
                    set.extend(w.added);
                }
            }
            None => {}
        }
        true
    }

    /// Applies messages until `worker`'s keys equal `expected`; panics with the last view after `timeout`.
    pub async fn wait_for(&mut self, worker: &str, expected: &[u64], timeout: Duration) {
        assert!(
            self.sees(worker, expected, timeout).await,
            "timed out: {worker} has {:?} keys, expected {} (messages: {:?})",
            self.view.get(worker).map(|v| v.len()),
            expected.len(),
            self.kinds
        );
    }

    /// Applies messages until `worker`'s keys equal `expected`: whether they did within `timeout`.
    pub async fn sees(&mut self, worker: &str, expected: &[u64], timeout: Duration) -> bool {
        let expected: HashSet<u64> = expected.iter().copied().collect();
        let deadline = Instant::now() + timeout;
        loop {
            if self.view.get(worker).is_some_and(|v| *v == expected) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            self.step(left.min(Duration::from_millis(200))).await;
        }
    }
}

/// A ZMTP 3.0 greeting with the given security mechanism, as a peer sends it.
pub fn zmtp_greeting(mechanism: &str) -> Vec<u8> {
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
pub fn zmtp_ready(ty: &str) -> Vec<u8> {
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

/// The workers file for one worker.
pub fn worker_yaml(url: &str, events: &str, bind: bool, replay: &str) -> String {
    format!(
        "workers:\n  - url: {url}\n    model: {MODEL}\n    kv_events_endpoint: {events}\n    kv_events_bind: {bind}\n    kv_replay_endpoint: {replay}\n"
    )
}
