//! The rows answer what the workers' states answer: on random fleets and random event sequences,
//! every candidate read from the rows has the figures read under the worker's lock.

use std::time::{Duration, Instant};

use kinference_api::KeyHasher;
use kinference_api::summary::{self as pb, Summary, summary};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::routing::candidates::Candidate;
use crate::routing::kv_index::WorkerId;
use crate::routing::*;

const WORKERS_PER_AGENT: usize = 6;
const BLOCK: usize = 16;

fn url(i: usize) -> String {
    format!("http://w{i}")
}

/// Every figure of a candidate that the decision or its explanation reads.
fn figures(c: &Candidate<'_>) -> String {
    format!(
        "{:?} bs={} live={} in_flight={} scraped={:?} kernel={:?} awaiting={} queue={:?} signal={:?} \
         missing={:?} rates={:?} own={:?} late={:?} kv={:?}",
        c.worker.id,
        c.block_size,
        c.live,
        c.in_flight,
        c.scraped,
        c.kernel_fresh,
        c.awaiting_first_token,
        c.queue,
        c.signal,
        c.kernel_missing,
        c.rates,
        c.own_s_per_token,
        c.late,
        c.kv_room,
    )
}

fn random_load(rng: &mut StdRng) -> pb::WorkerLoad {
    let kernel_ok = rng.random_bool(0.5);
    let kernel_in_flight = rng.random_range(0..12);
    pb::WorkerLoad {
        running: rng.random_range(0..8),
        waiting: rng.random_range(0..4),
        kv_usage: rng.random_range(0.0..1.0),
        metrics_age_ms: rng.random_range(0..400),
        metrics_ok: rng.random_bool(0.9),
        kernel_ok,
        kernel_in_flight,
        kernel_waiting: rng.random_range(0..=kernel_in_flight),
        kernel_waits_for_body: rng.random_bool(0.5),
        kernel_idle_gap_ms: rng.random_range(0..3) * 5,
        num_gpu_blocks: if rng.random_bool(0.7) { 64 } else { 0 },
        ..Default::default()
    }
}

/// A router over `agents x WORKERS_PER_AGENT` workers (plus two without an agent), each holding
/// some of `prompts`.
fn fleet(agents: usize, prompts: &[Vec<u32>], rng: &mut StdRng) -> Router {
    let workers = agents * WORKERS_PER_AGENT + 2;
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
        ..RoutingTuning::default()
    };
    let router = Router::with_tuning(config, tuning).expect("router");
    let hasher = KeyHasher::for_model("m");
    for a in 0..agents {
        let states = (a * WORKERS_PER_AGENT..(a + 1) * WORKERS_PER_AGENT)
            .map(|i| {
                let mut keys = Vec::new();
                for p in prompts {
                    if !rng.random_bool(0.2) {
                        continue;
                    }
                    let held = rng.random_range(0..=p.len() / BLOCK);
                    keys.extend(hasher.keys(None, &p[..held * BLOCK], BLOCK));
                }
                pb::WorkerState {
                    worker_id: url(i),
                    model: "m".into(),
                    block_size: BLOCK as u32,
                    keys,
                    offloaded_keys: Vec::new(),
                    data_parallel_rank: None,
                    role: String::new(),
                    load: Some(random_load(rng)),
                }
            })
            .collect();
        router.apply_agent_summary(
            a,
            Summary {
                kind: Some(summary::Kind::Snapshot(pb::Snapshot {
                    node: format!("node-{a}"),
                    epoch: 1,
                    workers: states,
                    node_state: None,
                })),
            },
        );
    }
    router
}

