//! `scale-bench` end to end on the smallest fleet that still has several agents (3 workers, 2 per
//! node, both nodes' workers in one simulator process as the 1,000-worker fleet runs them): the real
//! simulator, agents and gateways start, every policy runs, and the table and the plot are written. Keeps the harness from rotting; the figures themselves are the benchmark's business.

use std::process::Command;

use testkit::{bin_dir, require, tokenizer_dir};

#[test]
fn a_three_worker_two_agent_fleet_runs_and_writes_table_and_plot() {
    let bins = bin_dir();
    let missing: Vec<&str> = ["vllm-sim", "kinference-agent", "kinference-gateway"]
        .into_iter()
        .filter(|b| !bins.join(b).is_file())
        .collect();
    if !require(
        missing.is_empty(),
        "the workspace binaries",
        format!(
            "{missing:?} not in {} (cargo build -p kinference-bench -p kinference-agent -p kinference-gateway)",
            bins.display()
        ),
    ) {
        return;
    }
    let out = tempfile_dir();
    let status = Command::new(env!("CARGO_BIN_EXE_scale-bench"))
        .args(["--fleets", "3", "--workers-per-node", "2", "--runs", "1"])
        .args(["--nodes-per-sim", "2"])
        .args(["--prefixes-per-worker", "1", "--prefix-words", "120"])
        .args(["--requests-per-worker", "2", "--max-tokens", "2"])
        .args([
            "--preset",
            "fast",
            "--time-scale",
            "0.05",
            "--num-blocks",
            "256",
        ])
        .arg("--bin-dir")
        .arg(&bins)
        .arg("--tokenizer-dir")
        .arg(tokenizer_dir())
        .arg("--out-dir")
        .arg(&out)
        .status()
        .expect("run scale-bench");
    assert!(status.success(), "scale-bench failed: {status}");

    let md = std::fs::read_to_string(out.join("scale.md")).expect("scale.md");
    for policy in ["random", "kinference", "oracle"] {
        assert!(
            md.contains(&format!("| 3 | 2 | {policy} | 1 x 6 |")),
            "a {policy} row for 3 workers on 2 agents:\n{md}"
        );
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("scale.json")).expect("scale.json"))
            .expect("scale.json parses");
    let kinference = json["rows"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["policy"] == "kinference"))
        .expect("the kinference row");
    assert_eq!(kinference["errors"], 0, "{kinference}");
    assert!(
        kinference["decision_p99_us"]
            .as_f64()
            .is_some_and(|v| v > 0.0),
        "the gateway's decision histogram was read: {kinference}"
    );
    // Read, not necessarily above 0: `/proc` counts CPU in 10 ms ticks, and six requests can take
    // less than one (a run at cede439 read 0 for one policy and 1.67 ms a request for another).
    assert!(
        kinference["gateway_cpu_ms_per_request"]
            .as_f64()
            .is_some_and(|v| v >= 0.0),
        "the gateway's CPU time was read: {kinference}"
    );
    assert!(
        kinference["agent_bytes_per_s"]
            .as_f64()
            .is_some_and(|v| v > 0.0),
        "the agents streamed to the gateway: {kinference}"
    );
    assert!(
        md.contains("3 workers: 2 agent processes, 1 vllm-sim processes"),
        "both nodes' workers in one simulator:\n{md}"
    );
    let svg = std::fs::read_to_string(out.join("scale.svg")).expect("scale.svg");
    assert!(
        svg.starts_with("<svg") && svg.contains("<polyline"),
        "{svg}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// A fresh directory under the system's temporary folder.
fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "scale-bench-smoke-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    dir
}
