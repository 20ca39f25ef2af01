//! How the routing decision grows with the fleet (issue 35, item 6): the decision stage alone
//! (`Router::pick_tokens`, tokenization excluded) over fleets shaped as `scale-bench` runs them: 8
//! workers per agent, every worker holding 4 prompts of its own (about 70 blocks each) in a 512-block
//! cache, scraped load and KV capacity fresh. Every decision asks for another worker's prompt, so the
//! winner and the index keys it reads change from one decision to the next, as they do in a running
//! gateway; each ticket ends before the next decision. Every 250 ms (between two timed decisions) each
//! agent resends its workers' load, as a running agent's scrape does, so the views stay fresh and
//! the ledger's entries since the latest view stay as few as in a running gateway.
//!
//! Prints p50 / p99 / mean per fleet size, with the CPU's caches warm and then emptied before each
//! decision (what a gateway that relays other requests between two decisions sees at worst), for
//! two arms on identical fleets, one after the other: the candidates' figures read from the decision
//! rows (`rows`, the default) and read under each worker's lock (`locked`, `decision_rows: false`).
//! No criterion: the figures are percentiles of single timed decisions.
//!
//! Run: `cargo bench -p kinference-gateway --bench decide_scale [-- SIZES]` (default 104,250,500,1000).

use std::hint::black_box;
use std::time::{Duration, Instant};

use kinference_api::KeyHasher;
use kinference_api::summary::{self as pb, Summary, summary};
use kinference_gateway::routing::{
    ModelConfig, Router, RoutingConfig, RoutingMode, RoutingTuning, WorkerConfig,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const WORKERS_PER_AGENT: usize = 8;
const PROMPTS_PER_WORKER: usize = 4;
/// About `scale-bench`'s 1,000-word prompt plus a question, in 16-token blocks.
const PROMPT_BLOCKS: usize = 72;
const BLOCK: usize = 16;
const CACHE_BLOCKS: u32 = 512;
const WARM_DECISIONS: usize = 20_000;
const COLD_DECISIONS: usize = 400;
/// Bytes written through before each cold decision: twice a 32 MiB last-level cache.
const COLD_SCRATCH_BYTES: usize = 64 << 20;
/// How often the agents resend their workers' load (the agent's default scrape interval).
const LOAD_REFRESH: Duration = Duration::from_millis(250);

fn url(i: usize) -> String {
    format!(
        "http://10.{}.{}.{}:8000",
        i / 65_536,
        (i / 256) % 256,
        i % 256
    )
}

/// A router over `workers` workers behind `workers / 8` agents, every worker's prompts' tokens, and
/// each agent's load update (what it resends every [`LOAD_REFRESH`]).
fn fleet(
    workers: usize,
    decision_rows: bool,
    rng: &mut StdRng,
) -> (Router, Vec<Vec<u32>>, Vec<Summary>) {
    let agents = workers.div_ceil(WORKERS_PER_AGENT);
    let config = RoutingConfig {
        workers: (0..workers)
            .map(|i| WorkerConfig {
                url: url(i),
                model: "m".into(),
                role: Default::default(),
            })
            .collect(),
        models: vec![ModelConfig {
            name: "m".into(),
            tokenizer_dir: None,
            serves_messages: false,
            profile: None,
        }],
        agents: (0..agents)
            .map(|a| format!("http://agent-{a}.invalid:7070"))
            .collect(),
        mode: RoutingMode::Kinference,
    };
    let tuning = RoutingTuning {
        connect_agents: false,
        decision_rows,
        ..RoutingTuning::default()
    };
    let router = Router::with_tuning(config, tuning).expect("router");
    let hasher = KeyHasher::for_model("m");
    let mut prompts = Vec::with_capacity(workers * PROMPTS_PER_WORKER);
    let mut refresh = Vec::with_capacity(agents);
    for agent in 0..agents {
        let states = (agent * WORKERS_PER_AGENT..((agent + 1) * WORKERS_PER_AGENT).min(workers))
            .map(|i| {
                let mut keys = Vec::new();
                for _ in 0..PROMPTS_PER_WORKER {
                    let tokens: Vec<u32> = (0..PROMPT_BLOCKS * BLOCK)
                        .map(|_| rng.random_range(0..150_000))
                        .collect();
                    keys.extend(hasher.keys(None, &tokens, BLOCK));
                    prompts.push(tokens);
                }
                pb::WorkerState {
                    worker_id: url(i),
                    model: "m".into(),
                    block_size: BLOCK as u32,
                    keys,
                    offloaded_keys: Vec::new(),
                    data_parallel_rank: None,
                    role: String::new(),
                    load: Some(pb::WorkerLoad {
                        running: rng.random_range(0..4),
                        waiting: 0,
                        kv_usage: rng.random_range(0.3..0.6),
                        metrics_ok: true,
                        num_gpu_blocks: CACHE_BLOCKS,
                        ..Default::default()
                    }),
                }
            })
            .collect::<Vec<_>>();
        let loads = states
            .iter()
            .map(|s| pb::WorkerDelta {
                worker_id: s.worker_id.clone(),
                load: s.load,
                ..Default::default()
            })
            .collect();
        refresh.push(Summary {
            kind: Some(summary::Kind::Delta(pb::Delta {
                workers: loads,
                node_state: None,
            })),
        });
        router.apply_agent_summary(
            agent,
            Summary {
                kind: Some(summary::Kind::Snapshot(pb::Snapshot {
                    node: format!("node-{agent}"),
                    epoch: 1,
                    workers: states,
                    node_state: None,
                })),
            },
        );
    }
    (router, prompts, refresh)
}

/// Times `n` decisions, the `i`th for prompt `order[i % len]`, each after `prepare(i)`; the agents
/// resend `refresh` every [`LOAD_REFRESH`] (untimed).
fn time_decisions(
    router: &Router,
    prompts: &[Vec<u32>],
    refresh: &[Summary],
    order: &[usize],
    n: usize,
    prepare: &mut dyn FnMut(usize),
) -> Vec<Duration> {
    let mut refreshed = Instant::now();
    (0..n)
        .map(|i| {
            if refreshed.elapsed() >= LOAD_REFRESH {
                for (agent, load) in refresh.iter().enumerate() {
                    router.apply_agent_summary(agent, load.clone());
                }
                refreshed = Instant::now();
            }
            prepare(i);
            let tokens = &prompts[order[i % order.len()]];
            let t = Instant::now();
            let d = router.pick_tokens("m", tokens, false).expect("pick");
            let e = t.elapsed();
            black_box(&d.worker);
            drop(d);
            e
        })
        .collect()
}

fn report(what: &str, samples: &mut [Duration]) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    let mean = samples.iter().sum::<Duration>() / samples.len() as u32;
    println!(
        "{what:<40} p50 {:>7.1} us  p99 {:>7.1} us  mean {:>7.1} us  ({} decisions)",
        at(0.5).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
        mean.as_secs_f64() * 1e6,
        samples.len(),
    );
}

