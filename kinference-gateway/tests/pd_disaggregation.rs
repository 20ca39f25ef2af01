//! Prefill/decode disaggregation against the real gateway binary and real `vllm-sim` workers with
//! KV connectors (one `kv_producer`, two `kv_consumer`s) on loopback:
//!
//! - a long prompt is split: the prefill worker runs it to one token and answers with its
//!   `kv_transfer_params`, the decode worker pulls the KV cache and streams the answer; the decision
//!   header names both picks; the request is billed once, the prompt by the prefill worker's usage
//!   at the prefill pool's prices and the output at the decode pool's;
//! - a short prompt runs whole on a decode worker, and a prefill worker never gets a whole request;
//! - a prompt the prefill worker refuses (longer than the model's context) is the client's 400, in
//!   the OpenAI and the Anthropic shape, with nothing billed;
//! - a prefill worker that fails (500) leaves the request whole on its decode worker, billed once; one
//!   without a KV connector (no `kv_transfer_params`) leaves the decode worker computing the prompt;
//! - through the ext_proc door (Envoy forwards to one destination) nothing is split, and the
//!   destination is a decode worker.

use serde_json::{Value, json};
use testkit::{ChildGuard, free_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod support;

use support::envoy::Envoy;
use support::policies;

const MODEL: &str = "qwen2-sim";

/// One `vllm-sim` process with one worker per port: `roles[i]` is worker `i`'s `--kv-role`
/// (`none`: no connector).
fn spawn_sims(sim: &std::path::Path, roles: &[&str]) -> (ChildGuard, Vec<u16>) {
    let ports: Vec<u16> = roles.iter().map(|_| free_port()).collect();
    let list = |v: Vec<String>| v.join(",");
    let mut command = std::process::Command::new(sim);
    command
        .args(["--host", "127.0.0.1", "--model", MODEL, "--preset", "fast"])
        .args(["--max-model-len", "2048"])
        .args(["--port", &list(ports.iter().map(u16::to_string).collect())])
        .arg("--tokenizer-dir")
        .arg(testkit::tokenizer_dir())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    if roles.iter().all(|r| *r != "none") {
        command.args([
            "--kv-role",
            &list(roles.iter().map(|r| r.to_string()).collect()),
        ]);
    }
    (ChildGuard(command.spawn().expect("start vllm-sim")), ports)
}

fn url(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

/// A prompt of about `words` tokens.
fn prompt(words: usize) -> String {
    let vocabulary = [
        "parcel", "route", "depot", "truck", "invoice", "customs", "pallet",
    ];
    (0..words)
        .map(|i| vocabulary[i * 7 % vocabulary.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// A `kinference_sim_*` or `vllm:*` counter of the worker on `port` (summed over its series).
async fn sim_counter(port: u16, name: &str) -> f64 {
    support::metrics_text(port)
        .await
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `POST path` through the gateway on `api` as an admin (loopback) asking for the decision header.
async fn post(api: u16, path: &str, body: &Value) -> (u16, String, String) {
    support::call(
        "127.0.0.1",
        api,
        "POST",
        path,
        &[("x-kinference-debug", "1")],
        &body.to_string(),
    )
    .await
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .map(str::trim)
}

/// The usage records written so far.
fn records(journal: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(journal)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The usage records of served requests (status 200), once there are `n` of them.
async fn wait_for_served(journal: &std::path::Path, n: usize) -> Vec<Value> {
    let served = || {
        records(journal)
            .into_iter()
            .filter(|r| r["status"] == 200)
            .collect::<Vec<_>>()
    };
    support::wait_for(&format!("{n} usage records"), || async {
        served().len() >= n
    })
    .await;
    served()
}

fn pool_doc(name: &str, role: &str, workers: &[u16], extra: &str, prices: &str) -> String {
    let endpoints = workers
        .iter()
        .map(|p| format!("{{url: \"{}\"}}", url(*p)))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "apiVersion: kinference.ai/v1alpha1\nkind: InferencePool\nmetadata: {{name: {name}}}\nspec:\n  models: [{MODEL}]\n  gpuClass: l40s\n  role: {role}\n  endpoints: [{endpoints}]\n{extra}  prices: {prices}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_is_split_streamed_from_the_decode_side_and_billed_once() {
    let Some(sim) = support::vllm_sim_binary() else {
        return;
    };
    let (_sims, ports) = spawn_sims(&sim, &["kv_producer", "kv_consumer", "kv_consumer"]);
    let (prefill, decodes) = (ports[0], &ports[1..]);
    for p in &ports {
        support::wait_until_ok(*p, "/health").await;
    }
    let dir = support::TempDir::new("pd");
    let policy_dir = policies::write(
        &dir.0,
        &[
            policies::model(MODEL, Some(&testkit::tokenizer_dir())),
            pool_doc(
                "prefill-pool",
                "prefill",
                &[prefill],
                "",
                "{cachedInputPerMillion: 0.1, uncachedInputPerMillion: 1.0, outputPerMillion: 9.0}",
            ),
            pool_doc(
                "decode-pool",
                "decode",
                decodes,
                "  disaggregation: {prefillPool: prefill-pool, minUncachedTokens: 64}\n",
                "{cachedInputPerMillion: 0.5, uncachedInputPerMillion: 5.0, outputPerMillion: 2.0}",
            ),
        ],
    );
    let journal = dir.0.join("usage.jsonl");
    let extproc = free_port();
    let config = dir.0.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "{}tenancy:\n  usage_journal: {}\n",
            policies::gateway_yaml(&policy_dir, 200),
            journal.display()
        ),
    )
    .unwrap();
    let extproc_flag = format!("--extproc-listen=127.0.0.1:{extproc}");
    let (_gateway, api, admin) = support::start_gateway(&config, &[&extproc_flag]).await;

    // A long prompt, streamed: split.
    let long = prompt(400);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": long}],
        "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}});
    let (status, head, text) = post(api, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{head}\n{text}");
    assert_eq!(
        header(&head, "x-kinference-prefill-worker"),
        Some(url(prefill).as_str())
    );
    let decode = header(&head, "x-kinference-worker")
        .expect("the decode worker")
        .to_string();
    assert!(
        decodes.iter().any(|p| url(*p) == decode),
        "{decode} is no decode worker"
    );
    let decision = header(&head, "x-kinference-decision").expect("the decision header");
    assert!(decision.contains("pd=split: "), "{decision}");
    assert!(
        decision.contains(&format!("prefill: *{}", url(prefill))),
        "{decision}"
    );
    assert!(
        decision.contains(&format!("*{decode} running=")),
        "{decision}"
    );
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect();
    let content: usize = chunks
        .iter()
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
        })
        .count();
    assert_eq!(content, 8, "{text}");
    let usage = chunks
        .iter()
        .find_map(|c| c.get("usage").filter(|u| u.is_object()))
        .expect("usage");
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 400, "{usage}");
    // The prefill worker ran one token and handed its cache over; the decode worker pulled it.
    assert_eq!(
        sim_counter(prefill, "vllm:generation_tokens_total").await,
        1.0
    );
    assert_eq!(
        sim_counter(prefill, "kinference_sim_kv_prefills_handed_total").await,
        1.0
    );
    let decode_port: u16 = decode.rsplit(':').next().unwrap().parse().unwrap();
    assert_eq!(
        sim_counter(decode_port, "kinference_sim_kv_pulls_total").await,
        1.0
    );
    assert_eq!(
        sim_counter(decode_port, "kinference_sim_kv_pulled_blocks_total").await,
        (prompt_tokens / 16) as f64
    );
    assert_eq!(
        sim_counter(decode_port, "vllm:generation_tokens_total").await,
        8.0
    );
    assert_eq!(
        support::metric(admin, "kinference_routing_pd_total{outcome=\"split\"}").await,
        1.0
    );
    // Billed once: the prompt as the prefill worker computed it, at the prefill pool's prices.
    let record = wait_for_served(&journal, 1).await.remove(0);
    assert_eq!(record["pool"], "decode-pool", "{record}");
    assert_eq!(record["prefill_pool"], "prefill-pool", "{record}");
    assert_eq!(record["input_uncached"], prompt_tokens, "{record}");
    assert_eq!(record["input_cached"], 0, "{record}");
    assert_eq!(record["output"], 8, "{record}");
    let cost = record["cost"].as_f64().unwrap();
    let expected = (prompt_tokens as f64 * 1.0 + 8.0 * 2.0) / 1e6;
    assert!(
        (cost - expected).abs() < 1e-12,
        "cost {cost}, expected {expected}: {record}"
    );

    // A short prompt: whole, on a decode worker; the prefill worker sees nothing.
    let short = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4});
    let (status, head, text) = post(api, "/v1/chat/completions", &short).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        header(&head, "x-kinference-prefill-worker").is_none(),
        "{head}"
    );
    assert!(
        decodes
            .iter()
            .any(|p| Some(url(*p).as_str()) == header(&head, "x-kinference-worker"))
    );
    assert!(
        header(&head, "x-kinference-decision")
            .unwrap()
            .contains("pd=whole: "),
        "{head}"
    );
    assert_eq!(
        sim_counter(prefill, "kinference_sim_kv_prefills_handed_total").await,
        1.0
    );

    // A prompt past the model's context: the prefill worker's 400, in the client's protocol.
    let too_long = prompt(2100);
    let (status, _, text) = post(
        api,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": too_long}], "max_tokens": 8}),
    )
    .await;
    assert_eq!(status, 400, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length"),
        "{error}"
    );
    let (status, _, text) = post(
        api,
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": too_long}]}),
    )
    .await;
    assert_eq!(status, 400, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["type"], "error", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length")
    );
    assert_eq!(
        sim_counter(prefill, "kinference_sim_kv_prefills_handed_total").await,
        1.0,
        "a refused prefill hands nothing over"
    );

    // Through Envoy (ext_proc): not split; the destination is a decode worker.
    let mut envoy = Envoy::connect(format!("127.0.0.1:{extproc}").parse().unwrap()).await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": prompt(300)}],
        "max_tokens": 4});
    let answer = envoy
        .request(
            "POST",
            "/v1/chat/completions",
            &[],
            body.to_string().as_bytes(),
        )
        .await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let destination = answer.destination.expect("routed");
    assert!(
        decodes
            .iter()
            .any(|p| destination == format!("127.0.0.1:{p}")),
        "{destination}"
    );
    assert_eq!(
        sim_counter(prefill, "vllm:request_success_total").await,
        1.0
    );

    // Every successful request billed exactly once (2 whole + 1 split), the 400s at no tokens.
    let served = wait_for_served(&journal, 3).await;
    assert_eq!(served.len(), 3, "{served:?}");
    assert!(
        records(&journal)
            .iter()
            .filter(|r| r["status"] != 200)
            .all(|r| r["output"] == 0 && r["cost"] == 0.0),
        "the refused requests cost nothing"
    );
    assert_eq!(
        served
            .iter()
            .filter(|r| r["prefill_pool"] == "prefill-pool")
            .count(),
        1
    );
}

