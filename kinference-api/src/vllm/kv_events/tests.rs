use super::encode::{EncodeOptions, EventFormat, encode_batch};
use super::*;
use proptest::prelude::*;
use rmp::Marker;
use rmp::encode as mp;
use serde_json::Value;

/// Test inputs are written with `rmp`, an encoder independent of the one under test.
const VEC: &str = "writing msgpack to a Vec";

const FIXTURES: &[&str] = &["events-run1.jsonl", "events-run2.jsonl"];

fn fixture_lines(name: &str) -> Vec<Value> {
    let path = format!(
        "{}/../bench/fixtures/vllm-0.32/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines()
        .map(|l| serde_json::from_str(l).expect("fixture line is JSON"))
        .collect()
}

/// Header widths: minimal (what msgspec usually writes) or the widest the spec allows.
#[derive(Clone, Copy)]
enum Width {
    Minimal,
    Wide,
}

fn w_array(out: &mut Vec<u8>, n: usize, w: Width) {
    match w {
        Width::Minimal => {
            mp::write_array_len(out, n as u32).expect(VEC);
        }
        Width::Wide => {
            out.push(Marker::Array32.to_u8());
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

fn w_map(out: &mut Vec<u8>, n: usize, w: Width) {
    match w {
        Width::Minimal => {
            mp::write_map_len(out, n as u32).expect(VEC);
        }
        Width::Wide => {
            // msgspec writes map16 for structs of more than 15 fields even with fewer entries.
            out.push(Marker::Map16.to_u8());
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
    }
}

/// Generic JSON -> msgpack, as msgspec would encode the same Python values.
fn json_to_msgpack(out: &mut Vec<u8>, v: &Value, w: Width) {
    match v {
        Value::Null => mp::write_nil(out).expect(VEC),
        Value::Bool(b) => mp::write_bool(out, *b).expect(VEC),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                mp::write_uint(out, u).expect(VEC);
            } else if let Some(i) = n.as_i64() {
                mp::write_sint(out, i).expect(VEC);
            } else {
                mp::write_f64(out, n.as_f64().expect("number")).expect(VEC);
            }
        }
        Value::String(s) => mp::write_str(out, s).expect(VEC),
        Value::Array(a) => {
            w_array(out, a.len(), w);
            a.iter().for_each(|x| json_to_msgpack(out, x, w));
        }
        Value::Object(m) => {
            w_map(out, m.len(), w);
            for (k, x) in m {
                mp::write_str(out, k).expect(VEC);
                json_to_msgpack(out, x, w);
            }
        }
    }
}

/// vLLM's positional field order per event type (<= 0.23 array format, 0.22 fields).
fn array_fields(tag: &str) -> &'static [&'static str] {
    match tag {
        "BlockStored" => &[
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
        ],
        "BlockRemoved" => &["block_hashes", "medium", "group_idx"],
        _ => &[],
    }
}

/// Re-encodes a captured batch (JSON) to msgpack in the given event format.
fn encode_json_batch(batch: &Value, format: EventFormat, w: Width) -> Vec<u8> {
    let a = batch.as_array().expect("batch is an array");
    let mut out = Vec::new();
    w_array(&mut out, 3, w);
    mp::write_f64(&mut out, a[0].as_f64().expect("ts")).expect(VEC);
    let events = a[1].as_array().expect("events");
    w_array(&mut out, events.len(), w);
    for ev in events {
        match format {
            EventFormat::Map => json_to_msgpack(&mut out, ev, w),
            EventFormat::Array => {
                let tag = ev["type"].as_str().expect("type");
                let fields = array_fields(tag);
                w_array(&mut out, 1 + fields.len(), w);
                mp::write_str(&mut out, tag).expect(VEC);
                for f in fields {
                    json_to_msgpack(&mut out, ev.get(*f).unwrap_or(&Value::Null), w);
                }
            }
        }
    }
    json_to_msgpack(&mut out, &a[2], w);
    out
}

/// What the decoder must produce for a captured batch.
fn expected_batch(batch: &Value) -> EventBatch {
    let a = batch.as_array().expect("batch");
    let hashes = |v: &Value| -> Vec<u64> {
        v.as_array()
            .expect("hashes")
            .iter()
            .map(|h| h.as_u64().expect("u64 hash"))
            .collect()
    };
    let events = a[1]
        .as_array()
        .expect("events")
        .iter()
        .map(|ev| match ev["type"].as_str().expect("type") {
            "BlockStored" => KvEvent::BlockStored {
                block_hashes: hashes(&ev["block_hashes"]),
                parent_block_hash: ev["parent_block_hash"].as_u64(),
                token_ids: ev["token_ids"]
                    .as_array()
                    .expect("tokens")
                    .iter()
                    .map(|t| t.as_u64().expect("token") as u32)
                    .collect(),
                block_size: ev["block_size"].as_u64().expect("block_size") as u32,
                medium: Medium::Gpu,
                // The captures are of base-model requests: `lora_name` nil, `extra_keys` all nil.
                lora: None,
                extra_keys: Vec::new(),
            },
            "BlockRemoved" => KvEvent::BlockRemoved {
                block_hashes: hashes(&ev["block_hashes"]),
                medium: Medium::Gpu,
            },
            "AllBlocksCleared" => KvEvent::AllBlocksCleared,
            other => panic!("unexpected event type {other}"),
        })
        .collect();
    EventBatch {
        ts: a[0].as_f64().expect("ts"),
        events,
        data_parallel_rank: a[2].as_i64(),
    }
}

#[test]
fn real_captures_decode_in_both_formats_and_any_header_width() {
    let mut batches = 0;
    for name in FIXTURES {
        for line in fixture_lines(name) {
            let expected = expected_batch(&line["batch"]);
            for format in [EventFormat::Map, EventFormat::Array] {
                for w in [Width::Minimal, Width::Wide] {
                    let bytes = encode_json_batch(&line["batch"], format, w);
                    assert_eq!(
                        decode_batch(&bytes).as_ref(),
                        Ok(&expected),
                        "{name} seq {}",
                        line["seq"]
                    );
                }
            }
            batches += 1;
        }
    }
    assert_eq!(batches, 34);
}

#[test]
fn map_encoding_reproduces_the_captured_payload_sizes() {
    // The capture records each payload's length and first bytes: the re-encoding must match them, which
    // proves the test feeds the decoder vLLM's real byte layout and not a lookalike.
    for name in FIXTURES {
        for line in fixture_lines(name) {
            let bytes = encode_json_batch(&line["batch"], EventFormat::Map, Width::Minimal);
            assert_eq!(
                bytes.len() as u64,
                line["payload_len"].as_u64().expect("len"),
                "seq {}",
                line["seq"]
            );
            let head: String = bytes.iter().take(4).map(|b| format!("{b:02x}")).collect();
            assert!(
                line["payload_head_hex"]
                    .as_str()
                    .expect("head")
                    .starts_with(&head)
            );
        }
    }
}

#[test]
fn encoder_round_trips_every_event_kind_in_both_formats() {
    let batch = EventBatch {
        ts: 1.5,
        events: vec![
            KvEvent::BlockStored {
                block_hashes: vec![1, u64::MAX, 1 << 63],
                parent_block_hash: Some(7),
                token_ids: (0..48).map(|t| t * 4000).collect(),
                block_size: 16,
                medium: Medium::Cpu,
                lora: None,
                extra_keys: Vec::new(),
            },
            KvEvent::BlockStored {
                block_hashes: vec![3, 4],
                parent_block_hash: None,
                token_ids: (0..32).collect(),
                block_size: 16,
                medium: Medium::Gpu,
                lora: Some(Lora::Name("sql-lora".into())),
                extra_keys: vec![
                    vec![
                        ExtraKey::Str("sql-lora".into()),
                        ExtraKey::Raw(vec![0x92, 0xa3, b'i', b'm', b'g', 0x05]),
                    ],
                    vec![],
                ],
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![u64::MAX],
                medium: Medium::Gpu,
            },
            KvEvent::AllBlocksCleared,
            KvEvent::Unknown,
        ],
        data_parallel_rank: Some(2),
    };
    // An event of an unknown type is checked and skipped: nothing of it is kept.
    let mut known = batch.clone();
    known.events.retain(|e| *e != KvEvent::Unknown);
    for format in [EventFormat::Map, EventFormat::Array] {
        for bin_hashes in [false, true] {
            let bytes = encode_batch(&batch, EncodeOptions { format, bin_hashes });
            assert_eq!(
                decode_batch(&bytes),
                Ok(known.clone()),
                "{format:?} bin={bin_hashes}"
            );
        }
    }
}

/// A real capture's first `BlockStored` as vLLM sends it for a LoRA request: the live run's event with
/// `lora_id`, `lora_name` and per-block `extra_keys` filled the way `to_event_extra_keys` (0.31+) fills
/// them (the adapter's name, then a multimodal `(identifier, offset)` pair on the second block).
fn lora_capture() -> Value {
    let mut batch = fixture_lines("events-run1.jsonl")[0]["batch"].clone();
    let ev = &mut batch[1][0];
    assert_eq!(ev["type"], "BlockStored");
    assert_eq!(ev["block_hashes"].as_array().map(Vec::len), Some(3));
    ev["lora_id"] = serde_json::json!(2);
    ev["lora_name"] = serde_json::json!("sql-lora");
    ev["extra_keys"] = serde_json::json!([["sql-lora"], ["sql-lora", ["img-7f3a", 12]], null]);
    batch
}

#[test]
fn lora_fields_decode_in_both_formats_and_any_header_width() {
    let batch = lora_capture();
    let mut mm = Vec::new();
    json_to_msgpack(
        &mut mm,
        &serde_json::json!(["img-7f3a", 12]),
        Width::Minimal,
    );
    for format in [EventFormat::Map, EventFormat::Array] {
        for w in [Width::Minimal, Width::Wide] {
            let got = decode_batch(&encode_json_batch(&batch, format, w)).expect("decodes");
            let KvEvent::BlockStored {
                lora, extra_keys, ..
            } = &got.events[0]
            else {
                panic!("not a BlockStored: {:?}", got.events[0]);
            };
            assert_eq!(lora, &Some(Lora::Name("sql-lora".into())), "{format:?}");
            let name = ExtraKey::Str("sql-lora".into());
            let pair = match w {
                // The raw bytes are the pair exactly as sent, header width included.
                Width::Minimal => ExtraKey::Raw(mm.clone()),
                Width::Wide => ExtraKey::Raw({
                    let mut v = Vec::new();
                    json_to_msgpack(&mut v, &serde_json::json!(["img-7f3a", 12]), w);
                    v
                }),
            };
            assert_eq!(
                extra_keys,
                &vec![vec![name.clone()], vec![name, pair], vec![]],
                "{format:?}"
            );
        }
    }
}

#[test]
fn only_a_lora_id_names_the_adapter_by_number_and_nils_mean_the_base_model() {
    let mut batch = lora_capture();
    batch[1][0]["lora_name"] = Value::Null;
    let got = decode_batch(&encode_json_batch(
        &batch,
        EventFormat::Array,
        Width::Minimal,
    ))
    .expect("decodes");
    assert!(matches!(
        &got.events[0],
        KvEvent::BlockStored {
            lora: Some(Lora::Id(2)),
            ..
        }
    ));
    batch[1][0]["lora_id"] = Value::Null;
    batch[1][0]["extra_keys"] = Value::Null;
    let got = decode_batch(&encode_json_batch(&batch, EventFormat::Map, Width::Minimal))
        .expect("decodes");
    assert!(matches!(
        &got.events[0],
        KvEvent::BlockStored { lora: None, extra_keys, .. } if extra_keys.is_empty()
    ));
}

#[test]
fn bin_hashes_use_the_last_eight_bytes_big_endian() {
    let mut out = Vec::new();
    mp::write_array_len(&mut out, 3).expect(VEC);
    mp::write_uint(&mut out, 0).expect(VEC); // ts as an int
    mp::write_array_len(&mut out, 1).expect(VEC);
    mp::write_map_len(&mut out, 2).expect(VEC);
    mp::write_str(&mut out, "block_hashes").expect(VEC);
    mp::write_array_len(&mut out, 2).expect(VEC);
    mp::write_bin(&mut out, &[0xff, 0xff, 1, 2, 3, 4, 5, 6, 7, 8]).expect(VEC);
    mp::write_bin(&mut out, &[0x01, 0x02]).expect(VEC);
    mp::write_str(&mut out, "type").expect(VEC);
    mp::write_str(&mut out, "BlockRemoved").expect(VEC);
    mp::write_nil(&mut out).expect(VEC);
    let batch = decode_batch(&out).expect("decodes");
    assert_eq!(
        batch.events,
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![0x0102030405060708, 0x0102],
            medium: Medium::Gpu
        }]
    );
}

