//! Every PromQL expression of `deploy/grafana/kinference-dashboard.json` names only metrics the code
//! really exports: the real `kinference-gateway` and `kinference-agent` binaries are started on
//! loopback, their `/metrics` scraped, and each metric name of each `expr` looked up there.
//!
//! Families without samples still print their `# TYPE` line, so a metric that only appears under load
//! (a rejection counter, a histogram of streams) is known by name from an idle process.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use testkit::{ChildGuard, free_port};

mod support;

fn get(port: u16, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    stream.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

fn scrape(child: &mut ChildGuard, port: u16, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(body) = get(port, "/metrics") {
            return body;
        }
        if let Ok(Some(status)) = child.0.try_wait() {
            panic!("{what} exited with {status} before serving /metrics");
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not serve /metrics in 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Metric names a Prometheus server would store from an exposition: sample names, plus the series
/// names implied by each `# TYPE` line (counters `_total`, histograms `_bucket/_sum/_count`).
fn exported_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            match kind {
                "counter" => {
                    names.insert(format!("{}_total", name.trim_end_matches("_total")));
                }
                "histogram" | "gaugehistogram" => {
                    for suffix in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{name}{suffix}"));
                    }
                }
                "summary" => {
                    for suffix in ["", "_sum", "_count"] {
                        names.insert(format!("{name}{suffix}"));
                    }
                }
                "info" => {
                    names.insert(format!("{name}_info"));
                }
                _ => {
                    names.insert(name.to_string());
                }
            }
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

/// The metric names of a PromQL expression: identifiers that are not functions, keywords, label
/// names (inside `{...}`, `by (...)`, `without (...)`, `on (...)`, `ignoring (...)`) or ranges.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let strings = regex::Regex::new(r#""(?:[^"\\]|\\.)*""#).unwrap();
    let matchers = regex::Regex::new(r"\{[^}]*\}").unwrap();
    let ranges = regex::Regex::new(r"\[[^\]]*\]").unwrap();
    let groupings =
        regex::Regex::new(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
            .unwrap();
    let ident = regex::Regex::new(r"[a-zA-Z_:][a-zA-Z0-9_:]*").unwrap();
    let e = strings.replace_all(expr, "\"\"");
    let e = matchers.replace_all(&e, " ");
    let e = ranges.replace_all(&e, " ");
    let e = groupings.replace_all(&e, " ");
    const KEYWORDS: [&str; 9] = [
        "by", "without", "on", "ignoring", "bool", "and", "or", "unless", "offset",
    ];
    let mut out = BTreeSet::new();
    for m in ident.find_iter(&e) {
        let after = e[m.end()..].trim_start();
        let before = e[..m.start()].chars().last();
        if after.starts_with('(')
            || KEYWORDS.contains(&m.as_str())
            || before.is_some_and(|c| c.is_ascii_digit() || c == '.' || c == '$')
        {
            continue;
        }
        out.insert(m.as_str().to_string());
    }
    out
}

fn exprs(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

#[test]
fn promql_extraction_ignores_labels_functions_and_ranges() {
    let names = metric_names(
        r#"histogram_quantile(0.95, sum by (le, tenant) (rate(a_bucket{tenant=~"$tenant", x="y{z}"}[$__rate_interval]))) / on (tenant) b_total * 3600"#,
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["a_bucket", "b_total"]
    );
}

#[test]
fn every_dashboard_query_names_an_exported_metric() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("deploy/grafana/kinference-dashboard.json"))
            .expect("deploy/grafana/kinference-dashboard.json"),
    )
    .expect("the dashboard is JSON");
    let mut all = Vec::new();
    exprs(&dashboard, &mut all);
    assert!(all.len() >= 20, "only {} expressions", all.len());

    let dir = std::env::temp_dir().join(format!("kinference-dashboard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    // The gateway: one (unreachable) worker is enough for every family to be registered; the
    // per-tenant histograms the latency panels read and the spend the cost panels read are opt-in.
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        "workers:\n  - url: http://127.0.0.1:9\n    model: m\nrouting: kinference\ntenancy:\n  per_tenant_histograms: true\n",
    )
    .unwrap();
    let (mut gateway, _api, admin) =
        support::spawn_gateway_with(&config, &["--metrics-tenant-spend"]);

    let agent_bin = support::agent_binary();
    let workers = dir.join("agent-workers.yaml");
    std::fs::write(&workers, "workers: []\n").unwrap();
    let (grpc, metrics) = (free_port(), free_port());
    let mut agent = ChildGuard(
        Command::new(&agent_bin)
            .args(["--grpc-listen", &format!("127.0.0.1:{grpc}")])
            .args(["--metrics-listen", &format!("127.0.0.1:{metrics}")])
            .arg("--workers")
            .arg(&workers)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting kinference-agent"),
    );

    let mut exported = exported_names(&scrape(&mut gateway, admin, "kinference-gateway"));
    exported.extend(exported_names(&scrape(
        &mut agent,
        metrics,
        "kinference-agent",
    )));
    assert!(exported.contains("kinference_gateway_tenant_requests_total"));
    assert!(exported.contains("kinference_agent_gpu_utilization_ratio"));

    let mut missing = Vec::new();
    for expr in &all {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "no metric in `{expr}`");
        for name in names {
            if !exported.contains(&name) {
                missing.push(format!("{name} (in `{expr}`)"));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        missing.is_empty(),
        "dashboard queries name metrics no binary exports:\n  {}",
        missing.join("\n  ")
    );
}
