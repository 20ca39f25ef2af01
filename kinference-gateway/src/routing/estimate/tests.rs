use rand::SeedableRng;
use rand::rngs::StdRng;

use super::*;

fn cfg() -> EstimatorConfig {
    EstimatorConfig::default()
}

#[test]
fn learns_rates_from_observed_ttfts() {
    let cfg = cfg();
    let mut r = Rates::prior(&cfg);
    // The true worker: 40 ms overhead, 2,000 tokens/s (the prior says 20 ms and 5,000 tokens/s).
    let truth = |work: f64| 0.04 + work / 2_000.0;
    for i in 0..200 {
        let work = if i % 2 == 0 { 4_000.0 } else { 50.0 };
        r.observe(truth(work), work, &cfg);
    }
    assert!((1.0 / r.s_per_token - 2_000.0).abs() < 100.0, "{r:?}");
    assert!((r.overhead_s - 0.04).abs() < 0.01, "{r:?}");
}

#[test]
fn learning_is_robust_to_outliers_and_garbage() {
    let cfg = cfg();
    let mut r = Rates::prior(&cfg);
    for _ in 0..50 {
        r.observe(0.02 + 4_000.0 / 5_000.0, 4_000.0, &cfg);
    }
    let settled = r.clone();
    // One absurd sample (a stalled connection) moves the rate by at most 3x * alpha.
    r.observe(600.0, 4_000.0, &cfg);
    assert!(r.s_per_token < settled.s_per_token * 1.25, "{r:?}");
    r.observe(f64::NAN, 4_000.0, &cfg);
    r.observe(-1.0, 4_000.0, &cfg);
    assert!(r.s_per_token.is_finite() && r.s_per_token > 0.0);
}

#[test]
fn estimate_counts_only_uncached_tokens_and_queue() {
    let cfg = cfg();
    let r = Rates {
        s_per_token: 0.001,
        overhead_s: 0.01,
        samples: 0,
    };
    let cold = estimate(
        &r,
        &Inputs {
            prompt_tokens: 1_000,
            cached_tokens: 0,
            queue_tokens: 0.0,
            running: 0,
        },
        &cfg,
    );
    let warm = estimate(
        &r,
        &Inputs {
            prompt_tokens: 1_000,
            cached_tokens: 900,
            queue_tokens: 0.0,
            running: 0,
        },
        &cfg,
    );
    let busy = estimate(
        &r,
        &Inputs {
            prompt_tokens: 1_000,
            cached_tokens: 900,
            queue_tokens: 2_000.0,
            running: 2,
        },
        &cfg,
    );
    assert!((cold.ttft_s - 1.01).abs() < 1e-9);
    assert!((warm.ttft_s - 0.11).abs() < 1e-9);
    assert!((busy.queue_s - (2_000.0 + 32.0) * 0.001).abs() < 1e-9);
    assert!(busy.ttft_s > cold.ttft_s);
}

#[test]
fn ties_are_spread_at_random() {
    let cfg = cfg();
    let mut rng = StdRng::seed_from_u64(7);
    let scored = vec![
        Scored {
            ttft_s: 0.5,
            load: 0,
            cached_tokens: 0
        };
        4
    ];
    let mut counts = [0usize; 4];
    for _ in 0..400 {
        let (i, why) = choose(&scored, &cfg, &mut rng).unwrap();
        assert_eq!(why, Why::TieSpread);
        counts[i] += 1;
    }
    assert!(counts.iter().all(|c| *c > 50), "{counts:?}");
}

#[test]
fn strict_best_wins_with_its_reason() {
    let cfg = cfg();
    let mut rng = StdRng::seed_from_u64(1);
    let scored = vec![
        Scored {
            ttft_s: 1.0,
            load: 0,
            cached_tokens: 0,
        },
        Scored {
            ttft_s: 0.1,
            load: 3,
            cached_tokens: 900,
        },
    ];
    assert_eq!(choose(&scored, &cfg, &mut rng), Some((1, Why::CacheHit)));
    let scored = vec![
        Scored {
            ttft_s: 1.0,
            load: 5,
            cached_tokens: 0,
        },
        Scored {
            ttft_s: 0.5,
            load: 0,
            cached_tokens: 0,
        },
    ];
    assert_eq!(choose(&scored, &cfg, &mut rng), Some((1, Why::LeastLoaded)));
}

#[test]
fn load_guard_caps_piling_onto_one_worker() {
    let cfg = cfg();
    let mut rng = StdRng::seed_from_u64(1);
    // The cached worker looks best but already has 17 more requests than the idle one.
    let scored = vec![
        Scored {
            ttft_s: 0.1,
            load: 17,
            cached_tokens: 5_000,
        },
        Scored {
            ttft_s: 2.0,
            load: 0,
            cached_tokens: 0,
        },
    ];
    assert_eq!(choose(&scored, &cfg, &mut rng), Some((1, Why::LoadGuard)));
    // At 16 it is still allowed; relative slack applies once every worker is busy.
    assert!(within_guard(16, 0, &cfg));
    assert!(within_guard(80, 40, &cfg));
    assert!(!within_guard(81, 40, &cfg));
}

#[test]
fn near_ties_prefer_the_cache_then_spread() {
    let cfg = cfg();
    let mut rng = StdRng::seed_from_u64(3);
    let scored = vec![
        Scored {
            ttft_s: 1.00,
            load: 0,
            cached_tokens: 0,
        },
        Scored {
            ttft_s: 1.01,
            load: 1,
            cached_tokens: 4_000,
        },
        Scored {
            ttft_s: 1.00,
            load: 0,
            cached_tokens: 0,
        },
    ];
    assert_eq!(choose(&scored, &cfg, &mut rng), Some((1, Why::CacheHit)));
}
