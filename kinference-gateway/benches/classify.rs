//! What classification costs per request: the whole-body PII scan and complexity assessment
//! (`policy::classify::classify_request`) on the chat bodies an agent sends: a system prompt, tools
//! with schemas, tool calls and results, at about 8 KB and 64 KB.
//!
//! Run: `cargo bench -p kinference-gateway --bench classify`.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kinference_gateway::policy::classify::classify_request;
use serde_json::{Value, json};

/// An agent's chat body of about `turns` * 1 KB, without personal data (the scan reads it all).
fn agent_body(turns: usize) -> Value {
    let prose =
        "The quarterly report covers revenue, churn and the hiring plan for the platform team; \
                 summarise the risks and list the open questions for the next review. "
            .repeat(5);
    let mut messages = vec![json!({"role": "system", "content": prose})];
    for i in 0..turns {
        messages.push(json!({"role": "user", "content": format!("Step {i}: {prose}")}));
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("call_{i}"),
            "type": "function", "function": {"name": "search", "arguments": json!({"query": prose}).to_string()}}]}));
        messages
            .push(json!({"role": "tool", "tool_call_id": format!("call_{i}"), "content": prose}));
    }
    json!({"model": "qwen3-8b", "max_tokens": 512, "messages": messages,
        "tools": [{"type": "function", "function": {"name": "search", "description": prose,
            "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": prose}}}}}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}})
}

fn classify(c: &mut Criterion) {
    let mut group = c.benchmark_group("classify_request");
    for (name, turns) in [("8KB", 3), ("64KB", 24)] {
        let body = agent_body(turns);
        group.throughput(Throughput::Bytes(body.to_string().len() as u64));
        group.bench_function(name, |b| {
            b.iter(|| classify_request(black_box(&body), None))
        });
    }
    group.finish();
}

criterion_group!(benches, classify);
criterion_main!(benches);
