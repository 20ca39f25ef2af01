//! The five CRDs drive a running cluster (issue 18), against a real kube-apiserver
//! (`deploy/tests/kube-apiserver/`, through `testkit`). Runs with `KINFERENCE_TEST_APISERVER=1`;
//! skipped otherwise, except under `CI=true`, where a missing or broken apiserver fails the test.
//!
//! Two gateway-side cluster sources (two replicas) watch one namespace. The test checks: both
//! converge on the same serving generations; only the Lease holder writes status (server-side
//! apply, field manager `kinference-gateway`), and the other replica takes over when it stops; an
//! applied policy changes the routing decision within 2 s (the figure is printed); an invalid edit
//! leaves the previous generation serving with a `RolledBack` condition naming the field; a broken
//! tenant never weakens authentication; a rotated Secret key is accepted and the old one refused
//! within 5 s (printed); deleting a provider removes it from the serving set.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderValue, StatusCode};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kinference_gateway::config_source::cluster::Cluster;
use kinference_gateway::config_source::kube::{KubeSourceConfig, api_resource};
use kinference_gateway::config_source::{ObjectState, Snapshot};
use kinference_gateway::discovery::{Discovery, KubernetesConfig, WorkerSink};
use kinference_gateway::policy::stage::{PlanTarget, PolicyStage, StageRequest};
use kinference_gateway::policy::{PoolStates, evaluate};
use kinference_gateway::pools::Pools;
use kinference_gateway::routing::tokenize::PromptTokens;
use kinference_gateway::routing::{ModelConfig, Prompt, Router, RoutingConfig, RoutingTuning};
use kinference_gateway::tenancy::{Tenancy, TenancyConfig};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::DynamicObject;
use kube::{Api, Client};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use testkit::{Apiserver, ChildGuard, free_port};

const NS: &str = "kinf";
/// A second watched namespace (sorts before NS: the owner of a name is not the first in order).
const OTHER_NS: &str = "another";

/// One apiserver at a time: two at once (plus the gateways) starve a 2-core machine.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn client(server: &Apiserver) -> Client {
    let kc = Kubeconfig::read_from(server.kubeconfig()).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("client config");
    Client::try_from(config).expect("client")
}

/// A fresh apiserver with `namespaces` created and the CRDs installed, and a client for it; `None`
/// when no apiserver can run here ([`Apiserver::start`]).
async fn apiserver_with(namespaces: &[&str]) -> Option<(Apiserver, Client)> {
    let server = Apiserver::start("crds-bin")?;
    let kube = client(&server).await;
    let api: Api<Namespace> = Api::all(kube.clone());
    for name in namespaces {
        let namespace = serde_json::from_value(
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}),
        )
        .expect("ns");
        api.create(&PostParams::default(), &namespace)
            .await
            .expect("namespace");
    }
    install_crds(&kube).await;
    Some((server, kube))
}

async fn install_crds(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for (_, crd) in kinference_crds::all_crds() {
        crds.create(&PostParams::default(), &crd)
            .await
            .expect("create CRD");
    }
    // Established, and the kinds listable.
    let deadline = Instant::now() + Duration::from_secs(60);
    for kind in kinference_crds::KINDS {
        let ar = api_resource(kind).expect("kind");
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &ar);
        while api.list(&Default::default()).await.is_err() {
            assert!(Instant::now() < deadline, "{kind} never became listable");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

async fn apply(client: &Client, object: Value) {
    let kind = object["kind"].as_str().expect("kind").to_string();
    let name = object["metadata"]["name"]
        .as_str()
        .expect("name")
        .to_string();
    let ns = object["metadata"]["namespace"].as_str().unwrap_or(NS);
    let ar = api_resource(&kind).expect("known kind");
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    api.patch(
        &name,
        &PatchParams::apply("test").force(),
        &Patch::Apply(&object),
    )
    .await
    .unwrap_or_else(|e| panic!("apply {kind}/{name}: {e}"));
}

async fn get(client: &Client, kind: &str, name: &str) -> DynamicObject {
    let ar = api_resource(kind).expect("kind");
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &ar);
    api.get(name).await.expect("get")
}

async fn put_secret(client: &Client, name: &str, key: &str) {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let s: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": NS},
        "stringData": {"api-key": key}
    }))
    .expect("secret");
    secrets
        .patch(name, &PatchParams::apply("test").force(), &Patch::Apply(&s))
        .await
        .expect("apply secret");
}

fn tenant(name: &str, secret: &str) -> Value {
    json!({
        "apiVersion": "kinference.ai/v1alpha1", "kind": "InferenceTenant",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"apiKeys": [{"secretRef": {"name": secret, "key": "api-key"}}]}
    })
}

