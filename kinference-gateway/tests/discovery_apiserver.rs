//! In-cluster discovery against a real kube-apiserver (`deploy/tests/kube-apiserver/`), run only with
//! `KINFERENCE_TEST_APISERVER=1` (a failure without it under `CI=true`; it starts etcd and
//! kube-apiserver, about 5 s, after `build.sh` has built them once). The test plays the kubelet: it creates Node and Pod objects, patches pod status
//! (Running, Ready, pod IP), relabels and deletes pods, and publishes agent EndpointSlices; the router's
//! worker set and the discovered agents must follow within seconds. A second test runs the real
//! gateway binary with the chart's `kubernetes:` block and a kubeconfig: requests reach a `vllm-sim`
//! worker only while its pod is ready. The standard `InferencePool` and `InferenceObjective` CRDs
//! (written from the standard's API types, `deploy/gateway-api/crds/`) are installed and followed.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kinference_gateway::discovery::{Discovery, KubernetesConfig, WorkerSink};
use kinference_gateway::routing::{ModelConfig, Router, RoutingConfig, RoutingTuning};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::DynamicObject;
use kube::{Api, Client};
use serde_json::json;
use testkit::{Apiserver, ChildGuard, free_port};

const NS: &str = "inference";
const MODEL: &str = "qwen2-sim";

async fn client(server: &Apiserver) -> Client {
    let kc = Kubeconfig::read_from(server.kubeconfig()).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("client config");
    Client::try_from(config).expect("client")
}

/// Creates the tests' namespace [`NS`].
async fn create_namespace(client: &Client) {
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": NS}}))
            .expect("namespace"),
        )
        .await
        .expect("create namespace");
}

/// Installs a standard (Gateway API Inference Extension) CRD and waits until its kind `(group,
/// version, kind, plural)` is served; the objects of that kind in [`NS`].
async fn install_standard_crd(
    client: &Client,
    crd: CustomResourceDefinition,
    (group, version, kind, plural): (&str, &str, &str, &str),
) -> Api<DynamicObject> {
    Api::<CustomResourceDefinition>::all(client.clone())
        .create(&PostParams::default(), &crd)
        .await
        .unwrap_or_else(|e| panic!("install the standard {kind} CRD: {e}"));
    let resource = kube::api::ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: format!("{group}/{version}"),
        kind: kind.into(),
        plural: plural.into(),
    };
    let objects: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &resource);
    // The CRD is served once established.
    let start = Instant::now();
    while objects.list(&Default::default()).await.is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "CRD never served"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    objects
}

async fn create_node(client: &Client, name: &str) {
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name,
            "labels": {"nvidia.com/gpu.present": "true"}}
    }))
    .expect("node");
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("create node");
}

fn worker_pod(name: &str, node: &str, port: u16) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": NS,
            "labels": {"kinference.ai/worker": "true", "kinference.ai/model": MODEL},
            "annotations": {"kinference.ai/http-port": port.to_string()}
        },
        "spec": {"nodeName": node, "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0"}]}
    }))
    .expect("pod")
}

/// What a kubelet reports once the container runs and its readiness probe passes (or fails).
async fn set_status(pods: &Api<Pod>, name: &str, ip: &str, ready: bool) {
    let status = json!({"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "192.168.0.1",
        "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
    }});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("patch status");
}

