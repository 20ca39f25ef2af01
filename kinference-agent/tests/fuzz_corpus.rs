//! Replays every saved fuzz input (`fuzz/corpus/<target>/`) through the same entry points the fuzz
//! targets call ([`kinference_agent::untrusted`]), in the normal `cargo test`: a crash a fuzzer once
//! found, minimised and saved there, stays fixed.
//!
//! The seeds were made from the real vLLM 0.32 captures in `bench/fixtures/vllm-0.32/` and from the bytes
//! a real `zeromq` PUB socket sends, by `write_seed_corpus` below (run by hand:
//! `cargo test -p kinference-agent --test fuzz_corpus -- --ignored write_seed_corpus`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use kinference_agent::kv_events::encode::{EncodeOptions, EventFormat, encode_batch};
use kinference_agent::kv_events::{ExtraKey, KvEvent, Lora, decode_batch};
use kinference_agent::untrusted::{self, TARGETS, join_frames};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus")
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/fixtures/vllm-0.32")
}

#[test]
fn every_saved_fuzz_input_replays_without_a_panic() {
    testkit::replay_corpus(&corpus_dir(), &TARGETS, 5, untrusted::run);
}

/// The seeds must exercise the parsers' success paths, not only their rejections.
#[test]
fn the_seed_corpus_holds_real_valid_inputs() {
    let read = |target: &str, name: &str| {
        std::fs::read(corpus_dir().join(target).join(name))
            .unwrap_or_else(|e| panic!("{target}/{name}: {e}"))
    };
    let batch = decode_batch(&read("kv_batch", "run2-10-map")).expect("a real vLLM batch decodes");
    assert_eq!(batch.events.len(), 3);
    for name in ["run1-0-lora-map", "run1-0-lora-array"] {
        let batch = decode_batch(&read("kv_batch", name)).expect("a LoRA batch decodes");
        assert!(
            matches!(&batch.events[0], KvEvent::BlockStored { lora: Some(Lora::Name(n)), extra_keys, .. }
                if n == "sql-lora" && extra_keys.len() == 3),
            "{name}: {:?}",
            batch.events[0]
        );
    }
    let stream = read("zmtp_stream", "zeromq-pub-3-messages");
    let progress = kinference_agent::zmq_guard::Inspector::new(Default::default())
        .feed(&stream)
        .expect("a real zeromq PUB stream passes the guard");
    assert!(progress.handshake_done);
    assert_eq!(progress.messages, 3);
}

/// A vLLM capture line's payload: its JSON `batch` back to msgpack, as vLLM's msgspec writes it. Map keys
/// keep the order they have in the capture's text (`line`), which is vLLM's field order.
fn json_to_msgpack(v: &serde_json::Value, line: &str) -> rmpv::Value {
    use serde_json::Value as J;
    match v {
        J::Null => rmpv::Value::Nil,
        J::Bool(b) => rmpv::Value::Boolean(*b),
        J::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => rmpv::Value::from(u),
            (None, Some(i)) => rmpv::Value::from(i),
            _ => rmpv::Value::F64(n.as_f64().expect("a number")),
        },
        J::String(s) => rmpv::Value::from(s.as_str()),
        J::Array(a) => rmpv::Value::Array(a.iter().map(|v| json_to_msgpack(v, line)).collect()),
        J::Object(o) => match o.get("__bytes__").and_then(|b| b.as_str()) {
            Some(hex) => rmpv::Value::Binary(
                (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                    .collect(),
            ),
            None => {
                let mut fields: Vec<_> = o.iter().collect();
                fields.sort_by_key(|(k, _)| line.find(&format!("\"{k}\":")));
                rmpv::Value::Map(
                    fields
                        .into_iter()
                        .map(|(k, v)| (rmpv::Value::from(k.as_str()), json_to_msgpack(v, line)))
                        .collect(),
                )
            }
        },
    }
}

