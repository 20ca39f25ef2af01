use super::*;

/// vLLM 0.32's `/v1/models` with `--lora-modules sql-lora=... chat-lora=...` (fields as `ModelCard`).
const VLLM_MODELS: &str = r#"{"object":"list","data":[
 {"id":"tiny","object":"model","created":1,"owned_by":"vllm","root":"/models/tiny","parent":null,"max_model_len":2048,"permission":[]},
 {"id":"sql-lora","object":"model","created":1,"owned_by":"vllm","root":"/adapters/sql","parent":"tiny","max_model_len":null,"permission":[]},
 {"id":"chat-lora","object":"model","created":1,"owned_by":"vllm","root":"/adapters/chat","parent":"tiny","max_model_len":null,"permission":[]}]}"#;

#[test]
fn adapters_are_the_entries_whose_parent_is_the_model() {
    assert_eq!(
        adapters_in(VLLM_MODELS.as_bytes(), "tiny"),
        Ok(vec!["chat-lora".to_string(), "sql-lora".to_string()])
    );
    // Another base model's adapters are not this worker's model's.
    assert_eq!(adapters_in(VLLM_MODELS.as_bytes(), "other"), Ok(vec![]));
}

#[test]
fn a_list_without_adapters_or_parents_has_none() {
    let plain = r#"{"object":"list","data":[{"id":"tiny","object":"model"}]}"#;
    assert_eq!(adapters_in(plain.as_bytes(), "tiny"), Ok(vec![]));
}

#[test]
fn a_body_that_is_no_model_list_is_an_error() {
    assert!(adapters_in(b"<html>", "tiny").is_err());
    assert!(adapters_in(br#"{"data": 3}"#, "tiny").is_err());
}
