//! Tenancy fails closed (issue 18): a broken tenants file never opens an authenticated gateway.
//!
//! A one-character mistake in the tenants file used to turn an authenticated gateway open (requests
//! without a key served as `anonymous` after the reload). These tests reload broken files into a
//! running [`Tenancy`] and check that every other tenant's key keeps working, that a request without
//! a key still gets 401, and that a gateway that never loaded a valid tenant refuses everything with
//! 503 in the client's protocol.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderValue, StatusCode};
use kinference_gateway::errors::Protocol;
use kinference_gateway::tenancy::{Tenancy, TenancyConfig};
use prometheus_client::registry::Registry;

const ACME: &str = r#"apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata:
  name: acme
spec:
  apiKeys:
    - secretRef: {name: acme, key: api-key}
"#;

const BETA: &str = r#"apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata:
  name: beta
spec:
  apiKeys:
    - secretRef: {name: beta, key: api-key}
"#;

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kinference-failclosed-{tag}-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    for (name, key) in [("acme", "sk-acme"), ("beta", "sk-beta")] {
        std::fs::create_dir_all(dir.join("secrets").join(name)).unwrap();
        std::fs::write(dir.join("secrets").join(name).join("api-key"), key).unwrap();
    }
    dir
}

fn start(dir: &Path, tenants: PathBuf) -> Arc<Tenancy> {
    let config = TenancyConfig {
        tenants_dir: Some(tenants),
        secrets_dir: Some(dir.join("secrets")),
        usage_journal: Some(dir.join("usage.jsonl")),
        reload_interval_ms: 100,
        ..TenancyConfig::default()
    };
    let mut registry = Registry::default();
    Tenancy::start(
        config,
        &dir.join("gateway.yaml"),
        None,
        vec!["m".into()],
        &mut registry,
    )
    .unwrap()
}

fn key(k: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {k}")).unwrap(),
    );
    h
}

fn status_of(t: &Tenancy, headers: &HeaderMap) -> StatusCode {
    match t.authenticate(headers) {
        Ok(_) => StatusCode::OK,
        Err(e) => e.status(),
    }
}

/// Writes `text` and waits for a few reload intervals (the file's mtime must change).
async fn rewrite(path: &Path, text: &str) {
    tokio::time::sleep(Duration::from_millis(20)).await;
    std::fs::write(path, text).unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
}

#[tokio::test]
async fn a_broken_tenants_file_keeps_the_last_good_set_and_never_opens() {
    let dir = scratch("file");
    let file = dir.join("tenants.yaml");
    std::fs::write(&file, format!("{ACME}---\n{BETA}")).unwrap();
    let t = start(&dir, file.clone());
    assert!(!t.is_open());
    assert_eq!(status_of(&t, &key("sk-acme")), StatusCode::OK);
    assert_eq!(status_of(&t, &key("sk-beta")), StatusCode::OK);
    assert_eq!(status_of(&t, &HeaderMap::new()), StatusCode::UNAUTHORIZED);

    // One character: a missing `}` makes the whole second document unreadable YAML.
    let broken_beta = BETA.replace("api-key}", "api-key");
    rewrite(&file, &format!("{ACME}---\n{broken_beta}")).await;
    assert!(!t.is_open(), "a broken tenants file opened the gateway");
    assert_eq!(status_of(&t, &HeaderMap::new()), StatusCode::UNAUTHORIZED);
    assert_eq!(status_of(&t, &key("sk-wrong")), StatusCode::UNAUTHORIZED);
    assert_eq!(status_of(&t, &key("sk-acme")), StatusCode::OK);
    assert_eq!(
        status_of(&t, &key("sk-beta")),
        StatusCode::OK,
        "beta's last good version must keep serving"
    );

    // A schema error in one object (unknown field) rolls that object back; the other is applied.
    let invalid_acme = ACME.replace("apiKeys:", "apiKeyz:");
    rewrite(&file, &format!("{invalid_acme}---\n{BETA}")).await;
    assert_eq!(status_of(&t, &key("sk-acme")), StatusCode::OK);
    assert_eq!(status_of(&t, &key("sk-beta")), StatusCode::OK);
    assert_eq!(status_of(&t, &HeaderMap::new()), StatusCode::UNAUTHORIZED);

    // Every document broken, then the file gone: still the last good set, still closed.
    rewrite(&file, "apiVersion: kinference.ai/v1alpha1\nkind: [").await;
    assert_eq!(status_of(&t, &HeaderMap::new()), StatusCode::UNAUTHORIZED);
    assert_eq!(status_of(&t, &key("sk-acme")), StatusCode::OK);
    std::fs::remove_file(&file).unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(status_of(&t, &HeaderMap::new()), StatusCode::UNAUTHORIZED);
    assert_eq!(status_of(&t, &key("sk-beta")), StatusCode::OK);

    // Deleting a tenant in a valid file removes it: its key is refused, the other still works.
    rewrite(&file, ACME).await;
    assert_eq!(status_of(&t, &key("sk-acme")), StatusCode::OK);
    assert_eq!(status_of(&t, &key("sk-beta")), StatusCode::UNAUTHORIZED);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_broken_tenants_directory_keeps_the_last_good_set() {
    let dir = scratch("dir");
    let tenants = dir.join("tenants");
    std::fs::create_dir_all(&tenants).unwrap();
    std::fs::write(tenants.join("acme.yaml"), ACME).unwrap();
    std::fs::write(tenants.join("beta.yaml"), BETA).unwrap();
    let t = start(&dir, tenants.clone());
    assert_eq!(status_of(&t, &key("sk-beta")), StatusCode::OK);
    rewrite(&tenants.join("beta.yaml"), &BETA.replace("kind:", "kind")).await;
    assert_eq!(status_of(&t, &HeaderMap::new()), StatusCode::UNAUTHORIZED);
    assert_eq!(status_of(&t, &key("sk-acme")), StatusCode::OK);
    assert_eq!(status_of(&t, &key("sk-beta")), StatusCode::OK);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn with_no_valid_tenant_ever_loaded_every_request_gets_503_in_its_protocol() {
    let dir = scratch("never");
    let file = dir.join("tenants.yaml");
    std::fs::write(&file, ACME.replace("api-key}", "api-key")).unwrap();
    let t = start(&dir, file.clone());
    assert!(!t.is_open());
    for headers in [HeaderMap::new(), key("sk-acme")] {
        let err = match t.authenticate(&headers) {
            Ok(caller) => panic!("served as {} with no valid tenant loaded", caller.name()),
            Err(e) => e,
        };
        assert_eq!(err.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            err.body(Protocol::OpenAi)["error"]["code"],
            "tenants_unavailable"
        );
        assert_eq!(
            err.body(Protocol::Anthropic)["error"]["type"],
            "overloaded_error"
        );
        assert_eq!(err.body(Protocol::Anthropic)["type"], "error");
    }
    // A missing file at start is the same: closed, not open.
    let missing = start(&dir, dir.join("nowhere.yaml"));
    assert_eq!(
        status_of(&missing, &HeaderMap::new()),
        StatusCode::SERVICE_UNAVAILABLE
    );
    // Once fixed, the tenant serves and a request without a key is 401.
    rewrite(&file, ACME).await;
    assert_eq!(status_of(&t, &key("sk-acme")), StatusCode::OK);
    assert_eq!(status_of(&t, &HeaderMap::new()), StatusCode::UNAUTHORIZED);
    let _ = std::fs::remove_dir_all(&dir);
}