#[test]
fn unknown_fields_and_events_are_skipped() {
    let batch: Value = serde_json::json!([
        12.0,
        [
            {"type": "SomeFutureEvent", "x": {"nested": [1, 2, {"y": null}]}},
            {"zz_new_field": [[1, 2], {"a": "b"}], "type": "BlockRemoved", "block_hashes": [5], "medium": "GPU",
             "locality": "LOCAL", "ownership": "tier-1"},
            {"type": "AllBlocksCleared", "also_new": 1.25}
        ],
        null
    ]);
    let bytes = encode_json_batch(&batch, EventFormat::Map, Width::Wide);
    let got = decode_batch(&bytes).expect("decodes");
    assert_eq!(
        got.events,
        vec![
            KvEvent::BlockRemoved {
                block_hashes: vec![5],
                medium: Medium::Gpu
            },
            KvEvent::AllBlocksCleared
        ]
    );
    assert_eq!(got.data_parallel_rank, None);
}

#[test]
fn old_array_events_without_medium_decode() {
    // vLLM 0.10.0: BlockStored had 5 fields after the tag, BlockRemoved only block_hashes.
    let batch: Value = serde_json::json!([
        1.0,
        [
            ["BlockStored", [1, 2], null, [1, 2, 3, 4], 2, null],
            ["BlockRemoved", [1]]
        ],
        0
    ]);
    let mut out = Vec::new();
    json_to_msgpack(&mut out, &batch, Width::Minimal);
    let got = decode_batch(&out).expect("decodes");
    assert_eq!(got.events.len(), 2);
    assert_eq!(
        got.events[1],
        KvEvent::BlockRemoved {
            block_hashes: vec![1],
            medium: Medium::Gpu
        }
    );
}