/// Compares the rows' candidates with the locked states' at one instant; returns how many workers
/// the rows answered and how many they could not (read under the lock instead).
fn compare(router: &Router, step: usize) -> (usize, usize) {
    let shared = &router.shared;
    let workers = router.candidates("m").expect("candidates");
    // The candidate list from the rows is the one from the workers' states.
    let table = shared.workers.read();
    let expected: Vec<WorkerId> = {
        let listed = |whole: bool| {
            table
                .all()
                .iter()
                .filter(|w| {
                    let st = w.state.read();
                    !st.gone && st.healthy && st.role.serves_whole() == whole
                })
                .map(|w| w.id)
                .collect::<Vec<_>>()
        };
        let whole = listed(true);
        if whole.is_empty() {
            listed(false)
        } else {
            whole
        }
    };
    drop(table);
    let ids: Vec<WorkerId> = workers.iter().map(|w| w.id).collect();
    assert_eq!(ids, expected, "step {step}: the candidate list");

    let now = Instant::now();
    let from_rows = shared.candidates_at(&workers, now);
    let locked = shared.candidates_locked(&workers, now);
    assert_eq!(from_rows.len(), locked.len());
    for (r, l) in from_rows.iter().zip(&locked) {
        assert_eq!(figures(r), figures(l), "step {step}");
    }
    let fresh = shared.fresh_agents(now);
    let fleet = shared.fleet_of(&workers);
    let rows = shared.rows.read();
    let answered = workers
        .iter()
        .zip(&fleet)
        .filter(|(w, fleet)| {
            shared
                .candidate(w, &rows[usize::from(w.id)], fleet, &fresh, now)
                .1
        })
        .count();
    (answered, workers.len() - answered)
}

#[test]
fn rows_match_the_locked_state() {
    let (mut answered, mut unanswered) = (0, 0);
    for seed in 0..4 {
        let mut rng = StdRng::seed_from_u64(seed);
        let prompts: Vec<Vec<u32>> = (0..12)
            .map(|_| {
                (0..rng.random_range(2..8) * BLOCK)
                    .map(|_| rng.random_range(0..50_000))
                    .collect()
            })
            .collect();
        let agents = 4;
        let router = fleet(agents, &prompts, &mut rng);
        let mut held: Vec<Decision> = Vec::new();
        for step in 0..250 {
            match rng.random_range(0..10) {
                0..=3 => {
                    let p = &prompts[rng.random_range(0..prompts.len())];
                    held.push(router.pick_tokens("m", p, false).expect("pick"));
                    if held.len() > 40 {
                        held.swap_remove(rng.random_range(0..held.len()));
                    }
                }
                4 if !held.is_empty() => {
                    let i = rng.random_range(0..held.len());
                    held[i].ticket.first_token();
                }
                5 if !held.is_empty() => {
                    let d = held.swap_remove(rng.random_range(0..held.len()));
                    if rng.random_bool(0.5) {
                        d.ticket.finish(true, 16, None);
                    }
                }
                6 => {
                    // One agent's new scrape of its workers.
                    let a = rng.random_range(0..agents);
                    let mut workers = Vec::new();
                    for i in a * WORKERS_PER_AGENT..(a + 1) * WORKERS_PER_AGENT {
                        if rng.random_bool(0.6) {
                            workers.push(pb::WorkerDelta {
                                worker_id: url(i),
                                load: Some(random_load(&mut rng)),
                                ..Default::default()
                            });
                        }
                    }
                    router.apply_agent_summary(
                        a,
                        Summary {
                            kind: Some(summary::Kind::Delta(pb::Delta {
                                workers,
                                node_state: None,
                            })),
                        },
                    );
                }
                7 => std::thread::sleep(Duration::from_millis(rng.random_range(0..4))),
                8 => {
                    let w = rng.random_range(0..agents * WORKERS_PER_AGENT + 2);
                    router.set_healthy(&url(w), rng.random_bool(0.8));
                }
                _ => {
                    // An agent's stream drops (its data stale after `stale_after`) or comes back.
                    let agent = router.shared.agent(rng.random_range(0..agents));
                    let mut st = agent.lock();
                    st.connected = rng.random_bool(0.7);
                    st.since = Instant::now()
                        .checked_sub(Duration::from_secs(rng.random_range(0..20)))
                        .unwrap_or_else(Instant::now);
                }
            }
            let (a, u) = compare(&router, step);
            answered += a;
            unanswered += u;
        }
    }
    // Both paths ran: most workers from their rows, some (a burst since their views) locked.
    assert!(
        answered > 10 * unanswered,
        "{answered} from rows, {unanswered} locked"
    );
    assert!(unanswered > 0, "no worker outran its row's tail");
}
