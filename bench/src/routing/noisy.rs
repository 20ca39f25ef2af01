//! The noisy-neighbour benchmark (`routing-bench --noisy-neighbour`): three tenants on one fleet of
//! simulated workers behind a gateway. Tenant A (low priority) floods at several times the fleet's
//! capacity, B (medium) sends a steady light load, C (high) is latency-critical and lighter still.
//! Arms, on the same cluster and request schedule: the gateway with flow control (`--flow-control`)
//! and without, and B alone and C alone as the reference of an undisturbed fleet.
//!
//! Arrivals are open loop (Poisson per tenant from a seeded generator), so a slow answer does not
//! slow the sender; each request's time to first token and status are recorded, with whether a
//! refusal carried `Retry-After`. A request still unanswered when an arm's drain time is up counts
//! as neither served nor shed (`cut`). Times are wall-clock (the simulator runs at
//! `--time-scale`).

use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use http_body_util::BodyExt as _;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::json;

use crate::harness::http::HttpClient;

/// One tenant's load in an arm.
#[derive(Debug, Clone, Serialize)]
pub struct TenantLoad {
    /// `a`, `b` or `c`.
    pub tenant: &'static str,
    /// Its API key.
    pub key: &'static str,
    /// Arrivals per second (Poisson).
    pub rate_rps: f64,
    /// Prompt words (about tokens).
    pub prompt_words: usize,
    /// Completion tokens asked for.
    pub max_tokens: u32,
}

/// The three tenants' names, keys and priorities.
pub const TENANTS: [(&str, &str, &str); 3] = [
    ("a", "sk-noisy-a", "Low"),
    ("b", "sk-noisy-b", "Medium"),
    ("c", "sk-noisy-c", "High"),
];

/// What happened to one request.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// Its tenant.
    pub tenant: &'static str,
    /// When it was sent, from the arm's start.
    pub sent_s: f64,
    /// HTTP status (0: no answer before the drain ended, or a transport error).
    pub status: u16,
    /// Time to the first content token, for a served request.
    pub ttft_s: Option<f64>,
    /// Served to its end.
    pub done: bool,
    /// A refusal that carried `Retry-After`.
    pub retry_after: bool,
}

/// Writes the tenants' `InferenceTenant` objects and keys under `dir`; returns the gateways'
/// `tenancy` configuration.
pub fn write_tenants(dir: &Path) -> std::io::Result<serde_json::Value> {
    let mut objects = Vec::new();
    for (name, key, priority) in TENANTS {
        let secret = dir.join("secrets").join(name);
        std::fs::create_dir_all(&secret)?;
        std::fs::write(secret.join("api-key"), key)?;
        objects.push(format!(
            "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {{name: {name}}}\nspec:\n  apiKeys: [{{secretRef: {{name: {name}, key: api-key}}}}]\n  priority: {priority}\n"
        ));
    }
    std::fs::write(dir.join("tenants.yaml"), objects.join("---\n"))?;
    Ok(json!({
        "tenants_dir": dir.join("tenants.yaml").display().to_string(),
        "secrets_dir": dir.join("secrets").display().to_string(),
        "usage_journal": dir.join("usage.jsonl").display().to_string(),
    }))
}

/// The arrival schedule of `loads` over `duration`: (offset, tenant index), in time order.
pub fn schedule(loads: &[TenantLoad], duration: Duration, seed: u64) -> Vec<(Duration, usize)> {
    let mut all = Vec::new();
    for (i, load) in loads.iter().enumerate() {
        if load.rate_rps <= 0.0 {
            continue;
        }
        // Seeded by the tenant, not its place in `loads`: B alone and B beside A get the same arrivals.
        let stream = load
            .tenant
            .bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
        let mut rng =
            StdRng::seed_from_u64(seed ^ stream.wrapping_add(1).wrapping_mul(0x9E37_79B9));
        let mut t = 0.0;
        loop {
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            t += -u.ln() / load.rate_rps;
            if t >= duration.as_secs_f64() {
                break;
            }
            all.push((Duration::from_secs_f64(t), i));
        }
    }
    all.sort_by_key(|(t, _)| *t);
    all
}