#[test]
fn every_truncation_of_a_real_payload_is_an_error_not_a_panic() {
    let line = &fixture_lines("events-run2.jsonl")[21];
    for format in [EventFormat::Map, EventFormat::Array] {
        let bytes = encode_json_batch(&line["batch"], format, Width::Minimal);
        for cut in 0..bytes.len() {
            assert!(decode_batch(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }
}

#[test]
fn hostile_headers_do_not_allocate_or_recurse_unboundedly() {
    // An event array claiming 2^32-1 events, then deep nesting: both must fail fast.
    let mut huge = vec![0x93, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
    huge.extend(std::iter::repeat_n(0x91, 100_000));
    assert!(decode_batch(&huge).is_err());
    let mut deep = vec![0x93, 0x00, 0x91, 0x82, 0xa1, b'x'];
    deep.extend(std::iter::repeat_n(0x91, 1_000_000));
    assert!(decode_batch(&deep).is_err());
}

fn sample_payloads() -> Vec<Vec<u8>> {
    let mut v = Vec::new();
    for line in fixture_lines("events-run2.jsonl").iter().take(8) {
        for format in [EventFormat::Map, EventFormat::Array] {
            v.push(encode_json_batch(&line["batch"], format, Width::Minimal));
        }
    }
    v
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn mutated_real_payloads_never_panic(
        idx in 0usize..16,
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
    ) {
        let samples = sample_payloads();
        let mut bytes = samples[idx % samples.len()].clone();
        for (pos, b) in edits {
            let n = bytes.len();
            bytes[pos % n] = b;
        }
        let _ = decode_batch(&bytes);
    }
}

/// A `BlockStored` (array form, nine fields) with `keys` extra-key entries for two blocks.
fn stored_with_extra_keys(keys: usize) -> Vec<u8> {
    let mut out = Vec::new();
    mp::write_array_len(&mut out, 3).unwrap();
    mp::write_f64(&mut out, 1.0).unwrap();
    mp::write_array_len(&mut out, 1).unwrap();
    mp::write_array_len(&mut out, 9).unwrap();
    mp::write_str(&mut out, "BlockStored").unwrap();
    mp::write_array_len(&mut out, 2).unwrap();
    mp::write_uint(&mut out, 1).unwrap();
    mp::write_uint(&mut out, 2).unwrap();
    mp::write_nil(&mut out).unwrap();
    mp::write_array_len(&mut out, 4).unwrap();
    for t in 0..4 {
        mp::write_uint(&mut out, t).unwrap();
    }
    mp::write_uint(&mut out, 2).unwrap();
    mp::write_nil(&mut out).unwrap();
    mp::write_str(&mut out, "GPU").unwrap();
    mp::write_str(&mut out, "sql-lora").unwrap();
    mp::write_array_len(&mut out, keys as u32).unwrap();
    for k in 0..keys {
        mp::write_str(&mut out, &format!("img-{k}")).unwrap();
    }
    mp::write_nil(&mut out).unwrap();
    out
}

#[test]
fn extra_keys_must_come_one_per_block() {
    let batch = decode_batch(&stored_with_extra_keys(2)).unwrap();
    let KvEvent::BlockStored { extra_keys, .. } = &batch.events[0] else {
        panic!("{batch:?}");
    };
    assert_eq!(extra_keys.len(), 2);
    // More or fewer entries than blocks: which key is whose cannot be told, so the event is refused
    // (a fuzzer found that the agent otherwise kept keys for blocks that do not exist).
    for keys in [1, 3, 96] {
        let error = decode_batch(&stored_with_extra_keys(keys)).unwrap_err();
        assert!(error.to_string().contains("extra_keys"), "{error}");
    }
}
