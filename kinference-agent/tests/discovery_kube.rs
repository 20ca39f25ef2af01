//! The agent's Kubernetes worker source.
//!
//! Offline: which pods are workers and the spec each one gets. Against a real kube-apiserver
//! (`deploy/tests/kube-apiserver/`, only with `KINFERENCE_TEST_APISERVER=1`; a failure without it under CI): the test plays the
//! kubelet on two nodes, and the source of the agent on `gpu-a` must emit exactly the changes of its
//! own node's pods (ready, unready, relabelled, deleted) within seconds.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kinference_agent::config::WorkerSpec;
use kinference_agent::discovery::WorkerChange;
use kinference_agent::discovery::kube::{KubeSource, watch_pods};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use serde_json::json;
use testkit::Apiserver;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const NS: &str = "inference";
const MODEL: &str = "qwen2-sim";

fn source() -> KubeSource {
    KubeSource {
        node: "gpu-a".into(),
        namespaces: vec![NS.into()],
        selector: "kinference.ai/worker=true".into(),
        kv_events_endpoint: Some("tcp://0.0.0.0:5557".into()),
    }
}

fn pod(name: &str, node: &str, port: u16) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": NS,
            "labels": {"kinference.ai/worker": "true", "kinference.ai/model": MODEL},
            "annotations": {"kinference.ai/http-port": port.to_string(),
                            "kinference.ai/kv-replay-port": "5558"}
        },
        "spec": {"nodeName": node, "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0"}]}
    }))
    .expect("pod")
}

fn status(ip: &str, ready: bool) -> serde_json::Value {
    json!({"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "192.168.0.1",
        "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
    }})
}

fn expected(name: &str, ip: &str, port: u16) -> WorkerSpec {
    WorkerSpec {
        url: format!("http://{ip}:{port}"),
        model: MODEL.into(),
        kv_events_endpoint: Some("tcp://0.0.0.0:5557".into()),
        kv_events_bind: true,
        kv_replay_endpoint: Some(format!("tcp://{ip}:5558")),
        kv_topic: Some(format!("kv@{name}@{MODEL}")),
        role: None,
        data_parallel_size: None,
    }
}

#[test]
fn pod_specs_follow_the_chart_conventions() {
    let s = source();
    let mut p = pod("w1", "gpu-a", 8001);
    assert_eq!(s.spec_of(&p), None, "no status yet");
    let st = status("10.0.1.1", true);
    p.status = serde_json::from_value(st["status"].clone()).expect("status");
    assert_eq!(s.spec_of(&p), Some(expected("w1", "10.0.1.1", 8001)));
    let mut other_node = p.clone();
    other_node.spec.as_mut().expect("spec").node_name = Some("gpu-b".into());
    assert_eq!(s.spec_of(&other_node), None, "another node's pod");
    let mut unready = p.clone();
    unready.status =
        serde_json::from_value(status("10.0.1.1", false)["status"].clone()).expect("status");
    assert_eq!(s.spec_of(&unready), None);
}

// ---------------------------------------------------------------------------------------------
// Against a real kube-apiserver

async fn next(rx: &mut mpsc::Receiver<WorkerChange>, what: &str) -> WorkerChange {
    let start = Instant::now();
    let c = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .unwrap_or_else(|_| panic!("no change within 10 s: {what}"))
        .expect("source alive");
    eprintln!("{what}: {:?} after the API call returned", start.elapsed());
    c
}

async fn quiet(rx: &mut mpsc::Receiver<WorkerChange>, what: &str) {
    if let Ok(Some(c)) = tokio::time::timeout(Duration::from_millis(700), rx.recv()).await {
        panic!("unexpected change ({what}): {c:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_follows_its_nodes_worker_pods() {
    let Some(server) = Apiserver::start("agent-discovery") else {
        return;
    };
    let kc = Kubeconfig::read_from(server.kubeconfig()).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("client config");
    let client = Client::try_from(config).expect("client");
    let pp = PostParams::default();
    Api::<Namespace>::all(client.clone())
        .create(
            &pp,
            &serde_json::from_value(json!({"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": NS}}))
            .expect("ns"),
        )
        .await
        .expect("namespace");
    for n in ["gpu-a", "gpu-b"] {
        Api::<Node>::all(client.clone())
            .create(
                &pp,
                &serde_json::from_value(json!({"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": n}}))
                .expect("node"),
            )
            .await
            .expect("node");
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    // One worker already running before the agent starts: it is in the initial list.
    pods.create(&pp, &pod("w0", "gpu-a", 8000))
        .await
        .expect("w0");
    pods.patch_status(
        "w0",
        &PatchParams::default(),
        &Patch::Merge(status("10.0.1.10", true)),
    )
    .await
    .expect("w0 status");

    let cancel = CancellationToken::new();
    let mut rx = watch_pods(client.clone(), source(), cancel.clone());
    assert_eq!(
        next(&mut rx, "initial list").await,
        WorkerChange::Upsert(expected("w0", "10.0.1.10", 8000))
    );

    // Pods on this node and the other one; only this node's ready pod is a worker.
    pods.create(&pp, &pod("w1", "gpu-a", 8001))
        .await
        .expect("w1");
    pods.create(&pp, &pod("other", "gpu-b", 8001))
        .await
        .expect("other");
    pods.patch_status(
        "other",
        &PatchParams::default(),
        &Patch::Merge(status("10.0.2.1", true)),
    )
    .await
    .expect("other status");
    quiet(
        &mut rx,
        "pending pod on this node, ready pod on another node",
    )
    .await;
    pods.patch_status(
        "w1",
        &PatchParams::default(),
        &Patch::Merge(status("10.0.1.1", true)),
    )
    .await
    .expect("w1 status");
    assert_eq!(
        next(&mut rx, "pod ready").await,
        WorkerChange::Upsert(expected("w1", "10.0.1.1", 8001))
    );

    // Relabelled out of the selector, and back.
    pods.patch(
        "w1",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"kinference.ai/worker": "false"}}})),
    )
    .await
    .expect("relabel");
    assert_eq!(
        next(&mut rx, "relabelled").await,
        WorkerChange::Remove("http://10.0.1.1:8001".into())
    );
    pods.patch(
        "w1",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"kinference.ai/worker": "true"}}})),
    )
    .await
    .expect("relabel back");
    assert_eq!(
        next(&mut rx, "relabelled back").await,
        WorkerChange::Upsert(expected("w1", "10.0.1.1", 8001))
    );

    // Readiness lost, then the pod deleted.
    pods.patch_status(
        "w0",
        &PatchParams::default(),
        &Patch::Merge(status("10.0.1.10", false)),
    )
    .await
    .expect("w0 unready");
    assert_eq!(
        next(&mut rx, "unready").await,
        WorkerChange::Remove("http://10.0.1.10:8000".into())
    );
    pods.delete("w1", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete");
    assert_eq!(
        next(&mut rx, "deleted").await,
        WorkerChange::Remove("http://10.0.1.1:8001".into())
    );
    quiet(&mut rx, "nothing else").await;
    cancel.cancel();
    drop(server);
}