/// The router's ready workers.
fn ready(router: &Router) -> BTreeMap<String, String> {
    router
        .workers()
        .into_iter()
        .filter(|w| w.healthy)
        .map(|w| (w.url, w.model))
        .collect()
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "not within 10 s: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "{what}: seen {:?} after the API call returned",
        start.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_follows_worker_pods_and_agent_slices() {
    let Some(server) = Apiserver::start("gw-discovery") else {
        return;
    };
    let client = client(&server).await;
    create_namespace(&client).await;
    create_node(&client, "gpu-a").await;
    create_node(&client, "gpu-b").await;

    // The router follows the discovered agents without connecting to them (their addresses are not
    // on this machine).
    let router = Arc::new(
        Router::with_tuning(
            RoutingConfig {
                models: vec![ModelConfig {
                    name: MODEL.into(),
                    tokenizer_dir: None,
                    serves_messages: false,
                    profile: None,
                }],
                ..Default::default()
            },
            RoutingTuning {
                connect_agents: false,
                ..Default::default()
            },
        )
        .expect("router"),
    );
    let config: KubernetesConfig = serde_json::from_value(json!({
        "namespaces": [NS],
        "worker_selector": {"kinference.ai/worker": "true"},
        "agent_service": "kinference-agent",
        "agent_namespace": NS,
        "agent_grpc_port": 7070
    }))
    .expect("config");
    let mut discovery = Discovery::start(
        client.clone(),
        &config,
        Arc::clone(&router) as Arc<dyn WorkerSink>,
    );
    discovery.follow_agents_into(&router, BTreeSet::new());
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    // A pod is a worker only once it runs, is ready and has an IP.
    pods.create(&PostParams::default(), &worker_pod("w1", "gpu-a", 8001))
        .await
        .expect("create w1");
    pods.create(&PostParams::default(), &worker_pod("w2", "gpu-b", 8002))
        .await
        .expect("create w2");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(ready(&router).is_empty(), "pending pods are no workers");
    set_status(&pods, "w1", "10.0.1.1", true).await;
    set_status(&pods, "w2", "10.0.1.2", true).await;
    let both = BTreeMap::from([
        ("http://10.0.1.1:8001".to_string(), MODEL.to_string()),
        ("http://10.0.1.2:8002".to_string(), MODEL.to_string()),
    ]);
    eventually("two ready pods -> two workers", || ready(&router) == both).await;
    let discovered: BTreeMap<String, String> = discovery
        .workers()
        .borrow()
        .iter()
        .map(|(url, w)| (url.clone(), w.model.clone()))
        .collect();
    assert_eq!(discovered, both);

    // Relabelled out of the selector: gone; relabelled back: back.
    let unlabel = json!({"metadata": {"labels": {"kinference.ai/worker": null}}});
    pods.patch("w1", &PatchParams::default(), &Patch::Merge(&unlabel))
        .await
        .expect("relabel");
    eventually("relabelled pod leaves", || {
        !ready(&router).contains_key("http://10.0.1.1:8001")
    })
    .await;
    let relabel = json!({"metadata": {"labels": {"kinference.ai/worker": "true"}}});
    pods.patch("w1", &PatchParams::default(), &Patch::Merge(&relabel))
        .await
        .expect("relabel back");
    eventually("relabelled pod returns", || ready(&router) == both).await;

    // Not ready (readiness probe failing): not a candidate.
    set_status(&pods, "w2", "10.0.1.2", false).await;
    eventually("unready pod leaves", || {
        ready(&router).keys().collect::<Vec<_>>() == ["http://10.0.1.1:8001"]
    })
    .await;

    // Deleted: gone; a new pod: added.
    pods.delete("w1", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete w1");
    pods.create(&PostParams::default(), &worker_pod("w3", "gpu-a", 8003))
        .await
        .expect("create w3");
    set_status(&pods, "w3", "10.0.1.3", true).await;
    eventually("deleted pod leaves, new pod joins", || {
        ready(&router).keys().collect::<Vec<_>>() == ["http://10.0.1.3:8003"]
    })
    .await;
    assert_eq!(
        discovery
            .workers()
            .borrow()
            .keys()
            .cloned()
            .collect::<Vec<_>>(),
        ["http://10.0.1.3:8003"]
    );

    // Agents: the EndpointSlices of the agent Service (v1beta1 on this 1.20 server, v1 on 1.21+).
    let group = kube::discovery::group(&client, "discovery.k8s.io")
        .await
        .expect("discovery group");
    let (ar, _) = group
        .recommended_kind("EndpointSlice")
        .expect("EndpointSlice kind");
    let slices: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &ar);
    let slice = |addresses: &[(&str, bool)]| {
        let endpoints: Vec<_> = addresses
            .iter()
            .map(|(a, r)| json!({"addresses": [a], "conditions": {"ready": r}}))
            .collect();
        let value = json!({
            "apiVersion": ar.api_version, "kind": "EndpointSlice",
            "metadata": {"name": "kinference-agent-abc", "namespace": NS,
                         "labels": {"kubernetes.io/service-name": "kinference-agent"}},
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": [{"name": "grpc", "port": 7070, "protocol": "TCP"},
                      {"name": "metrics", "port": 9091, "protocol": "TCP"}]
        });
        serde_json::from_value::<DynamicObject>(value).expect("slice")
    };
    let agents = discovery.agents();
    assert!(
        discovery
            .initial_agents(Duration::from_secs(10))
            .await
            .is_empty(),
        "no agents before the slice exists"
    );
    slices
        .create(
            &PostParams::default(),
            &slice(&[("10.0.2.1", true), ("10.0.2.2", false)]),
        )
        .await
        .expect("create slice");
    eventually("agent slice -> agents", || {
        agents.borrow().urls.iter().cloned().collect::<Vec<_>>() == ["http://10.0.2.1:7070"]
    })
    .await;
    eventually("the router follows the new agent", || {
        router.agent_urls() == ["http://10.0.2.1:7070"]
    })
    .await;
    slices
        .patch(
            "kinference-agent-abc",
            &PatchParams::default(),
            &Patch::Merge(json!({"endpoints": [
                {"addresses": ["10.0.2.1"], "conditions": {"ready": true}},
                {"addresses": ["10.0.2.2"], "conditions": {"ready": true}}]})),
        )
        .await
        .expect("patch slice");
    eventually("second agent ready", || agents.borrow().urls.len() == 2).await;
    eventually("the router follows the second agent", || {
        router.agent_urls().len() == 2
    })
    .await;
    // An agent pod replaced on its node: the old IP leaves, the new one joins.
    slices
        .patch(
            "kinference-agent-abc",
            &PatchParams::default(),
            &Patch::Merge(json!({"endpoints": [
                {"addresses": ["10.0.2.3"], "conditions": {"ready": true}},
                {"addresses": ["10.0.2.2"], "conditions": {"ready": true}}]})),
        )
        .await
        .expect("patch slice");
    eventually("the router replaces the agent whose IP changed", || {
        let mut urls = router.agent_urls();
        urls.sort();
        urls == ["http://10.0.2.2:7070", "http://10.0.2.3:7070"]
    })
    .await;
    slices
        .delete("kinference-agent-abc", &DeleteParams::default())
        .await
        .expect("delete slice");
    eventually("agents gone with the slice", || {
        agents.borrow().urls.is_empty()
    })
    .await;
    eventually("the router drops the agents", || {
        router.agent_urls().is_empty()
    })
    .await;
    drop(discovery);
    drop(server);
}

