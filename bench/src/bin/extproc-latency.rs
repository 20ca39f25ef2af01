//! `extproc-latency`: the decision latency the gateway's ext_proc inference handler adds to a request
//! routed by Envoy.
//!
//! Starts `vllm-sim` workers and the real `kinference-gateway` with `--extproc-listen` (binaries from
//! `--bin-dir`, `$KINFERENCE_BIN_DIR` or `target/debug`), then plays Envoy: one `Process` stream per
//! request, `request_headers` then one buffered `request_body`, and the stream closed. It reports, over
//! `--calls` requests per arm (after a warm-up), the two arms interleaved request by request:
//! - `buffered` (`request_body_mode: BUFFERED`, one answer per message):
//!   - `headers`: the round trip of the headers message (the gRPC hop alone, no decision);
//!   - `decision`: the round trip of the body message (parse, tokenize, estimate, pick, reply);
//!   - `added`: decision minus the headers round trip of the same request, i.e. the picking itself;
//!   - `stream`: the whole exchange including opening the stream.
//! - `duplex` (`FULL_DUPLEX_STREAMED`, the endpoint picker's mode: headers and body sent at once,
//!   the headers answered with the route once the body is read):
//!   - `decision`: from sending the headers to the route (the headers' answer);
//!   - `body`: from sending the headers to the last streamed body chunk back;
//!   - `stream`: the whole exchange including opening the stream.
//!
//! ```sh
//! cargo build -p kinference-bench --bin vllm-sim --bin extproc-latency && cargo build -p kinference-gateway
//! target/debug/extproc-latency --calls 3000
//! # the picker's target setting: 64 streams, the gateway on a core of its own, 500 pairs/s offered
//! target/release/extproc-latency --concurrency 64 --gateway-cpu 1 --rate 500
//! ```

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as PReq;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as PResp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration,
};
use kinference_bench::harness::http::HttpClient;
use kinference_bench::harness::{Process, free_port, wait_ready};
use kinference_bench::stats::percentile;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

#[derive(Debug, Parser)]
#[command(about = "Decision latency of the ext_proc inference handler (p50/p99 over many calls)")]
struct Args {
    /// Directory with `kinference-gateway` and `vllm-sim`.
    #[arg(long, env = "KINFERENCE_BIN_DIR", default_value = "target/debug")]
    bin_dir: PathBuf,
    /// Tokenizer directory (the gateway tokenizes locally, as in production).
    #[arg(
        long,
        env = "KINFERENCE_TOKENIZER_DIR",
        default_value = ".assets/qwen2"
    )]
    tokenizer_dir: PathBuf,
    /// Number of `vllm-sim` workers.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Measured requests.
    #[arg(long, default_value_t = 3000)]
    calls: usize,
    /// Unmeasured requests first.
    #[arg(long, default_value_t = 200)]
    warmup: usize,
    /// Words of the shared system prompt (about 1.3 tokens each).
    #[arg(long, default_value_t = 400)]
    prompt_words: usize,
    /// Distinct system prompts (prefix families) the requests cycle through.
    #[arg(long, default_value_t = 16)]
    families: usize,
    /// Streams open at once (tasks sharing one HTTP/2 connection, as Envoy multiplexes them).
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Open loop: request pairs per second over all streams (each stream starts its next pair at
    /// its scheduled time, or at once when behind). 0: closed loop, each stream sends its next pair
    /// as soon as the last is answered, so the figures measure throughput as much as latency.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Pin the gateway to this CPU (`taskset -c`): the decision on a core of its own.
    #[arg(long)]
    gateway_cpu: Option<usize>,
}

/// How long a process may take to answer its readiness URL.
const READY: Duration = Duration::from_secs(120);

fn spawn(bin: &Path, args: &[String], cpu: Option<usize>) -> anyhow::Result<Process> {
    if !bin.exists() {
        bail!(
            "{} not found: build it (cargo build -p kinference-bench --bin vllm-sim; cargo build -p kinference-gateway)",
            bin.display()
        );
    }
    let mut command = match cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(cpu.to_string()).arg(bin);
            c
        }
        None => Command::new(bin),
    };
    let child = command
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let name = bin.file_name().unwrap_or_default().to_string_lossy();
    Ok(Process::adopt(&name, child))
}

fn header(key: &str, value: &str) -> HeaderValue {
    HeaderValue {
        key: key.into(),
        raw_value: value.as_bytes().to_vec(),
        ..Default::default()
    }
}

