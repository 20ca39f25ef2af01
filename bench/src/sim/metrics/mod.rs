//! `/metrics` in vLLM's Prometheus exposition (`vllm/v1/metrics/loggers.py`, as scraped from vLLM 0.32 in
//! `bench/fixtures/vllm-0.32/metrics-run1.txt`): the same metric names, HELP texts, labels
//! (`engine="0"`, `model_name`, sorted as `prometheus_client` prints them), `_total` / `_created`
//! series and histogram buckets, so a router's scraper cannot tell the simulator from vLLM.
//!
//! Written by hand rather than with `prometheus-client` because vLLM's output (Python
//! `prometheus_client`) has details that crate does not reproduce: `_created` gauges, float formatting
//! such as `5.0` and `1.79e+09`, and `vllm:cache_config_info` without a `model_name` label.

#[cfg(test)]
mod tests;

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

/// `vllm/v1/metrics/buckets.py`: time to first token.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Inter-token latency.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// Request-level latencies (e2e, queue time).
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Why a request finished (`finished_reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Abort,
    Error,
    Repetition,
}

impl FinishReason {
    const ALL: [FinishReason; 5] = [
        Self::Stop,
        Self::Length,
        Self::Abort,
        Self::Error,
        Self::Repetition,
    ];

    /// The label value (and OpenAI `finish_reason` for stop/length).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Error => "error",
            Self::Repetition => "repetition",
        }
    }
}

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }
}

#[derive(Debug)]
struct State {
    prefix_queries: u64,
    prefix_hits: u64,
    prompt_tokens: u64,
    prompt_cached: u64,
    generation_tokens: u64,
    preemptions: u64,
    success: [u64; 5],
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue: Histogram,
}

/// Gauges read from the engine at scrape time.
#[derive(Debug, Clone, Copy, Default)]
pub struct Gauges {
    pub running: usize,
    pub waiting: usize,
    pub kv_cache_usage: f64,
}

/// Static cache configuration (`vllm:cache_config_info`).
#[derive(Debug, Clone)]
pub struct CacheInfo {
    pub block_size: usize,
    pub num_gpu_blocks: usize,
}

/// The simulator's vLLM metrics.
#[derive(Debug)]
pub struct Metrics {
    model: String,
    created: f64,
    state: Mutex<State>,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs_f64()
}

impl Metrics {
    /// Metrics labelled with the served model name.
    pub fn new(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            created: unix_now(),
            state: Mutex::new(State {
                prefix_queries: 0,
                prefix_hits: 0,
                prompt_tokens: 0,
                prompt_cached: 0,
                generation_tokens: 0,
                preemptions: 0,
                success: [0; 5],
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                e2e: Histogram::new(REQUEST_LATENCY_BUCKETS),
                queue: Histogram::new(REQUEST_LATENCY_BUCKETS),
            }),
        }
    }

    /// A waiting request was scheduled for the first time: prefix-cache lookup of `queried` tokens.
    pub fn on_scheduled(&self, queried: usize, hit: usize, queue_time: Duration) {
        let mut s = self.state.lock();
        s.prefix_queries += queried as u64;
        s.prefix_hits += hit as u64;
        s.queue.observe(queue_time.as_secs_f64());
    }

    /// A request produced its first token.
    pub fn on_first_token(&self, prompt_tokens: usize, cached_tokens: usize, ttft: Duration) {
        let mut s = self.state.lock();
        s.prompt_tokens += prompt_tokens as u64;
        s.prompt_cached += cached_tokens as u64;
        s.generation_tokens += 1;
        s.ttft.observe(ttft.as_secs_f64());
    }

    /// A request produced a later token, `itl` after the previous one.
    pub fn on_token(&self, itl: Duration) {
        let mut s = self.state.lock();
        s.generation_tokens += 1;
        s.itl.observe(itl.as_secs_f64());
    }

    /// A request left the engine.
    pub fn on_finished(&self, reason: FinishReason, e2e: Duration) {
        let mut s = self.state.lock();
        if let Some(i) = FinishReason::ALL.iter().position(|&r| r == reason) {
            s.success[i] += 1;
        }
        if reason != FinishReason::Abort {
            s.e2e.observe(e2e.as_secs_f64());
        }
    }

    /// A running request was preempted (its blocks freed for recompute).
    pub fn on_preempted(&self) {
        self.state.lock().preemptions += 1;
    }

    /// The exposition text; `engines` holds each engine's gauges, by its number (a data-parallel
    /// worker's ranks, each labelled `engine` as vLLM labels them; the counters and histograms are
    /// the worker's, as engine 0's).
    pub fn render(&self, engines: &[Gauges], cache: &CacheInfo) -> String {
        let s = self.state.lock();
        let mut out = String::with_capacity(16 * 1024);
        let model = escape(&self.model);
        let base = format!("engine=\"0\",model_name=\"{model}\"");
        let created = go_float(self.created);

        let gauge = |out: &mut String, name: &str, help: &str, v: fn(&Gauges) -> f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (i, g) in engines.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{name}{{engine=\"{i}\",model_name=\"{model}\"}} {}",
                    go_float(v(g))
                );
            }
        };
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name}_total {help}\n# TYPE {name}_total counter"
            );
            let _ = writeln!(out, "{name}_total{{{base}}} {}", go_float(v as f64));
            let _ = writeln!(
                out,
                "# HELP {name}_created {help}\n# TYPE {name}_created gauge"
            );
            let _ = writeln!(out, "{name}_created{{{base}}} {created}");
        };
        let histogram = |out: &mut String, name: &str, help: &str, h: &Histogram| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
            let mut acc = 0;
            for (b, c) in h.bounds.iter().zip(&h.counts) {
                acc += c;
                let _ = writeln!(
                    out,
                    "{name}_bucket{{engine=\"0\",le=\"{}\",model_name=\"{}\"}} {}",
                    go_float(*b),
                    escape(&self.model),
                    go_float(acc as f64)
                );
            }
            let _ = writeln!(
                out,
                "{name}_bucket{{engine=\"0\",le=\"+Inf\",model_name=\"{}\"}} {}",
                escape(&self.model),
                go_float(h.count as f64)
            );
            let _ = writeln!(out, "{name}_count{{{base}}} {}", go_float(h.count as f64));
            let _ = writeln!(out, "{name}_sum{{{base}}} {}", go_float(h.sum));
            let _ = writeln!(
                out,
                "# HELP {name}_created {help}\n# TYPE {name}_created gauge"
            );
            let _ = writeln!(out, "{name}_created{{{base}}} {created}");
        };

        // The Python client's process metric, which vLLM exposes too: a restart changes it.
        let _ = writeln!(
            out,
            "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}",
            go_float(self.created)
        );
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            |g| g.running as f64,
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            |g| g.waiting as f64,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.\n# TYPE vllm:num_requests_waiting_by_reason gauge"
        );
        for (i, g) in engines.iter().enumerate() {
            let labels = format!("engine=\"{i}\",model_name=\"{model}\"");
            let _ = writeln!(
                out,
                "vllm:num_requests_waiting_by_reason{{{labels},reason=\"capacity\"}} {}",
                go_float(g.waiting as f64)
            );
            let _ = writeln!(
                out,
                "vllm:num_requests_waiting_by_reason{{{labels},reason=\"deferred\"}} 0.0"
            );
        }
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            |g| g.kv_cache_usage,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_queries,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_hits,
        );
        counter(
            &mut out,
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.preemptions,
        );
        counter(
            &mut out,
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            s.prompt_tokens,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.\n# TYPE vllm:prompt_tokens_by_source_total counter"
        );
        for (src, v) in [
            ("local_compute", s.prompt_tokens - s.prompt_cached),
            ("local_cache_hit", s.prompt_cached),
            ("external_kv_transfer", 0),
        ] {
            let _ = writeln!(
                out,
                "vllm:prompt_tokens_by_source_total{{{base},source=\"{src}\"}} {}",
                go_float(v as f64)
            );
        }
        counter(
            &mut out,
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            s.prompt_cached,
        );
        counter(
            &mut out,
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            s.generation_tokens,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter"
        );
        for (r, v) in FinishReason::ALL.iter().zip(s.success) {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{engine=\"0\",finished_reason=\"{}\",model_name=\"{}\"}} {}",
                r.as_str(),
                escape(&self.model),
                go_float(v as f64)
            );
        }
        histogram(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &s.ttft,
        );
        histogram(
            &mut out,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &s.itl,
        );
        histogram(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &s.e2e,
        );
        histogram(
            &mut out,
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            &s.queue,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge"
        );
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{block_size=\"{bs}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.92\",kv_cache_size_tokens=\"{tokens}\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{nb}\",num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"sha256\",sliding_window=\"None\",user_specified_block_size=\"True\"}} 1.0",
            bs = cache.block_size,
            nb = cache.num_gpu_blocks,
            tokens = cache.block_size * cache.num_gpu_blocks,
        );
        out
    }
}

/// Label value escaping of the text exposition format.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `prometheus_client.utils.floatToGoString`: Python's `repr`, with `.0` on integers and large values
/// in Go's exponent form (`1.7962316608366878e+09`).
pub fn go_float(d: f64) -> String {
    if d.is_infinite() {
        return if d > 0.0 { "+Inf" } else { "-Inf" }.to_owned();
    }
    if d.is_nan() {
        return "NaN".to_owned();
    }
    let mut s = format!("{d:?}");
    if !s.contains('.') && !s.contains('e') {
        s.push_str(".0");
    }
    if let Some(dot) = s.find('.')
        && d > 0.0
        && dot > 6
        && !s.contains('e')
    {
        let mantissa = format!("{}.{}{}", &s[..1], &s[1..dot], &s[dot + 1..]);
        let mantissa = mantissa.trim_end_matches(['0', '.']);
        return format!("{mantissa}e+0{}", dot - 1);
    }
    s
}
