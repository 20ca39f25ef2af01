use serde_json::json;

use super::*;

fn connector(role: KvRole) -> KvConnector {
    KvConnector::new(role, "127.0.0.1".into(), 8001, 0.0, 1.0)
}

#[test]
fn requests_are_read_by_the_workers_role() {
    let prefill =
        json!({"kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}});
    let decode = json!({"kv_transfer_params": {
        "do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "e",
        "remote_request_id": "cmpl-1", "remote_block_ids": [0, 1, 2], "remote_host": "10.0.0.1",
        "remote_port": 8001, "tp_size": 1,
    }});
    let room = json!({"bootstrap_host": "10.0.0.1", "bootstrap_port": 8001, "bootstrap_room": 7});
    let both = connector(KvRole::Both);
    assert_eq!(both.transfer_of(&prefill), Some(Transfer::Produce));
    assert_eq!(
        both.transfer_of(&decode),
        Some(Transfer::Pull {
            host: "10.0.0.1".into(),
            port: 8001,
            request_id: "cmpl-1".into(),
            blocks: 3,
        })
    );
    // SGLang's rooms need a side: a kv_both worker runs such a request whole.
    assert_eq!(both.transfer_of(&room), None);
    assert_eq!(
        connector(KvRole::Producer).transfer_of(&room),
        Some(Transfer::ProduceRoom { room: 7 })
    );
    assert!(matches!(
        connector(KvRole::Consumer).transfer_of(&room),
        Some(Transfer::PullRoom {
            room: 7,
            port: 8001,
            ..
        })
    ));
    // A producer does not continue others' prefills, nor a consumer run them.
    assert_eq!(connector(KvRole::Producer).transfer_of(&decode), None);
    assert_eq!(connector(KvRole::Consumer).transfer_of(&prefill), None);
    // Params that name no pull: whole, counted as a failed pull.
    let broken = json!({"kv_transfer_params": {"do_remote_prefill": true}});
    let c = connector(KvRole::Consumer);
    assert_eq!(c.transfer_of(&broken), None);
    assert!(c.render("m").contains(
        "kinference_sim_kv_pull_failures_total{model_name=\"m\",kv_role=\"kv_consumer\"} 1"
    ));
    assert_eq!(c.transfer_of(&json!({"messages": []})), None);
}

#[test]
fn a_produced_transfer_names_this_worker_and_is_handed_over_once() {
    let p = connector(KvRole::Producer);
    let params = p.produced(&Transfer::Produce, "cmpl-9", 4).unwrap();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["remote_request_id"], "cmpl-9");
    assert_eq!(params["remote_engine_id"], p.engine_id.as_str());
    assert_eq!(params["remote_block_ids"].as_array().unwrap().len(), 4);
    assert_eq!(
        (
            params["remote_host"].as_str(),
            params["remote_port"].as_u64()
        ),
        (Some("127.0.0.1"), Some(8001))
    );
    assert_eq!(p.hand_over("cmpl-9"), Some(4));
    assert_eq!(p.hand_over("cmpl-9"), None, "a transfer is pulled once");
}

#[tokio::test]
async fn a_room_is_waited_for_until_its_prefill_is_done() {
    let p = std::sync::Arc::new(connector(KvRole::Producer));
    let t = Transfer::ProduceRoom { room: 3 };
    p.started(&t);
    assert_eq!(p.room(3, Duration::from_millis(20)).await, None);
    let waiter = {
        let p = std::sync::Arc::clone(&p);
        tokio::spawn(async move { p.room(3, Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(p.produced(&t, "cmpl-1", 5), None);
    assert_eq!(waiter.await.unwrap(), Some(5));
}
