use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;

use super::*;
use crate::discovery::pods::PodWorker;
use crate::routing::{RoutingConfig, RoutingMode};

fn tokenizer_dir() -> PathBuf {
    let dir = std::env::var_os("KINFERENCE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.assets/qwen2")));
    assert!(
        dir.join("tokenizer.json").exists(),
        "no tokenizer at {}: run `cargo xtask setup`",
        dir.display()
    );
    dir
}

/// A private directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kinference-stage-{tag}-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A pool `local` (workers w0 and w1) serving `small` and `big` on two pools, a provider, and a
/// burst rule that holds whenever the local pools are saturated (an unavailable pool counts).
fn write_policies(dir: &Path) {
    let tok = tokenizer_dir();
    let text = format!(
        r#"apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {{name: small}}
spec:
  servedName: small-served
  classes: [general]
  tokenizer: {{dir: "{tok}"}}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {{name: local}}
spec:
  models: [small]
  gpuClass: sim
  locality: Local
  endpoints: [{{url: "http://w0"}}, {{url: "http://w1/"}}]
  prices: {{cachedInputPerMillion: 0.01, uncachedInputPerMillion: 0.1, outputPerMillion: 0.2}}
---
apiVersion: kinference.ai/v1alpha1
kind: InferenceProvider
metadata: {{name: cloud}}
spec:
  baseUrl: http://127.0.0.1:1/v1
  apiStyle: OpenAI
  credentials: {{env: KINFERENCE_STAGE_TEST_KEY}}
  models: [{{name: cloud-model, substitutes: [small]}}]
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePolicy
metadata: {{name: burst}}
spec:
  priority: 10
  rules:
    - name: saturated
      action:
        burst:
          providers: [cloud]
          when: {{queueDepthAbove: 3}}
"#,
        tok = tok.display()
    );
    std::fs::write(dir.join("policies.yaml"), text).unwrap();
}

async fn stage_and_router(dir: &Path) -> (Arc<PolicyStage>, Router) {
    let config = crate::config::GatewayConfig {
        policy_dir: Some(dir.to_path_buf()),
        ..Default::default()
    };
    let source = crate::config::local_source(&config).unwrap();
    let (config, pools) =
        crate::config::with_policy_stage(config, &crate::config::HttpSettings::default(), source);
    let stage = Arc::clone(pools.unwrap().stage());
    assert_eq!(
        config
            .workers
            .iter()
            .map(|w| (w.url.as_str(), w.model.as_str()))
            .collect::<Vec<_>>(),
        [("http://w0", "small-served"), ("http://w1", "small-served")]
    );
    let router = Router::new(RoutingConfig {
        workers: config.workers.clone(),
        models: config.models.clone(),
        agents: vec![],
        mode: RoutingMode::Kinference,
    })
    .unwrap();
    (stage, router)
}

fn chat(text: &str) -> serde_json::Value {
    json!({"model": "small", "messages": [{"role": "user", "content": text}]})
}

async fn decide(
    stage: &PolicyStage,
    router: &Router,
    body: &serde_json::Value,
) -> (Result<Plan, GatewayError>, Option<String>) {
    let messages = body["messages"].clone();
    let tokens = PromptTokens::default();
    let req = StageRequest {
        body,
        model: body["model"].as_str().unwrap(),
        prompt: Prompt::Chat(&messages),
        tenant: None,
        tags_header: None,
        debug: true,
        tokens: &tokens,
        cache_salt: None,
    };
    match stage.decide(router, req).await {
        Ok(plan) => {
            let explain = plan.explain.clone();
            (Ok(plan), explain)
        }
        Err(refused) => (Err(refused.error), refused.explain),
    }
}

