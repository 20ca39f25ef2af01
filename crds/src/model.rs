//! `InferenceModel`: a served model, its aliases and the classes users may ask for instead.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::ResourceStatus;

/// A model that pools serve. Clients may request it by name, by alias, or by any of its classes
/// ("qwen-3.8", "coding"): a class lets policies pick the concrete checkpoint.
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[kube(
    group = "kinference.ai",
    version = "v1alpha1",
    kind = "InferenceModel",
    namespaced,
    status = "ResourceStatus",
    shortname = "imodel",
    category = "kinference",
    printcolumn(name = "Served", type_ = "string", json_path = ".spec.servedName"),
    printcolumn(name = "Tier", type_ = "string", json_path = ".spec.costTier"),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "RolledBack",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"RolledBack\")].status"
    ),
    printcolumn(
        name = "Serving",
        type_ = "integer",
        json_path = ".status.activeGeneration"
    ),
    printcolumn(
        name = "Observed",
        type_ = "integer",
        json_path = ".status.observedGeneration",
        priority = 1
    ),
    printcolumn(
        name = "Message",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].message",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferenceModelSpec {
    /// The model name the workers serve (vLLM `--served-model-name`).
    #[schemars(length(min = 1, max = 253))]
    pub served_name: String,
    /// Other names clients may use for this model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// Classes the model belongs to; a request for a class may be served by any member.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<String>,
    /// Free-form labels policies can match on (e.g. `reasoning`, `multilingual`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// Where the gateway gets the tokenizer; without it the workers' `/tokenize` is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerSource>,
    /// Relative cost, used to order candidates when no prices apply.
    #[serde(default)]
    pub cost_tier: CostTier,
    /// Maximum context length in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub context_length: Option<u32>,
    /// The workers serve Anthropic's `POST /v1/messages` themselves (recent vLLM does): Anthropic
    /// requests pass through to them unchanged instead of being translated to the chat API.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub serves_messages: bool,
    /// The engine profile the gateway's TTFT estimate starts from, which also prices a prefill's
    /// attention; without one, the default priors and no attention term.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_profile: Option<EngineProfile>,
}

/// An engine profile: the estimate's priors and attention cost for one model on one kind of hardware
/// (the gateway's `src/routing/estimate/profiles.rs` holds the figures).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum EngineProfile {
    /// The small random Qwen2 on vLLM 0.32 on CPU, measured (`bench/real-vllm/run.sh calibrate`).
    CpuQwen2Small,
    /// A 27B model in FP8 on an NVIDIA L40S, from published figures.
    L40s27bFp8,
}

impl EngineProfile {
    /// Every profile, for checks that cover them all.
    pub const ALL: [EngineProfile; 2] = [EngineProfile::CpuQwen2Small, EngineProfile::L40s27bFp8];

    /// The name the gateway's configuration uses.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineProfile::CpuQwen2Small => "cpu-qwen2-small",
            EngineProfile::L40s27bFp8 => "l40s-27b-fp8",
        }
    }
}

/// Where the tokenizer comes from.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenizerSource {
    /// A directory with `tokenizer.json` and `tokenizer_config.json` (local mode, or a mounted volume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<String>,
    /// A Hugging Face repository id, fetched once at start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugging_face: Option<String>,
}

/// Relative cost of a model.
#[derive(
    Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, JsonSchema, Default,
)]
pub enum CostTier {
    Economy,
    #[default]
    Standard,
    Premium,
}