/// The model `small`, served as `small-served`, with the rest of its spec in `spec`.
fn small_model(spec: Value) -> Value {
    let mut model = json!({
        "apiVersion": "kinference.ai/v1alpha1", "kind": "InferenceModel",
        "metadata": {"name": "small", "namespace": NS},
        "spec": {"servedName": "small-served"}
    });
    if let (Some(all), Some(more)) = (model["spec"].as_object_mut(), spec.as_object()) {
        all.extend(more.clone());
    }
    model
}

fn pool(name: &str, url: &str) -> Value {
    json!({
        "apiVersion": "kinference.ai/v1alpha1", "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"models": ["small"], "gpuClass": "sim", "locality": "Local",
            "endpoints": [{"url": url}],
            "prices": {"cachedInputPerMillion": 0.0, "uncachedInputPerMillion": 0.1, "outputPerMillion": 0.2}}
    })
}

fn route_policy(to_pool: &str) -> Value {
    json!({
        "apiVersion": "kinference.ai/v1alpha1", "kind": "InferencePolicy",
        "metadata": {"name": "route", "namespace": NS},
        "spec": {"priority": 10, "rules": [
            {"name": "pin", "action": {"route": {"targets": [{"pool": to_pool}]}}}
        ]}
    })
}

/// `pool/<name>` the set routes a chat request for `small` to first (or `reject`).
fn first_target(snapshot: &Snapshot) -> String {
    let body = json!({"model": "small", "messages": [{"role": "user", "content": "hello"}]});
    let Some((facts, _)) =
        kinference_gateway::policy::classify::request_facts(&body, None, None, None)
    else {
        return "unclassified".into();
    };
    match evaluate(&snapshot.set, &facts, &PoolStates::default()).outcome {
        kinference_gateway::policy::Outcome::Route(plan) => plan
            .targets
            .first()
            .map_or("none".into(), |t| t.backend.to_string()),
        kinference_gateway::policy::Outcome::Reject(_) => "reject".into(),
    }
}

/// The policy stage serving `cluster`'s policy sets (no policy directory), as main.rs starts it.
fn policy_stage(cluster: &mut Cluster) -> Arc<PolicyStage> {
    PolicyStage::start(cluster.source.policy_sets(), Duration::from_secs(60))
}

/// The pools' run-time part over [`policy_stage`], as main.rs starts it.
fn pools(cluster: &mut Cluster) -> Arc<Pools> {
    Pools::new(policy_stage(cluster), Duration::from_secs(1), None)
}

fn config(identity: &str) -> KubeSourceConfig {
    serde_yaml::from_str(&format!(
        "namespaces: [{NS}]\nidentity: {identity}\nlease_duration_s: 3\n"
    ))
    .expect("config")
}

async fn wait_until<F: FnMut() -> bool>(what: &str, limit: Duration, mut f: F) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "timed out after {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    start.elapsed()
}

fn with_key(k: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {k}")).expect("header"),
    );
    h
}

fn auth(t: &Tenancy, h: &HeaderMap) -> StatusCode {
    match t.authenticate(h) {
        Ok(_) => StatusCode::OK,
        Err(e) => e.status(),
    }
}

