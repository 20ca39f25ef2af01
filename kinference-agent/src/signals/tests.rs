use std::path::Path;
use std::time::Duration;

use super::*;
use crate::config::WorkerSpec;

fn spec(url: &str) -> WorkerSpec {
    WorkerSpec {
        url: url.into(),
        model: "m".into(),
        kv_events_endpoint: None,
        kv_events_bind: true,
        kv_replay_endpoint: None,
        kv_topic: None,
        role: None,
        data_parallel_size: None,
    }
}

#[test]
fn figures_carry_the_backlog_peak_and_the_ttfb_median() {
    let view = KernelView {
        in_flight: 5,
        idle_gap: Duration::from_millis(250),
        waiting: 2,
        waits_for_body: true,
        accept_backlog: 1,
        accept_backlog_peak: 7,
        accept_backlog_max: 4096,
        ttfb_p50: Some(Duration::from_micros(1500)),
        ..KernelView::default()
    };
    assert_eq!(
        kernel_figures(&view),
        KernelFigures {
            in_flight: 5,
            idle_gap_ms: 250,
            waiting: 2,
            waits_for_body: true,
            accept_backlog: 7,
            accept_backlog_max: 4096,
            ttfb_p50_us: 1500,
        }
    );
}

#[tokio::test]
async fn without_nvml_the_node_state_says_why() {
    let gpu = Arc::new(GpuMonitor::start_with_library(Path::new(
        "/nonexistent/libnvidia-ml.so.1",
    )));
    let registry = Arc::new(Registry::default());
    registry.upsert(spec("http://127.0.0.1:8001"), 16);
    let cancel = CancellationToken::new();
    let task = tokio::spawn(run_gpu(
        gpu,
        Arc::clone(&registry),
        Duration::from_millis(10),
        cancel.clone(),
    ));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let state = loop {
        if let (v, Some(state)) = registry.node_state() {
            assert_eq!(v, 1, "the first sample sets version 1");
            break state;
        }
        assert!(std::time::Instant::now() < deadline, "no node state");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(state.gpus.is_empty());
    assert!(
        state.gpu_unavailable_reason.contains("NVML"),
        "{}",
        state.gpu_unavailable_reason
    );
    // Later samples are identical: the version (and so the stream) does not move.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(registry.node_state().0, 1);
    cancel.cancel();
    let _ = task.await;
}

#[tokio::test]
async fn disabled_ebpf_leaves_loads_without_kernel_figures() {
    let signals = NodeSignals {
        kernel: Arc::new(KernelMonitor::start(EbpfOptions {
            disabled: true,
            ..EbpfOptions::default()
        })),
        gpu: Arc::new(GpuMonitor::start_with_library(Path::new("/nonexistent"))),
    };
    let registry = Arc::new(Registry::default());
    let slot = registry.upsert(spec("http://127.0.0.1:8001"), 16);
    signals.watch(&slot.spec.url);
    // Returns at once: nothing to copy.
    tokio::time::timeout(
        Duration::from_secs(2),
        run_kernel(
            Arc::clone(&signals.kernel),
            Arc::clone(&registry),
            Duration::from_millis(5),
            CancellationToken::new(),
        ),
    )
    .await
    .expect("run_kernel returns when eBPF is off");
    assert_eq!(slot.load.lock().kernel, None);
    let described = signals.describe();
    assert!(
        described.contains("ebpf: off (disabled by KINFERENCE_DISABLE_EBPF)"),
        "{described}"
    );
    assert!(described.contains("gpu: unavailable"), "{described}");
}
