use serde_json::json;

use super::validate;

fn policy(rule_action: serde_json::Value) -> serde_json::Value {
    json!({
        "apiVersion": "kinference.ai/v1alpha1",
        "kind": "InferencePolicy",
        "metadata": {"name": "p"},
        "spec": {"priority": 10, "rules": [{"name": "r", "action": rule_action}]}
    })
}

#[test]
fn valid_policy_passes() {
    let errors = validate(
        "InferencePolicy",
        &policy(json!({"reject": {"status": 403, "message": "no"}})),
    );
    assert!(errors.is_empty(), "{errors:?}");
}

#[test]
fn out_of_range_status_is_reported_with_its_path() {
    let errors = validate(
        "InferencePolicy",
        &policy(json!({"reject": {"status": 200, "message": "no"}})),
    );
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].path, "spec.rules[0].action.reject.status");
    assert!(
        errors[0].message.contains("minimum"),
        "{}",
        errors[0].message
    );
}

#[test]
fn missing_required_field_and_unknown_field_are_reported() {
    let errors = validate(
        "InferencePolicy",
        &policy(json!({"reject": {"status": 403, "mesage": "no"}})),
    );
    let paths: Vec<&str> = errors.iter().map(|e| e.path.as_str()).collect();
    assert!(
        paths.contains(&"spec.rules[0].action.reject.message"),
        "{paths:?}"
    );
    assert!(
        paths.contains(&"spec.rules[0].action.reject.mesage"),
        "{paths:?}"
    );
}

#[test]
fn enum_values_and_ranges_of_fractions_are_checked() {
    let mut obj = policy(
        json!({"burst": {"providers": ["cloud"], "when": {"kvCacheUsageAbove": 1.5, "mode": "Most"}}}),
    );
    let errors = validate("InferencePolicy", &obj);
    assert_eq!(errors.len(), 2, "{errors:?}");
    obj["spec"]["rules"][0]["action"]["burst"]["when"] =
        json!({"kvCacheUsageAbove": 0.9, "mode": "Any"});
    assert!(validate("InferencePolicy", &obj).is_empty());
}

#[test]
fn bad_names_and_unknown_kinds_are_rejected() {
    let mut obj = policy(json!({"requireLocal": {}}));
    obj["metadata"]["name"] = json!("Not_A_Name");
    assert_eq!(validate("InferencePolicy", &obj)[0].path, "metadata.name");
    assert_eq!(validate("InferenceThing", &obj)[0].path, "kind");
}

#[test]
fn pool_endpoint_urls_must_look_like_urls() {
    let pool = json!({
        "apiVersion": "kinference.ai/v1alpha1", "kind": "InferencePool", "metadata": {"name": "a"},
        "spec": {"models": ["m"], "gpuClass": "l40s", "endpoints": [{"url": "127.0.0.1:8001"}],
                 "prices": {"cachedInputPerMillion": 0.1, "uncachedInputPerMillion": 1.0, "outputPerMillion": 2.0}}
    });
    let errors = validate("InferencePool", &pool);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].path, "spec.endpoints[0].url");
}

#[test]
fn a_tenants_flow_control_share_is_validated() {
    let tenant = |flow: serde_json::Value| {
        json!({
            "apiVersion": "kinference.ai/v1alpha1",
            "kind": "InferenceTenant",
            "metadata": {"name": "t"},
            "spec": {
                "apiKeys": [{"secretRef": {"name": "t", "key": "api-key"}}],
                "priority": "Low",
                "flowControl": flow,
            }
        })
    };
    let ok = validate(
        "InferenceTenant",
        &tenant(json!({"weight": 4, "requestPriority": true, "queueDeadlineMs": 1500})),
    );
    assert!(ok.is_empty(), "{ok:?}");
    for (flow, path) in [
        (json!({"weight": 0}), "spec.flowControl.weight"),
        (json!({"weight": 1001}), "spec.flowControl.weight"),
        (
            json!({"queueDeadlineMs": 0}),
            "spec.flowControl.queueDeadlineMs",
        ),
        (json!({"band": "high"}), "spec.flowControl.band"),
    ] {
        let errors = validate("InferenceTenant", &tenant(flow.clone()));
        assert_eq!(errors.len(), 1, "{flow}: {errors:?}");
        assert_eq!(errors[0].path, path, "{flow}");
    }
}
