//! vLLM's Prometheus `/metrics`: the few series that describe a worker's load and cache.
//!
//! Only five series matter: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//! `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` before 0.11), the `block_size` and
//! `num_gpu_blocks` labels of `vllm:cache_config_info`, and `process_start_time_seconds` (it moves
//! when the worker restarts). With several engines (data parallel) counts are summed, usage is the
//! maximum and capacity the minimum (each engine has its own cache: the router plans against the
//! tightest one); each engine's own running, waiting and usage are kept beside the totals
//! ([`VllmLoad::engines`], vLLM's `engine` label is its data-parallel rank), for the ranks to be told
//! apart. The text comes from a worker, so nothing in it may panic or
//! poison a figure: malformed lines, non-finite values, a zero block size and a capacity vLLM has not
//! profiled yet (`num_gpu_blocks="None"`) are skipped. See `docs/vllm-interfaces.md`.

/// The load figures read from one scrape.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VllmLoad {
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    pub kv_usage: Option<f64>,
    pub block_size: Option<u32>,
    /// KV cache capacity in blocks (`num_gpu_blocks`); `None` before vLLM has profiled its memory.
    pub num_gpu_blocks: Option<u32>,
    /// When the serving process started, Unix seconds (`process_start_time_seconds`): a different value
    /// from one scrape to the next means the worker restarted, with an empty cache.
    pub process_start_s: Option<f64>,
    /// Each engine's own figures, by its `engine` label, lowest first: the ranks of a data-parallel
    /// worker (engines numbered [`MAX_ENGINES`] or above are in the totals only).
    pub engines: Vec<EngineLoad>,
}

/// Engines told apart at most: labels from 0 to this, exclusive (as many ranks as the agent follows).
pub const MAX_ENGINES: u32 = 256;

/// One engine's load: the figures of the samples labelled with its `engine`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    /// The `engine` label (vLLM's data-parallel rank).
    pub engine: u32,
    pub running: f64,
    pub waiting: f64,
    pub kv_usage: f64,
}

/// Parses the Prometheus text exposition format, keeping only the series above. Malformed lines are
/// skipped: one odd line from a newer vLLM must not blind the router.
pub fn parse(text: &str) -> VllmLoad {
    let mut load = VllmLoad::default();
    let mut engines = std::collections::BTreeMap::<u32, EngineLoad>::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some(sample) = parse_line(line) else {
            continue;
        };
        // NaN and infinities are valid exposition values but no load figure: they would poison scores.
        if !sample.value.is_finite() {
            continue;
        }
        let add = |slot: &mut Option<f64>, v: f64| *slot = Some(slot.unwrap_or(0.0) + v);
        let engine = sample
            .label("engine")
            .and_then(|e| e.parse::<u32>().ok())
            .filter(|&e| e < MAX_ENGINES);
        let mut of_engine = |set: fn(&mut EngineLoad, f64)| {
            if let Some(e) = engine {
                let entry = engines.entry(e).or_insert(EngineLoad {
                    engine: e,
                    ..EngineLoad::default()
                });
                set(entry, sample.value);
            }
        };
        match sample.name {
            "vllm:num_requests_running" => of_engine(|e, v| e.running += v),
            "vllm:num_requests_waiting" => of_engine(|e, v| e.waiting += v),
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                of_engine(|e, v| e.kv_usage = e.kv_usage.max(v))
            }
            _ => {}
        }
        match sample.name {
            "vllm:num_requests_running" => add(&mut load.running, sample.value),
            "vllm:num_requests_waiting" => add(&mut load.waiting, sample.value),
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                load.kv_usage = Some(load.kv_usage.map_or(sample.value, |u| u.max(sample.value)))
            }
            // The latest start among several processes: any restart moves it.
            "process_start_time_seconds" if sample.value > 0.0 => {
                load.process_start_s = Some(
                    load.process_start_s
                        .map_or(sample.value, |t| t.max(sample.value)),
                )
            }
            "vllm:cache_config_info" => {
                // 0 would mean "unknown" downstream; a worker reporting it tells us nothing.
                if let Some(bs) = sample
                    .label("block_size")
                    .and_then(|v| v.parse().ok())
                    .filter(|&bs: &u32| bs > 0)
                {
                    load.block_size = Some(bs);
                }
                // "None" until the engine has profiled its memory; 0 would be no cache at all.
                if let Some(blocks) = sample
                    .label("num_gpu_blocks")
                    .and_then(|v| v.parse().ok())
                    .filter(|&blocks: &u32| blocks > 0)
                {
                    load.num_gpu_blocks =
                        Some(load.num_gpu_blocks.map_or(blocks, |b| b.min(blocks)));
                }
            }
            _ => {}
        }
    }
    // Sums of huge finite values can still overflow.
    for v in [&mut load.running, &mut load.waiting] {
        *v = v.filter(|x| x.is_finite());
    }
    load.engines = engines
        .into_values()
        .filter(|e| e.running.is_finite() && e.waiting.is_finite())
        .collect();
    load
}

struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, String)>,
    value: f64,
}

impl Sample<'_> {
    fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

fn parse_line(line: &str) -> Option<Sample<'_>> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if rest.starts_with('{') {
        let (parsed, after) = parse_labels(&rest[1..])?;
        labels = parsed;
        rest = after;
    }
    // The value, then an optional timestamp.
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "NaN" => f64::NAN,
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Parses `k="v",k2="v2"}` (after the opening brace), with `\\`, `\"` and `\n` escapes.
fn parse_labels(s: &str) -> Option<(Vec<(&str, String)>, &str)> {
    let mut labels = Vec::new();
    let mut rest = s;
    loop {
        rest = rest.trim_start_matches([' ', ',']);
        if let Some(after) = rest.strip_prefix('}') {
            return Some((labels, after));
        }
        let eq = rest.find('=')?;
        let key = rest[..eq].trim();
        rest = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        };
        labels.push((key, value));
        rest = &rest[end + 1..];
    }
}

#[cfg(test)]
mod tests;
