//! `demo`: Kinference on your laptop in about a minute.
//!
//! Starts 3 simulated vLLM workers (the L40S / 27B FP8 preset, sped up), a node agent and two gateways on
//! loopback, then sends the same shared-prefix workload (long shared system prompts, short questions)
//! once through random routing (what a Kubernetes Service does) and once through Kinference, and prints
//! TTFT, goodput and the workers' own prefix-cache hit rate for both.
//!
//! Binaries are taken from the directory of this executable (or `KINFERENCE_BIN_DIR`), the tokenizer
//! from `KINFERENCE_TOKENIZER_DIR` (default `<repo>/.assets/qwen2`).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use kinference_bench::harness::{self, http::HttpClient};
use kinference_bench::routing::client::LoadClient;
use kinference_bench::routing::cluster::{self, Cluster, ClusterConfig, ClusterError};
use kinference_bench::routing::experiment::{self, ExperimentConfig, RequestCount, RunRecord};
use kinference_bench::routing::oracle::Oracle;
use kinference_bench::routing::policy::Policy;
use kinference_bench::routing::workload::{WorkloadKind, WorkloadShape};

/// Kinference demo: random routing vs. Kinference on 3 simulated vLLM workers.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Virtual users sending requests at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Requests per policy.
    #[arg(long, default_value_t = 48)]
    requests: usize,
    /// Simulator time scale (wall-clock = simulated x scale); figures are printed in simulated time.
    #[arg(long, default_value_t = 0.1)]
    time_scale: f64,
    /// Seed of the request sequence.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    tokio::select! {
        result = run(&args) => match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("demo: {e}");
                ExitCode::FAILURE
            }
        },
        _ = tokio::signal::ctrl_c() => {
            eprintln!("interrupted: stopping the cluster");
            ExitCode::from(130)
        }
    }
}

async fn run(args: &Args) -> Result<(), DemoError> {
    let started = Instant::now();
    let policies = [Policy::Random, Policy::Kinference];
    let config = ExperimentConfig {
        workloads: vec![WorkloadKind::SharedPrefix],
        concurrency: vec![args.concurrency],
        policies: policies.to_vec(),
        requests: RequestCount::Fixed(args.requests),
        warmup: None,
        seed: args.seed,
        time_scale: args.time_scale,
        shape: WorkloadShape::default(),
        settle: Duration::from_millis(300),
    };
    let cluster_config = ClusterConfig {
        bin_dir: harness::bin_dir(),
        tokenizer_dir: cluster::default_tokenizer_dir(),
        workers: 3,
        preset: "l40s-27b-fp8".into(),
        time_scale: args.time_scale,
        worker_args: vec![],
        gateway_modes: policies
            .iter()
            .filter_map(|p| p.gateway_mode())
            .map(str::to_string)
            .collect(),
        work_dir: std::env::temp_dir().join(format!("kinference-demo-{}", std::process::id())),
        ready_timeout: Duration::from_secs(60),
    };
    println!(
        "Starting 3 simulated vLLM workers (L40S, 27B FP8 preset, {}x faster than real time), a node agent and 2 gateways...",
        1.0 / args.time_scale
    );
    let http = HttpClient::new();
    let cluster = Cluster::start(&cluster_config, http.clone()).await?;
    for (i, w) in cluster.workers().iter().enumerate() {
        println!("  worker {}: {w}", i + 1);
    }
    for p in policies {
        if let Some(g) = p.gateway_mode().and_then(|m| cluster.gateway(m)) {
            println!("  gateway ({}): {}  (admin {})", g.mode, g.url, g.admin_url);
        }
    }
    let (warmup, workload) = config.sequences(WorkloadKind::SharedPrefix, args.concurrency);
    println!(
        "\nWorkload: {} requests ({} more to warm the caches first), {} shared system prompts of ~{} tokens + a short question each, {} users at once, TTFT SLO {} s.",
        workload.len(),
        warmup.len(),
        config.shape.shared_prefixes,
        config.shape.prefix_words,
        args.concurrency,
        WorkloadKind::SharedPrefix.ttft_slo_s()
    );
    let oracle = Arc::new(Oracle::new(http.clone(), cluster.workers().to_vec()));
    let client = LoadClient::new(http, cluster::MODEL, false, Duration::from_secs(300));
    let mut records: Vec<RunRecord> = Vec::new();
    for policy in policies {
        println!("Running through {policy} routing...");
        let record = experiment::run_one(
            &cluster,
            &client,
            &oracle,
            &warmup,
            &workload,
            policy,
            args.concurrency,
            &config,
        )
        .await?;
        records.push(record);
    }

    println!("\nResults (simulated seconds):\n");
    println!(
        "{:<12} {:>12} {:>10} {:>16} {:>16} {:>8}",
        "routing", "median TTFT", "p90 TTFT", "goodput (/min)", "cache hit rate", "errors"
    );
    for r in &records {
        let s = &r.summary;
        println!(
            "{:<12} {:>11.2}s {:>9.2}s {:>16.1} {:>15.0}% {:>8}",
            r.policy.as_str(),
            s.median_ttft_s,
            s.p90_ttft_s,
            s.goodput_rpm,
            100.0 * r.cache_hit_share.unwrap_or(f64::NAN),
            s.errors
        );
    }
    if let [random, kinference] = &records[..] {
        let (a, b) = (&random.summary, &kinference.summary);
        println!(
            "\nKinference: median TTFT {:.1}x lower, goodput {:.1}x higher than random routing.",
            a.median_ttft_s / b.median_ttft_s,
            b.goodput_rpm / a.goodput_rpm
        );
    }
    println!(
        "(cache hit rate = vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total over all workers; demo took {:.0} s; logs in {})",
        started.elapsed().as_secs_f64(),
        cluster.work_dir().display()
    );
    Ok(())
}

/// Why the demo stopped.
#[derive(Debug, thiserror::Error)]
enum DemoError {
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error(transparent)]
    Experiment(#[from] experiment::ExperimentError),
}