/// POSTs a chat request; the status and the worker that served it.
async fn chat(api: u16) -> (u16, Option<String>) {
    use http_body_util::{BodyExt, Full};
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<bytes::Bytes>>();
    let body = json!({"model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hello"}]})
    .to_string();
    let req = hyper::Request::post(format!("http://127.0.0.1:{api}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(body)))
        .expect("request");
    match client.request(req).await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let worker = resp
                .headers()
                .get("x-kinference-worker")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let _ = resp.into_body().collect().await;
            (status, worker)
        }
        Err(_) => (0, None),
    }
}

async fn eventually_async<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "not within 20 s: {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("{what}: {:?}", start.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_binary_routes_to_discovered_pods() {
    let Some(server) = Apiserver::start("gw-binary") else {
        return;
    };
    let sim = testkit::bin_dir().join("vllm-sim");
    if !testkit::require(
        sim.exists(),
        "vllm-sim",
        format_args!(
            "{} not built (cargo build -p kinference-bench --bin vllm-sim)",
            sim.display()
        ),
    ) {
        return;
    }
    let tokenizer = testkit::tokenizer_dir();
    let client = client(&server).await;
    create_namespace(&client).await;
    create_node(&client, "gpu-a").await;

    let port = free_port();
    let _worker = ChildGuard(
        Command::new(&sim)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--model", MODEL, "--preset", "fast", "--tokenizer-dir"])
            .arg(&tokenizer)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("vllm-sim"),
    );
    // The chart's gateway.yaml: no static workers, a kubernetes block.
    let config = server.dir().join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - name: {MODEL}\n    tokenizer_dir: {}\nworkers: []\nagents: []\nrouting: kinference\n\
             kubernetes:\n  namespaces: [{NS}]\n  all_namespaces: false\n  worker_selector: {{kinference.ai/worker: \"true\"}}\n",
            tokenizer.display()
        ),
    )
    .expect("config");
    let (api, admin) = (free_port(), free_port());
    let _gateway = ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_kinference-gateway"))
            .arg(format!("--listen=127.0.0.1:{api}"))
            .arg(format!("--admin-listen=127.0.0.1:{admin}"))
            .arg("--config")
            .arg(&config)
            .env("KUBECONFIG", server.kubeconfig())
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("gateway"),
    );
    eventually_async("gateway up, no worker yet", || async {
        let (status, _) = chat(api).await;
        status != 0 && status != 200
    })
    .await;

    // The pod's IP is loopback so the gateway can reach the simulator behind it.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.create(&PostParams::default(), &worker_pod("w1", "gpu-a", port))
        .await
        .expect("create w1");
    set_status(&pods, "w1", "127.0.0.1", true).await;
    let url = format!("http://127.0.0.1:{port}");
    eventually_async("ready pod serves requests", || async {
        chat(api).await == (200, Some(url.clone()))
    })
    .await;
    set_status(&pods, "w1", "127.0.0.1", false).await;
    eventually_async("unready pod no longer routed", || async {
        chat(api).await.0 == 503
    })
    .await;
    set_status(&pods, "w1", "127.0.0.1", true).await;
    eventually_async("ready again", || async { chat(api).await.0 == 200 }).await;
    pods.delete("w1", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete w1");
    eventually_async("deleted pod no longer routed", || async {
        chat(api).await.0 == 503
    })
    .await;
}

