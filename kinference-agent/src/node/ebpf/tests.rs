use super::*;

#[test]
fn worker_urls_give_ports() {
    assert_eq!(port_of("http://127.0.0.1:8001"), Some(8001));
    assert_eq!(port_of("http://127.0.0.1:8001/v1"), Some(8001));
    assert_eq!(port_of("http://[::1]:9000/"), Some(9000));
    assert_eq!(port_of("http://user@host:7000"), Some(7000));
    assert_eq!(port_of("http://worker.local"), Some(80));
    assert_eq!(port_of("https://worker.local/x"), Some(443));
    assert_eq!(port_of("127.0.0.1:8001"), None);
    assert_eq!(port_of("http://host:notaport"), None);
}

#[test]
fn worker_urls_give_endpoints() {
    let key = |url| watch_key(url).map(|k| (k.addr, k.port));
    // Loopback, unspecified, names and IPv6 match any local address; a pod IP matches only itself.
    assert_eq!(key("http://127.0.0.1:8001"), Some((0, 8001)));
    assert_eq!(key("http://0.0.0.0:8001"), Some((0, 8001)));
    assert_eq!(key("http://worker-0.svc:8000/v1"), Some((0, 8000)));
    assert_eq!(key("http://[fd00::1]:8000"), Some((0, 8000)));
    assert_eq!(
        key("http://10.1.2.3:8000"),
        Some((u32::from_ne_bytes([10, 1, 2, 3]), 8000))
    );
    assert_eq!(key("10.1.2.3:8000"), None);
}

#[test]
fn median_and_events() {
    let ms = Duration::from_millis;
    assert_eq!(median([ms(3), ms(1), ms(2)].into_iter()), Some(ms(2)));
    assert_eq!(
        median([ms(4), ms(1), ms(3), ms(2)].into_iter()),
        Some(ms(3))
    );
    assert_eq!(median(std::iter::empty()), None);

    let event = common::Event {
        ts_ns: 1,
        value_ns: 2,
        read_delay_ns: 3,
        kind: 4,
        addr: 6,
        port: 5,
        _pad: 0,
        _pad2: 0,
    };
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&1u64.to_ne_bytes());
    bytes.extend_from_slice(&2u64.to_ne_bytes());
    bytes.extend_from_slice(&3u64.to_ne_bytes());
    bytes.extend_from_slice(&4u32.to_ne_bytes());
    bytes.extend_from_slice(&6u32.to_ne_bytes());
    bytes.extend_from_slice(&5u16.to_ne_bytes());
    bytes.extend_from_slice(&0u16.to_ne_bytes());
    bytes.extend_from_slice(&0u32.to_ne_bytes());
    assert_eq!(bytes.len(), std::mem::size_of::<common::Event>());
    assert_eq!(decode_event(&bytes), Some(event));
    assert_eq!(decode_event(&bytes[..20]), None);
}

#[test]
fn ttfb_p50_in_microseconds() {
    let view = KernelView {
        ttfb_p50: Some(Duration::from_millis(12)),
        ..KernelView::default()
    };
    assert_eq!(view.ttfb_p50_us(), 12_000);
    assert_eq!(KernelView::default().ttfb_p50_us(), 0);
}

#[test]
fn disabled_reports_every_program_and_exports_the_state() {
    let monitor = KernelMonitor::start(EbpfOptions {
        disabled: true,
        ..EbpfOptions::default()
    });
    let status = monitor.status();
    assert!(!status.active);
    assert!(
        status
            .reason
            .as_deref()
            .is_some_and(|r| r.contains(ENV_DISABLE))
    );
    assert_eq!(status.programs.len(), PROGRAMS.len());
    assert!(
        status
            .programs
            .iter()
            .all(|p| p.state == ProgramState::Disabled)
    );
    assert!(monitor.watch("http://127.0.0.1:8001"));
    assert!(!monitor.watch("not a url"));
    assert_eq!(monitor.view("http://127.0.0.1:8001"), None);

    let mut registry = Registry::default();
    monitor.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
    assert!(
        text.contains(
            r#"kinference_agent_ebpf_program_state{program="inet_sock_set_state",state="disabled"} 1"#
        ),
        "{text}"
    );
    assert!(
        text.contains(
            r#"kinference_agent_ebpf_program_state{program="inet_sock_set_state",state="attached"} 0"#
        ),
        "{text}"
    );
}

#[test]
fn a_missing_object_or_btf_is_a_reason_not_a_failure() {
    let monitor = KernelMonitor::start(EbpfOptions {
        object_path: Some(PathBuf::from("/nonexistent/kinference.bpf.o")),
        ..EbpfOptions::default()
    });
    assert!(!monitor.active());
    let reason = monitor.status().reason.clone().unwrap_or_default();
    assert!(reason.contains("/nonexistent/kinference.bpf.o"), "{reason}");
    assert!(
        monitor
            .status()
            .programs
            .iter()
            .all(|p| p.state == ProgramState::LoadFailed)
    );

    if embedded_object().is_none() {
        let monitor = KernelMonitor::start(EbpfOptions::default());
        assert!(
            monitor
                .status()
                .programs
                .iter()
                .all(|p| p.state == ProgramState::NotBuilt)
        );
    }
}