/// Polls the policy `route` until `found` reads what the test waits for from it; fails the test
/// with `what` after 10 s.
async fn route_policy_until<T>(
    kube: &Client,
    what: &str,
    mut found: impl FnMut(&DynamicObject) -> Option<T>,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let policy = get(kube, "InferencePolicy", "route").await;
        if let Some(value) = found(&policy) {
            return value;
        }
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn condition(obj: &DynamicObject, type_: &str) -> Option<Value> {
    obj.data["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_five_crds_drive_the_gateway_with_status_leases_and_secrets() {
    let _serial = SERIAL.lock().await;
    let Some((server, kube)) = apiserver_with(&[NS]).await else {
        return;
    };

    // The objects, before the replicas start (the first list sees them).
    put_secret(&kube, "acme-key", "sk-acme-old").await;
    put_secret(&kube, "beta-key", "sk-beta").await;
    put_secret(&kube, "cloud-key", "sk-cloud").await;
    apply(&kube, small_model(json!({"classes": ["general"]}))).await;
    apply(&kube, pool("pool-a", "http://127.0.0.1:1")).await;
    apply(&kube, pool("pool-b", "http://127.0.0.1:2")).await;
    apply(
        &kube,
        json!({
            "apiVersion": "kinference.ai/v1alpha1", "kind": "InferenceProvider",
            "metadata": {"name": "cloud", "namespace": NS},
            "spec": {"baseUrl": "http://127.0.0.1:3/v1", "apiStyle": "OpenAI",
                "credentials": {"secretRef": {"name": "cloud-key", "key": "api-key"}},
                "models": [{"name": "cloud-model", "substitutes": ["small"]}]}
        }),
    )
    .await;
    apply(&kube, tenant("acme", "acme-key")).await;
    apply(&kube, tenant("beta", "beta-key")).await;
    apply(&kube, route_policy("pool-a")).await;

    // Two replicas.
    let a = Cluster::start_with_client(kube.clone(), &config("gw-a")).await;
    let b = Cluster::start_with_client(kube.clone(), &config("gw-b")).await;
    assert!(a.source.current().synced && b.source.current().synced);
    assert_eq!(first_target(&a.source.current()), "pool/pool-a");

    // Tenancy of replica A reads tenants and keys from the cluster.
    let dir = std::env::temp_dir().join(format!("kinference-crds-live-t-{}", std::process::id()));
    let tenancy = Tenancy::start(
        TenancyConfig {
            usage_journal: Some(dir.join("usage.jsonl")),
            ..TenancyConfig::default()
        },
        &dir.join("gateway.yaml"),
        None,
        vec!["small".into()],
        &mut Registry::default(),
    )
    .expect("tenancy");
    let _follow = tenancy.follow(a.source.subscribe(), a.secrets.clone());
    wait_until("acme's key works", Duration::from_secs(10), || {
        auth(&tenancy, &with_key("sk-acme-old")) == StatusCode::OK
    })
    .await;
    assert_eq!(auth(&tenancy, &HeaderMap::new()), StatusCode::UNAUTHORIZED);
    assert_eq!(auth(&tenancy, &with_key("sk-beta")), StatusCode::OK);

    // Exactly one replica holds the lease, and it is the Lease's holder.
    wait_until("one leader", Duration::from_secs(10), || {
        *a.leader.borrow() != *b.leader.borrow()
    })
    .await;
    let (leader_id, follower_writes) = if *a.leader.borrow() {
        ("gw-a", b.status_writes())
    } else {
        ("gw-b", a.status_writes())
    };
    let leases: Api<Lease> = Api::namespaced(kube.clone(), NS);
    let lease = leases
        .get("kinference-gateway-status")
        .await
        .expect("lease");
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    assert_eq!(holder, leader_id);

    // Status written by the leader (server-side apply, our field manager), none by the follower.
    let policy = route_policy_until(&kube, "the leader never wrote the policy's status", |p| {
        condition(p, "Accepted").is_some().then(|| p.clone())
    })
    .await;
    assert_eq!(
        condition(&policy, "Accepted").expect("Accepted")["status"],
        "True"
    );
    assert_eq!(
        condition(&policy, "Ready").expect("Ready")["status"],
        "True"
    );
    assert_eq!(policy.data["status"]["observedGeneration"], 1);
    let managers: Vec<(String, String)> = policy
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .map(|m| {
            (
                m.manager.clone().unwrap_or_default(),
                m.operation.clone().unwrap_or_default(),
            )
        })
        .collect();
    assert!(
        managers.contains(&("kinference-gateway".into(), "Apply".into())),
        "{managers:?}"
    );
    assert_eq!(follower_writes, 0, "the follower wrote status");

    // An applied policy changes routing within 2 s, on both replicas.
    let applied = Instant::now();
    apply(&kube, route_policy("pool-b")).await;
    let took = wait_until("routing follows the policy", Duration::from_secs(2), || {
        first_target(&a.source.current()) == "pool/pool-b"
    })
    .await;
    println!(
        "FIGURE policy applied -> routing changed in {} ms after the apply returned ({} ms from before the apply)",
        took.as_millis(),
        applied.elapsed().as_millis()
    );
    wait_until("replica B routes the same", Duration::from_secs(2), || {
        first_target(&b.source.current()) == "pool/pool-b"
    })
    .await;

    // An invalid edit (a rule routing to a pool that does not exist: the apiserver's schema
    // accepts it, the gateway's cross-check refuses it): generation 2 keeps serving.
    apply(&kube, route_policy("pool-missing")).await;
    let rolled = |s: &Snapshot| {
        s.entry("InferencePolicy", "route").is_some_and(|e| {
            matches!(
                &e.state,
                ObjectState::RolledBack {
                    serving_generation: Some(2),
                    ..
                }
            ) && e.observed_generation == Some(3)
        })
    };
    wait_until("policy rolled back", Duration::from_secs(5), || {
        rolled(&a.source.current()) && rolled(&b.source.current())
    })
    .await;
    assert_eq!(first_target(&a.source.current()), "pool/pool-b");
    let rolled_back = route_policy_until(&kube, "no RolledBack condition written", |p| {
        let c = condition(p, "RolledBack").filter(|c| c["status"] == "True")?;
        assert_eq!(p.data["status"]["observedGeneration"], 3);
        assert_eq!(p.data["status"]["activeGeneration"], 2);
        Some(c)
    })
    .await;
    let message = rolled_back["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("pool-missing") && message.contains("generation 2"),
        "{message}"
    );
    println!("RolledBack condition: {message}");

    // A broken tenant (a key with neither secretRef nor env passes the 1.20 schema, not ours)
    // keeps its last good generation; the other tenant's key works; no key is still 401.
    let mut broken = tenant("beta", "beta-key");
    broken["spec"]["apiKeys"] = json!([{}]);
    apply(&kube, broken).await;
    wait_until("tenant beta rolled back", Duration::from_secs(5), || {
        a.source
            .current()
            .entry("InferenceTenant", "beta")
            .is_some_and(|e| matches!(e.state, ObjectState::RolledBack { .. }))
    })
    .await;
    assert_eq!(auth(&tenancy, &HeaderMap::new()), StatusCode::UNAUTHORIZED);
    assert_eq!(auth(&tenancy, &with_key("sk-acme-old")), StatusCode::OK);
    assert_eq!(auth(&tenancy, &with_key("sk-beta")), StatusCode::OK);

    // Converged: both replicas serve the same generation of every object.
    let generations = |s: &Snapshot| {
        s.objects
            .values()
            .map(|e| (e.object.to_string(), e.serving_generation, e.state.name()))
            .collect::<Vec<_>>()
    };
    wait_until("replicas converge", Duration::from_secs(5), || {
        generations(&a.source.current()) == generations(&b.source.current())
    })
    .await;

    // A rotated key: the new one works and the old one is refused within 5 s, no restart.
    let rotated = Instant::now();
    put_secret(&kube, "acme-key", "sk-acme-new").await;
    let took = wait_until("rotated key", Duration::from_secs(5), || {
        auth(&tenancy, &with_key("sk-acme-new")) == StatusCode::OK
            && auth(&tenancy, &with_key("sk-acme-old")) == StatusCode::UNAUTHORIZED
    })
    .await;
    println!(
        "FIGURE rotated key accepted and old key refused in {} ms (apply to switch: {} ms)",
        took.as_millis(),
        rotated.elapsed().as_millis()
    );

    // Provider credentials come from the Secret too.
    let resolve = a.credentials();
    let cloud = a.source.current().set.providers["cloud"]
        .spec
        .credentials
        .clone();
    assert_eq!(resolve("cloud", &cloud).as_deref(), Some("sk-cloud"));

    // Deleting the provider removes it from the serving set.
    let ar = api_resource("InferenceProvider").expect("kind");
    let providers: Api<DynamicObject> = Api::namespaced_with(kube.clone(), NS, &ar);
    providers
        .delete("cloud", &DeleteParams::default())
        .await
        .expect("delete provider");
    wait_until("provider gone", Duration::from_secs(5), || {
        !a.source.current().set.providers.contains_key("cloud")
    })
    .await;

    // The leader stops: the other replica takes the lease over and writes the next status.
    let (survivor, survivor_id) = if leader_id == "gw-a" {
        drop(a);
        (b, "gw-b")
    } else {
        drop(b);
        (a, "gw-a")
    };
    wait_until("lease taken over", Duration::from_secs(15), || {
        *survivor.leader.borrow()
    })
    .await;
    let lease = leases
        .get("kinference-gateway-status")
        .await
        .expect("lease");
    assert_eq!(
        lease.spec.and_then(|s| s.holder_identity).as_deref(),
        Some(survivor_id)
    );
    apply(&kube, route_policy("pool-a")).await;
    route_policy_until(&kube, "the new leader wrote no status", |p| {
        (p.data["status"]["observedGeneration"] == 4
            && condition(p, "Accepted").is_some_and(|c| c["status"] == "True"))
        .then_some(())
    })
    .await;
    // The write is visible on the apiserver a moment before the writer counts it.
    wait_until(
        "the new leader counted its write",
        Duration::from_secs(5),
        || survivor.status_writes() > 0,
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    drop(server);
}

/// POSTs a request for `small` in the OpenAI (or Anthropic) protocol: (status, error code or type).
async fn call(api: u16, key: Option<&str>, anthropic: bool) -> (u16, String) {
    use http_body_util::{BodyExt, Full};
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<bytes::Bytes>>();
    let body = json!({"model": "small", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hello"}]})
    .to_string();
    let path = if anthropic {
        "/v1/messages"
    } else {
        "/v1/chat/completions"
    };
    let mut req = hyper::Request::post(format!("http://127.0.0.1:{api}{path}"))
        .header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let Ok(req) = req.body(Full::new(bytes::Bytes::from(body))) else {
        return (0, String::new());
    };
    match client.request(req).await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let code = if anthropic {
                v["error"]["type"].as_str().unwrap_or_default().to_string()
            } else {
                v["error"]["code"].as_str().unwrap_or_default().to_string()
            };
            (status, code)
        }
        Err(_) => (0, String::new()),
    }
}

/// GET `path` on `port`: the body, empty on any error.
async fn get_text(port: u16, path: &str) -> String {
    use http_body_util::{BodyExt, Empty};
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<bytes::Bytes>>();
    let Ok(uri) = format!("http://127.0.0.1:{port}{path}").parse::<hyper::Uri>() else {
        return String::new();
    };
    match client.get(uri).await {
        Ok(resp) => resp
            .into_body()
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).to_string())
            .unwrap_or_default(),
        Err(_) => String::new(),
    }
}

async fn eventually<F, Fut>(what: &str, limit: Duration, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < limit, "timed out after {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_binary_in_cluster_mode_authenticates_and_routes_from_the_crds() {
    let _serial = SERIAL.lock().await;
    let Some((server, kube)) = apiserver_with(&[NS, OTHER_NS]).await else {
        return;
    };
    apply(&kube, small_model(json!({"classes": ["general"]}))).await;
    apply(&kube, pool("pool-a", "http://127.0.0.1:1")).await;

    let dir = std::env::temp_dir().join(format!("kinference-crds-gateway-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "crds:\n  namespaces: [{NS}, {OTHER_NS}]\n  kubeconfig: {}\n  lease_duration_s: 3\ntenancy:\n  usage_journal: {}\n",
            server.kubeconfig().display(),
            dir.join("usage.jsonl").display()
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
            .env("RUST_LOG", "warn")
            .stdout(std::fs::File::create(dir.join("gateway.log")).expect("log"))
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("gateway"),
    );

    let kinfctl = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kinfctl"))
            .args(args)
            .arg("--kubeconfig")
            .arg(server.kubeconfig())
            .output()
            .expect("kinfctl");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    };

    // No tenant in the cluster: closed, 503 in both protocols, never served openly.
    eventually("gateway up", Duration::from_secs(30), || async {
        call(api, None, false).await.0 != 0
    })
    .await;
    assert_eq!(
        call(api, None, false).await,
        (503, "tenants_unavailable".into())
    );
    assert_eq!(
        call(api, None, true).await,
        (503, "overloaded_error".into())
    );

    // A tenant and its Secret: no key is 401, the key passes authentication.
    put_secret(&kube, "acme-key", "sk-acme-old").await;
    apply(&kube, tenant("acme", "acme-key")).await;
    eventually(
        "the tenant's key authenticates",
        Duration::from_secs(5),
        || async {
            let (status, code) = call(api, Some("sk-acme-old"), false).await;
            status != 401 && status != 0 && code != "tenants_unavailable"
        },
    )
    .await;
    assert_eq!(
        call(api, None, false).await,
        (401, "invalid_api_key".into())
    );
    assert_eq!(
        call(api, Some("sk-wrong"), true).await,
        (401, "authentication_error".into())
    );

    // The same tenant name in the other watched namespace, created later: refused with a
    // NameConflict condition; its key never authenticates, the owner's keeps working. Creation
    // times have whole seconds (a tie goes to the namespace first by name, here the other one):
    // wait for the next second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut impostor = tenant("acme", "acme-key");
    impostor["metadata"]["namespace"] = json!(OTHER_NS);
    let secrets: Api<Secret> = Api::namespaced(kube.clone(), OTHER_NS);
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "acme-key"}, "stringData": {"api-key": "sk-impostor"}}))
            .expect("secret"),
        )
        .await
        .expect("secret");
    apply(&kube, impostor).await;
    let ar = api_resource("InferenceTenant").expect("kind");
    let other: Api<DynamicObject> = Api::namespaced_with(kube.clone(), OTHER_NS, &ar);
    eventually("NameConflict written", Duration::from_secs(10), || async {
        other
            .get("acme")
            .await
            .is_ok_and(|t| condition(&t, "Accepted").is_some_and(|c| c["reason"] == "NameConflict"))
    })
    .await;
    assert_eq!(call(api, Some("sk-impostor"), false).await.0, 401);
    assert_ne!(call(api, Some("sk-acme-old"), false).await.0, 401);
    let (code, text) = kinfctl(&["explain", "itenant/acme"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains(&format!("InferenceTenant/{NS}/acme\n  state: Accepted")),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "InferenceTenant/{OTHER_NS}/acme\n  state: Conflict"
        )),
        "{text}"
    );
    assert!(text.contains("NameConflict"), "{text}");
    other
        .delete("acme", &DeleteParams::default())
        .await
        .expect("delete");

    // A broken edit of the tenant: its last good generation keeps serving, no key still 401.
    let mut broken = tenant("acme", "acme-key");
    broken["spec"]["apiKeys"] = json!([{}]);
    apply(&kube, broken).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(call(api, None, false).await.0, 401);
    assert_ne!(call(api, Some("sk-acme-old"), false).await.0, 401);
    // The gateway's metrics report the same state.
    let metrics = eventually(
        "metrics show the rollback",
        Duration::from_secs(5),
        || async {
            get_text(admin, "/metrics").await.contains(
            "kinference_gateway_config_objects{kind=\"InferenceTenant\",state=\"RolledBack\"} 1",
        )
        },
    )
    .await;
    assert!(metrics < Duration::from_secs(5));
    // kinfctl explain says the same, from the status the gateway wrote.
    eventually("kinfctl explain shows the rollback", Duration::from_secs(10), || async {
        let (code, text) = kinfctl(&["explain", "InferenceTenant/acme", "-n", NS]);
        code == Some(1)
            && text.contains("state: RolledBack")
            && text.contains("kinference_gateway_config_objects{kind=\"InferenceTenant\",state=\"RolledBack\"}")
            && text.contains("RolledBack True")
    })
    .await;

    // An applied policy changes the decision within 2 s (end to end, through the binary).
    let applied = Instant::now();
    apply(&kube, json!({
        "apiVersion": "kinference.ai/v1alpha1", "kind": "InferencePolicy",
        "metadata": {"name": "block", "namespace": NS},
        "spec": {"priority": 1, "rules": [
            {"name": "all", "action": {"reject": {"status": 403, "message": "blocked by policy"}}}
        ]}
    }))
    .await;
    eventually("the policy rejects", Duration::from_secs(2), || async {
        call(api, Some("sk-acme-old"), false).await.0 == 403
    })
    .await;
    println!(
        "FIGURE (gateway binary) policy applied -> decision changed in {} ms",
        applied.elapsed().as_millis()
    );

    // A rotated key: new accepted, old refused within 5 s, no restart.
    apply(&kube, tenant("acme", "acme-key")).await;
    let rotated = Instant::now();
    put_secret(&kube, "acme-key", "sk-acme-new").await;
    eventually("rotated key", Duration::from_secs(5), || async {
        call(api, Some("sk-acme-new"), false).await.0 == 403
            && call(api, Some("sk-acme-old"), false).await.0 == 401
    })
    .await;
    println!(
        "FIGURE (gateway binary) rotated key accepted and old refused in {} ms",
        rotated.elapsed().as_millis()
    );

    // kinfctl status: the gateway (lease holder) wrote every object's conditions.
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let (code, text) = kinfctl(&["status", "-n", NS]);
        if code == Some(0) && text.lines().count() == 4 {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "kinfctl status: {code:?}\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        text.lines().any(|l| l.starts_with("InferencePolicy")
            && l.contains("block")
            && l.contains("serving 1")
            && l.contains("Accepted=True")
            && l.contains("state=Accepted")),
        "{text}"
    );

    // kinfctl diff: a directory that moves the pool's endpoint and adds a provider.
    let objects = dir.join("objects");
    std::fs::create_dir_all(&objects).expect("dir");
    let mut moved = pool("pool-a", "http://127.0.0.1:9");
    moved["metadata"]
        .as_object_mut()
        .map(|m| m.remove("namespace"));
    std::fs::write(
        objects.join("pool.yaml"),
        serde_yaml::to_string(&moved).expect("yaml"),
    )
    .expect("write");
    std::fs::write(
        objects.join("model.yaml"),
        "apiVersion: kinference.ai/v1alpha1\nkind: InferenceModel\nmetadata: {name: small}\n\
         spec: {servedName: small-served, classes: [general]}\n",
    )
    .expect("write");
    let (code, text) = kinfctl(&["diff", objects.to_str().expect("utf-8"), "-n", NS]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("~ InferencePool/pool-a"), "{text}");
    assert!(text.contains("spec.endpoints[0].url"), "{text}");
    assert!(text.contains("- InferencePolicy/block"), "{text}");
    assert!(!text.contains("InferencePool/pool-a (created)"), "{text}");
    assert!(!text.contains("InferenceModel/small"), "unchanged: {text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A ready worker pod with `labels` (plus the discovery label and the model), as the kubelet
/// reports it.
async fn ready_worker_pod(pods: &Api<Pod>, name: &str, ip: &str, labels: Value) {
    let mut all = json!({"kinference.ai/worker": "true", "kinference.ai/model": "small-served"});
    if let (Some(a), Some(l)) = (all.as_object_mut(), labels.as_object()) {
        a.extend(l.clone());
    }
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": all,
            "annotations": {"kinference.ai/http-port": "8000"}},
        "spec": {"nodeName": "gpu-node", "containers": [{"name": "vllm", "image": "vllm"}]}
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
    let status = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True"}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("pod status");
}