/// The standard `InferencePool` CRD the tests install (written from the v1 API types).
fn standard_pool_crd() -> CustomResourceDefinition {
    let path = testkit::repo_root()
        .join("deploy/gateway-api/crds/inference.networking.k8s.io_inferencepools.yaml");
    serde_yaml::from_str(&std::fs::read_to_string(path).expect("CRD file")).expect("CRD")
}

fn standard_pool(name: &str, picker: &str, ports: &[u16]) -> DynamicObject {
    let ports: Vec<_> = ports.iter().map(|p| json!({"number": p})).collect();
    serde_json::from_value(json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NS, "annotations": {"kinference.ai/model": MODEL}},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm-standard"}},
            "targetPorts": ports,
            "appProtocol": "http",
            "endpointPickerRef": {"name": picker, "port": {"number": 9002}, "failureMode": "FailOpen"}
        }
    }))
    .expect("pool")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standard_pool_naming_the_picker_service_is_served_port_by_port() {
    let Some(server) = Apiserver::start("standard-pool") else {
        return;
    };
    let client = client(&server).await;
    create_namespace(&client).await;
    let pools = install_standard_crd(
        &client,
        standard_pool_crd(),
        (
            "inference.networking.k8s.io",
            "v1",
            "InferencePool",
            "inferencepools",
        ),
    )
    .await;

    // The schema is the standard's: more than 8 ports, or an unknown failure mode, is refused.
    let nine: Vec<u16> = (8000..8009).collect();
    assert!(
        pools
            .create(
                &PostParams::default(),
                &standard_pool("too-many", "kinference-picker", &nine)
            )
            .await
            .is_err(),
        "targetPorts is at most 8"
    );
    let mut odd = standard_pool("odd", "kinference-picker", &[8000]);
    odd.data["spec"]["endpointPickerRef"]["failureMode"] = json!("Sometimes");
    assert!(pools.create(&PostParams::default(), &odd).await.is_err());

    let router = Arc::new(
        Router::with_tuning(
            RoutingConfig {
                models: vec![ModelConfig {
                    name: MODEL.into(),
                    tokenizer_dir: None,
                    serves_messages: false,
                    profile: None,
                }],
                ..Default::default()
            },
            RoutingTuning {
                connect_agents: false,
                ..Default::default()
            },
        )
        .expect("router"),
    );
    let config: KubernetesConfig = serde_json::from_value(json!({
        "namespaces": [NS],
        "picker_service": "kinference-picker"
    }))
    .expect("config");
    let _discovery = Discovery::start(
        client.clone(),
        &config,
        Arc::clone(&router) as Arc<dyn WorkerSink>,
    );

    // A pool naming Kinference (two ports), one naming another picker, one member pod each.
    pools
        .create(
            &PostParams::default(),
            &standard_pool("qwen", "kinference-picker", &[8000, 8001]),
        )
        .await
        .expect("create the served pool");
    let mut other = standard_pool("other", "someone-elses-epp", &[9000]);
    other.data["spec"]["selector"]["matchLabels"] = json!({"app": "other"});
    pools
        .create(&PostParams::default(), &other)
        .await
        .expect("create the other pool");
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    for (name, app) in [("s1", "vllm-standard"), ("o1", "other")] {
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"app": app}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0"}]}
        }))
        .expect("pod");
        pods.create(&PostParams::default(), &pod)
            .await
            .expect("create pod");
    }
    set_status(&pods, "s1", "10.0.2.1", true).await;
    set_status(&pods, "o1", "10.0.2.9", true).await;
    let served = BTreeMap::from([
        ("http://10.0.2.1:8000".to_string(), MODEL.to_string()),
        ("http://10.0.2.1:8001".to_string(), MODEL.to_string()),
    ]);
    eventually("each podIP:port of the served pool is a worker", || {
        ready(&router) == served
    })
    .await;

    // The pool now names another picker: its endpoints leave; named again: back.
    let rename = |name: &str| json!({"spec": {"endpointPickerRef": {"name": name}}});
    pools
        .patch(
            "qwen",
            &PatchParams::default(),
            &Patch::Merge(&rename("someone-elses-epp")),
        )
        .await
        .expect("repoint");
    eventually("a pool naming another picker is not served", || {
        ready(&router).is_empty()
    })
    .await;
    pools
        .patch(
            "qwen",
            &PatchParams::default(),
            &Patch::Merge(&rename("kinference-picker")),
        )
        .await
        .expect("repoint back");
    eventually("served again", || ready(&router) == served).await;

    // The member turns unready: gone. The picker wrote no status (the standard gives it to Gateways).
    set_status(&pods, "s1", "10.0.2.1", false).await;
    eventually("an unready member leaves", || ready(&router).is_empty()).await;
    let pool = pools.get("qwen").await.expect("pool");
    assert!(
        pool.data
            .get("status")
            .is_none_or(|s| s.get("parents").is_none()),
        "{:?}",
        pool.data
    );
}

