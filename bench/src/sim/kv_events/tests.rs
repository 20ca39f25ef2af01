use super::*;

#[test]
fn bind_or_connect_follows_vllm() {
    assert!(binds("tcp://*:5557"));
    assert!(binds("tcp://[::]:5557"));
    assert!(binds("ipc:///tmp/kv"));
    assert!(!binds("tcp://127.0.0.1:25557"));
    assert_eq!(
        normalize("tcp://*:5557").expect("tcp"),
        "tcp://0.0.0.0:5557"
    );
    assert_eq!(
        normalize("tcp://127.0.0.1:*").expect("tcp"),
        "tcp://127.0.0.1:0"
    );
    assert!(normalize("inproc://x").is_err());
}

#[test]
fn big_hashes_are_uint64_and_batch_is_3_array() {
    let ev = KvCacheEvent::BlockRemoved {
        block_hashes: vec![u64::MAX - 1],
    };
    let b = encode_batch(1.5, &[ev], 0, EventFormat::Map);
    assert_eq!(b[0], 0x93, "fixarray(3)");
    assert_eq!(b[1], 0xcb, "float64 ts");
    assert_eq!(b[10], 0x91, "one event");
    assert_eq!(b[11], 0x84, "fixmap(4)");
    let pos = b.iter().position(|&x| x == 0xcf).expect("uint64 marker");
    assert_eq!(&b[pos + 1..pos + 9], &(u64::MAX - 1).to_be_bytes());
    assert_eq!(*b.last().expect("rank"), 0x00, "dp rank 0");
}

#[test]
fn array_format_is_positional_with_trailing_nils() {
    let ev = KvCacheEvent::BlockStored {
        block_hashes: vec![1],
        parent_block_hash: None,
        token_ids: vec![5, 6],
        block_size: 2,
        lora: None,
        salt: None,
    };
    let b = encode_batch(0.0, &[ev], 0, EventFormat::Array);
    let v = rmpv::decode::read_value(&mut &b[..]).expect("msgpack");
    let event = &v[1][0];
    let fields = event.as_array().expect("array event");
    assert_eq!(fields.len(), 12);
    assert_eq!(fields[0].as_str(), Some("BlockStored"));
    assert!(fields[2].is_nil());
    assert_eq!(fields[6].as_str(), Some("GPU"));
    assert!(fields[11].is_nil());
}

#[test]
fn an_adapters_blocks_carry_its_name_as_vllm_publishes_them() {
    let lora = std::sync::Arc::new(crate::sim::cache::LoraAdapter::new("sql-lora", 1));
    let ev = KvCacheEvent::BlockStored {
        block_hashes: vec![1, 2],
        parent_block_hash: None,
        token_ids: vec![5, 6, 7, 8],
        block_size: 2,
        lora: Some(lora),
        salt: None,
    };
    let b = encode_batch(0.0, &[ev], 0, EventFormat::Map);
    let v = rmpv::decode::read_value(&mut &b[..]).expect("msgpack");
    let event = v[1][0].as_map().expect("map event");
    let field = |name: &str| {
        event
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no {name}"))
    };
    assert_eq!(field("lora_name").as_str(), Some("sql-lora"));
    assert_eq!(field("lora_id").as_i64(), Some(1));
    // One untagged tuple per block holding the adapter's name (vLLM's `to_event_extra_keys`).
    let extra = field("extra_keys");
    let extra = extra.as_array().expect("extra_keys");
    assert_eq!(extra.len(), 2);
    assert!(
        extra
            .iter()
            .all(|k| k.as_array().map(|a| a[0].as_str()) == Some(Some("sql-lora")))
    );
}

/// vLLM's publisher (libzmq) dials a subscriber that is not bound yet every 100 ms, so a worker started
/// long before its agent reaches it as soon as it binds. With the `zeromq` crate's doubling wait, a
/// subscriber bound 4 s after the first dial would be reached only at about 6.4 s.
#[tokio::test]
async fn a_connect_mode_publisher_reaches_a_late_subscriber_at_once() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let dial = tokio::spawn({
        let endpoint = endpoint.clone();
        async move {
            let _socket = connect_until_bound(&endpoint).await;
            std::time::Instant::now()
        }
    });
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut sub = zeromq::SubSocket::new();
    sub.bind(&endpoint).await.expect("bind the subscriber");
    let bound = std::time::Instant::now();
    let connected = tokio::time::timeout(Duration::from_secs(10), dial)
        .await
        .expect("the publisher connects")
        .expect("the dial task");
    let after = connected.saturating_duration_since(bound);
    assert!(
        after < Duration::from_millis(1500),
        "connected {after:?} after the subscriber bound"
    );
}
