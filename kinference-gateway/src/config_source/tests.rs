use serde_json::json;

use super::*;

fn tenant(ns: &str, name: &str, generation: i64, secret: &str) -> serde_json::Value {
    json!({
        "apiVersion": "kinference.ai/v1alpha1", "kind": "InferenceTenant",
        "metadata": {"name": name, "namespace": ns, "generation": generation, "uid": format!("uid-{name}"),
            "managedFields": [{"manager": "kubectl"}]},
        "spec": {"apiKeys": [{"secretRef": {"name": secret, "key": "api-key"}}]},
        "status": {"observedGeneration": 1}
    })
}

fn obj(kind: &'static str, ns: &str, name: &str) -> ObjectRef {
    ObjectRef {
        kind,
        namespace: ns.into(),
        name: name.into(),
    }
}

#[test]
fn a_valid_generation_replaces_an_invalid_one_rolls_back_and_delete_removes() {
    let mut a = Applier::default();
    a.upsert_value("InferenceTenant", &tenant("ns", "acme", 1, "acme-v1"));
    a.upsert_value("InferenceTenant", &tenant("ns", "beta", 1, "beta"));
    let s = a.build(true);
    assert_eq!(s.set.tenants.len(), 2);
    let acme = &s.objects[&obj("InferenceTenant", "ns", "acme")];
    assert_eq!(acme.state, ObjectState::Accepted);
    assert_eq!(acme.serving_generation, Some(1));
    assert_eq!(acme.uid.as_deref(), Some("uid-acme"));
    assert!(acme.live_status.is_some());

    // Generation 2 is valid: it serves.
    a.upsert_value("InferenceTenant", &tenant("ns", "acme", 2, "acme-v2"));
    let s = a.build(true);
    assert_eq!(
        s.set.tenants["acme"].spec.api_keys[0]
            .secret_ref
            .as_ref()
            .map(|r| r.name.as_str()),
        Some("acme-v2")
    );

    // Generation 3 is invalid (unknown field): generation 2 keeps serving, beta untouched.
    let mut bad = tenant("ns", "acme", 3, "acme-v3");
    bad["spec"]["apiKeyz"] = json!([]);
    a.upsert_value("InferenceTenant", &bad);
    let s = a.build(true);
    let acme = &s.objects[&obj("InferenceTenant", "ns", "acme")];
    match &acme.state {
        ObjectState::RolledBack {
            error,
            serving_generation,
        } => {
            assert!(error.contains("apiKeyz"), "{error}");
            assert_eq!(*serving_generation, Some(2));
        }
        other => panic!("expected RolledBack, got {other:?}"),
    }
    assert_eq!(acme.observed_generation, Some(3));
    assert_eq!(acme.serving_generation, Some(2));
    assert_eq!(s.set.tenants["acme"].generation, Some(2));
    assert!(s.set.tenants.contains_key("beta"));

    // Still rolled back on the next rebuild (another object changed).
    a.upsert_value("InferenceTenant", &tenant("ns", "beta", 2, "beta"));
    let s = a.build(true);
    assert_eq!(s.set.tenants["acme"].generation, Some(2));

    // Deleting removes it.
    a.remove(&obj("InferenceTenant", "ns", "acme"));
    let s = a.build(true);
    assert!(!s.set.tenants.contains_key("acme"));
    assert!(
        !s.objects
            .contains_key(&obj("InferenceTenant", "ns", "acme"))
    );
    assert_eq!(s.set.tenants.len(), 1);
}

#[test]
fn an_invalid_object_with_no_valid_generation_is_rejected_and_not_served() {
    let mut a = Applier::default();
    let mut bad = tenant("ns", "acme", 1, "acme");
    bad["spec"]["apiKeys"] = json!("not a list");
    a.upsert_value("InferenceTenant", &bad);
    let s = a.build(true);
    assert!(s.set.tenants.is_empty());
    assert!(matches!(
        s.objects[&obj("InferenceTenant", "ns", "acme")].state,
        ObjectState::Rejected { .. }
    ));
    assert_eq!(
        s.objects[&obj("InferenceTenant", "ns", "acme")].serving_generation,
        None
    );
}

