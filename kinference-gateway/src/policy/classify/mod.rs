//! Facts about a request, from its body and headers: PII, prompt complexity, tags.
//!
//! [`classify_request`] is what the gateway pipeline calls on the parsed body (OpenAI chat or
//! completion, or Anthropic messages). The PII scan reads every key, string and number of the body
//! ([`body::extract`]), not a list of known fields: whatever a worker or provider would receive is
//! scanned. Content that cannot be read as text (images, audio, token-id prompts without a
//! tokenizer) fails closed: the request is tagged `pii` and [`UNREADABLE_TAG`], so it stays local.

pub mod body;
pub mod complexity;
pub mod external;
pub mod pii;
pub mod tags;

use std::collections::BTreeSet;
use std::sync::OnceLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Serialize;
use serde_json::Value;

use super::engine::{PII_TAG, RequestFacts};

#[cfg(test)]
mod tests;

/// The tag of a request with content the classifiers cannot read (binary data, token ids that
/// could not be decoded); such a request is also tagged `pii` (fail closed).
pub const UNREADABLE_TAG: &str = "unreadable";

/// Decodes a token-id prompt to text with the requested model's tokenizer (`None`: no tokenizer).
pub type TokenDecoder<'a> = &'a (dyn Fn(&[u32]) -> Option<String> + Sync);

/// What the built-in classifiers found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Classification {
    /// All tags: `pii` and `pii:<kind>` from the detectors, plus the client's tags.
    pub tags: BTreeSet<String>,
    /// PII matches (kinds and positions in the extracted text, never the text).
    pub pii: Vec<pii::PiiMatch>,
    /// What could not be read: media types of binary content, `token_ids` for token prompts that
    /// could not be decoded.
    pub unreadable: Vec<String>,
    /// The complexity assessment.
    pub complexity: complexity::ComplexityAssessment,
}

/// Classifies a request body, with the value of the `x-kinference-tags` header if present.
/// Token-id prompts count as unreadable; see [`classify_request_with`].
pub fn classify_request(body: &Value, tags_header: Option<&str>) -> Classification {
    classify_request_with(body, tags_header, &|_| None)
}

/// [`classify_request`], with token-id prompts decoded by `decode` and scanned as text.
pub fn classify_request_with(
    body: &Value,
    tags_header: Option<&str>,
    decode: TokenDecoder<'_>,
) -> Classification {
    classify_content(body, tags_header, decode).0
}

/// [`classify_request_with`] and the text it scanned (for the external classifier).
fn classify_content(
    body: &Value,
    tags_header: Option<&str>,
    decode: TokenDecoder<'_>,
) -> (Classification, String) {
    let mut content = body::extract(body);
    let mut unreadable = std::mem::take(&mut content.binary);
    for ids in &content.token_prompts {
        match decode(ids) {
            Some(text) => {
                content.text.push_str("\n\n");
                content.text.push_str(&text);
            }
            None => unreadable.push("token_ids".to_string()),
        }
    }
    let pii = pii::scan(&content.text);
    let mut tags = tags::from_body(body);
    if let Some(h) = tags_header {
        tags.extend(tags::from_header(h));
    }
    if !pii.is_empty() {
        tags.insert(PII_TAG.to_string());
        tags.extend(pii.iter().map(|m| m.kind.tag().to_string()));
    }
    if !unreadable.is_empty() {
        // Fail closed: what cannot be read may hold personal data.
        tags.insert(PII_TAG.to_string());
        tags.insert(UNREADABLE_TAG.to_string());
    }
    let (prompt, turns) = request_text(body);
    let classification = Classification {
        tags,
        pii,
        unreadable,
        complexity: complexity::assess(&prompt, turns),
    };
    (classification, content.text)
}

/// The engine's facts for a request body: what the gateway pipeline calls before
/// [`super::engine::evaluate`]. `tenant` is the authenticated tenant, `tags_header` the
/// `x-kinference-tags` value, `prompt_tokens` the router's count when it has one (else about four
/// characters per token). `None` when the body has no `model`.
pub fn request_facts(
    body: &Value,
    tenant: Option<&str>,
    tags_header: Option<&str>,
    prompt_tokens: Option<u64>,
) -> Option<(RequestFacts, Classification)> {
    request_facts_with(body, tenant, tags_header, prompt_tokens, &|_| None)
}

/// [`request_facts`], with token-id prompts decoded by `decode` (see [`classify_request_with`]).
pub fn request_facts_with(
    body: &Value,
    tenant: Option<&str>,
    tags_header: Option<&str>,
    prompt_tokens: Option<u64>,
    decode: TokenDecoder<'_>,
) -> Option<(RequestFacts, Classification)> {
    let model = body.get("model")?.as_str()?.to_string();
    let classification = classify_request_with(body, tags_header, decode);
    Some(facts_of(body, model, tenant, prompt_tokens, classification))
}

/// Every classifier a request passes before the plan: the built-in detectors over the whole body,
/// then the external classifier when `classifier.external` is configured (always asked, so its
/// tags are there for every request; its failure fails closed unless configured otherwise). Counts
/// what it could not read and how the external classifier answered.
#[derive(Default)]
pub struct Classifier {
    external: OnceLock<External>,
    metrics: ClassifierMetrics,
}

/// The external classifier as configured.
enum External {
    /// Asked for every request.
    Ready(Box<external::ExternalClassifier>),
    /// Configured, but the configuration is unusable: every request is treated as unanswered
    /// (`pii`, fail closed), never as if no classifier were configured.
    Broken(external::ExternalError),
}

/// `classifier` in `gateway.yaml`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassifierConfig {
    /// An external classifier asked for every request before the plan (off when absent).
    #[serde(default)]
    pub external: Option<external::ExternalConfig>,
}

