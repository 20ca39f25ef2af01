use super::*;

#[test]
fn the_random_front_spreads_evenly_and_draws_the_same_replica_every_run() {
    let mut counts = [0usize; 4];
    for session in 0..1000 {
        for turn in 0..4 {
            let r = super::front_pick(42, session, turn, 4);
            assert_eq!(r, super::front_pick(42, session, turn, 4));
            counts[r] += 1;
        }
    }
    // 4,000 draws over 4 replicas: about 1,000 each (3 sigma is about 82).
    assert!(
        counts.iter().all(|&c| (900..1100).contains(&c)),
        "{counts:?}"
    );
    // Another seed draws another sequence; one replica takes everything.
    assert!((0..64).any(|s| super::front_pick(42, s, 0, 4) != super::front_pick(7, s, 0, 4)));
    assert_eq!(super::front_pick(42, 5, 1, 1), 0);
}

#[test]
fn sse_events_are_reassembled_across_arbitrary_cuts() {
    let stream = concat!(
        "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
        "data: {\"choices\":[{\"delta\":{\"content\":\" hello\"}}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":2,",
        "\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n",
        "data: [DONE]\n\n"
    )
    .as_bytes();
    for cut in 1..stream.len() {
        let mut parser = SseParser::default();
        let mut events = parser.push(&stream[..cut]);
        events.extend(parser.push(&stream[cut..]));
        assert_eq!(events.len(), 4, "cut at {cut}");
        assert_eq!(events[3], SseEvent::Done);
    }
}

#[test]
fn only_a_chunk_with_text_counts_as_the_first_token() {
    let role_only = serde_json::json!({"choices":[{"delta":{"role":"assistant","content":""}}]});
    let text = serde_json::json!({"choices":[{"delta":{"content":" hi"}}]});
    let usage = serde_json::json!({"choices":[],"usage":{"prompt_tokens":3}});
    let completion = serde_json::json!({"choices":[{"text":" hi"}]});
    assert!(!has_content(&role_only));
    assert!(has_content(&text));
    assert!(!has_content(&usage));
    assert!(has_content(&completion));
}

#[test]
fn crlf_separated_events_are_parsed() {
    let mut parser = SseParser::default();
    let events = parser.push(b"data: {\"a\":1}\r\n\r\ndata: [DONE]\r\n\r\n");
    assert_eq!(
        events,
        vec![SseEvent::Chunk(serde_json::json!({"a":1})), SseEvent::Done]
    );
}

#[tokio::test]
async fn a_stream_counts_to_its_first_non_empty_frame_and_a_whole_answer_to_its_end() {
    use http_body::Frame;
    use http_body_util::StreamBody;

    // An empty frame at once, text after 50 ms, the end 400 ms later.
    fn body() -> impl http_body::Body<Data = Bytes, Error = std::convert::Infallible> + Unpin {
        let frames = futures::stream::unfold(0, |i| async move {
            let data = match i {
                0 => "",
                1 => "data: hi\n\n",
                2 => "data: [DONE]\n\n",
                _ => return None,
            };
            match i {
                1 => tokio::time::sleep(Duration::from_millis(50)).await,
                2 => tokio::time::sleep(Duration::from_millis(400)).await,
                _ => {}
            }
            Some((Ok(Frame::data(Bytes::from(data))), i + 1))
        });
        StreamBody::new(Box::pin(frames))
    }
    let start = Instant::now();
    let first = latency_that_counts(body(), start, true).await.unwrap();
    assert!(
        (Duration::from_millis(50)..Duration::from_millis(400)).contains(&first),
        "{first:?}"
    );
    let start = Instant::now();
    let whole = latency_that_counts(body(), start, false).await.unwrap();
    assert!(whole >= Duration::from_millis(450), "{whole:?}");
}

/// A simulated worker in this process (fast preset), on a free port.
async fn sim_worker(shutdown: tokio_util::sync::CancellationToken) -> String {
    let config = crate::sim::SimConfig {
        listen: "127.0.0.1:0".parse().expect("address"),
        model: "qwen2-sim".into(),
        tokenizer_dir: testkit::tokenizer_dir(),
        preset: crate::sim::engine::Preset::Fast,
        time_scale: 1.0,
        slowdown: 1.0,
        block_size: 16,
        num_blocks: 512,
        max_num_seqs: 16,
        max_model_len: 8192,
        seed: 0,
        prompt_tokens_details: true,
        auto_tool_choice: true,
        lora_modules: Vec::new(),
        api_key: None,
        responses_api: true,
        responses_store: false,
        messages_api: true,
        kv_events: None,
        kv_role: None,
        kv_transfer_s_per_block: None,
        data_parallel_size: 1,
    };
    let running = crate::sim::start(config, shutdown)
        .await
        .expect("simulator");
    format!("http://{}", running.addr)
}

#[tokio::test]
async fn sessions_wait_for_their_arrival_and_the_event_runs_once_beside_the_users() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::routing::workload::{Workload, WorkloadKind, WorkloadShape};

    let shutdown = tokio_util::sync::CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let worker = sim_worker(shutdown.clone()).await;
    let shape = WorkloadShape {
        shared_prefixes: 2,
        prefix_words: 50,
        max_tokens: 2,
        burst_period_s: 0.4,
        burst_spread_s: 0.0,
        ..WorkloadShape::default()
    };
    let mut workload = Workload::generate(WorkloadKind::Bursty, &shape, 1, 6);
    workload.schedule_bursts(&shape, 3, 1);
    let client = LoadClient::new(
        HttpClient::new(),
        "qwen2-sim",
        false,
        Duration::from_secs(60),
    );
    // A long event (as a worker restart is): the users go on beside it and the run waits for it.
    let event_takes = Duration::from_secs(3);
    let fired = AtomicUsize::new(0);
    let finished = AtomicUsize::new(0);
    let extras = RunExtras {
        time_scale: 1.0,
        event: Some((
            3,
            Box::pin(async {
                fired.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(event_takes).await;
                finished.fetch_add(1, Ordering::SeqCst);
            }),
        )),
    };
    // Six users for six sessions: nothing but the schedule holds the second burst back.
    let result = client
        .run_with(&Route::Endpoint(worker), &workload, 6, extras)
        .await;
    assert_eq!(fired.load(Ordering::SeqCst), 1);
    assert_eq!(
        finished.load(Ordering::SeqCst),
        1,
        "the run waited for the event"
    );
    assert!(result.wall >= event_takes);
    assert_eq!(result.outcomes.len(), 6);
    for o in &result.outcomes {
        assert!(o.ok(), "{o:?}");
        let second_burst = workload.sessions[3..]
            .iter()
            .any(|s| s.requests[0].session == o.session);
        if second_burst {
            assert!(o.sent_at >= Duration::from_millis(400), "{o:?}");
            let answered = o.sent_at + o.e2e.expect("answered");
            assert!(answered < event_takes, "not held back by the event: {o:?}");
        } else {
            assert!(o.sent_at < Duration::from_millis(400), "{o:?}");
        }
    }
    assert!(result.wall >= Duration::from_millis(400));
}
