use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderValue};

use super::Pools;
use crate::policy::stage::PolicyStage;

const POOLS: &str = r#"apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {name: m}
spec: {servedName: m}
---
apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {name: m2}
spec: {servedName: m2}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {name: keyed}
spec:
  models: [m]
  locality: Local
  gpuClass: sim
  prices: {cachedInputPerMillion: 0, uncachedInputPerMillion: 0, outputPerMillion: 0}
  endpoints: [{url: "http://w1"}]
  workerCredentials: {secretRef: {name: keyed, key: api-key}}
  workerHeaders: {x-pool: keyed}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {name: rented}
spec:
  models: [m]
  locality: Remote
  gpuClass: rented
  prices: {cachedInputPerMillion: 0, uncachedInputPerMillion: 0, outputPerMillion: 0}
  endpoints: [{url: "http://w2"}]
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {name: rented-keyed}
spec:
  models: [m]
  locality: Remote
  gpuClass: rented
  prices: {cachedInputPerMillion: 0, uncachedInputPerMillion: 0, outputPerMillion: 0}
  endpoints: [{url: "http://w3"}]
  workerCredentials: {secretRef: {name: rented-keyed, key: api-key}}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {name: twice-a}
spec:
  models: [m]
  locality: Local
  gpuClass: sim
  prices: {cachedInputPerMillion: 0, uncachedInputPerMillion: 0, outputPerMillion: 0}
  endpoints: [{url: "http://w4"}]
  workerCredentials: {secretRef: {name: twice-a, key: api-key}}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {name: twice-b}
spec:
  models: [m]
  locality: Local
  gpuClass: sim
  prices: {cachedInputPerMillion: 0, uncachedInputPerMillion: 0, outputPerMillion: 0}
  endpoints: [{url: "http://w4"}]
  workerCredentials: {secretRef: {name: twice-b, key: api-key}}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {name: unreadable}
spec:
  models: [m]
  locality: Local
  gpuClass: sim
  prices: {cachedInputPerMillion: 0, uncachedInputPerMillion: 0, outputPerMillion: 0}
  endpoints: [{url: "http://w5"}]
  workerCredentials: {secretRef: {name: gone, key: api-key}}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {name: by-label}
spec:
  models: [m2]
  locality: Local
  gpuClass: sim
  prices: {cachedInputPerMillion: 0, uncachedInputPerMillion: 0, outputPerMillion: 0}
  selector: {matchLabels: {tier: a}, targetPort: 8000}
  workerHeaders: {x-sel: by-label}
"#;

fn get(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

#[tokio::test]
async fn each_pool_sends_its_own_credentials_and_only_those() {
    let dir = std::env::temp_dir().join(format!("pools-{:x}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("pools.yaml"), POOLS).unwrap();
    let source = crate::config_source::files::start(dir.clone(), Duration::from_secs(60)).unwrap();
    let stage = PolicyStage::start(source.into_policy_sets(), Duration::from_secs(60));
    let pools = Pools::new(stage, Duration::from_secs(1), None);
    // Keys as Secrets would hold them; `gone` has none.
    pools.set_pool_credentials(Arc::new(|_pool, cred| {
        let name = cred.secret_ref.as_ref()?.name.clone();
        (name != "gone").then(|| format!("sk-{name}"))
    }));
    let mut gateway = HeaderMap::new();
    gateway.insert(
        "authorization",
        HeaderValue::from_static("Bearer sk-gateway"),
    );
    gateway.insert("x-team", HeaderValue::from_static("search"));
    let workers: Vec<(String, String)> = [("http://w6", "m2"), ("http://w7", "m")]
        .iter()
        .map(|(u, m)| (u.to_string(), m.to_string()))
        .collect();
    let sent = pools.worker_headers(&gateway, &workers);
    assert_eq!(pools.stage().current().pools.len(), 7, "every pool loaded");

    // A local pool's own key and headers over the gateway-wide ones.
    let w1 = &sent["http://w1"];
    assert_eq!(get(w1, "authorization").as_deref(), Some("Bearer sk-keyed"));
    assert_eq!(get(w1, "x-pool").as_deref(), Some("keyed"));
    assert_eq!(get(w1, "x-team").as_deref(), Some("search"));
    // A remote pool gets only what it is configured with: nothing, or its own key.
    assert!(sent["http://w2"].is_empty(), "{:?}", sent["http://w2"]);
    let w3 = &sent["http://w3"];
    assert_eq!(
        get(w3, "authorization").as_deref(),
        Some("Bearer sk-rented-keyed")
    );
    assert_eq!(get(w3, "x-team"), None);
    // Two pools, two keys: neither (fail closed).
    assert!(sent["http://w4"].is_empty(), "{:?}", sent["http://w4"]);
    // A key that cannot be read: no key at all, never the gateway-wide one.
    let w5 = &sent["http://w5"];
    assert_eq!(get(w5, "authorization"), None);
    assert_eq!(get(w5, "x-team").as_deref(), Some("search"));
    // A selector pool without discovery: every worker of its model.
    let w6 = &sent["http://w6"];
    assert_eq!(get(w6, "x-sel").as_deref(), Some("by-label"));
    assert_eq!(
        get(w6, "authorization").as_deref(),
        Some("Bearer sk-gateway")
    );
    // A worker in no pool of its own keeps the gateway-wide headers (no entry).
    assert!(!sent.contains_key("http://w7"));
    let _ = std::fs::remove_dir_all(&dir);
}
