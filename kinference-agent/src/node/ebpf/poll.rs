//! The poller: every `poll_interval` it applies watch and unwatch commands, drains the ring buffer of
//! samples, counts each watched port's connections by phase, and publishes a [`KernelView`] per worker
//! and the node metrics.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kinference_ebpf_common as common;

use super::load::Loaded;
use super::metrics::WorkerLabels;
use super::{Command, EbpfOptions, KernelView, Shared};

/// Per-port state the poller keeps between reads.
struct PortTrack {
    worker: String,
    ttfb: VecDeque<(Instant, Duration)>,
    accept_wait: VecDeque<(Instant, Duration)>,
}

/// Decodes one ring buffer record ([`common::Event`], native byte order).
pub fn decode_event(bytes: &[u8]) -> Option<common::Event> {
    let u64_at = |o: usize| {
        bytes
            .get(o..o + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_ne_bytes)
    };
    let u32_at = |o: usize| {
        bytes
            .get(o..o + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_ne_bytes)
    };
    let u16_at = |o: usize| {
        bytes
            .get(o..o + 2)
            .and_then(|b| b.try_into().ok())
            .map(u16::from_ne_bytes)
    };
    Some(common::Event {
        ts_ns: u64_at(0)?,
        value_ns: u64_at(8)?,
        read_delay_ns: u64_at(16)?,
        kind: u32_at(24)?,
        addr: u32_at(28)?,
        port: u16_at(32)?,
        _pad: 0,
        _pad2: 0,
    })
}

/// The median of `samples` (the upper one of the two middle values for an even count).
pub fn median(samples: impl Iterator<Item = Duration>) -> Option<Duration> {
    let mut v: Vec<Duration> = samples.collect();
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    Some(v[v.len() / 2])
}

fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_nsec as u64)
}

pub(super) fn run_poller(mut loaded: Loaded, options: &EbpfOptions, shared: &Shared) {
    let mut tracks: HashMap<common::WatchKey, PortTrack> = HashMap::new();
    while !shared.stop.load(Ordering::Relaxed) {
        apply_commands(&mut loaded, &mut tracks, shared);
        poll_once(&mut loaded, &mut tracks, options, shared);
        std::thread::sleep(options.poll_interval);
    }
}

fn apply_commands(
    loaded: &mut Loaded,
    tracks: &mut HashMap<common::WatchKey, PortTrack>,
    shared: &Shared,
) {
    let commands = std::mem::take(&mut *shared.commands.lock());
    for command in commands {
        match command {
            Command::Watch(key, worker) => {
                if let Some(track) = tracks.get_mut(&key) {
                    track.worker = worker;
                    continue;
                }
                if let Err(e) = loaded.ports.insert(key, common::PortStats::default(), 0) {
                    tracing::warn!(port = key.port, %worker, error = %e, "eBPF: cannot watch worker");
                    continue;
                }
                tracing::info!(port = key.port, %worker, "eBPF: watching worker");
                tracks.insert(
                    key,
                    PortTrack {
                        worker,
                        ttfb: VecDeque::new(),
                        accept_wait: VecDeque::new(),
                    },
                );
            }
            Command::Unwatch(key) => {
                let _ = loaded.ports.remove(&key);
                let _ = loaded.backlog.remove(&key);
                if let Some(track) = tracks.remove(&key) {
                    shared.metrics.forget(&track.worker);
                }
                shared.views.lock().remove(&key);
            }
        }
    }
}

