use std::collections::BTreeSet;
use std::path::Path;

use kinference_crds::Complexity;

use super::{Backend, Outcome, PoolSnapshot, PoolStates, RequestFacts, RuleVerdict, evaluate};
use crate::policy::model::PolicySet;
use crate::policy::source::parse_file;

pub(crate) const RESOURCES: &str = r#"
apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {name: small}
spec: {servedName: org/small, aliases: [s], classes: [general, cheap], costTier: Economy}
---
apiVersion: kinference.ai/v1alpha1
kind: InferenceModel
metadata: {name: large}
spec: {servedName: org/large, aliases: [l], classes: [general, coding], costTier: Premium}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {name: pool-small}
spec:
  models: [small]
  gpuClass: l4
  endpoints: [{url: "http://127.0.0.1:8001"}]
  prices: {cachedInputPerMillion: 0.01, uncachedInputPerMillion: 0.1, outputPerMillion: 0.3}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePool
metadata: {name: pool-large}
spec:
  models: [large]
  gpuClass: l40s
  endpoints: [{url: "http://127.0.0.1:8002"}]
  prices: {cachedInputPerMillion: 0.1, uncachedInputPerMillion: 1.0, outputPerMillion: 3.0}
---
apiVersion: kinference.ai/v1alpha1
kind: InferenceProvider
metadata: {name: cloud}
spec:
  baseUrl: https://api.example.invalid/v1
  apiStyle: OpenAI
  credentials: {env: CLOUD_KEY}
  models:
    - {name: cloud-mini, substitutes: [small], classes: [general]}
    - {name: cloud-big, substitutes: [large], classes: [coding, frontier]}
  prices: {cachedInputPerMillion: 0.5, uncachedInputPerMillion: 2, outputPerMillion: 8}
---
apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata: {name: acme}
spec: {apiKeys: [{env: ACME_KEY}]}
---
apiVersion: kinference.ai/v1alpha1
kind: InferenceTenant
metadata: {name: trial}
spec: {apiKeys: [{env: TRIAL_KEY}], allowedModels: [small]}
"#;

pub(crate) const POLICIES: &str = r#"
apiVersion: kinference.ai/v1alpha1
kind: InferencePolicy
metadata: {name: guard}
spec:
  priority: 0
  rules:
    - name: pii-local
      match: {tags: [pii]}
      action: {requireLocal: {}}
    - name: unknown-tenant
      match: {unknownTenant: true}
      action: {reject: {status: 401, message: "unknown API key"}}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePolicy
metadata: {name: burst}
spec:
  priority: 10
  rules:
    - name: saturated
      action:
        burst:
          providers: [cloud]
          when: {queueDepthAbove: 8}
---
apiVersion: kinference.ai/v1alpha1
kind: InferencePolicy
metadata: {name: semantic}
spec:
  priority: 20
  rules:
    - name: simple-cheap
      match: {classes: [general], complexity: [Simple]}
      action:
        route:
          targets: [{modelClass: cheap}, {pool: pool-large}]
          select: CheaperUnlessFaster
          minTtftGainMs: 200
"#;

pub(crate) fn set_from(texts: &[&str]) -> PolicySet {
    let mut manifests = Vec::new();
    for (i, t) in texts.iter().enumerate() {
        let parsed = parse_file(Path::new(&format!("t{i}.yaml")), t);
        assert!(parsed.problems.is_empty(), "{:?}", parsed.problems);
        manifests.extend(parsed.manifests);
    }
    let out = PolicySet::build(&manifests, None, &Default::default());
    assert!(out.problems.is_empty(), "{:?}", out.problems);
    out.set
}

fn facts(tenant: &str, model: &str, tags: &[&str], complexity: Complexity) -> RequestFacts {
    RequestFacts {
        tenant: Some(tenant.to_string()),
        model: model.to_string(),
        tags: tags.iter().map(|t| t.to_string()).collect::<BTreeSet<_>>(),
        complexity: Some(complexity),
        prompt_tokens: Some(2000),
        max_output_tokens: Some(100),
    }
}

fn state(pools: &[(&str, PoolSnapshot)]) -> PoolStates {
    PoolStates {
        pools: pools
            .iter()
            .map(|(n, s)| (n.to_string(), s.clone()))
            .collect(),
    }
}

fn snap(queue: u32, ttft: f64) -> PoolSnapshot {
    PoolSnapshot {
        queue_depth: Some(queue),
        estimated_ttft_ms: Some(ttft),
        ..PoolSnapshot::default()
    }
}