fn body_for(i: usize, args: &Args) -> Vec<u8> {
    let family = i % args.families.max(1);
    let system: Vec<String> = (0..args.prompt_words)
        .map(|w| format!("f{family}w{}", (w * 7919) % 1013))
        .collect();
    serde_json::json!({
        "model": "qwen2-sim",
        "max_tokens": 16,
        "messages": [
            {"role": "system", "content": system.join(" ")},
            {"role": "user", "content": format!("question number {i}")}
        ]
    })
    .to_string()
    .into_bytes()
}

struct Sample {
    headers: Duration,
    decision: Duration,
    stream: Duration,
}

async fn one(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    body: Vec<u8>,
) -> anyhow::Result<Sample> {
    let start = Instant::now();
    let (tx, rx) = mpsc::channel(4);
    let mut responses = client.process(ReceiverStream::new(rx)).await?.into_inner();
    let t = Instant::now();
    tx.send(ProcessingRequest {
        request: Some(PReq::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":method", "POST"),
                    header(":path", "/v1/chat/completions"),
                    header("content-type", "application/json"),
                ],
            }),
            ..Default::default()
        })),
        ..Default::default()
    })
    .await?;
    let r = responses.message().await?.context("no headers answer")?;
    let headers = t.elapsed();
    if !matches!(r.response, Some(PResp::RequestHeaders(_))) {
        bail!("unexpected headers answer {r:?}");
    }
    let t = Instant::now();
    tx.send(ProcessingRequest {
        request: Some(PReq::RequestBody(HttpBody {
            body,
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await?;
    let r = responses.message().await?.context("no body answer")?;
    let decision = t.elapsed();
    if r.dynamic_metadata.is_none() {
        bail!("not routed: {r:?}");
    }
    drop(tx);
    let stream = start.elapsed();
    Ok(Sample {
        headers,
        decision,
        stream,
    })
}

struct DuplexSample {
    decision: Duration,
    body: Duration,
    stream: Duration,
}

/// One request as Envoy sends it in `FULL_DUPLEX_STREAMED`: headers and the whole body without
/// waiting; the route comes as the headers' answer, then the body as streamed chunks.
async fn one_duplex(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    body: Vec<u8>,
) -> anyhow::Result<DuplexSample> {
    let start = Instant::now();
    let (tx, rx) = mpsc::channel(4);
    let mut responses = client.process(ReceiverStream::new(rx)).await?.into_inner();
    let t = Instant::now();
    let duplex = BodySendMode::FullDuplexStreamed as i32;
    tx.send(ProcessingRequest {
        request: Some(PReq::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":method", "POST"),
                    header(":path", "/v1/chat/completions"),
                    header("content-type", "application/json"),
                ],
            }),
            ..Default::default()
        })),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: duplex,
            response_body_mode: duplex,
            send_body_without_waiting_for_header_response: true,
        }),
        ..Default::default()
    })
    .await?;
    tx.send(ProcessingRequest {
        request: Some(PReq::RequestBody(HttpBody {
            body,
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await?;
    let r = responses.message().await?.context("no headers answer")?;
    let decision = t.elapsed();
    if !matches!(r.response, Some(PResp::RequestHeaders(_))) || r.dynamic_metadata.is_none() {
        bail!("not routed: {r:?}");
    }
    let r = responses.message().await?.context("no body answer")?;
    let body = t.elapsed();
    if !matches!(r.response, Some(PResp::RequestBody(_))) {
        bail!("unexpected body answer {r:?}");
    }
    drop(tx);
    let stream = start.elapsed();
    Ok(DuplexSample {
        decision,
        body,
        stream,
    })
}

fn line(name: &str, mut v: Vec<f64>) {
    v.sort_by(f64::total_cmp);
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    println!(
        "{name:<9} p50 {:>8.3} ms  p90 {:>8.3} ms  p99 {:>8.3} ms  max {:>8.3} ms  mean {:>8.3} ms",
        percentile(&v, 50.0),
        percentile(&v, 90.0),
        percentile(&v, 99.0),
        percentile(&v, 100.0),
        mean
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let tokenizer = std::fs::canonicalize(&args.tokenizer_dir)
        .with_context(|| format!("tokenizer dir {}", args.tokenizer_dir.display()))?;
    let probe = HttpClient::new();
    let mut guards = Vec::new();
    let mut worker_lines = String::new();
    for _ in 0..args.workers {
        let port = free_port();
        let mut sim = spawn(
            &args.bin_dir.join("vllm-sim"),
            &[
                "--host".into(),
                "127.0.0.1".into(),
                "--port".into(),
                port.to_string(),
                "--model".into(),
                "qwen2-sim".into(),
                "--preset".into(),
                "fast".into(),
                "--tokenizer-dir".into(),
                tokenizer.display().to_string(),
            ],
            None,
        )?;
        let health = format!("http://127.0.0.1:{port}/health");
        wait_ready(&probe, &mut sim, &health, READY, |_| true).await?;
        guards.push(sim);
        worker_lines.push_str(&format!(
            "  - {{url: \"http://127.0.0.1:{port}\", model: qwen2-sim}}\n"
        ));
    }
    let dir =
        std::env::temp_dir().join(format!("kinference-extproc-latency-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - name: qwen2-sim\n    tokenizer_dir: {}\nworkers:\n{worker_lines}routing: kinference\n",
            tokenizer.display()
        ),
    )?;
    let (api, admin, xp) = (free_port(), free_port(), free_port());
    let mut gateway = spawn(
        &args.bin_dir.join("kinference-gateway"),
        &[
            format!("--listen=127.0.0.1:{api}"),
            format!("--admin-listen=127.0.0.1:{admin}"),
            format!("--extproc-listen=127.0.0.1:{xp}"),
            format!("--config={}", config.display()),
        ],
        args.gateway_cpu,
    )?;
    // The gateway binds its ext_proc port before its admin port answers.
    let readyz = format!("http://127.0.0.1:{admin}/readyz");
    wait_ready(&probe, &mut gateway, &readyz, READY, |_| true).await?;
    guards.push(gateway);
    let mut client = ExternalProcessorClient::connect(format!("http://127.0.0.1:{xp}")).await?;

    for i in 0..args.warmup {
        one(&mut client, body_for(i, &args)).await?;
        one_duplex(&mut client, body_for(i, &args)).await?;
    }
    let started = Instant::now();
    // Side by side: each request's twin in the other mode right after it (the same prefix family
    // and cache state, a different question), on `concurrency` streams at once.
    let args = std::sync::Arc::new(args);
    let tasks = args.concurrency.max(1);
    let mut handles = Vec::new();
    for t in 0..tasks {
        let mut client = client.clone();
        let args = std::sync::Arc::clone(&args);
        handles.push(tokio::spawn(async move {
            let mut pairs = Vec::new();
            let mut i = t;
            while i < args.calls {
                if args.rate > 0.0 {
                    // Pair i's scheduled start; a stream that is behind starts at once.
                    let due = started + Duration::from_secs_f64(i as f64 / args.rate);
                    tokio::time::sleep_until(due.into()).await;
                }
                let buffered = one(&mut client, body_for(args.warmup + 2 * i, &args)).await?;
                let duplex =
                    one_duplex(&mut client, body_for(args.warmup + 2 * i + 1, &args)).await?;
                pairs.push((buffered, duplex));
                i += tasks;
            }
            anyhow::Ok(pairs)
        }));
    }
    let mut samples = Vec::with_capacity(args.calls);
    let mut duplex = Vec::with_capacity(args.calls);
    for h in handles {
        for (b, d) in h.await?? {
            samples.push(b);
            duplex.push(d);
        }
    }
    let wall = started.elapsed();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let pacing = if args.rate > 0.0 {
        format!("open loop at {} pairs/s", args.rate)
    } else {
        "closed loop".to_string()
    };
    println!(
        "extproc-latency: {} calls per arm ({} warm-up) on {} streams at once ({pacing}), gateway CPU {}, {} workers, {} prefix families of ~{} words, bin dir {}",
        args.calls,
        args.warmup,
        tasks,
        args.gateway_cpu
            .map_or("any".to_string(), |c| c.to_string()),
        args.workers,
        args.families,
        args.prompt_words,
        args.bin_dir.display()
    );
    println!("buffered (BUFFERED, one answer per message):");
    line("headers", samples.iter().map(|s| ms(s.headers)).collect());
    line("decision", samples.iter().map(|s| ms(s.decision)).collect());
    line(
        "added",
        samples
            .iter()
            .map(|s| ms(s.decision) - ms(s.headers))
            .collect(),
    );
    line("stream", samples.iter().map(|s| ms(s.stream)).collect());
    println!("duplex (FULL_DUPLEX_STREAMED, the endpoint picker's mode):");
    line("decision", duplex.iter().map(|s| ms(s.decision)).collect());
    line("body", duplex.iter().map(|s| ms(s.body)).collect());
    line("stream", duplex.iter().map(|s| ms(s.stream)).collect());
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        percentile(&v, 50.0)
    };
    let buffered_stream = median(samples.iter().map(|s| ms(s.stream)).collect());
    let duplex_stream = median(duplex.iter().map(|s| ms(s.stream)).collect());
    println!(
        "ratio duplex/buffered stream p50 {:.2}",
        duplex_stream / buffered_stream
    );
    println!(
        "throughput {:.0} decisions/s (both arms)",
        (2 * args.calls) as f64 / wall.as_secs_f64()
    );
    drop(guards);
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}
