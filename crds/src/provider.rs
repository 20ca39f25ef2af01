//! `InferenceProvider`: an external OpenAI- or Anthropic-compatible endpoint used for bursting.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::{CredentialRef, ResourceStatus, TokenPrices};

/// An external (remote) endpoint speaking the OpenAI or Anthropic API. Providers are always
/// remote: requests that must stay local never go to one.
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[kube(
    group = "kinference.ai",
    version = "v1alpha1",
    kind = "InferenceProvider",
    namespaced,
    status = "ResourceStatus",
    shortname = "iprov",
    category = "kinference",
    printcolumn(name = "API", type_ = "string", json_path = ".spec.apiStyle"),
    printcolumn(name = "URL", type_ = "string", json_path = ".spec.baseUrl"),
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
pub struct InferenceProviderSpec {
    /// Base URL, e.g. `https://api.openai.com/v1`.
    #[schemars(regex(pattern = r"^https?://[^\s/]+"))]
    pub base_url: String,
    /// The API the endpoint speaks.
    pub api_style: ApiStyle,
    /// The API key.
    pub credentials: CredentialRef,
    /// Models offered, and which local models or classes each may stand in for.
    #[schemars(length(min = 1))]
    pub models: Vec<ProviderModel>,
    /// Default prices for models without their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prices: Option<TokenPrices>,
    /// Request timeout in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub timeout_seconds: Option<u32>,
}

/// The wire API of a provider.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, JsonSchema)]
pub enum ApiStyle {
    /// `/chat/completions` and `/completions`.
    OpenAI,
    /// `/messages`.
    Anthropic,
}

/// One model a provider offers.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProviderModel {
    /// The provider's model name.
    #[schemars(length(min = 1))]
    pub name: String,
    /// `InferenceModel` names this model may replace when bursting.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub substitutes: Vec<String>,
    /// Model classes this model belongs to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<String>,
    /// Prices for this model (else the provider's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prices: Option<TokenPrices>,
}
