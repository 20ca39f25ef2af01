use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

use super::agents::{Slice, agents_of, endpoints_of};
use super::pods::worker_of;
use super::*;

fn pod(phase: &str, ready: &str, ip: Option<&str>, labels: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "w", "namespace": "ns", "labels": labels,
                     "annotations": {"kinference.ai/http-port": "8001"}},
        "status": {"phase": phase, "podIP": ip,
                   "conditions": [{"type": "Ready", "status": ready}]}
    }))
    .expect("pod")
}

#[test]
fn only_running_ready_pods_with_ip_and_model_are_workers() {
    let labels = json!({"kinference.ai/worker": "true", "kinference.ai/model": "m"});
    assert_eq!(
        worker_of(&pod("Running", "True", Some("10.0.0.5"), labels.clone())),
        Some(PodWorker {
            url: "http://10.0.0.5:8001".into(),
            model: "m".into(),
            labels: serde_json::from_value(labels.clone()).expect("labels"),
        })
    );
    assert_eq!(
        worker_of(&pod("Pending", "True", Some("10.0.0.5"), labels.clone())),
        None
    );
    assert_eq!(
        worker_of(&pod("Running", "False", Some("10.0.0.5"), labels.clone())),
        None
    );
    assert_eq!(worker_of(&pod("Running", "True", None, labels)), None);
    assert_eq!(
        worker_of(&pod(
            "Running",
            "True",
            Some("10.0.0.5"),
            json!({"kinference.ai/worker": "true"})
        )),
        None,
        "no model"
    );
    let v6 = pod(
        "Running",
        "True",
        Some("fd00::5"),
        json!({"kinference.ai/model": "m"}),
    );
    assert_eq!(
        worker_of(&v6).map(|w| w.url),
        Some("http://[fd00::5]:8001".into())
    );
}

#[test]
fn slices_give_ready_agents_at_the_grpc_port() {
    let slice: Slice = serde_json::from_value(json!({
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": ["10.1.0.1"], "conditions": {"ready": true}},
            {"addresses": ["10.1.0.2"], "conditions": {"ready": false}},
            {"addresses": ["10.1.0.3"]}
        ],
        "ports": [{"name": "metrics", "port": 9091}, {"name": "grpc", "port": 7071}]
    }))
    .expect("slice");
    let got: Vec<String> = agents_of(&slice, 7070).into_iter().collect();
    assert_eq!(got, vec!["http://10.1.0.1:7071", "http://10.1.0.3:7071"]);
}

#[test]
fn slices_give_gateway_peers_at_the_admin_port_and_none_without_it() {
    let slice: Slice = serde_json::from_value(json!({
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": ["10.2.0.1"], "conditions": {"ready": true}},
            {"addresses": ["10.2.0.2"], "conditions": {"ready": false}}
        ],
        "ports": [{"name": "http", "port": 8080}, {"name": "admin", "port": 9090}]
    }))
    .expect("slice");
    let got: Vec<String> = endpoints_of(&slice, super::PEER_PORT_NAME, 0)
        .into_iter()
        .collect();
    assert_eq!(got, vec!["http://10.2.0.1:9090"]);
    // A Service without an `admin` port gives no peers (never a guessed port).
    let unnamed: Slice = serde_json::from_value(json!({
        "endpoints": [{"addresses": ["10.2.0.1"]}],
        "ports": [{"name": "http", "port": 8080}]
    }))
    .expect("slice");
    assert!(endpoints_of(&unnamed, super::PEER_PORT_NAME, 0).is_empty());
}

#[test]
fn chart_block_parses() {
    let yaml = r#"
routing: kinference
models: []
kubernetes:
  namespaces: [inference]
  all_namespaces: false
  worker_selector: {kinference.ai/worker: "true", tier: gpu}
  agent_service: kinference-agent
  agent_namespace: kinference
  agent_grpc_port: 7070
"#;
    let config = crate::config::GatewayConfig::from_yaml(yaml).expect("config");
    let k = config.kubernetes.expect("kubernetes block");
    assert_eq!(k.namespaces, vec!["inference"]);
    assert_eq!(k.label_selector(), "kinference.ai/worker=true,tier=gpu");
    assert_eq!(k.agent_service.as_deref(), Some("kinference-agent"));
}

#[derive(Default)]
struct Recorder(Mutex<Vec<String>>);

impl WorkerSink for Recorder {
    fn upsert(&self, w: &PodWorker) {
        self.0.lock().push(format!("+{}", w.url));
    }
    fn remove(&self, url: &str) {
        self.0.lock().push(format!("-{url}"));
    }
}

#[test]
fn pod_table_emits_only_transitions() {
    let rec = Arc::new(Recorder::default());
    let (tx, rx) = watch::channel(WorkerSet::new());
    let mut table = PodTable {
        by_pod: HashMap::new(),
        sink: rec.clone(),
        published: Arc::new(tx),
    };
    let w = |ip: &str| {
        Some(PodWorker {
            url: format!("http://{ip}:8000"),
            model: "m".into(),
            ..PodWorker::default()
        })
    };
    table.set("ns/a".into(), w("10.0.0.1"));
    table.set("ns/a".into(), w("10.0.0.1"));
    table.set("ns/b".into(), None);
    table.set("ns/b".into(), w("10.0.0.2"));
    table.set("ns/a".into(), None);
    table.replace(HashMap::from([("ns/c".to_string(), w("10.0.0.3"))]));
    assert_eq!(
        *rec.0.lock(),
        vec![
            "+http://10.0.0.1:8000",
            "+http://10.0.0.2:8000",
            "-http://10.0.0.1:8000",
            "-http://10.0.0.2:8000",
            "+http://10.0.0.3:8000",
        ]
    );
    assert_eq!(
        rx.borrow().keys().cloned().collect::<Vec<_>>(),
        vec!["http://10.0.0.3:8000"]
    );
}