fn poll_once(
    loaded: &mut Loaded,
    tracks: &mut HashMap<common::WatchKey, PortTrack>,
    options: &EbpfOptions,
    shared: &Shared,
) {
    let now = Instant::now();
    let metrics = &shared.metrics;
    while let Some(item) = loaded.events.next() {
        let Some(event) = decode_event(&item) else {
            continue;
        };
        let key = common::WatchKey {
            addr: event.addr,
            port: event.port,
            _pad: 0,
        };
        let Some(track) = tracks.get_mut(&key) else {
            continue;
        };
        let value = Duration::from_nanos(event.value_ns);
        let labels = WorkerLabels {
            worker: track.worker.clone(),
        };
        let window = match event.kind {
            common::EVENT_TTFB => {
                metrics
                    .ttfb
                    .get_or_create(&labels)
                    .observe(value.as_secs_f64());
                &mut track.ttfb
            }
            common::EVENT_ACCEPT_WAIT => {
                metrics
                    .accept_wait
                    .get_or_create(&labels)
                    .observe(value.as_secs_f64());
                &mut track.accept_wait
            }
            _ => continue,
        };
        window.push_back((now, value));
        while window.len() > options.window_samples {
            window.pop_front();
        }
    }
    if let Some(logger) = loaded.logger.as_mut() {
        logger.flush();
    }

    // Per port: requests waiting for their first response byte, and responses still being sent.
    let now_ns = monotonic_ns();
    let gap_ns = u64::try_from(options.idle_gap.as_nanos()).unwrap_or(u64::MAX);
    let mut counts: HashMap<common::WatchKey, (u32, u32, u32)> = HashMap::new();
    for entry in loaded.conns.iter() {
        let Ok((_, conn)) = entry else { continue };
        let key = common::WatchKey {
            addr: conn.addr,
            port: conn.port,
            _pad: 0,
        };
        let c = counts.entry(key).or_default();
        c.2 += 1;
        match conn.phase {
            common::PHASE_WAITING | common::PHASE_HEADERS => c.0 += 1,
            common::PHASE_RESPONDING if now_ns.saturating_sub(conn.last_send_ns) < gap_ns => {
                c.1 += 1
            }
            _ => {}
        }
    }

    let mut views = HashMap::with_capacity(tracks.len());
    for (&key, track) in tracks.iter_mut() {
        for window in [&mut track.ttfb, &mut track.accept_wait] {
            while window
                .front()
                .is_some_and(|(at, _)| now.duration_since(*at) > options.window)
            {
                window.pop_front();
            }
        }
        let (waiting, responding, connections) = counts.get(&key).copied().unwrap_or_default();
        let stats = loaded.ports.get(&key, 0).unwrap_or_default();
        let backlog = loaded.backlog.get(&key, 0).ok();
        if let Some(b) = backlog
            && b.peak != b.current
        {
            // Reset the peak so the next read shows the peak of the next interval.
            let _ = loaded.backlog.insert(
                key,
                common::Backlog {
                    peak: b.current,
                    ..b
                },
                0,
            );
        }
        let backlog = backlog.unwrap_or_default();
        let view = KernelView {
            in_flight: waiting + responding,
            idle_gap: options.idle_gap,
            waiting,
            waits_for_body: loaded.waits_for_body,
            connections,
            accept_backlog: backlog.current,
            accept_backlog_max: backlog.max,
            accept_backlog_peak: backlog.peak,
            ttfb_p50: median(track.ttfb.iter().map(|(_, d)| *d)),
            ttfb_recent: track.ttfb.iter().map(|(_, d)| *d).collect(),
            accept_wait_p50: median(track.accept_wait.iter().map(|(_, d)| *d)),
            requests_total: stats.requests,
            responses_total: stats.responses,
            dropped_samples: stats.dropped_events,
        };
        let labels = WorkerLabels {
            worker: track.worker.clone(),
        };
        metrics
            .in_flight
            .get_or_create(&labels)
            .set(i64::from(view.in_flight));
        metrics
            .waiting
            .get_or_create(&labels)
            .set(i64::from(view.waiting));
        metrics
            .accept_backlog
            .get_or_create(&labels)
            .set(i64::from(view.accept_backlog));
        metrics
            .accept_backlog_max
            .get_or_create(&labels)
            .set(i64::from(view.accept_backlog_max));
        views.insert(key, (track.worker.clone(), view));
    }
    *shared.views.lock() = views;
}