fn first(outcome: &Outcome) -> Backend {
    match outcome {
        Outcome::Route(plan) => plan.targets[0].backend.clone(),
        Outcome::Reject(r) => panic!("rejected: {r:?}"),
    }
}

fn saturated() -> PoolStates {
    state(&[
        ("pool-small", snap(20, 5000.0)),
        ("pool-large", snap(20, 9000.0)),
    ])
}

#[test]
fn saturation_bursts_to_the_provider_with_local_fallbacks() {
    let set = set_from(&[RESOURCES, POLICIES]);
    let d = evaluate(
        &set,
        &facts("acme", "large", &[], Complexity::Complex),
        &saturated(),
    );
    let Outcome::Route(plan) = &d.outcome else {
        panic!("{}", d.explain())
    };
    assert!(plan.burst);
    assert_eq!(plan.targets[0].backend, Backend::Provider("cloud".into()));
    assert_eq!(plan.targets[0].model, "cloud-big");
    assert_eq!(
        plan.targets.last().map(|t| t.backend.clone()),
        Some(Backend::Pool("pool-large".into()))
    );
    assert_eq!(
        d.rule().map(ToString::to_string).as_deref(),
        Some("burst/saturated")
    );
}

#[test]
fn pii_never_bursts_even_when_saturated() {
    let set = set_from(&[RESOURCES, POLICIES]);
    let d = evaluate(
        &set,
        &facts("acme", "large", &["pii", "pii:email"], Complexity::Complex),
        &saturated(),
    );
    assert_eq!(
        first(&d.outcome),
        Backend::Pool("pool-large".into()),
        "{}",
        d.explain()
    );
    let burst = d
        .trace
        .iter()
        .find(|t| t.rule.rule == "saturated")
        .expect("trace");
    assert!(
        matches!(&burst.verdict, RuleVerdict::Skipped(r) if r.contains("local-only")),
        "{burst:?}"
    );
    assert!(d.local_only.is_some());
}

#[test]
fn pii_is_kept_local_by_the_builtin_guard_without_any_policy() {
    let set = set_from(&[
        RESOURCES,
        "apiVersion: kinference.ai/v1alpha1\nkind: InferencePolicy\nmetadata: {name: b}\nspec:\n  priority: 1\n  rules:\n    - name: always\n      action: {burst: {providers: [cloud], when: {queueDepthAbove: 1}}}\n",
    ]);
    let d = evaluate(
        &set,
        &facts("acme", "small", &["pii"], Complexity::Simple),
        &saturated(),
    );
    assert_eq!(
        first(&d.outcome),
        Backend::Pool("pool-small".into()),
        "{}",
        d.explain()
    );
    assert!(d.local_only.as_ref().is_some_and(|l| l.rule.is_none()));
}

#[test]
fn pii_without_an_available_local_pool_is_refused_not_sent_remote() {
    let set = set_from(&[RESOURCES, POLICIES]);
    let down = PoolSnapshot {
        available: false,
        queue_depth: Some(50),
        ..PoolSnapshot::default()
    };
    let st = state(&[("pool-small", down.clone()), ("pool-large", down)]);
    let d = evaluate(
        &set,
        &facts("acme", "large", &["pii", "pii:iban"], Complexity::Simple),
        &st,
    );
    let Outcome::Reject(r) = &d.outcome else {
        panic!("{}", d.explain())
    };
    assert_eq!((r.status, r.code), (503, "local_processing_required"));
    assert!(r.message.contains("personal data (iban)"), "{}", r.message);
    // The same request without PII bursts.
    let d = evaluate(&set, &facts("acme", "large", &[], Complexity::Simple), &st);
    assert!(
        matches!(&d.outcome, Outcome::Route(p) if p.burst),
        "{}",
        d.explain()
    );
}

#[test]
fn pii_for_a_model_only_a_provider_serves_is_refused_with_403() {
    let set = set_from(&[RESOURCES, POLICIES]);
    let d = evaluate(
        &set,
        &facts("acme", "frontier", &["pii"], Complexity::Simple),
        &PoolStates::default(),
    );
    let Outcome::Reject(r) = &d.outcome else {
        panic!("{}", d.explain())
    };
    assert_eq!(r.status, 403);
    assert_eq!(r.code, "local_processing_required");
    assert!(
        r.message.contains("no local pool serves it"),
        "{}",
        r.message
    );
}