/// `(file, line) -> (topic, seq, payload)` for every captured message.
fn captured() -> Vec<(String, usize, String, u64, Vec<u8>)> {
    let mut out = Vec::new();
    for file in ["events-run1.jsonl", "events-run2.jsonl"] {
        let text = std::fs::read_to_string(fixtures().join(file)).expect("fixture");
        for (i, line) in text.lines().enumerate() {
            let v: serde_json::Value = serde_json::from_str(line).expect("json line");
            let mut payload = Vec::new();
            rmpv::encode::write_value(&mut payload, &json_to_msgpack(&v["batch"], line))
                .expect("encode");
            // The re-encoding matches vLLM's bytes in size and head (the events' order and encoding).
            assert_eq!(
                payload.len() as u64,
                v["payload_len"].as_u64().expect("len"),
                "{file}:{i}"
            );
            // Bytes 2..10 hold the timestamp, which serde_json may parse one ulp off.
            let hex = |b: &[u8]| b.iter().map(|b| format!("{b:02x}")).collect::<String>();
            let want = v["payload_head_hex"].as_str().expect("head");
            assert_eq!(hex(&payload[..2]), want[..4], "{file}:{i}");
            assert_eq!(hex(&payload[10..16]), want[20..32], "{file}:{i}");
            let run = file
                .trim_start_matches("events-")
                .trim_end_matches(".jsonl");
            out.push((
                run.to_string(),
                i,
                v["topic"].as_str().expect("topic").to_string(),
                v["seq"].as_u64().expect("seq"),
                payload,
            ));
        }
    }
    out
}

fn greeting(mechanism: &str, major: u8, minor: u8) -> Vec<u8> {
    let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, major, minor];
    let mut mech = mechanism.as_bytes().to_vec();
    mech.resize(20, 0);
    g.extend(mech);
    g.push(0);
    g.extend([0u8; 31]);
    g
}

fn ready(ty: &str) -> Vec<u8> {
    let mut body = vec![5];
    body.extend(b"READY");
    body.push(11);
    body.extend(b"Socket-Type");
    body.extend((ty.len() as u32).to_be_bytes());
    body.extend(ty.as_bytes());
    let mut f = vec![0x04, body.len() as u8];
    f.extend(body);
    f
}

fn frame(more: bool, body: &[u8]) -> Vec<u8> {
    let mut f = if body.len() > 255 {
        let mut f = vec![0x02 | u8::from(more)];
        f.extend((body.len() as u64).to_be_bytes());
        f
    } else {
        vec![u8::from(more), body.len() as u8]
    };
    f.extend(body);
    f
}

