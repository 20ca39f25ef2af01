//! The committed CRD YAML under `crds/` must be what the Rust types generate.

use std::path::Path;

#[test]
fn committed_crd_yaml_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (file, crd) in kinference_crds::all_crds() {
        let expected = kinference_crds::render_yaml(&crd).expect("render");
        let committed = std::fs::read_to_string(dir.join(file))
            .unwrap_or_else(|e| panic!("crds/{file}: {e}; run `cargo xtask gen-crds`"));
        assert!(
            committed == expected,
            "crds/{file} is stale; run `cargo xtask gen-crds` and commit the result"
        );
    }
}

#[test]
fn crds_have_status_subresource_printer_columns_and_no_cel() {
    for (file, crd) in kinference_crds::all_crds() {
        assert_eq!(crd.spec.group, "kinference.ai", "{file}");
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        assert!(
            version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some(),
            "{file}: no status subresource"
        );
        let columns = version
            .additional_printer_columns
            .as_deref()
            .unwrap_or_default();
        for name in ["Accepted", "Ready", "RolledBack", "Serving", "Observed"] {
            assert!(
                columns.iter().any(|c| c.name == name),
                "{file}: no {name} column"
            );
        }
        // The 1.20 test apiserver (and older clusters) reject CEL rules.
        let yaml = kinference_crds::render_yaml(&crd).expect("render");
        assert!(
            !yaml.contains("x-kubernetes-validations"),
            "{file} uses CEL"
        );
    }
}

#[test]
fn every_kind_round_trips_through_its_crd_schema() {
    let pool = serde_json::json!({
        "apiVersion": "kinference.ai/v1alpha1", "kind": "InferencePool", "metadata": {"name": "gpu-a"},
        "spec": {"models": ["qwen"], "gpuClass": "l40s", "selector": {"matchLabels": {"app": "vllm"}, "targetPort": 8000},
                 "prices": {"cachedInputPerMillion": 0.02, "uncachedInputPerMillion": 0.2, "outputPerMillion": 0.6}}
    });
    assert!(kinference_crds::schema::validate("InferencePool", &pool).is_empty());
    let typed: kinference_crds::InferencePool = serde_json::from_value(pool).expect("typed");
    assert_eq!(typed.spec.locality, kinference_crds::Locality::Local);
}