/// Runs one arm: `loads` against the gateways at `bases` for `duration` (request `n` to
/// `bases[n % len]`: replicas behind a round-robin front), then waits up to `drain` for the answers.
pub async fn run_arm(
    http: &HttpClient,
    bases: &[String],
    model: &str,
    loads: &[TenantLoad],
    duration: Duration,
    drain: Duration,
    seed: u64,
) -> Vec<Outcome> {
    let arrivals = schedule(loads, duration, seed);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(arrivals.len());
    let mut rng = StdRng::seed_from_u64(seed.wrapping_add(7));
    for (n, (at, i)) in arrivals.into_iter().enumerate() {
        tokio::time::sleep_until((start + at).into()).await;
        let load = loads[i].clone();
        // A unique prompt per request: no tenant gains from another's cache.
        let prompt = format!(
            "request {n} of tenant {}: {}",
            load.tenant,
            (0..load.prompt_words)
                .map(|_| WORDS[rng.random_range(0..WORDS.len())])
                .collect::<Vec<_>>()
                .join(" ")
        );
        let body = json!({
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": load.max_tokens,
            "stream": true,
        });
        let base = &bases[n % bases.len()];
        let (http, url) = (http.clone(), format!("{base}/v1/chat/completions"));
        let (tenant, sent_s) = (load.tenant, at.as_secs_f64());
        tasks.push((
            tenant,
            sent_s,
            tokio::spawn(async move { send(&http, &url, &load, body.to_string(), sent_s).await }),
        ));
    }
    collect(tasks, Instant::now() + drain).await
}

/// The outcomes of `tasks`, each cut (aborted: its connection closes, so the gateway and the worker
/// drop it) when still unanswered at `deadline`.
async fn collect(
    tasks: Vec<(&'static str, f64, tokio::task::JoinHandle<Outcome>)>,
    deadline: Instant,
) -> Vec<Outcome> {
    let mut outcomes = Vec::with_capacity(tasks.len());
    for (tenant, sent_s, mut task) in tasks {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, &mut task).await {
            Ok(Ok(outcome)) => outcomes.push(outcome),
            _ => {
                task.abort();
                outcomes.push(Outcome {
                    tenant,
                    sent_s,
                    status: 0,
                    ttft_s: None,
                    done: false,
                    retry_after: false,
                });
            }
        }
    }
    outcomes
}

/// `users` closed-loop clients of `load` for `duration`: requests served per second (the fleet's
/// capacity for this request shape when `users` exceeds its batch slots).
pub async fn capacity(
    http: &HttpClient,
    base: &str,
    model: &str,
    load: &TenantLoad,
    users: usize,
    duration: Duration,
) -> f64 {
    let start = Instant::now();
    let url = format!("{base}/v1/chat/completions");
    let served = futures::future::join_all((0..users).map(|u| {
        let (http, url, load) = (http.clone(), url.clone(), load.clone());
        async move {
            let mut n = 0usize;
            while start.elapsed() < duration {
                let body = json!({
                    "model": model,
                    "messages": [{"role": "user", "content": format!("capacity {u} {n}: {}", WORDS.repeat(load.prompt_words / WORDS.len() + 1).join(" "))}],
                    "max_tokens": load.max_tokens,
                    "stream": true,
                });
                if send(&http, &url, &load, body.to_string(), 0.0).await.done {
                    n += 1;
                }
            }
            n
        }
    }))
    .await;
    served.iter().sum::<usize>() as f64 / start.elapsed().as_secs_f64()
}

