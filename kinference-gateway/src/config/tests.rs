use std::time::Duration;

use super::*;

#[test]
fn parses_the_documented_example() {
    let yaml = r#"
models:
  - name: qwen2-sim
    tokenizer_dir: .assets/qwen2
workers:
  - url: http://127.0.0.1:8001
    model: qwen2-sim
agents: ["http://127.0.0.1:7070"]
routing: least-outstanding
policy_dir: deploy/examples/policies
"#;
    let config = GatewayConfig::from_yaml(yaml).expect("parses");
    assert_eq!(config.models[0].name, "qwen2-sim");
    assert_eq!(config.workers[0].url, "http://127.0.0.1:8001");
    assert_eq!(config.routing, RoutingMode::LeastOutstanding);
    assert_eq!(config.agents.len(), 1);
    config.validate().expect("valid");
}

#[test]
fn rejects_worker_of_undeclared_model_and_bad_url() {
    let config = GatewayConfig::from_yaml(
        "models: [{name: a}]\nworkers: [{url: 'http://127.0.0.1:1', model: b}]",
    )
    .expect("parses");
    assert!(
        config
            .validate()
            .unwrap_err()
            .contains("not under `models`")
    );
    let config =
        GatewayConfig::from_yaml("workers: [{url: 'localhost', model: b}]").expect("parses");
    assert!(config.validate().is_err());
}

#[test]
fn model_names_include_worker_only_models() {
    let config = GatewayConfig::from_yaml(
        "workers: [{url: 'http://127.0.0.1:1', model: x}, {url: 'http://127.0.0.1:2', model: x}]",
    )
    .expect("parses");
    assert_eq!(config.model_names(), vec!["x".to_string()]);
}

#[test]
fn http_defaults_match_flag_defaults() {
    let defaults = HttpSettings::default();
    assert_eq!(defaults.body_limit_bytes, 4 * 1024 * 1024);
    assert_eq!(defaults.connect_timeout(), Duration::from_secs(2));
    let args = Args::parse_from(["kinference-gateway", "--idle-timeout-ms", "5"]);
    assert_eq!(args.http.idle_timeout(), Duration::from_millis(5));
}

#[test]
fn a_misspelt_key_names_the_file_line_column_and_the_nearest_key() {
    let path = std::env::temp_dir().join(format!("kinference-strict-{}.yaml", std::process::id()));
    std::fs::write(
        &path,
        "routing: kinference\nworkers:\n  - url: http://127.0.0.1:8001\n    modle: m\n",
    )
    .expect("write");
    let message = GatewayConfig::load(&path).unwrap_err().to_string();
    let _ = std::fs::remove_file(&path);
    assert_eq!(
        message,
        format!(
            "unknown key `modle` at {}:4:5; did you mean `model`?",
            path.display()
        )
    );
    // Top level and nested blocks alike.
    for (yaml, key, nearest) in [
        ("policy_dri: p\n", "policy_dri", "policy_dir"),
        ("tenancy:\n  redis_ur: x\n", "redis_ur", "redis_url"),
        ("kubernetes:\n  namespace: [a]\n", "namespace", "namespaces"),
        (
            "classifier:\n  external:\n    urll: http://x\n",
            "urll",
            "url",
        ),
    ] {
        let e = GatewayConfig::from_yaml(yaml).unwrap_err();
        let message = yaml::describe(std::path::Path::new("gateway.yaml"), 1, &e);
        assert!(
            message.starts_with(&format!("unknown key `{key}` at gateway.yaml:"))
                && message.ends_with(&format!("did you mean `{nearest}`?")),
            "{yaml}: {message}"
        );
    }
}
