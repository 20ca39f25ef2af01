//! A tenant's output limit cannot be dodged: the output reserved at admission is the largest limit
//! the worker will honour (`max_completion_tokens` over a smaller `max_tokens`, which vLLM ignores
//! when both are set), and the worker is sent exactly that limit; a request that sets none reserves
//! the model's limit and is sent it. Against the real gateway binary and a real `vllm-sim`.

use futures::future::join_all;
use serde_json::{Value, json};
use testkit::ChildGuard;

mod support;

const MODEL: &str = "qwen2-sim";
const KEY: &str = "sk-reservation-0123456789abcdef";

async fn start(dir: &std::path::Path, sim: u16) -> (ChildGuard, u16) {
    support::write_tenants(
        dir,
        &[("meter", KEY)],
        "  limits: {outputTokensPerMinute: 300}\n",
    );
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "routing: kinference\nworkers:\n  - {{url: \"http://127.0.0.1:{sim}\", model: {MODEL}}}\nmodels:\n  - {{name: {MODEL}, tokenizer_dir: \"{}\"}}\ntenancy:\n  tenants_dir: {}\n  secrets_dir: {}\n  usage_journal: {}\n  default_output_reservation: 8\n",
            testkit::tokenizer_dir().display(),
            dir.join("tenants.yaml").display(),
            dir.join("secrets").display(),
            dir.join("usage.jsonl").display(),
        ),
    )
    .unwrap();
    let (gateway, api, _admin) = support::start_gateway(&config, &[]).await;
    (gateway, api)
}

async fn chat(api: u16, body: &Value) -> (u16, Value) {
    let bearer = format!("Bearer {KEY}");
    let (status, _, text) = support::call(
        "127.0.0.1",
        api,
        "POST",
        "/v1/chat/completions",
        &[("authorization", &bearer)],
        &body.to_string(),
    )
    .await;
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_largest_limit_is_reserved_and_the_worker_is_sent_no_more() {
    let Some(sim) = support::vllm_sim_binary() else {
        return;
    };
    let (_sim, sim_port) = support::spawn_vllm_sim(&sim, MODEL);
    support::wait_until_ok(sim_port, "/health").await;
    let dir = support::TempDir::new("reservation");
    let (_gateway, api) = start(&dir.0, sim_port).await;

    // Ten at once, each asking for 1 token by `max_tokens` and 40 by `max_completion_tokens` (the
    // one vLLM honours), against 300 output tokens a minute: each reserves 40, so at most 300/40 are
    // admitted, and no answer is longer than what was reserved.
    let dodge = json!({"model": MODEL, "max_tokens": 1, "max_completion_tokens": 40,
        "messages": [{"role": "user", "content": "write at length"}]});
    let answers = join_all((0..10).map(|_| chat(api, &dodge))).await;
    let served: Vec<&Value> = answers
        .iter()
        .filter(|(s, _)| *s == 200)
        .map(|(_, b)| b)
        .collect();
    let refused = answers.iter().filter(|(s, _)| *s == 429).count();
    let output: u64 = served
        .iter()
        .map(|b| b["usage"]["completion_tokens"].as_u64().unwrap_or(0))
        .sum();
    assert!(
        served.len() <= 300 / 40 && served.len() + refused == 10,
        "{} served, {refused} refused: {answers:?}",
        served.len()
    );
    assert!(refused >= 2, "the limit held back some: {answers:?}");
    assert!(
        output <= 300,
        "{output} output tokens generated past a 300 a minute limit: {answers:?}"
    );
    for b in &served {
        assert_eq!(b["usage"]["completion_tokens"], 40, "{b}");
    }

    // No limit set: the model's (here the configured default, 8) is reserved and sent.
    let dir = support::TempDir::new("reservation-default");
    let (_gateway, api) = start(&dir.0, sim_port).await;
    let open = json!({"model": MODEL, "messages": [{"role": "user", "content": "go on"}]});
    let (status, body) = chat(api, &open).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 8, "{body}");
}