/// The exact bytes a real `zeromq` PUB sends to a subscriber while publishing `messages`.
async fn capture_pub_stream(messages: &[Vec<Bytes>]) -> Vec<u8> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let messages = messages.to_vec();
    let publisher = tokio::spawn(async move {
        let mut pubs = PubSocket::new();
        pubs.connect(&format!("tcp://{addr}"))
            .await
            .expect("PUB connects");
        // Until the subscription has arrived a PUB drops messages: give it a moment.
        tokio::time::sleep(Duration::from_millis(300)).await;
        for m in messages {
            pubs.send(ZmqMessage::try_from(m).expect("frames"))
                .await
                .expect("send");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    });
    let (mut s, _) = listener.accept().await.expect("accept");
    let mut ours = greeting("NULL", 3, 0);
    ours.extend(ready("SUB"));
    ours.extend(frame(false, &[1]));
    s.write_all(&ours).await.expect("write");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await {
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    publisher.await.expect("publisher");
    got
}

#[tokio::test]
#[ignore = "writes fuzz/corpus/; run by hand after changing a parser's input format"]
async fn write_seed_corpus() {
    let write = |target: &str, name: &str, data: &[u8]| {
        let dir = corpus_dir().join(target);
        std::fs::create_dir_all(&dir).expect("corpus dir");
        std::fs::write(dir.join(name), data).expect("write seed");
    };
    let msgs = captured();
    let by = |run: &str, i: usize| {
        msgs.iter()
            .find(|m| m.0 == run && m.1 == i)
            .expect("captured message")
    };

    // kv_batch: vLLM's own bytes (map format), the array format of <= 0.23, and byte-string hashes.
    let raw = [
        ("run1", 0),
        ("run1", 1),
        ("run2", 2),
        ("run2", 3),
        ("run2", 5),
        ("run2", 6),
        ("run2", 10),
        ("run2", 11),
        ("run2", 21),
        ("run2", 23),
    ];
    for (run, i) in raw {
        write("kv_batch", &format!("{run}-{i}-map"), &by(run, i).4);
    }
    for (run, i, format, bin_hashes) in [
        ("run1", 0, EventFormat::Array, false),
        ("run2", 2, EventFormat::Array, false),
        ("run2", 5, EventFormat::Array, false),
        ("run2", 11, EventFormat::Array, false),
        ("run2", 21, EventFormat::Array, false),
        ("run2", 3, EventFormat::Map, true),
        ("run2", 10, EventFormat::Array, true),
    ] {
        let batch = decode_batch(&by(run, i).4).expect("fixture decodes");
        let name = format!(
            "{run}-{i}-{}{}",
            if format == EventFormat::Array {
                "array"
            } else {
                "map"
            },
            if bin_hashes { "-bin" } else { "" }
        );
        write(
            "kv_batch",
            &name,
            &encode_batch(&batch, EncodeOptions { format, bin_hashes }),
        );
    }
    // The first capture as a LoRA request sends it: the adapter's name, and per block the name as an
    // extra key, the second block with a multimodal `(identifier, offset)` key too.
    let mut batch = decode_batch(&by("run1", 0).4).expect("fixture decodes");
    if let Some(KvEvent::BlockStored {
        lora,
        extra_keys,
        block_hashes,
        ..
    }) = batch.events.first_mut()
    {
        let name = ExtraKey::Str("sql-lora".into());
        *lora = Some(Lora::Name("sql-lora".into()));
        *extra_keys = vec![vec![name]; block_hashes.len()];
        let image = [&[0x92, 0xa8][..], b"img-7f3a", &[0x0c]].concat();
        extra_keys[1].push(ExtraKey::Raw(image));
    }
    for format in [EventFormat::Map, EventFormat::Array] {
        let name = format!("run1-0-lora-{}", format!("{format:?}").to_lowercase());
        let options = EncodeOptions {
            format,
            bin_hashes: false,
        };
        write("kv_batch", &name, &encode_batch(&batch, options));
    }

    // zmtp_stream: a real zeromq PUB's bytes, cut short, and hostile variants.
    let three: Vec<Vec<Bytes>> = [("run2", 5), ("run2", 11), ("run1", 1)]
        .iter()
        .map(|&(run, i)| {
            let m = by(run, i);
            vec![
                Bytes::from(m.2.clone()),
                Bytes::copy_from_slice(&m.3.to_be_bytes()),
                Bytes::from(m.4.clone()),
            ]
        })
        .collect();
    let real = capture_pub_stream(&three).await;
    let seen = kinference_agent::zmq_guard::Inspector::new(Default::default()).feed(&real);
    assert_eq!(
        seen.map(|p| p.messages),
        Ok(3),
        "captured {} bytes",
        real.len()
    );
    write("zmtp_stream", "zeromq-pub-3-messages", &real);
    write("zmtp_stream", "zeromq-pub-cut-11", &real[..11]);
    write("zmtp_stream", "zeromq-pub-cut-greeting", &real[..64]);
    let mut router = greeting("NULL", 3, 1);
    router.extend(ready("ROUTER"));
    router.extend([0x04, 7, 4]);
    router.extend(b"PING\0\x0a");
    for f in [&b""[..], b"kv@pod-a@tiny", &5u64.to_be_bytes()] {
        router.extend(frame(true, f));
    }
    router.extend(frame(false, &by("run2", 5).4));
    router.extend(frame(true, b""));
    router.extend(frame(true, b""));
    router.extend(frame(true, &[0xff; 8]));
    router.extend(frame(false, b""));
    write("zmtp_stream", "router-replay-zmtp31", &router);
    let mut giant = greeting("NULL", 3, 0);
    giant.extend(ready("PUB"));
    giant.push(0x02);
    giant.extend((1u64 << 40).to_be_bytes());
    write("zmtp_stream", "giant-frame", &giant);
    write("zmtp_stream", "curve", &greeting("CURVE", 3, 0));
    write("zmtp_stream", "zmtp2", &greeting("NULL", 2, 0));
    let mut early = greeting("NULL", 3, 0);
    early.extend(frame(false, b"hello"));
    write("zmtp_stream", "message-before-ready", &early);
    write("zmtp_stream", "http", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");

    // zmq_frames: live messages and replay replies of both vLLM shapes.
    for (run, i) in [("run2", 5), ("run2", 11), ("run1", 1), ("run2", 3)] {
        let (_, _, topic, seq, payload) = by(run, i);
        let seq = seq.to_be_bytes();
        write(
            "zmq_frames",
            &format!("live-{run}-{i}"),
            &join_frames(&[topic.as_bytes(), &seq, payload]),
        );
        write(
            "zmq_frames",
            &format!("replay-v025-{run}-{i}"),
            &join_frames(&[b"", &seq, payload]),
        );
        write(
            "zmq_frames",
            &format!("replay-v026-{run}-{i}"),
            &join_frames(&[b"", topic.as_bytes(), &seq, payload]),
        );
    }
    write(
        "zmq_frames",
        "end-v025",
        &join_frames(&[b"", &[0xff; 8], b""]),
    );
    write(
        "zmq_frames",
        "end-v026",
        &join_frames(&[b"", b"", &[0xff; 8], b""]),
    );

    // vllm_metrics: the real scrape, whole and in pieces around the series the agent reads.
    let text = std::fs::read_to_string(fixtures().join("metrics-run1.txt")).expect("fixture");
    write("vllm_metrics", "vllm-0.32-full", text.as_bytes());
    let lines: Vec<&str> = text.lines().collect();
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:prompt_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
    ] {
        let Some(at) = lines.iter().position(|l| l.contains(name)) else {
            continue;
        };
        let piece = lines[at.saturating_sub(2)..(at + 4).min(lines.len())].join("\n");
        write(
            "vllm_metrics",
            name.trim_start_matches("vllm:"),
            piece.as_bytes(),
        );
    }
    write(
        "vllm_metrics",
        "edge-values",
        b"vllm:num_requests_running{engine=\"0\"} NaN\nvllm:num_requests_waiting 1e308\n\
          vllm:num_requests_waiting 1e308\nvllm:kv_cache_usage_perc +Inf\n\
          vllm:cache_config_info{block_size=\"0\"} 1\nvllm:cache_config_info{block_size=\"x\\\"} 1\n",
    );
}

/// Seeds as large as a worker may send (a 16 MiB message), too large to commit: `testkit/fuzz/run.sh`
/// writes them into `$KINFERENCE_FUZZ_LARGE_SEEDS/<target>/` before fuzzing, so that every run starts
/// from the 16 MiB paths (the decoder's reservations, the events' size once decoded) under the RSS
/// limit, not from what a mutator would rarely grow to.
#[test]
#[ignore = "run by testkit/fuzz/run.sh"]
fn write_large_seeds() {
    // Each seed is written, and replayed through its entry as the fuzzer will start with it.
    let seeds = testkit::LargeSeeds::from_env(untrusted::run);
    let write = |target: &str, name: &str, bytes: &[u8]| seeds.write(target, name, bytes);
    const MESSAGE: usize = 16 << 20;
    // A header declaring 2^32-1 events, then junk up to the message limit.
    let mut declared = vec![0x93, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
    declared.resize(MESSAGE, 0xc1);
    write("kv_batch", "declared-4g-events-16mib", &declared);
    // A valid batch of the smallest events kept (2 MiB: the entry decodes, applies and re-encodes
    // it five times, and a 16 MiB one takes seconds per run; tests/decode_allocation.rs measures
    // the decoded size).
    let mut removed = vec![0x92, 0xac];
    removed.extend(b"BlockRemoved");
    removed.push(0x90);
    let n = (MESSAGE / 8 - 16) / removed.len();
    let mut batch = vec![0x93, 0x00, 0xdd];
    batch.extend((n as u32).to_be_bytes());
    for _ in 0..n {
        batch.extend(&removed);
    }
    batch.push(0xc0);
    write("kv_batch", "empty-removals-2mib", &batch);
    // A 1M-token prefill's BlockStored (about 5 MiB), as vLLM publishes one.
    let tokens: Vec<u32> = (0..1u32 << 20).map(|t| t % 151_000).collect();
    let stored = KvEvent::BlockStored {
        block_hashes: (0..(1u64 << 16)).collect(),
        parent_block_hash: None,
        token_ids: tokens,
        block_size: 16,
        medium: Default::default(),
        lora: None,
        extra_keys: Vec::new(),
    };
    let big = encode_batch(
        &kinference_agent::kv_events::EventBatch {
            ts: 1.0,
            events: vec![stored],
            data_parallel_rank: None,
        },
        EncodeOptions {
            format: EventFormat::Array,
            bin_hashes: false,
        },
    );
    write("kv_batch", "prefill-1m-tokens", &big);
}
