//! The policy documents several tests put in the gateway's `policy_dir` (an `InferenceModel`,
//! `InferencePool`s, an OpenAI-style `InferenceProvider`), as YAML text, and the `gateway.yaml`
//! that loads them. Each test writes its own `InferencePolicy` documents: those are what it tests.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Writes `documents` as `dir/policies/all.yaml`; returns the policy directory.
pub fn write(dir: &Path, documents: &[String]) -> PathBuf {
    let policies = dir.join("policies");
    std::fs::create_dir_all(&policies).unwrap();
    std::fs::write(policies.join("all.yaml"), documents.join("---\n")).unwrap();
    policies
}

/// A `gateway.yaml` routing with the policies in `policies`, reloaded every `reload_ms`.
pub fn gateway_yaml(policies: &Path, reload_ms: u64) -> String {
    format!(
        "routing: kinference\npolicy_dir: {}\npolicy_load_interval_ms: {reload_ms}\n",
        policies.display()
    )
}

/// An `InferenceModel` serving `name`, with the gateway's own `tokenizer` when given (without one
/// the gateway asks a worker's `/tokenize`).
pub fn model(name: &str, tokenizer: Option<&Path>) -> String {
    let tokenizer = tokenizer
        .map(|dir| format!("  tokenizer: {{dir: \"{}\"}}\n", dir.display()))
        .unwrap_or_default();
    format!(
        "apiVersion: kinference.ai/v1alpha1\nkind: InferenceModel\nmetadata: {{name: {name}}}\nspec:\n  servedName: {name}\n{tokenizer}"
    )
}

/// An `InferencePool` `name` of `model` (`locality` `Local` or `Remote`), whose workers are given
/// by `workers` (a spec line: [`endpoint`], or a `selector`), at the tests' usual prices.
pub fn pool(name: &str, model: &str, locality: &str, gpu_class: &str, workers: &str) -> String {
    format!(
        "apiVersion: kinference.ai/v1alpha1\nkind: InferencePool\nmetadata: {{name: {name}}}\nspec:\n  models: [{model}]\n  gpuClass: {gpu_class}\n  locality: {locality}\n  {workers}\n  prices: {{cachedInputPerMillion: 0.01, uncachedInputPerMillion: 0.1, outputPerMillion: 0.4}}\n"
    )
}

/// A pool's workers line: the one endpoint `url`.
pub fn endpoint(url: &str) -> String {
    format!("endpoints: [{{url: \"{url}\"}}]")
}

/// The tests' stand-in provider: an OpenAI-style `InferenceProvider` `standin` at `addr` (an
/// in-test server), its key in environment variable `key_env`, serving `standin-model` in place of
/// `model`.
pub fn standin_provider(addr: SocketAddr, key_env: &str, model: &str) -> String {
    provider(
        "standin",
        &format!("http://{addr}/v1"),
        key_env,
        "standin-model",
        model,
    )
}

/// An OpenAI-style `InferenceProvider` `name` at `base_url`, its key in environment variable
/// `key_env`, serving `served` in place of `substitutes`.
pub fn provider(
    name: &str,
    base_url: &str,
    key_env: &str,
    served: &str,
    substitutes: &str,
) -> String {
    format!(
        "apiVersion: kinference.ai/v1alpha1\nkind: InferenceProvider\nmetadata: {{name: {name}}}\nspec:\n  baseUrl: {base_url}\n  apiStyle: OpenAI\n  credentials: {{env: {key_env}}}\n  models: [{{name: {served}, substitutes: [{substitutes}]}}]\n"
    )
}