fn main() {
    // `cargo bench` passes `--bench`; without it (`cargo test --benches`) one small fleet is
    // checked, not timed. The sizes are the one other argument.
    let timed = std::env::args().any(|a| a == "--bench");
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .map(|a| a.split(',').map(|s| s.parse().expect("size")).collect())
        .unwrap_or_else(|| vec![104, 250, 500, 1000]);
    let (sizes, warm_n, cold_n) = if timed {
        (sizes, WARM_DECISIONS, COLD_DECISIONS)
    } else {
        (vec![16], 100, 2)
    };
    let mut scratch = vec![0u8; COLD_SCRATCH_BYTES];
    for workers in sizes {
        for (arm, decision_rows) in [("rows", true), ("locked", false)] {
            let mut rng = StdRng::seed_from_u64(35);
            let (router, prompts, refresh) = fleet(workers, decision_rows, &mut rng);
            let order: Vec<usize> = (0..4096)
                .map(|_| rng.random_range(0..prompts.len()))
                .collect();
            // Each prompt goes to the worker holding it (its only holder): the decision reads the
            // index.
            for (i, p) in prompts.iter().enumerate().take(8) {
                let d = router.pick_tokens("m", p, false).expect("pick");
                assert_eq!(d.worker, url(i / PROMPTS_PER_WORKER), "the holder wins");
            }
            let time = |n: usize, prepare: &mut dyn FnMut(usize)| {
                time_decisions(&router, &prompts, &refresh, &order, n, prepare)
            };
            time(warm_n / 10, &mut |_| {});
            let mut warm = time(warm_n, &mut |_| {});
            report(&format!("{workers} workers, {arm}, caches warm"), &mut warm);
            let mut cold = time(cold_n, &mut |i| {
                for line in scratch.chunks_mut(64) {
                    line[0] = line[0].wrapping_add(i as u8);
                }
                black_box(&scratch);
            });
            report(&format!("{workers} workers, {arm}, caches cold"), &mut cold);
        }
    }
}