/// The standard `InferenceObjective` CRD the tests install (written from the v1alpha2 API types).
fn objective_crd() -> CustomResourceDefinition {
    let path = testkit::repo_root()
        .join("deploy/gateway-api/crds/inference.networking.x-k8s.io_inferenceobjectives.yaml");
    serde_yaml::from_str(&std::fs::read_to_string(path).expect("CRD file")).expect("CRD")
}

fn objective(name: &str, priority: Option<i64>) -> DynamicObject {
    let mut spec = json!({"poolRef": {"name": "qwen"}});
    if let Some(p) = priority {
        spec["priority"] = json!(p);
    }
    serde_json::from_value(json!({
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec
    }))
    .expect("objective")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_objectives_are_followed_into_bands() {
    use kinference_crds::TenantPriority::{High, Low, Medium};
    let Some(server) = Apiserver::start("standard-objective") else {
        return;
    };
    let client = client(&server).await;
    create_namespace(&client).await;
    let objectives = install_standard_crd(
        &client,
        objective_crd(),
        (
            "inference.networking.x-k8s.io",
            "v1alpha2",
            "InferenceObjective",
            "inferenceobjectives",
        ),
    )
    .await;
    // The schema is the standard's: a poolRef is required; its kind and group take their defaults.
    let mut orphan = objective("orphan", Some(1));
    orphan.data["spec"] = json!({"priority": 1});
    assert!(
        objectives
            .create(&PostParams::default(), &orphan)
            .await
            .is_err(),
        "poolRef is required"
    );
    let created = objectives
        .create(&PostParams::default(), &objective("chat", Some(10)))
        .await
        .expect("create chat");
    assert_eq!(created.data["spec"]["poolRef"]["kind"], "InferencePool");
    assert_eq!(
        created.data["spec"]["poolRef"]["group"],
        "inference.networking.k8s.io"
    );

    let router = Arc::new(
        Router::with_tuning(
            RoutingConfig::default(),
            RoutingTuning {
                connect_agents: false,
                ..Default::default()
            },
        )
        .expect("router"),
    );
    // Objectives are read in picker mode.
    let config: KubernetesConfig = serde_json::from_value(json!({
        "namespaces": [NS],
        "picker_service": "kinference-picker"
    }))
    .expect("config");
    let discovery = Discovery::start(
        client.clone(),
        &config,
        Arc::clone(&router) as Arc<dyn WorkerSink>,
    );
    let table = discovery.objectives();
    eventually("a listed objective's priority is its band", || {
        table.band("chat") == Some(High)
    })
    .await;
    objectives
        .create(&PostParams::default(), &objective("batch", None))
        .await
        .expect("create batch");
    eventually("an objective without priority is medium", || {
        table.band("batch") == Some(Medium)
    })
    .await;
    objectives
        .patch(
            "chat",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"priority": -5}})),
        )
        .await
        .expect("patch chat");
    eventually("a changed priority changes the band", || {
        table.band("chat") == Some(Low)
    })
    .await;
    objectives
        .delete("chat", &DeleteParams::default())
        .await
        .expect("delete chat");
    eventually("a deleted objective names no band", || {
        table.band("chat").is_none()
    })
    .await;
    assert_eq!(table.band("batch"), Some(Medium));
}