/// Waits until the workers at `workers` (base URLs) have no request running or waiting, at most
/// `limit`.
pub async fn wait_idle(http: &HttpClient, workers: &[String], limit: Duration) {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        let mut busy = 0.0;
        for w in workers {
            if let Ok(text) = http.get_text(&format!("{w}/metrics")).await {
                busy += super::cluster::metric_sum(&text, "vllm:num_requests_running")
                    + super::cluster::metric_sum(&text, "vllm:num_requests_waiting");
            }
        }
        if busy == 0.0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn send(
    http: &HttpClient,
    url: &str,
    load: &TenantLoad,
    body: String,
    sent_s: f64,
) -> Outcome {
    let started = Instant::now();
    let bearer = format!("Bearer {}", load.key);
    let mut outcome = Outcome {
        tenant: load.tenant,
        sent_s,
        status: 0,
        ttft_s: None,
        done: false,
        retry_after: false,
    };
    let Ok(response) = http
        .send(
            Method::POST,
            url,
            &[("authorization", &bearer)],
            Bytes::from(body),
        )
        .await
    else {
        return outcome;
    };
    outcome.status = response.status().as_u16();
    outcome.retry_after = response.headers().contains_key(http::header::RETRY_AFTER);
    let ok = response.status().is_success();
    let mut body = response.into_body();
    while let Some(Ok(frame)) = body.frame().await {
        let Some(data) = frame.data_ref() else {
            continue;
        };
        if ok && outcome.ttft_s.is_none() && has_token(data) {
            outcome.ttft_s = Some(started.elapsed().as_secs_f64());
        }
    }
    outcome.done = ok && outcome.ttft_s.is_some();
    outcome
}

/// Whether an SSE chunk carries generated text.
fn has_token(data: &[u8]) -> bool {
    let text = String::from_utf8_lossy(data);
    text.contains("\"content\":\"") && !text.contains("\"content\":\"\"")
}

/// Per-tenant figures of one arm.
#[derive(Debug, Clone, Serialize)]
pub struct TenantFigures {
    /// Tenant.
    pub tenant: &'static str,
    /// Requests sent.
    pub sent: usize,
    /// Served to the end.
    pub served: usize,
    /// Refused with 429.
    pub shed_429: usize,
    /// Refused with 503.
    pub shed_503: usize,
    /// Of the refusals, those with `Retry-After`.
    pub with_retry_after: usize,
    /// Neither answered nor refused within the drain.
    pub cut: usize,
    /// Median TTFT of the served, seconds.
    pub ttft_p50_s: Option<f64>,
    /// 90th percentile TTFT of the served, seconds.
    pub ttft_p90_s: Option<f64>,
    /// Served within the TTFT objective, per minute of the arm.
    pub goodput_rpm: f64,
}

/// The figures of `outcomes` by tenant (and `all`), goodput against `slo_s` over `duration`.
pub fn figures(outcomes: &[Outcome], slo_s: f64, duration: Duration) -> Vec<TenantFigures> {
    let mut rows = Vec::new();
    for tenant in ["a", "b", "c", "all"] {
        let mine: Vec<&Outcome> = outcomes
            .iter()
            .filter(|o| tenant == "all" || o.tenant == tenant)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let mut ttfts: Vec<f64> = mine
            .iter()
            .filter(|o| o.done)
            .filter_map(|o| o.ttft_s)
            .collect();
        ttfts.sort_by(f64::total_cmp);
        let pct = |p: f64| {
            (!ttfts.is_empty()).then(|| ttfts[((ttfts.len() - 1) as f64 * p).round() as usize])
        };
        let good = ttfts.iter().filter(|t| **t <= slo_s).count();
        rows.push(TenantFigures {
            tenant: match tenant {
                "a" => "a",
                "b" => "b",
                "c" => "c",
                _ => "all",
            },
            sent: mine.len(),
            served: mine.iter().filter(|o| o.done).count(),
            shed_429: mine.iter().filter(|o| o.status == 429).count(),
            shed_503: mine.iter().filter(|o| o.status == 503).count(),
            with_retry_after: mine
                .iter()
                .filter(|o| matches!(o.status, 429 | 503) && o.retry_after)
                .count(),
            cut: mine.iter().filter(|o| o.status == 0).count(),
            ttft_p50_s: pct(0.5),
            ttft_p90_s: pct(0.9),
            goodput_rpm: good as f64 * 60.0 / duration.as_secs_f64(),
        });
    }
    rows
}

/// Common words the Qwen2 tokenizer encodes as one token each.
const WORDS: [&str; 32] = [
    "the", "time", "people", "water", "house", "light", "river", "stone", "paper", "music",
    "green", "small", "north", "south", "early", "story", "table", "money", "field", "power",
    "city", "night", "world", "school", "family", "market", "summer", "winter", "garden", "window",
    "letter", "answer",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_is_seeded_and_keeps_each_tenants_rate() {
        let loads = [
            TenantLoad {
                tenant: "a",
                key: "",
                rate_rps: 40.0,
                prompt_words: 1,
                max_tokens: 1,
            },
            TenantLoad {
                tenant: "b",
                key: "",
                rate_rps: 2.0,
                prompt_words: 1,
                max_tokens: 1,
            },
        ];
        let one = schedule(&loads, Duration::from_secs(50), 1);
        assert_eq!(one, schedule(&loads, Duration::from_secs(50), 1));
        assert_ne!(one, schedule(&loads, Duration::from_secs(50), 2));
        let a = one.iter().filter(|(_, i)| *i == 0).count() as f64;
        let b = one.iter().filter(|(_, i)| *i == 1).count() as f64;
        assert!((a / 50.0 - 40.0).abs() < 4.0, "a {a}");
        assert!((b / 50.0 - 2.0).abs() < 0.8, "b {b}");
        assert!(one.windows(2).all(|w| w[0].0 <= w[1].0));
        // B alone has B's arrivals of the mixed schedule.
        let alone = schedule(&loads[1..], Duration::from_secs(50), 1);
        let mixed: Vec<Duration> = one
            .iter()
            .filter(|(_, i)| *i == 1)
            .map(|(t, _)| *t)
            .collect();
        assert_eq!(alone.iter().map(|(t, _)| *t).collect::<Vec<_>>(), mixed);
    }

    #[test]
    fn figures_count_sheds_retry_after_and_goodput_within_the_objective() {
        let o = |tenant, status, ttft: Option<f64>, retry_after| Outcome {
            tenant,
            sent_s: 0.0,
            status,
            ttft_s: ttft,
            done: status == 200,
            retry_after,
        };
        let outcomes = [
            o("a", 200, Some(0.5), false),
            o("a", 503, None, true),
            o("a", 429, None, true),
            o("b", 200, Some(3.0), false),
            o("b", 200, Some(1.0), false),
        ];
        let rows = figures(&outcomes, 2.0, Duration::from_secs(60));
        let a = &rows[0];
        assert_eq!(
            (a.sent, a.served, a.shed_429, a.shed_503, a.with_retry_after),
            (3, 1, 1, 1, 2)
        );
        let b = &rows[1];
        assert_eq!(b.ttft_p50_s, Some(3.0));
        assert_eq!(b.goodput_rpm, 1.0);
        assert_eq!(rows.last().unwrap().served, 3);
    }
}

/// One arm's figures under one seed.
#[derive(Debug, Clone, Serialize)]
pub struct ArmResult {
    /// `flow-control`, `no-flow-control`, `b-alone`, `c-alone`.
    pub arm: &'static str,
    /// The schedule's seed.
    pub seed: u64,
    /// Per tenant, and `all`.
    pub rows: Vec<TenantFigures>,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// The median over seeds of `field` of `tenant` in `arm`.
pub fn across_seeds(
    results: &[ArmResult],
    arm: &str,
    tenant: &str,
    field: impl Fn(&TenantFigures) -> Option<f64>,
) -> Option<f64> {
    median(
        results
            .iter()
            .filter(|r| r.arm == arm)
            .flat_map(|r| r.rows.iter().filter(|t| t.tenant == tenant))
            .filter_map(&field)
            .collect(),
    )
}

/// The results as markdown: per seed and arm the tenants' rows, then the targets' ratios (medians
/// over seeds).
pub fn markdown(results: &[ArmResult], header: &str) -> String {
    let f = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.2}"));
    let mut md = format!(
        "{header}\n\n| seed | arm | tenant | sent | served | 429 | 503 | with Retry-After | cut | TTFT p50 s | TTFT p90 s | goodput /min |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    for r in results {
        for t in &r.rows {
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} |\n",
                r.seed,
                r.arm,
                t.tenant,
                t.sent,
                t.served,
                t.shed_429,
                t.shed_503,
                t.with_retry_after,
                t.cut,
                f(t.ttft_p50_s),
                f(t.ttft_p90_s),
                t.goodput_rpm
            ));
        }
    }
    let p90 = |arm: &str, tenant: &str| across_seeds(results, arm, tenant, |t| t.ttft_p90_s);
    let good = |arm: &str| across_seeds(results, arm, "all", |t| Some(t.goodput_rpm));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "n/a".into(),
    };
    // One column per arm run with all three tenants.
    let arms: Vec<&str> = ["flow-control", "flow-control-alt", "no-flow-control"]
        .into_iter()
        .filter(|arm| results.iter().any(|r| r.arm == *arm))
        .collect();
    md.push_str(&format!(
        "\n| target (medians over seeds) | {} | goal |\n|---|{}---|\n",
        arms.join(" | "),
        "---|".repeat(arms.len())
    ));
    let row = |what: &str, cell: &dyn Fn(&str) -> String, goal: &str| {
        let cells: Vec<String> = arms.iter().map(|arm| cell(arm)).collect();
        format!("| {what} | {} | {goal} |\n", cells.join(" | "))
    };
    md.push_str(&row(
        "B p90 TTFT / B alone",
        &|arm| ratio(p90(arm, "b"), p90("b-alone", "b")),
        "<= 1.3",
    ));
    md.push_str(&row(
        "C p90 TTFT / C alone",
        &|arm| ratio(p90(arm, "c"), p90("c-alone", "c")),
        "<= 1.1",
    ));
    md.push_str(&row(
        "total goodput, /min",
        &|arm| f(good(arm)),
        "flow >= no flow",
    ));
    let a_sum = |arm: &str, field: &dyn Fn(&TenantFigures) -> usize| -> usize {
        results
            .iter()
            .filter(|r| r.arm == arm)
            .flat_map(|r| r.rows.iter().filter(|t| t.tenant == "a"))
            .map(field)
            .sum()
    };
    md.push_str(&row(
        "A's requests shed (all seeds), of which with Retry-After",
        &|arm| {
            format!(
                "{}, {}",
                a_sum(arm, &|t| t.shed_429 + t.shed_503),
                a_sum(arm, &|t| t.with_retry_after)
            )
        },
        "all with Retry-After",
    ));
    let cut = |arm: &str| -> usize {
        results
            .iter()
            .filter(|r| r.arm == arm)
            .flat_map(|r| r.rows.iter().filter(|t| t.tenant != "all"))
            .map(|t| t.cut)
            .sum()
    };
    md.push_str(&row(
        "requests cut (no answer by the drain's end, all seeds)",
        &|arm| cut(arm).to_string(),
        "none",
    ));
    md
}