/// The workers of each pool the stage plans for a chat request to `small`.
async fn planned_pools(stage: &PolicyStage, router: &Router) -> Vec<(String, Vec<String>)> {
    let body = json!({"model": "small", "messages": [{"role": "user", "content": "hello"}]});
    let messages = body["messages"].clone();
    let tokens = PromptTokens::default();
    let req = StageRequest {
        body: &body,
        model: "small",
        prompt: Prompt::Chat(&messages),
        tenant: None,
        tags_header: None,
        debug: false,
        tokens: &tokens,
        cache_salt: None,
    };
    let Ok(plan) = stage.decide(router, req).await else {
        return Vec::new();
    };
    plan.targets
        .iter()
        .filter_map(|t| match t {
            PlanTarget::Pool { pool, workers, .. } => {
                Some((pool.clone(), workers.clone().unwrap_or_default()))
            }
            PlanTarget::Provider { .. } => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_selectors_and_gpu_class_pick_discovered_pods() {
    let _serial = SERIAL.lock().await;
    let Some((server, kube)) = apiserver_with(&[NS]).await else {
        return;
    };
    let tokenizer = concat!(env!("CARGO_MANIFEST_DIR"), "/../.assets/qwen2");
    apply(&kube, small_model(json!({"tokenizer": {"dir": tokenizer}}))).await;
    // Two pools of the same model, told apart by label and GPU class.
    for (name, tier, gpu) in [("near", "a", "l40s"), ("far", "b", "h100")] {
        apply(&kube, json!({
            "apiVersion": "kinference.ai/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"models": ["small"], "gpuClass": gpu,
                "selector": {"matchLabels": {"tier": tier}, "targetPort": 8000},
                "prices": {"cachedInputPerMillion": 0.0, "uncachedInputPerMillion": 0.1, "outputPerMillion": 0.2}}
        }))
        .await;
    }
    apply(
        &kube,
        json!({
            "apiVersion": "kinference.ai/v1alpha1", "kind": "InferencePolicy",
            "metadata": {"name": "order", "namespace": NS},
            "spec": {"priority": 1, "rules": [{"name": "near-first",
                "action": {"route": {"targets": [{"pool": "near"}, {"pool": "far"}]}}}]}
        }),
    )
    .await;

    // The gateway's parts as main.rs wires them: the CRDs, discovery feeding the router, the stage.
    let mut cluster = Cluster::start_with_client(kube.clone(), &config("gw-pools")).await;
    let router = Arc::new(
        Router::with_tuning(
            RoutingConfig {
                models: vec![ModelConfig {
                    name: "small-served".into(),
                    tokenizer_dir: Some(tokenizer.into()),
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
    let discovery_config: KubernetesConfig =
        serde_json::from_value(json!({"namespaces": [NS]})).expect("kubernetes config");
    let discovery = Discovery::start(
        kube.clone(),
        &discovery_config,
        Arc::clone(&router) as Arc<dyn WorkerSink>,
    );
    let stage = policy_stage(&mut cluster);
    stage.follow_discovered(discovery.workers());

    // Pods: w1 is near's; w2 far's; w3 has near's label but runs on h100: nobody's.
    let pods: Api<Pod> = Api::namespaced(kube.clone(), NS);
    ready_worker_pod(&pods, "w1", "10.0.2.1", json!({"tier": "a"})).await;
    ready_worker_pod(
        &pods,
        "w2",
        "10.0.2.2",
        json!({"tier": "b", "kinference.ai/gpu-class": "h100"}),
    )
    .await;
    ready_worker_pod(
        &pods,
        "w3",
        "10.0.2.3",
        json!({"tier": "a", "kinference.ai/gpu-class": "h100"}),
    )
    .await;
    let (w1, w2) = ("http://10.0.2.1:8000", "http://10.0.2.2:8000");
    let expected = vec![
        ("near".to_string(), vec![w1.to_string()]),
        ("far".to_string(), vec![w2.to_string()]),
    ];
    eventually("pools pick their pods", Duration::from_secs(10), || async {
        planned_pools(&stage, &router).await == expected
    })
    .await;

    // Relabelled: w1 moves to far; near has no pod, so it is unavailable and not planned.
    let relabelled = Instant::now();
    pods.patch(
        "w1",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"labels": {"tier": "b"}}})),
    )
    .await
    .expect("relabel");
    let expected = vec![("far".to_string(), vec![w1.to_string(), w2.to_string()])];
    eventually("relabel moves the pod", Duration::from_secs(5), || async {
        planned_pools(&stage, &router).await == expected
    })
    .await;
    println!(
        "FIGURE pod relabelled -> pool membership changed in the plan in {} ms",
        relabelled.elapsed().as_millis()
    );
    drop(discovery);
    drop(cluster);
    drop(server);
}

/// `servesMessages` on an `InferenceModel` survives the API server (its schema has the field, so
/// nothing is pruned) and reaches the model configuration the router is built from; an edit
/// turning it off applies on the next snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_messages_on_an_inference_model_reaches_the_gateway() {
    let _serial = SERIAL.lock().await;
    let Some((_server, kube)) = apiserver_with(&[NS]).await else {
        return;
    };
    let model = |serves: bool| small_model(json!({"servesMessages": serves}));
    apply(&kube, model(true)).await;
    let stored = get(&kube, "InferenceModel", "small").await;
    assert_eq!(stored.data["spec"]["servesMessages"], json!(true));

    let mut cluster = Cluster::start_with_client(kube.clone(), &config("gw-messages")).await;
    let stage = pools(&mut cluster);
    let serves = |stage: &Pools| {
        stage
            .routing_additions()
            .1
            .into_iter()
            .find(|m| m.name == "small-served")
            .map(|m| m.serves_messages)
    };
    wait_until(
        "servesMessages: true served",
        Duration::from_secs(30),
        || serves(&stage) == Some(true),
    )
    .await;

    apply(&kube, model(false)).await;
    wait_until(
        "servesMessages: false served",
        Duration::from_secs(30),
        || serves(&stage) == Some(false),
    )
    .await;
}

/// An `InferencePool`'s `workerCredentials` names a Secret: its workers get that key (over the
/// gateway-wide headers), and a rotated Secret applies without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pools_worker_key_comes_from_its_secret() {
    let _serial = SERIAL.lock().await;
    let Some((_server, kube)) = apiserver_with(&[NS]).await else {
        return;
    };
    apply(&kube, small_model(json!({}))).await;
    put_secret(&kube, "pool-key", "sk-pool-one").await;
    let mut keyed = pool("keyed", "http://127.0.0.1:9");
    keyed["spec"]["workerCredentials"] =
        json!({"secretRef": {"name": "pool-key", "key": "api-key"}});
    keyed["spec"]["workerHeaders"] = json!({"x-pool": "keyed"});
    apply(&kube, keyed).await;

    let mut cluster = Cluster::start_with_client(kube.clone(), &config("gw-pool-key")).await;
    let stage = pools(&mut cluster);
    stage.set_pool_credentials(cluster.pool_credentials());
    let mut gateway_wide = HeaderMap::new();
    gateway_wide.insert(
        "authorization",
        HeaderValue::from_static("Bearer sk-gateway"),
    );
    gateway_wide.insert("x-team", HeaderValue::from_static("search"));
    let sent = |stage: &Pools, name: &str| {
        stage
            .worker_headers(&gateway_wide, &[])
            .get("http://127.0.0.1:9")
            .and_then(|h| h.get(name))
            .and_then(|v| v.to_str().ok().map(str::to_string))
    };
    wait_until(
        "the pool's key from its Secret",
        Duration::from_secs(30),
        || sent(&stage, "authorization").as_deref() == Some("Bearer sk-pool-one"),
    )
    .await;
    assert_eq!(sent(&stage, "x-pool").as_deref(), Some("keyed"));
    assert_eq!(sent(&stage, "x-team").as_deref(), Some("search"));

    put_secret(&kube, "pool-key", "sk-pool-two").await;
    wait_until("the rotated key", Duration::from_secs(30), || {
        sent(&stage, "authorization").as_deref() == Some("Bearer sk-pool-two")
    })
    .await;
}
