use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, PodCondition, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::*;

fn source() -> KubeSource {
    KubeSource {
        node: "node1".into(),
        namespaces: vec![],
        selector: "kinference.ai/worker=true".into(),
        kv_events_endpoint: Some("tcp://0.0.0.0:5557".into()),
    }
}

fn pod(name: &str, ip: &str, annotations: &[(&str, &str)]) -> Pod {
    let annotations: BTreeMap<String, String> = annotations
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            labels: Some(BTreeMap::from([(MODEL_KEY.to_string(), "m".to_string())])),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some("node1".into()),
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: Some(ip.into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
    }
}

#[test]
fn annotated_workers_each_get_their_own_kv_endpoint() {
    let s = source();
    let a = s
        .spec_of(&pod(
            "a",
            "10.88.0.5",
            &[(KV_EVENTS_PORT_ANNOTATION, "5557")],
        ))
        .unwrap();
    let b = s
        .spec_of(&pod(
            "b",
            "10.88.0.6",
            &[(KV_EVENTS_PORT_ANNOTATION, "5557")],
        ))
        .unwrap();
    assert_eq!(
        a.kv_events_endpoint.as_deref(),
        Some("tcp://10.88.0.5:5557")
    );
    assert_eq!(
        b.kv_events_endpoint.as_deref(),
        Some("tcp://10.88.0.6:5557")
    );
    assert!(!a.kv_events_bind && !b.kv_events_bind);
    assert_eq!(a.kv_topic.as_deref(), Some("kv@a@m"));
    // Host-network workers on one node share an IP: their ports tell them apart.
    let c = s
        .spec_of(&pod(
            "c",
            "10.88.0.5",
            &[(KV_EVENTS_PORT_ANNOTATION, "5567")],
        ))
        .unwrap();
    assert_ne!(a.kv_events_endpoint, c.kv_events_endpoint);
}

#[test]
fn unannotated_worker_uses_the_agents_listen_endpoint() {
    let spec = source().spec_of(&pod("a", "10.88.0.5", &[])).unwrap();
    assert_eq!(
        spec.kv_events_endpoint.as_deref(),
        Some("tcp://0.0.0.0:5557")
    );
    assert!(spec.kv_events_bind);
    assert_eq!(spec.url, "http://10.88.0.5:8000");
}

#[test]
fn malformed_kv_events_port_is_not_a_worker() {
    assert!(
        source()
            .spec_of(&pod("a", "10.88.0.5", &[(KV_EVENTS_PORT_ANNOTATION, "x")]))
            .is_none()
    );
}

#[test]
fn the_role_label_or_annotation_names_the_workers_role() {
    let s = source();
    let mut p = pod("p", "10.88.0.7", &[]);
    p.metadata
        .labels
        .as_mut()
        .unwrap()
        .insert(ROLE_KEY.to_string(), "prefill".to_string());
    assert_eq!(
        s.spec_of(&p).unwrap().role,
        Some(kinference_api::WorkerRole::Prefill)
    );
    let d = pod("d", "10.88.0.8", &[(ROLE_KEY, "decode")]);
    assert_eq!(
        s.spec_of(&d).unwrap().role,
        Some(kinference_api::WorkerRole::Decode)
    );
    // No role, or one this agent does not know: the worker is followed without one.
    assert_eq!(s.spec_of(&pod("w", "10.88.0.9", &[])).unwrap().role, None);
    let odd = pod("o", "10.88.0.10", &[(ROLE_KEY, "encode")]);
    assert_eq!(s.spec_of(&odd).unwrap().role, None);
}

#[test]
fn the_data_parallel_annotation_names_the_workers_ranks() {
    let s = source();
    let ranked = pod("r", "10.88.0.11", &[(DATA_PARALLEL_SIZE_ANNOTATION, " 4 ")]);
    assert_eq!(s.spec_of(&ranked).unwrap().data_parallel_size, Some(4));
    assert_eq!(s.spec_of(&ranked).unwrap().ranks(), 4);
    // None, zero, past the bound or not a number: followed as rank-less, not dropped.
    for odd in ["0", "257", "two", ""] {
        let p = pod("o", "10.88.0.12", &[(DATA_PARALLEL_SIZE_ANNOTATION, odd)]);
        assert_eq!(s.spec_of(&p).unwrap().data_parallel_size, None, "{odd:?}");
    }
    assert_eq!(
        s.spec_of(&pod("w", "10.88.0.13", &[]))
            .unwrap()
            .data_parallel_size,
        None
    );
}
