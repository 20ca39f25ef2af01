use std::path::PathBuf;

use serde_json::json;

use crate::tokenize::ModelTokenizer;

fn qwen2() -> ModelTokenizer {
    let dir = std::env::var_os("KINFERENCE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.assets/qwen2"));
    ModelTokenizer::from_dir(&dir).unwrap_or_else(|e| {
        panic!(
            "Qwen2 tokenizer missing at {}: {e}; run `cargo xtask setup`",
            dir.display()
        )
    })
}

/// The get_weather tool as the gateway forwards it (serde_json keeps keys sorted, so the worker
/// receives `parameters` in this order).
fn weather(function_extra: serde_json::Value) -> serde_json::Value {
    let mut function = json!({
        "name": "get_weather",
        "parameters": {"properties": {"city": {"enum": ["Paris", "Oslo"], "type": "string"}},
                       "required": ["city"], "type": "object"},
    });
    function
        .as_object_mut()
        .unwrap()
        .extend(function_extra.as_object().unwrap().clone());
    json!({"type": "function", "function": function})
}

fn render(tool: serde_json::Value) -> String {
    let messages = json!([{"role": "user", "content": "What is the weather like in Paris?"}]);
    qwen2()
        .render_chat_with(&messages, true, Some(&json!({"tools": [tool]})))
        .expect("render")
}

/// The tool line of the prompt vLLM 0.32 rendered for this request (its `/tokenize` with the tool,
/// then `/detokenize`), and its 164 tokens.
#[test]
fn a_tool_renders_as_vllm_renders_it() {
    let tool = weather(json!({"description": "The current weather in a city."}));
    let text = render(tool);
    assert!(
        text.contains(
            "\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"The current weather in a city.\", \"parameters\": {\"properties\": {\"city\": {\"enum\": [\"Paris\", \"Oslo\"], \"type\": \"string\"}}, \"required\": [\"city\"], \"type\": \"object\"}}}\n</tools>\n"
        ),
        "{text}"
    );
    assert_eq!(qwen2().encode_text(&text, false).unwrap().len(), 164);
}

/// vLLM writes a missing description as null, and a tool's other keys (`strict`) after its parameters.
#[test]
fn a_missing_description_is_null_and_strict_comes_last() {
    let text = render(weather(json!({"strict": true})));
    assert!(
        text.contains("{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": null, \"parameters\": {")
            && text.contains("\"type\": \"object\"}, \"strict\": true}}\n</tools>"),
        "{text}"
    );
}

#[test]
fn tojson_writes_what_pythons_json_dumps_writes() {
    let mut env = minijinja::Environment::new();
    env.add_filter("tojson", super::tojson);
    let render = |src: &str| {
        env.render_str(src, minijinja::context! {v => json!({"b": "<a & 'b'>", "a": [1, 2.5, null, true], "c": {}})})
            .unwrap()
    };
    assert_eq!(
        render("{{ v | tojson }}"),
        r#"{"a": [1, 2.5, null, true], "b": "<a & 'b'>", "c": {}}"#
    );
    assert_eq!(
        render("{{ v.a | tojson(indent=2) }}"),
        "[\n  1,\n  2.5,\n  null,\n  true\n]"
    );
}

/// An earlier call's `arguments` (a JSON string in OpenAI's messages) reach the template parsed, as
/// vLLM parses them: vLLM 0.32 rendered this conversation as 207 tokens with the call line below.
#[test]
fn a_tool_calls_arguments_render_as_vllm_renders_them() {
    let messages = json!([
        {"role": "user", "content": "What is the weather like in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "chatcmpl-tool-a2ebb616985fb4c1",
            "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-a2ebb616985fb4c1", "content": "18 C and sunny"}
    ]);
    let tool = weather(json!({"description": "The current weather in a city.", "strict": true}));
    let tok = qwen2();
    let text = tok
        .render_chat_with(&messages, true, Some(&json!({"tools": [tool]})))
        .expect("render");
    assert!(
        text.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"),
        "{text}"
    );
    assert_eq!(tok.encode_text(&text, false).unwrap().len(), 207);
}
