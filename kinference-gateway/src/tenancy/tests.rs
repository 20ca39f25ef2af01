use http::{HeaderMap, HeaderValue};

use super::*;
use crate::api::openai::Usage;
use crate::errors::{GatewayError, Protocol};
use crate::tenancy::usage::UsageRecord;

const TENANTS: &str = r#"
apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata:
  name: acme
spec:
  apiKeys:
    - secretRef: {name: acme, key: api-key}
  limits:
    requestsPerMinute: 120
    outputTokensPerMinute: 600
  budget:
    monthlyLimit: 0.00002
    onExceeded: Reject
"#;

fn with_key(key: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {key}")).unwrap(),
    );
    h
}

fn start(dir: &Path, tenants: bool) -> Arc<Tenancy> {
    std::fs::create_dir_all(dir).unwrap();
    if tenants {
        std::fs::write(dir.join("tenants.yaml"), TENANTS).unwrap();
        std::fs::create_dir_all(dir.join("secrets/acme")).unwrap();
        std::fs::write(dir.join("secrets/acme/api-key"), "sk-acme-test-key\n").unwrap();
    }
    let mut config = TenancyConfig {
        tenants_dir: tenants.then(|| dir.join("tenants.yaml")),
        secrets_dir: Some(dir.join("secrets")),
        ..TenancyConfig::default()
    };
    config.prices.insert(
        "m".into(),
        TokenPrices {
            cached_input_per_million: 0.0,
            uncached_input_per_million: 1.0,
            output_per_million: 1.0,
            currency: None,
        },
    );
    config.tenants.insert(
        "acme".into(),
        TenantSettings {
            burst_seconds: Some(1.0),
            ..TenantSettings::default()
        },
    );
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

fn usage(prompt: u64, cached: u64, output: u64) -> Usage {
    Usage {
        prompt_tokens: prompt,
        completion_tokens: output,
        total_tokens: prompt + output,
        prompt_tokens_details: Some(crate::api::openai::PromptTokensDetails {
            cached_tokens: Some(cached),
        }),
    }
}

#[tokio::test]
async fn without_tenants_the_gateway_is_open() {
    let dir =
        std::env::temp_dir().join(format!("kinference-tenancy-open-{}", rand::random::<u64>()));
    let t = start(&dir, false);
    assert!(t.is_open());
    let caller = t.authenticate(&HeaderMap::new()).unwrap();
    assert_eq!(caller.name(), "anonymous");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn keys_limits_budget_and_usage_end_to_end_in_process() {
    let dir = std::env::temp_dir().join(format!("kinference-tenancy-{}", rand::random::<u64>()));
    let t = start(&dir, true);
    assert!(!t.is_open());
    let missing = t.authenticate(&HeaderMap::new()).unwrap_err();
    assert_eq!(missing.status(), http::StatusCode::UNAUTHORIZED);
    let wrong = t.authenticate(&with_key("sk-wrong")).unwrap_err();
    assert!(
        !wrong
            .body(Protocol::OpenAi)
            .to_string()
            .contains("sk-wrong")
    );
    assert_eq!(
        wrong.body(Protocol::OpenAi)["error"]["code"],
        "invalid_api_key"
    );
    assert_eq!(
        wrong.body(Protocol::Anthropic)["error"]["type"],
        "authentication_error"
    );
    let caller = t.authenticate(&with_key("sk-acme-test-key")).unwrap();
    assert_eq!(caller.name(), "acme");

    // 120 rpm with a 1 s burst: two requests, then 429 with the headers.
    let mut a = t
        .admit(&caller, "m", 10, 5, Protocol::OpenAi)
        .await
        .unwrap();
    assert!(a.headers().contains_key("x-ratelimit-remaining-requests"));
    a.routed("http://w", "least_loaded", Some(12));
    a.settle(200, Some(&usage(12, 4, 5)));
    let b = t
        .admit(&caller, "m", 10, 5, Protocol::Anthropic)
        .await
        .unwrap();
    drop(b); // an aborted request settles too (nothing billed: it never reached a worker)
    let limited = t
        .admit(&caller, "m", 10, 5, Protocol::Anthropic)
        .await
        .unwrap_err();
    let response = limited.into_response(Protocol::Anthropic);
    assert_eq!(response.status(), http::StatusCode::TOO_MANY_REQUESTS);
    assert!(response.headers().contains_key("retry-after"));
    assert!(
        response
            .headers()
            .contains_key("anthropic-ratelimit-requests-remaining")
    );

    // Half a second later the request bucket has refilled; this request's cost (10 uncached + 10
    // output tokens at 1 per million) brings the spend past the budget of 0.00002.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let mut c = t
        .admit(&caller, "m", 10, 10, Protocol::OpenAi)
        .await
        .unwrap();
    c.routed("http://w", "least_loaded", None);
    c.settle(200, Some(&usage(10, 0, 10)));
    let spent = t
        .admit(&caller, "m", 1, 1, Protocol::OpenAi)
        .await
        .unwrap_err();
    assert_eq!(
        spent.body(Protocol::OpenAi)["error"]["code"],
        "insufficient_quota"
    );

    t.flush().await;
    let report = t.usage_report("tenant=acme", None).await.unwrap();
    assert_eq!(report["total"]["requests"], 2);
    assert_eq!(report["total"]["input_uncached_tokens"], 18);
    assert_eq!(report["total"]["input_cached_tokens"], 4);
    assert_eq!(report["total"]["output_tokens"], 15);

    // A restart replays the journal: same figures, budget still spent.
    drop(t);
    let t = start(&dir, true);
    // From a day back: the records are from now, whichever month that is.
    let from = format!("from={}", now_ms() / 1000 - 86_400);
    let report = t
        .usage_report(&format!("tenant=acme&{from}"), None)
        .await
        .unwrap();
    assert_eq!(report["total"]["requests"], 2);
    assert_eq!(report["total"]["output_tokens"], 15);
    // A tenant's own view: its usage, and never another tenant's.
    let own = t.usage_report(&from, Some("acme")).await.unwrap();
    assert_eq!(own["total"]["requests"], 2);
    let nobody = t.usage_report(&from, Some("globex")).await.unwrap();
    assert_eq!(nobody["total"]["requests"], 0);
    let other = t
        .usage_report("tenant=acme", Some("globex"))
        .await
        .unwrap_err();
    assert_eq!(other.status(), http::StatusCode::FORBIDDEN);
    let caller = t.authenticate(&with_key("sk-acme-test-key")).unwrap();
    assert!(t.admit(&caller, "m", 1, 1, Protocol::OpenAi).await.is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn helpers() {
    assert_eq!(go_duration(0.02), "20ms");
    assert_eq!(go_duration(1.0), "1s");
    assert_eq!(go_duration(360.0), "6m0s");
    assert_eq!(percent_decode("a%20b+c%3A"), "a b c:");
    assert_eq!(percent_decode("%zz%"), "%zz%");
}

/// Two models of one class, one with an alias; acme may send one request a minute to `small`.
const MODELS_AND_TENANT: &str = r#"
apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {name: small}
spec:
  servedName: Org/Small-8B
  aliases: [small-latest]
  classes: [general]
---
apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {name: large}
spec:
  servedName: Org/Large-32B
  classes: [general]
---
apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata: {name: acme}
spec:
  apiKeys:
    - secretRef: {name: acme, key: api-key}
"#;

fn start_with_models(dir: &Path) -> Arc<Tenancy> {
    std::fs::create_dir_all(dir.join("secrets/acme")).unwrap();
    std::fs::write(dir.join("tenants.yaml"), MODELS_AND_TENANT).unwrap();
    std::fs::write(dir.join("secrets/acme/api-key"), "sk-acme-test-key\n").unwrap();
    let mut config = TenancyConfig {
        tenants_dir: Some(dir.join("tenants.yaml")),
        secrets_dir: Some(dir.join("secrets")),
        ..TenancyConfig::default()
    };
    let one_a_minute = limits::ModelLimits {
        requests_per_minute: Some(1),
        ..Default::default()
    };
    config.tenants.insert(
        "acme".into(),
        TenantSettings {
            models: [("Org/Small-8B".to_string(), one_a_minute)].into(),
            ..TenantSettings::default()
        },
    );
    let mut registry = Registry::default();
    Tenancy::start(
        config,
        &dir.join("gateway.yaml"),
        None,
        vec!["Org/Small-8B".into(), "Org/Large-32B".into()],
        &mut registry,
    )
    .unwrap()
}

#[tokio::test]
async fn per_model_limits_follow_the_served_model_whatever_name_was_asked() {
    let base = std::env::temp_dir().join(format!("kinf-served-{}", std::process::id()));
    let admit = |t: Arc<Tenancy>, model: &'static str| async move {
        let caller = t.authenticate(&with_key("sk-acme-test-key")).unwrap();
        t.admit(&caller, model, 10, 10, Protocol::OpenAi).await
    };
    let limited = |r: Result<Admission, GatewayError>| match r {
        Err(GatewayError::RateLimited { message, .. }) => {
            assert!(message.contains("`Org/Small-8B`"), "{message}");
            true
        }
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => false,
    };

    // Each pair spends the minute's one request one way and asks again another way: refused.
    let names = ["Org/Small-8B", "small", "small-latest"];
    for (i, first) in names.iter().enumerate() {
        for (j, second) in names.iter().enumerate() {
            let t = start_with_models(&base.join(format!("{i}{j}")));
            let a = admit(Arc::clone(&t), first).await.expect("first request");
            drop(a);
            assert!(
                limited(admit(Arc::clone(&t), second).await),
                "{first} then {second}"
            );
        }
    }

    // A class may land on the limited model: it is admitted only while that model has room, and
    // once routed elsewhere the limited model's share comes back.
    let t = start_with_models(&base.join("class"));
    let mut by_class = admit(Arc::clone(&t), "general")
        .await
        .expect("class admitted");
    assert!(limited(admit(Arc::clone(&t), "small").await));
    by_class.serving("Org/Large-32B");
    assert!(!limited(admit(Arc::clone(&t), "small").await));
    drop(by_class);

    // Routed to the limited model without having been admitted for it (a policy's fallback to
    // another model): charged there, so the next request for it waits.
    let t = start_with_models(&base.join("fallback"));
    let mut other = admit(Arc::clone(&t), "large")
        .await
        .expect("large admitted");
    other.serving("Org/Small-8B");
    assert!(limited(admit(Arc::clone(&t), "small-latest").await));
    drop(other);
    let _ = std::fs::remove_dir_all(&base);
}

/// A source over `files` (one YAML file in a fresh folder), as the gateway starts for its policy
/// directory, with `dir` named as the directory it reads.
fn policy_files(
    base: &Path,
    dir: &Path,
    files: &str,
) -> (config_source::ConfigSource, PolicyFiles) {
    let read = base.join("read");
    std::fs::create_dir_all(&read).unwrap();
    std::fs::write(read.join("all.yaml"), files).unwrap();
    let source = config_source::files::start(read, Duration::from_millis(50)).unwrap();
    let shared = PolicyFiles {
        dir: dir.to_path_buf(),
        snapshots: source.subscribe(),
    };
    (source, shared)
}

#[tokio::test]
async fn the_gateways_policy_source_is_shared_not_started_again() {
    let base = std::env::temp_dir().join(format!("kinf-shared-source-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(base.join("secrets/acme")).unwrap();
    std::fs::write(base.join("secrets/acme/api-key"), "sk-acme-test-key\n").unwrap();
    let start = |tenants_dir: PathBuf, shared: PolicyFiles| {
        let config = TenancyConfig {
            tenants_dir: Some(tenants_dir),
            secrets_dir: Some(base.join("secrets")),
            ..TenancyConfig::default()
        };
        let path = base.join("gateway.yaml");
        Tenancy::start(
            config,
            &path,
            Some(shared),
            vec!["m".into()],
            &mut Registry::default(),
        )
        .unwrap()
    };

    // `tenants_dir` is the policy directory: its tenants come from the gateway's source. The
    // folder named does not exist, so a source of tenancy's own would have nothing (503).
    let policy_dir = base.join("policies");
    let (_source, shared) = policy_files(&base.join("one"), &policy_dir, TENANTS);
    let t = start(policy_dir, shared);
    let caller = t.authenticate(&with_key("sk-acme-test-key")).expect("acme");
    assert_eq!(caller.label(), "acme");

    // Apart: the tenants from tenancy's own source (the gateway's tenants are not read), the pools
    // (their prices) from the gateway's.
    std::fs::write(base.join("tenants.yaml"), TENANTS).unwrap();
    let resources = crate::policy::engine::tests::RESOURCES;
    let (_source, shared) = policy_files(&base.join("two"), &base.join("policies"), resources);
    let t = start(base.join("tenants.yaml"), shared);
    assert!(t.authenticate(&with_key("sk-acme-test-key")).is_ok());
    let table = t.table.read().clone();
    let names: Vec<&str> = table.tenants.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["acme"]);
    let pools: Vec<&str> = table.pools.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(pools, ["pool-large", "pool-small"]);
    let _ = std::fs::remove_dir_all(&base);
}

fn record_of(tenant: &str, ts_ms: u64) -> UsageRecord {
    UsageRecord {
        id: format!("{tenant}-{ts_ms}"),
        request_id: String::new(),
        ts_ms,
        tenant: tenant.into(),
        model: "m".into(),
        pool: "p".into(),
        prefill_pool: String::new(),
        provider: String::new(),
        status: 200,
        requests: 1,
        input_uncached: 2,
        input_cached: 0,
        output: 3,
        cost: 0.0,
        estimated: false,
    }
}

#[tokio::test]
async fn a_usage_report_covers_at_most_62_days() {
    let dir = std::env::temp_dir().join(format!("kinf-report-range-{}", std::process::id()));
    let t = start(&dir, false);
    let now_s = now_ms() / 1000;
    // 400 days: 9,600 hourly lookups in Redis for one request.
    let long = t
        .usage_report(&format!("from={}", now_s - 400 * 86_400), None)
        .await
        .unwrap_err();
    assert_eq!(long.status(), http::StatusCode::BAD_REQUEST);
    assert!(long.to_string().contains("62 days"), "{long}");
    let to = now_s - 100 * 86_400;
    let explicit = t
        .usage_report(&format!("from={}&to={to}", to - 63 * 86_400), None)
        .await
        .unwrap_err();
    assert_eq!(explicit.status(), http::StatusCode::BAD_REQUEST);
    assert!(
        t.usage_report(&format!("from={}", now_s - 61 * 86_400), None)
            .await
            .is_ok()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_usage_report_comes_in_pages() {
    let dir = std::env::temp_dir().join(format!("kinf-report-pages-{}", std::process::id()));
    let t = start(&dir, false);
    let now = now_ms();
    {
        let mut aggregates = t.aggregates.lock();
        for i in 0..2_500 {
            aggregates.add(&record_of(&format!("t{i:04}"), now));
        }
    }
    let mut tenants = Vec::new();
    let mut query = String::new();
    let mut pages = 0;
    loop {
        let report = t.usage_report(&query, None).await.unwrap();
        pages += 1;
        let rows = report["usage"].as_array().unwrap();
        assert!(rows.len() <= 1_000, "{} rows on a page", rows.len());
        // The total is the whole range's on every page.
        assert_eq!(report["total"]["requests"], 2_500);
        tenants.extend(
            rows.iter()
                .map(|r| r["tenant"].as_str().unwrap().to_string()),
        );
        match report["next"].as_str() {
            Some(next) => query = format!("after={next}"),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    let expected: Vec<String> = (0..2_500).map(|i| format!("t{i:04}")).collect();
    assert_eq!(tenants, expected, "every group once, in order");
    let small = t.usage_report("limit=10", None).await.unwrap();
    assert_eq!(small["usage"].as_array().unwrap().len(), 10);
    assert!(small["next"].is_string());
    for bad in ["limit=0", "limit=1001", "limit=x", "after=%%%"] {
        let error = t.usage_report(bad, None).await.unwrap_err();
        assert_eq!(error.status(), http::StatusCode::BAD_REQUEST, "{bad}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
