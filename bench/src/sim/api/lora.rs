//! LoRA adapters on the HTTP side (vLLM's `--lora-modules`): a request that names an adapter in
//! `"model"` runs with it, `/tokenize` accepts its name, and `/v1/models` lists it after the base model
//! with the base model as `parent`, as vLLM does.

use std::sync::Arc;

use serde_json::{Value, json};

use super::AppState;
use super::openai;
use crate::sim::cache::LoraAdapter;

impl AppState {
    /// The loaded adapter named `model`, if any.
    pub fn lora(&self, model: &str) -> Option<Arc<LoraAdapter>> {
        self.lora_modules.iter().find(|l| l.name == model).cloned()
    }

    /// Whether `model` is served here: the base model or a loaded adapter.
    pub fn serves(&self, model: &str) -> bool {
        model == self.model || self.lora(model).is_some()
    }
}

/// `GET /v1/models`: the base model's card, then one per adapter (`parent`: the base model).
pub fn models_body(state: &AppState) -> Value {
    let mut body = openai::models_body(
        &state.model,
        &state.root,
        state.max_model_len,
        state.started,
    );
    if let Some(data) = body["data"].as_array_mut() {
        for lora in &state.lora_modules {
            data.push(json!({
                "id": lora.name, "object": "model", "created": state.started, "owned_by": "vllm",
                "root": format!("/adapters/{}", lora.name), "parent": state.model,
                "max_model_len": null,
            }));
        }
    }
    body
}