#[test]
fn simple_prompts_go_to_the_cheap_model_unless_the_dear_one_is_much_faster() {
    let set = set_from(&[RESOURCES, POLICIES]);
    let f = facts("acme", "large", &[], Complexity::Simple);
    // Both cold: cheap wins.
    let cold = state(&[
        ("pool-small", snap(0, 900.0)),
        ("pool-large", snap(0, 1500.0)),
    ]);
    let d = evaluate(&set, &f, &cold);
    assert_eq!(
        first(&d.outcome),
        Backend::Pool("pool-small".into()),
        "{}",
        d.explain()
    );
    let Outcome::Route(plan) = &d.outcome else {
        unreachable!()
    };
    assert_eq!(plan.targets[0].model, "org/small");
    // The large pool holds the prompt: 120 ms vs 900 ms, gain 780 >= 200: the dear one wins.
    let warm = state(&[
        ("pool-small", snap(0, 900.0)),
        ("pool-large", snap(0, 120.0)),
    ]);
    let d = evaluate(&set, &f, &warm);
    assert_eq!(
        first(&d.outcome),
        Backend::Pool("pool-large".into()),
        "{}",
        d.explain()
    );
    assert!(d.explain().contains("dearer but faster"));
    // Faster by less than the threshold: cheap still wins.
    let close = state(&[
        ("pool-small", snap(0, 900.0)),
        ("pool-large", snap(0, 750.0)),
    ]);
    assert_eq!(
        first(&evaluate(&set, &f, &close).outcome),
        Backend::Pool("pool-small".into())
    );
}

#[test]
fn unknown_tenants_models_and_disallowed_models_are_rejected() {
    let set = set_from(&[RESOURCES, POLICIES]);
    let st = PoolStates::default();
    let d = evaluate(
        &set,
        &facts("nobody", "small", &[], Complexity::Simple),
        &st,
    );
    assert!(
        matches!(&d.outcome, Outcome::Reject(r) if r.status == 401),
        "{}",
        d.explain()
    );
    let d = evaluate(&set, &facts("acme", "gpt-9", &[], Complexity::Complex), &st);
    assert!(
        matches!(&d.outcome, Outcome::Reject(r) if r.code == "model_not_found"),
        "{}",
        d.explain()
    );
    let d = evaluate(
        &set,
        &facts("trial", "large", &[], Complexity::Complex),
        &st,
    );
    assert!(
        matches!(&d.outcome, Outcome::Reject(r) if r.code == "model_not_allowed"),
        "{}",
        d.explain()
    );
    let d = evaluate(&set, &facts("trial", "s", &[], Complexity::Complex), &st);
    assert_eq!(first(&d.outcome), Backend::Pool("pool-small".into()));
}

#[test]
fn classes_and_aliases_resolve() {
    let set = set_from(&[RESOURCES, POLICIES]);
    let d = evaluate(
        &set,
        &facts("acme", "coding", &[], Complexity::Complex),
        &PoolStates::default(),
    );
    assert_eq!(
        first(&d.outcome),
        Backend::Pool("pool-large".into()),
        "{}",
        d.explain()
    );
    assert!(d.rule().is_none(), "default route");
    let d = evaluate(
        &set,
        &facts("acme", "l", &[], Complexity::Moderate),
        &PoolStates::default(),
    );
    assert_eq!(first(&d.outcome), Backend::Pool("pool-large".into()));
}

#[test]
fn every_rule_is_explained() {
    let set = set_from(&[RESOURCES, POLICIES]);
    let d = evaluate(
        &set,
        &facts("acme", "large", &[], Complexity::Complex),
        &PoolStates::default(),
    );
    assert_eq!(d.trace.len(), 4);
    let text = d.explain();
    assert!(
        text.contains("guard/pii-local: no match: tag \"pii\" is absent"),
        "{text}"
    );
    assert!(
        text.contains("burst/saturated: no match: burst condition"),
        "{text}"
    );
    assert!(text.contains("no state reported"), "{text}");
    assert!(
        text.contains("complexity Complex is not in [Simple]"),
        "{text}"
    );
    let d = evaluate(
        &set,
        &facts("nobody", "large", &[], Complexity::Complex),
        &PoolStates::default(),
    );
    assert!(
        d.trace
            .iter()
            .skip(2)
            .all(|t| t.verdict == RuleVerdict::NotReached),
        "{}",
        d.explain()
    );
}

#[test]
fn facts_and_state_deserialize_from_yaml() {
    let f: RequestFacts =
        serde_yaml::from_str("model: small\ntags: [pii]\ncomplexity: Simple\n").expect("facts");
    assert!(f.tags.contains("pii"));
    let s: PoolStates =
        serde_yaml::from_str("pools:\n  pool-small: {queue_depth: 3, available: false}\n")
            .expect("state");
    assert!(!s.pools["pool-small"].available);
}