impl ClassifierConfig {
    /// Checks the external classifier's URL (`http://host:port/path`).
    pub fn validate(&self) -> Result<(), String> {
        match &self.external {
            Some(c) => external::ExternalClassifier::from_config(c)
                .map(drop)
                .map_err(|e| format!("classifier.external: {e}")),
            None => Ok(()),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UnreadableLabels {
    content: &'static str,
}

#[derive(Clone, Debug, Default)]
struct ClassifierMetrics {
    external: Family<OutcomeLabels, Counter>,
    unreadable: Family<UnreadableLabels, Counter>,
}

impl std::fmt::Debug for Classifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Classifier")
            .field("external", &self.external.get().is_some())
            .finish()
    }
}

impl Classifier {
    /// Applies `config` (once; later calls are ignored and return `false`). An external classifier
    /// whose URL is unusable (which [`ClassifierConfig::validate`] rejects at load) fails every
    /// request closed.
    pub fn configure(&self, config: &ClassifierConfig) -> bool {
        let Some(c) = &config.external else {
            return true;
        };
        let external = match external::ExternalClassifier::from_config(c) {
            Ok(client) => External::Ready(Box::new(client)),
            Err(error) => {
                tracing::error!(%error, "external classifier unusable: every request is treated as personal data");
                External::Broken(error)
            }
        };
        self.external.set(external).is_ok()
    }

    /// The engine's facts for `body` (see [`request_facts_with`]), with the external classifier's
    /// tags. `None` when the body has no `model`.
    pub async fn facts(
        &self,
        body: &Value,
        tenant: Option<&str>,
        tags_header: Option<&str>,
        decode: TokenDecoder<'_>,
    ) -> Option<(RequestFacts, Classification)> {
        let model = body.get("model")?.as_str()?.to_string();
        let (mut classification, text) = classify_content(body, tags_header, decode);
        // Once per request and kind of content, however many images or prompts it holds.
        let contents: BTreeSet<&'static str> = classification
            .unreadable
            .iter()
            .map(|what| {
                if what == "token_ids" {
                    "token_ids"
                } else {
                    "binary"
                }
            })
            .collect();
        for content in contents {
            self.metrics
                .unreadable
                .get_or_create(&UnreadableLabels { content })
                .inc();
        }
        match self.external.get() {
            Some(External::Ready(external)) => {
                let tags = match external.classify(&text, &model).await {
                    Ok(tags) => {
                        self.count_external("ok");
                        tags
                    }
                    Err(error) => {
                        self.count_external(error.outcome());
                        external.fallback(&error, &model)
                    }
                };
                classification.tags.extend(tags);
            }
            Some(External::Broken(error)) => {
                tracing::warn!(%error, model, "external classifier unusable: treated as personal data");
                self.count_external("error");
                classification.tags.insert(PII_TAG.to_string());
                classification
                    .tags
                    .insert(external::UNAVAILABLE_TAG.to_string());
            }
            None => {}
        }
        Some(facts_of(body, model, tenant, None, classification))
    }

    fn count_external(&self, outcome: &'static str) {
        self.metrics
            .external
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// Registers `classifier_external_requests` and `classifier_unreadable_requests` in `registry`
    /// (the gateway's sub-registry).
    pub fn register_metrics(&self, registry: &mut Registry) {
        registry.register(
            "classifier_external_requests",
            "Calls to the external classifier by outcome (ok, timeout, error); timeout and error fail closed unless on_error is ignore",
            self.metrics.external.clone(),
        );
        registry.register(
            "classifier_unreadable_requests",
            "Requests with content the classifiers cannot read (binary: images, audio, documents; token_ids: no tokenizer), kept local",
            self.metrics.unreadable.clone(),
        );
    }
}

fn facts_of(
    body: &Value,
    model: String,
    tenant: Option<&str>,
    prompt_tokens: Option<u64>,
    classification: Classification,
) -> (RequestFacts, Classification) {
    let prompt_tokens =
        prompt_tokens.or_else(|| Some((request_text(body).0.len() as u64).div_ceil(4)));
    let max_output_tokens = body
        .get("max_tokens")
        .or_else(|| body.get("max_completion_tokens"))
        .and_then(Value::as_u64);
    let facts = RequestFacts {
        tenant: tenant.map(str::to_string),
        model,
        tags: classification.tags.clone(),
        complexity: Some(classification.complexity.level),
        prompt_tokens,
        max_output_tokens,
    };
    (facts, classification)
}

/// The prompt text of a request, one part per line, and its number of turns: what the complexity
/// assessment and the token estimate read (OpenAI chat `messages`, completion `prompt`, Anthropic
/// `system` and `messages`, Responses-style `input`). Inline data URLs (images) are skipped. The
/// PII scan reads far more: the whole body ([`body::extract`]).
pub fn request_text(body: &Value) -> (String, usize) {
    let mut parts = Vec::new();
    for key in ["system", "messages", "prompt", "input", "instructions"] {
        if let Some(v) = body.get(key) {
            collect_strings(v, &mut parts);
        }
    }
    let turns = match body.get("messages") {
        Some(Value::Array(m)) => m.len(),
        _ => 1,
    };
    (parts.join("\n"), turns)
}

fn collect_strings<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::String(s) if !s.starts_with("data:") => out.push(s),
        Value::Array(items) => items.iter().for_each(|i| collect_strings(i, out)),
        Value::Object(map) => {
            for (k, v) in map {
                // Structural fields, not text.
                if !matches!(
                    k.as_str(),
                    "role" | "type" | "id" | "tool_call_id" | "cache_control"
                ) {
                    collect_strings(v, out);
                }
            }
        }
        _ => {}
    }
}