#[test]
fn a_relist_replaces_the_objects_of_its_scope_only() {
    let mut a = Applier::default();
    a.upsert_value("InferenceTenant", &tenant("a", "one", 1, "s"));
    a.upsert_value("InferenceTenant", &tenant("b", "two", 1, "s"));
    a.replace_where(
        |o| o.kind == "InferenceTenant" && o.namespace == "a",
        "InferenceTenant",
        &[tenant("a", "three", 1, "s")],
    );
    let s = a.build(true);
    let names: Vec<&str> = s.set.tenants.keys().map(String::as_str).collect();
    assert_eq!(names, ["three", "two"]);
}

fn created(mut v: serde_json::Value, at: &str) -> serde_json::Value {
    v["metadata"]["creationTimestamp"] = json!(at);
    v
}

fn serving_secret(s: &Snapshot, tenant: &str) -> Option<String> {
    s.set.tenants.get(tenant).and_then(|t| {
        t.spec.api_keys[0]
            .secret_ref
            .as_ref()
            .map(|r| r.name.clone())
    })
}

#[test]
fn the_same_name_in_two_namespaces_is_owned_by_the_first_created_and_the_other_refused() {
    let mut a = Applier::default();
    // `zeta` was created first: it owns the name although `alpha` sorts first.
    a.upsert_value(
        "InferenceTenant",
        &created(
            tenant("alpha", "acme", 1, "alpha-key"),
            "2026-01-02T00:00:00Z",
        ),
    );
    a.upsert_value(
        "InferenceTenant",
        &created(
            tenant("zeta", "acme", 1, "zeta-key"),
            "2026-01-01T00:00:00Z",
        ),
    );
    let s = a.build(true);
    assert_eq!(s.set.tenants.len(), 1);
    assert_eq!(serving_secret(&s, "acme").as_deref(), Some("zeta-key"));
    let owner = &s.objects[&obj("InferenceTenant", "zeta", "acme")];
    assert_eq!(owner.state, ObjectState::Accepted);
    assert_eq!(owner.serving_generation, Some(1));
    let later = &s.objects[&obj("InferenceTenant", "alpha", "acme")];
    match &later.state {
        ObjectState::Conflict { error, owner } => {
            assert_eq!(*owner, obj("InferenceTenant", "zeta", "acme"));
            assert!(error.contains("\"zeta\""), "{error}");
        }
        other => panic!("expected Conflict, got {other:?}"),
    }
    assert_eq!(later.serving_generation, None);
    // Secrets are read in the owner's namespace.
    assert_eq!(
        s.entry("InferenceTenant", "acme")
            .map(|e| e.object.namespace.as_str()),
        Some("zeta")
    );
    let status = status::desired_status(later);
    let accepted = &status["conditions"][0];
    assert_eq!(accepted["type"], "Accepted");
    assert_eq!(accepted["status"], "False");
    assert_eq!(accepted["reason"], "NameConflict");
    assert_eq!(status["conditions"][1]["status"], "False", "not Ready");

    // The owner's next generation is invalid: it rolls back and keeps the name (no flip to alpha).
    let mut bad = created(
        tenant("zeta", "acme", 2, "zeta-key"),
        "2026-01-01T00:00:00Z",
    );
    bad["spec"]["apiKeyz"] = json!([]);
    a.upsert_value("InferenceTenant", &bad);
    let s = a.build(true);
    assert_eq!(serving_secret(&s, "acme").as_deref(), Some("zeta-key"));
    assert!(matches!(
        s.objects[&obj("InferenceTenant", "zeta", "acme")].state,
        ObjectState::RolledBack { .. }
    ));
    assert!(matches!(
        s.objects[&obj("InferenceTenant", "alpha", "acme")].state,
        ObjectState::Conflict { .. }
    ));

    // Deleting the owner hands the name over.
    a.remove(&obj("InferenceTenant", "zeta", "acme"));
    let s = a.build(true);
    assert_eq!(serving_secret(&s, "acme").as_deref(), Some("alpha-key"));
    assert_eq!(
        s.objects[&obj("InferenceTenant", "alpha", "acme")].state,
        ObjectState::Accepted
    );
}