#[tokio::test]
async fn healthy_idle_pool_routes_locally_with_the_served_name() {
    let dir = TempDir::new("idle");
    write_policies(&dir.0);
    let (stage, router) = stage_and_router(&dir.0).await;
    let (plan, explain) = decide(&stage, &router, &chat("Hello there")).await;
    let plan = plan.unwrap();
    assert!(!plan.burst);
    assert_eq!(plan.rule, "default");
    match &plan.targets[..] {
        [
            PlanTarget::Pool {
                pool,
                model,
                workers,
            },
        ] => {
            assert_eq!(pool, "local");
            assert_eq!(model, "small-served");
            assert_eq!(
                workers.as_deref(),
                Some(&["http://w0".to_string(), "http://w1".to_string()][..])
            );
        }
        other => panic!("unexpected targets {other:?}"),
    }
    let explain = explain.unwrap();
    assert!(explain.contains("outcome=route"), "{explain}");
    assert!(explain.contains("local(queue=?"), "{explain}");
}

#[tokio::test]
async fn down_pool_bursts_but_personal_data_is_refused_and_never_planned_remote() {
    let dir = TempDir::new("down");
    write_policies(&dir.0);
    let (stage, router) = stage_and_router(&dir.0).await;
    router.set_healthy("http://w0", false);
    router.set_healthy("http://w1", false);

    let (plan, explain) = decide(&stage, &router, &chat("Summarize the weekly report")).await;
    let plan = plan.unwrap();
    assert!(plan.burst);
    assert_eq!(plan.rule, "burst/saturated");
    assert!(
        matches!(&plan.targets[0], PlanTarget::Provider { model, .. } if model == "cloud-model")
    );
    assert!(explain.unwrap().contains("local(unavailable)"));

    let pii = chat("Please write to jane.doe@example.com about the invoice");
    let (plan, explain) = decide(&stage, &router, &pii).await;
    match plan {
        Err(GatewayError::PolicyRejected {
            status,
            code,
            message,
        }) => {
            assert_eq!(status, http::StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(code, "local_processing_required");
            assert!(message.contains("personal data"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(explain.unwrap().contains("outcome=reject"));

    // With the pool back, the PII request stays local even though a burst rule exists.
    router.set_healthy("http://w0", true);
    let (plan, _) = decide(&stage, &router, &pii).await;
    let plan = plan.unwrap();
    assert!(plan.local_only);
    assert!(
        plan.targets
            .iter()
            .all(|t| matches!(t, PlanTarget::Pool { .. }))
    );
}

#[test]
fn a_pool_without_workers_reports_saturated() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = TempDir::new("snap");
    write_policies(&dir.0);
    rt.block_on(async {
        let source =
            crate::config_source::files::start(dir.0.clone(), Duration::from_secs(60)).unwrap();
        let stage = PolicyStage::start(source.into_policy_sets(), Duration::from_secs(60));
        let snap = stage.snapshot(&[]);
        assert!(!snap.available);
        assert_eq!(snap.queue_depth, Some(u32::MAX));
        let est = WorkerEstimate {
            worker: "http://w0".into(),
            ttft_s: Some(0.25),
            cached_tokens: 32,
            in_flight: 1,
            waiting: Some(4),
            kv_usage: Some(0.5),
        };
        let snap = stage.snapshot(&[&est]);
        assert!(snap.available);
        assert_eq!(snap.queue_depth, Some(4));
        assert_eq!(snap.estimated_ttft_ms, Some(250.0));
        assert_eq!(snap.cached_tokens, Some(32));
        assert_eq!(snap.kv_cache_usage, Some(0.5));
    });
}

#[test]
fn header_values_are_visible_ascii() {
    assert_eq!(header_safe("a\nb – c"), "a?b ? c");
}

/// Two pools of the same model found by selector: `near` (Local, l40s, `tier: a`) and `far`
/// (Remote, h100, `tier: b`), tried in that order.
fn write_selector_pools(dir: &Path) {
    let tok = tokenizer_dir();
    let pool = |name: &str, tier: &str, gpu: &str, locality: &str| {
        format!(
            r#"apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {{name: {name}}}
spec:
  models: [small]
  gpuClass: {gpu}
  locality: {locality}
  selector: {{matchLabels: {{tier: {tier}}}, targetPort: 8000}}
  prices: {{cachedInputPerMillion: 0.01, uncachedInputPerMillion: 0.1, outputPerMillion: 0.2}}
---
"#
        )
    };
    let text = format!(
        r#"apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {{name: small}}
spec:
  servedName: small-served
  classes: [general]
  tokenizer: {{dir: "{tok}"}}
---
{near}{far}apiVersion: kinference.ai/v1alpha1
kind: InferencePolicy
metadata: {{name: order}}
spec:
  priority: 10
  rules:
    - name: near-first
      action: {{route: {{targets: [{{pool: near}}, {{pool: far}}]}}}}
"#,
        tok = tok.display(),
        near = pool("near", "a", "l40s", "Local"),
        far = pool("far", "b", "h100", "Remote"),
    );
    std::fs::write(dir.join("policies.yaml"), text).unwrap();
}

fn discovered_worker(url: &str, labels: &[(&str, &str)]) -> (String, PodWorker) {
    let worker = PodWorker {
        url: url.into(),
        model: "small-served".into(),
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    };
    (url.to_string(), worker)
}

fn pool_workers_of(plan: &Plan) -> Vec<(String, Option<Vec<String>>)> {
    plan.targets
        .iter()
        .filter_map(|t| match t {
            PlanTarget::Pool { pool, workers, .. } => Some((pool.clone(), workers.clone())),
            PlanTarget::Provider { .. } => None,
        })
        .collect()
}

#[tokio::test]
async fn selector_pools_are_the_discovered_workers_their_labels_and_gpu_class_pick() {
    let dir = TempDir::new("selector");
    write_selector_pools(&dir.0);
    let config = crate::config::GatewayConfig {
        policy_dir: Some(dir.0.clone()),
        ..Default::default()
    };
    let source = crate::config::local_source(&config).unwrap();
    let (_, pools) =
        crate::config::with_policy_stage(config, &crate::config::HttpSettings::default(), source);
    let pools = pools.unwrap();
    let stage = Arc::clone(pools.stage());
    let (a, b, c) = (
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
        "http://10.0.0.3:8000",
    );
    let router = Router::new(RoutingConfig {
        workers: [a, b, c]
            .iter()
            .map(|u| crate::routing::WorkerConfig {
                url: u.to_string(),
                model: "small-served".into(),
                role: Default::default(),
            })
            .collect(),
        models: pools.routing_additions().1,
        agents: vec![],
        mode: RoutingMode::Kinference,
    })
    .unwrap();

    // No discovered view (local mode): a selector pool stands for every worker of its model.
    let (plan, _) = decide(&stage, &router, &chat("Hello there")).await;
    assert_eq!(
        pool_workers_of(&plan.unwrap()),
        [("near".into(), None), ("far".into(), None)]
    );

    // Discovery: `c` has near's label but runs on h100, so it is nobody's.
    let (tx, rx) = tokio::sync::watch::channel(WorkerSet::from([
        discovered_worker(a, &[("tier", "a")]),
        discovered_worker(b, &[("tier", "b"), (pool_members::GPU_CLASS_LABEL, "h100")]),
        discovered_worker(c, &[("tier", "a"), (pool_members::GPU_CLASS_LABEL, "h100")]),
    ]));
    stage.follow_discovered(rx);
    let (plan, _) = decide(&stage, &router, &chat("Hello there")).await;
    assert_eq!(
        pool_workers_of(&plan.unwrap()),
        [
            ("near".into(), Some(vec![a.to_string()])),
            ("far".into(), Some(vec![b.to_string()])),
        ]
    );

    // Personal data stays local: only near's own worker.
    let (plan, _) = decide(&stage, &router, &chat("mail me at jane.doe@example.com")).await;
    assert_eq!(
        pool_workers_of(&plan.unwrap()),
        [("near".into(), Some(vec![a.to_string()]))]
    );

    // Relabelled: `a` moves to far; near is empty: unavailable (so not planned), never "every
    // worker of the model".
    tx.send_replace(WorkerSet::from([
        discovered_worker(a, &[("tier", "b")]),
        discovered_worker(b, &[("tier", "b"), (pool_members::GPU_CLASS_LABEL, "h100")]),
    ]));
    let (plan, explain) = decide(&stage, &router, &chat("Hello there")).await;
    assert_eq!(
        pool_workers_of(&plan.unwrap()),
        [("far".into(), Some(vec![a.to_string(), b.to_string()]))]
    );
    let explain = explain.unwrap();
    assert!(explain.contains("near(unavailable"), "{explain}");
}
