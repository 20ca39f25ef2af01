//! The agent binary end to end on loopback: a vLLM-protocol publisher (PUB + replay ROUTER) feeds it,
//! a gRPC watcher plays the gateway. Covers snapshot-then-deltas, agent restart, a ZMQ gap recovered
//! through replay, and an engine restart (sequence back to 0), across both event formats and both
//! replay reply shapes, in both socket directions.

mod support;

use std::time::Duration;

use kinference_agent::kv_events::KvEvent;
use kinference_agent::kv_events::encode::EventFormat;
use support::*;

const WAIT: Duration = Duration::from_secs(15);
const URL: &str = "http://127.0.0.1:18001";

fn endpoints() -> (String, String) {
    (
        format!("tcp://127.0.0.1:{}", free_port()),
        format!("tcp://127.0.0.1:{}", free_port()),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watcher_gets_a_snapshot_then_deltas_with_the_right_keys() {
    let (events, replay) = endpoints();
    // vLLM's connect mode: the agent binds, the engine's PUB connects.
    let agent = Agent::start(&worker_yaml(URL, &events, true, &replay), free_port()).await;
    let mut vllm =
        FakeVllm::start(&events, true, &replay, ReplayShape::V026, EventFormat::Map).await;
    let mut watch = Watch::connect(&agent.grpc).await;
    assert!(watch.step(WAIT).await, "a first message");
    assert_eq!(
        watch.kinds,
        ["snapshot"],
        "the stream starts with a snapshot"
    );
    assert!(
        watch.view.contains_key(URL),
        "the snapshot lists the worker"
    );

    // Prompt 1: 4 blocks, then 2 more chained from its 4th block; prompt 2: 3 blocks.
    vllm.publish(vec![stored(1, 0, 4)]).await;
    vllm.publish(vec![stored(1, 4, 6), stored(2, 0, 3)]).await;
    let mut expected = keys(1, 6);
    expected.extend(keys(2, 3));
    watch.wait_for(URL, &expected, WAIT).await;
    assert_eq!(watch.block_size.get(URL), Some(&BS));

    // Evict prompt 1's last two blocks and prompt 2's last: removals resolve through engine hashes.
    vllm.publish(vec![removed(1, &[5, 4]), removed(2, &[2])])
        .await;
    let mut expected = keys(1, 4);
    expected.extend(keys(2, 2));
    watch.wait_for(URL, &expected, WAIT).await;
    assert!(
        watch.kinds[1..].iter().all(|k| *k == "delta"),
        "then only deltas: {:?}",
        watch.kinds
    );

    // AllBlocksCleared empties the worker.
    vllm.publish(vec![KvEvent::AllBlocksCleared]).await;
    watch.wait_for(URL, &[], WAIT).await;
    assert!(agent.metric("kinference_agent_kv_block_events_total").await >= 13.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_restart_gives_a_reconnecting_watcher_the_full_state() {
    let (events, replay) = endpoints();
    // The engine binds here (vLLM with `tcp://*:port`); the agent connects, and reconnects after restart.
    let mut vllm =
        FakeVllm::start(&events, false, &replay, ReplayShape::V026, EventFormat::Map).await;
    let grpc_port = free_port();
    let yaml = worker_yaml(URL, &events, false, &replay);
    let mut agent = Agent::start(&yaml, grpc_port).await;
    let mut watch = Watch::connect(&agent.grpc).await;
    vllm.publish(vec![stored(1, 0, 5)]).await;
    vllm.publish(vec![stored(2, 0, 3), removed(1, &[4])]).await;
    let mut expected = keys(1, 4);
    expected.extend(keys(2, 3));
    watch.wait_for(URL, &expected, WAIT).await;
    let first_epoch = watch.epoch;

    agent.kill();
    drop(watch);
    let agent = Agent::start(&yaml, grpc_port).await;
    // Nothing new is published: the new agent must learn everything through the replay socket.
    let mut watch = Watch::connect(&agent.grpc).await;
    watch.wait_for(URL, &expected, WAIT).await;
    assert_eq!(watch.kinds[0], "snapshot");
    assert_ne!(
        watch.epoch, first_epoch,
        "a restarted agent has a new epoch"
    );
    assert!(agent.metric("kinference_agent_kv_replays_total").await >= 1.0);

    // And it keeps following the live stream.
    vllm.publish(vec![removed(2, &[2])]).await;
    let mut expected = keys(1, 4);
    expected.extend(keys(2, 2));
    watch.wait_for(URL, &expected, WAIT).await;
}

async fn gap_recovered(shape: ReplayShape, format: EventFormat) {
    let (events, replay) = endpoints();
    let agent = Agent::start(&worker_yaml(URL, &events, true, &replay), free_port()).await;
    let mut vllm = FakeVllm::start(&events, true, &replay, shape, format).await;
    let mut watch = Watch::connect(&agent.grpc).await;
    vllm.publish(vec![stored(1, 0, 3)]).await;
    watch.wait_for(URL, &keys(1, 3), WAIT).await;

    // Batch N is lost on the wire (only the replay buffer has it); N+1 removes a block N stored.
    vllm.buffer_only(vec![stored(1, 3, 6), stored(2, 0, 2)]);
    vllm.publish(vec![removed(1, &[5])]).await;
    let mut expected = keys(1, 5);
    expected.extend(keys(2, 2));
    watch.wait_for(URL, &expected, WAIT).await;
    assert!(
        agent.metric("kinference_agent_kv_seq_gaps_total").await >= 1.0,
        "the gap was seen"
    );
    assert_eq!(
        agent
            .metric("kinference_agent_kv_unknown_removals_total")
            .await,
        0.0
    );
    assert_eq!(
        agent
            .metric("kinference_agent_kv_unresolved_parents_total")
            .await,
        0.0
    );

    // The stream continues normally afterwards.
    vllm.publish(vec![stored(3, 0, 1)]).await;
    expected.extend(keys(3, 1));
    watch.wait_for(URL, &expected, WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_gap_is_recovered_through_replay_v026_map() {
    gap_recovered(ReplayShape::V026, EventFormat::Map).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_gap_is_recovered_through_replay_v025_array() {
    gap_recovered(ReplayShape::V025, EventFormat::Array).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_clears_the_workers_state() {
    let (events, replay) = endpoints();
    let agent = Agent::start(&worker_yaml(URL, &events, true, &replay), free_port()).await;
    let mut vllm =
        FakeVllm::start(&events, true, &replay, ReplayShape::V026, EventFormat::Map).await;
    let mut watch = Watch::connect(&agent.grpc).await;
    for id in 1..=4 {
        vllm.publish(vec![stored(id, 0, 2)]).await;
    }
    let mut before: Vec<u64> = (1..=4).flat_map(|id| keys(id, 2)).collect();
    watch.wait_for(URL, &before, WAIT).await;
    // Those blocks may have come from the agent's start-up replay while the live connection (the
    // engine's PUB to the agent's bound SUB) was still being set up: ZMQ drops what is published
    // before it is up, and on a busy machine that can take seconds. The restart below must travel a
    // live connection, so more batches go out until one is seen (a lost one is replayed once a later
    // one arrives live).
    for id in 5..=30 {
        vllm.publish(vec![stored(id, 0, 2)]).await;
        before.extend(keys(id, 2));
        if watch.sees(URL, &before, Duration::from_secs(1)).await {
            break;
        }
        assert!(id < 30, "no KV event reached the agent live");
    }

    // The engine restarts: seq 0 again, an empty cache, then new blocks (no AllBlocksCleared is sent).
    vllm.restart_engine();
    vllm.publish(vec![stored(9, 0, 3)]).await;
    watch.wait_for(URL, &keys(9, 3), WAIT).await;
    assert!(
        agent
            .metric("kinference_agent_kv_engine_restarts_total")
            .await
            >= 1.0
    );
}