#[test]
fn status_says_rolled_back_with_the_serving_generation_and_compares_without_times() {
    let e = ObjectEntry {
        object: obj("InferencePolicy", "ns", "p"),
        observed_generation: Some(5),
        serving_generation: Some(4),
        state: ObjectState::RolledBack {
            error: "spec.rules[0].action: unknown field `rout`".into(),
            serving_generation: Some(4),
        },
        live_status: None,
        uid: None,
    };
    let s = status::desired_status(&e);
    assert_eq!(s["observedGeneration"], 5);
    assert_eq!(s["activeGeneration"], 4);
    let rolled = s["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "RolledBack"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(rolled["status"], "True");
    let msg = rolled["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("rout") && msg.contains("generation 4"),
        "{msg}"
    );
    let mut later = s.clone();
    later["conditions"][0]["lastTransitionTime"] = json!("2030-01-01T00:00:00Z");
    assert!(status::same_status(Some(&later), &s));
    later["activeGeneration"] = json!(5);
    assert!(!status::same_status(Some(&later), &s));
    assert!(!status::same_status(None, &s));
}

#[test]
fn diff_shows_creates_field_level_updates_and_deletes_but_not_defaults() {
    let live = vec![
        (
            obj("InferenceTenant", "ns", "acme"),
            tenant("ns", "acme", 1, "acme"),
        ),
        (
            obj("InferenceTenant", "ns", "gone"),
            tenant("ns", "gone", 1, "gone"),
        ),
        (
            obj("InferenceTenant", "ns", "same"),
            tenant("ns", "same", 4, "same"),
        ),
    ];
    let mut a = Applier::default();
    a.upsert_value("InferenceTenant", &tenant("", "acme", 1, "acme-rotated"));
    a.upsert_value("InferenceTenant", &tenant("", "same", 1, "same"));
    a.upsert_value("InferenceTenant", &tenant("", "new", 1, "new"));
    let set = a.build(true).set;
    let local: Vec<_> = set
        .tenants
        .keys()
        .filter_map(|n| {
            set.manifest(&ObjectKey {
                kind: "InferenceTenant",
                name: n.clone(),
            })
        })
        .collect();
    let changes = inspect::diff(&local, &live);
    assert_eq!(
        changes,
        vec![
            inspect::Change::Update {
                object: "InferenceTenant/acme".into(),
                paths: vec!["spec.apiKeys[0].secretRef.name".into()],
            },
            inspect::Change::Create {
                object: "InferenceTenant/new".into()
            },
            inspect::Change::Delete {
                object: "InferenceTenant/gone".into()
            },
        ]
    );
}

#[test]
fn explain_names_each_state_as_the_metric_does_and_reads_back_the_written_status() {
    let entry = |state: ObjectState, serving: Option<i64>| ObjectEntry {
        object: obj("InferencePolicy", "ns", "p"),
        observed_generation: Some(3),
        serving_generation: serving,
        state,
        live_status: None,
        uid: None,
    };
    let states = [
        entry(ObjectState::Accepted, Some(3)),
        entry(
            ObjectState::RolledBack {
                error: "spec.rules[0].action: unknown field `rout`".into(),
                serving_generation: Some(2),
            },
            Some(2),
        ),
        entry(
            ObjectState::Rejected {
                error: "spec.priority: missing".into(),
            },
            None,
        ),
        entry(
            ObjectState::Conflict {
                error: "taken".into(),
                owner: obj("InferencePolicy", "other", "p"),
            },
            None,
        ),
    ];
    for e in &states {
        let explained = inspect::explain_entry(e);
        assert_eq!(explained.state, e.state.name());
        assert_eq!(explained.serving_generation, e.serving_generation);
        assert_eq!(explained.observed_generation, Some(3));
        // What the cluster returns once the status is written explains the same way.
        let live = json!({"metadata": {"generation": 3}, "status": status::desired_status(e)});
        assert_eq!(inspect::explain_live(&e.object, &live), explained);
        assert_eq!(inspect::status_row(&e.object, &live).state, e.state.name());
    }
    let rolled = inspect::explain_entry(&states[1]).to_string();
    assert!(rolled.contains("state: RolledBack"), "{rolled}");
    assert!(
        rolled.contains("rout") && rolled.contains("generation 2 keeps serving"),
        "{rolled}"
    );
    let pending = inspect::explain_live(&obj("InferencePolicy", "ns", "p"), &json!({}));
    assert_eq!(pending.state, "Pending");
    assert_eq!(inspect::kind_named("ipol"), Some("InferencePolicy"));
    assert_eq!(inspect::kind_named("inferencepools"), Some("InferencePool"));
    assert_eq!(
        inspect::kind_named("InferenceTenant"),
        Some("InferenceTenant")
    );
    assert_eq!(inspect::kind_named("pod"), None);
}

#[tokio::test]
async fn a_tenants_file_missing_at_start_is_unsynced_until_it_appears_then_followed() {
    let dir = std::env::temp_dir().join(format!(
        "kinference-files-source-{}-{:x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("tenants.yaml");
    let source = files::start_or_wait(file.clone(), std::time::Duration::from_millis(20));
    assert!(!source.current().synced, "nothing to read yet: unsynced");
    let tenant = |name: &str| {
        format!(
            "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {{name: {name}}}\nspec: {{apiKeys: [{{env: KEY}}]}}\n"
        )
    };
    std::fs::write(&file, tenant("acme")).expect("write");
    assert!(source.wait_synced(std::time::Duration::from_secs(5)).await);
    assert!(source.current().set.tenants.contains_key("acme"));
    // A broken edit keeps the last good version (the file is one object's only source).
    let mut rx = source.subscribe();
    std::fs::write(
        &file,
        "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {name: acme\n",
    )
    .expect("write");
    tokio::time::timeout(std::time::Duration::from_secs(5), rx.changed())
        .await
        .expect("reloaded")
        .expect("open");
    assert!(source.current().set.tenants.contains_key("acme"));
    let _ = std::fs::remove_dir_all(&dir);
}

fn model(name: &str, spec: serde_json::Value) -> serde_json::Value {
    json!({
        "apiVersion": "kinference.ai/v1alpha1", "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": "ns", "generation": 1},
        "spec": spec
    })
}

#[test]
fn serves_messages_reaches_the_routers_model_configuration() {
    let mut a = Applier::default();
    a.upsert_value(
        "InferenceModel",
        &model(
            "chat",
            json!({"servedName": "chat-served", "servesMessages": true}),
        ),
    );
    a.upsert_value(
        "InferenceModel",
        &model("plain", json!({"servedName": "plain-served"})),
    );
    // A misspelt key is refused, naming it; nothing of that object serves.
    a.upsert_value(
        "InferenceModel",
        &model(
            "typo",
            json!({"servedName": "typo-served", "serveMessages": true}),
        ),
    );
    let s = a.build(true);
    let models = crate::pools::pool_models(&s.set);
    let serves = |name: &str| {
        models
            .iter()
            .find(|m| m.name == name)
            .map(|m| m.serves_messages)
    };
    assert_eq!(serves("chat-served"), Some(true));
    assert_eq!(serves("plain-served"), Some(false));
    assert_eq!(serves("typo-served"), None);
    let typo = &s.objects[&obj("InferenceModel", "ns", "typo")];
    assert!(
        typo.state
            .error()
            .is_some_and(|e| e.contains("serveMessages")),
        "{:?}",
        typo.state
    );
}

#[test]
fn a_pools_worker_credentials_secret_is_watched_in_its_namespace() {
    let mut a = Applier::default();
    a.upsert_value("InferenceModel", &model("m", json!({"servedName": "m"})));
    a.upsert_value(
        "InferencePool",
        &json!({
            "apiVersion": "kinference.ai/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "keyed", "namespace": "workers", "generation": 1},
            "spec": {"models": ["m"], "gpuClass": "l4", "endpoints": [{"url": "http://10.0.0.1:8000"}],
                "prices": {"cachedInputPerMillion": 0.0, "uncachedInputPerMillion": 0.1, "outputPerMillion": 0.2},
                "workerCredentials": {"secretRef": {"name": "vllm-key", "key": "api-key"}},
                "workerHeaders": {"x-team": "search"}}
        }),
    );
    let s = a.build(true);
    assert_eq!(
        s.objects[&obj("InferencePool", "workers", "keyed")].state,
        ObjectState::Accepted
    );
    let pool = &s.set.pools["keyed"].spec;
    assert_eq!(
        pool.worker_headers.get("x-team").map(String::as_str),
        Some("search")
    );
    assert!(
        secrets::referenced(&s).contains(&("workers".to_string(), "vllm-key".to_string())),
        "{:?}",
        secrets::referenced(&s)
    );
}

/// What the policy stage's own directory poller was tested for, on the source the gateway runs:
/// a change reloads, and a version that fails the set's cross-checks keeps the previous one
/// serving, its object `RolledBack`.
#[tokio::test]
async fn the_policy_directory_reloads_on_change_and_rolls_back_bad_versions() {
    use crate::policy::engine::tests::{POLICIES, RESOURCES};
    let dir = std::env::temp_dir().join(format!(
        "kinference-files-reload-{}-{:x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("resources.yaml"), RESOURCES).expect("write");
    std::fs::write(dir.join("policies.yaml"), POLICIES).expect("write");
    let source = files::start(dir.clone(), std::time::Duration::from_millis(50)).expect("start");
    let mut rx = source.subscribe();
    assert_eq!(source.current().set.policies.len(), 3);
    async fn reload(rx: &mut tokio::sync::watch::Receiver<Arc<Snapshot>>) {
        tokio::time::timeout(std::time::Duration::from_secs(5), rx.changed())
            .await
            .expect("reload")
            .expect("open");
    }
    // Suspend one policy: applied.
    std::fs::write(
        dir.join("policies.yaml"),
        POLICIES.replace("priority: 10\n", "priority: 10\n  suspend: true\n"),
    )
    .expect("write");
    reload(&mut rx).await;
    assert!(
        source
            .current()
            .set
            .policies
            .iter()
            .any(|p| p.name == "burst" && p.spec.suspend)
    );
    // Break it with an unknown provider: the suspended version keeps serving.
    std::fs::write(
        dir.join("policies.yaml"),
        POLICIES
            .replace("providers: [cloud]", "providers: [nope]")
            .replace("priority: 10\n", "priority: 10 \n"),
    )
    .expect("write");
    reload(&mut rx).await;
    let snapshot = source.current();
    let burst = snapshot
        .set
        .policies
        .iter()
        .find(|p| p.name == "burst")
        .expect("kept");
    assert!(burst.spec.suspend);
    let entry = snapshot.entry("InferencePolicy", "burst").expect("entry");
    assert!(
        matches!(entry.state, ObjectState::RolledBack { .. }),
        "{:?}",
        entry.state
    );
    let _ = std::fs::remove_dir_all(&dir);
}