/// A stand-in prefill worker: healthy, lists the model, and fails every generation with a 500.
async fn failing_worker() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let n = stream.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]);
                let (status, body) = if head.starts_with("POST") {
                    (
                        "500 Internal Server Error",
                        r#"{"error":{"message":"engine died"}}"#.to_string(),
                    )
                } else {
                    (
                        "200 OK",
                        format!(r#"{{"object":"list","data":[{{"id":"{MODEL}"}}]}}"#),
                    )
                };
                let answer = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_or_connectorless_prefill_leaves_the_request_whole_and_billed_once() {
    let Some(sim) = support::vllm_sim_binary() else {
        return;
    };
    // A decode worker with a connector, a prefill worker without one (vLLM without
    // --kv-transfer-config), and a prefill worker that fails.
    let (_decode_sim, decode) = spawn_sims(&sim, &["kv_consumer"]);
    let (_plain_sim, plain) = spawn_sims(&sim, &["none"]);
    let (decode, plain) = (decode[0], plain[0]);
    support::wait_until_ok(decode, "/health").await;
    support::wait_until_ok(plain, "/health").await;
    let broken = failing_worker().await;
    let dir = support::TempDir::new("pd-fallback");
    let journal = dir.0.join("usage.jsonl");
    let config = dir.0.join("gateway.yaml");
    let write = |prefill: u16| {
        std::fs::write(
            &config,
            format!(
                "routing: kinference\nmodels:\n  - {{name: {MODEL}, tokenizer_dir: \"{}\"}}\nworkers:\n  - {{url: \"{}\", model: {MODEL}, role: prefill}}\n  - {{url: \"{}\", model: {MODEL}, role: decode}}\ndisaggregation: {{min_uncached_tokens: 64}}\ntenancy:\n  usage_journal: {}\n",
                testkit::tokenizer_dir().display(),
                url(prefill),
                url(decode),
                journal.display()
            ),
        )
        .unwrap();
    };
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": prompt(300)}],
        "max_tokens": 4});

    // The prefill worker fails: the request runs whole on its decode worker.
    write(broken);
    let (gateway, api, admin) = support::start_gateway(&config, &[]).await;
    let (status, head, text) = post(api, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{head}\n{text}");
    assert_eq!(
        header(&head, "x-kinference-worker"),
        Some(url(decode).as_str())
    );
    assert!(
        header(&head, "x-kinference-prefill-worker").is_none(),
        "{head}"
    );
    assert!(
        header(&head, "x-kinference-decision")
            .unwrap()
            .contains("pd=fallback: "),
        "{head}"
    );
    assert_eq!(
        support::metric(admin, "kinference_routing_pd_total{outcome=\"fallback\"}").await,
        1.0
    );
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 4);
    let records = wait_for_served(&journal, 1).await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert!(records[0].get("prefill_pool").is_none(), "{records:?}");
    assert_eq!(records[0]["output"], 4);
    drop(gateway);

    // The prefill worker has no KV connector: its answer carries no kv_transfer_params, and the
    // decode worker computes the prompt itself.
    write(plain);
    let (_gateway, api, admin) = support::start_gateway(&config, &[]).await;
    let (status, head, text) = post(api, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        header(&head, "x-kinference-prefill-worker"),
        Some(url(plain).as_str())
    );
    assert_eq!(
        support::metric(
            admin,
            "kinference_routing_pd_total{outcome=\"no_transfer_params\"}"
        )
        .await,
        1.0
    );
    // The decode worker got no params: nothing pulled, nothing failed, the prompt computed there.
    assert_eq!(
        sim_counter(decode, "kinference_sim_kv_pulls_total").await,
        0.0
    );
    assert_eq!(
        sim_counter(decode, "kinference_sim_kv_pull_failures_total").await,
        0.0
    );
    assert_eq!(
        sim_counter(plain, "vllm:generation_tokens_total").await,
        1.0
    );
}
