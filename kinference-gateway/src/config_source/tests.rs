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

#[test]
fn the_same_name_in_two_namespaces_serves_once() {
    let mut a = Applier::default();
    a.upsert_value("InferenceTenant", &tenant("a", "acme", 1, "s"));
    a.upsert_value("InferenceTenant", &tenant("b", "acme", 1, "s"));
    let s = a.build(true);
    assert_eq!(s.set.tenants.len(), 1);
    assert!(matches!(
        s.objects[&obj("InferenceTenant", "b", "acme")].state,
        ObjectState::Rejected { .. }
    ));
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
