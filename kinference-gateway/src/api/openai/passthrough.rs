//! The OpenAI endpoints the gateway passes to a worker of the requested model as they are:
//! `/v1/embeddings`, `/v1/responses`, vLLM's `/tokenize` and `/detokenize`. The gateway reads only
//! what it routes, admits and bills by (the model, the input's text, `stream`, the output limit, and
//! the answer's usage); every other field reaches the worker untouched.

use serde::Deserialize;
use serde_json::Value;

use super::{Usage, validate_model};
use crate::errors::GatewayError;

/// Which pass-through endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /v1/responses`.
    Responses,
    /// vLLM's `POST /tokenize`.
    Tokenize,
    /// vLLM's `POST /detokenize`.
    Detokenize,
}

impl Route {
    /// The route a request path names exactly (the inverse of [`Route::path`]); `None` for other paths.
    pub fn of_path(path: &str) -> Option<Self> {
        [
            Route::Embeddings,
            Route::Responses,
            Route::Tokenize,
            Route::Detokenize,
        ]
        .into_iter()
        .find(|r| r.path() == path)
    }

    /// The worker's path (the client's).
    pub fn path(self) -> &'static str {
        match self {
            Route::Embeddings => "/v1/embeddings",
            Route::Responses => "/v1/responses",
            Route::Tokenize => "/tokenize",
            Route::Detokenize => "/detokenize",
        }
    }

    /// Whether the tenant is admitted and billed for it (tokenizing generates nothing).
    pub fn billed(self) -> bool {
        matches!(self, Route::Embeddings | Route::Responses)
    }
}

/// The fields the gateway reads of a pass-through request.
#[derive(Debug, Clone, Deserialize)]
pub struct PassthroughRequest {
    /// Served model name.
    pub model: String,
    /// Embeddings and responses: the input (a string, a list of strings or token ids; responses:
    /// a list of messages).
    #[serde(default)]
    pub input: Option<Value>,
    /// Responses: the system instructions (part of the prompt).
    #[serde(default)]
    pub instructions: Option<String>,
    /// Tokenize: the prompt text.
    #[serde(default)]
    pub prompt: Option<Value>,
    /// Tokenize: chat messages.
    #[serde(default)]
    pub messages: Option<Value>,
    /// Responses: stream the answer as Responses events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Responses: the output limit (the tenant's reservation).
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    /// vLLM's prefix-cache salt (the gateway mixes the tenant's into it).
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// Responses: the end user (a session name, [`crate::routing::sessions`]).
    #[serde(default)]
    pub user: Option<Value>,
    /// Responses: the end user's stable identifier (a session name).
    #[serde(default)]
    pub safety_identifier: Option<Value>,
    /// Responses: the stored answer this one continues (held by the worker that made it).
    #[serde(default)]
    pub previous_response_id: Option<Value>,
}

impl PassthroughRequest {
    /// `safety_identifier`, else `user`, when one is a non-empty string.
    pub fn session_name(&self) -> Option<String> {
        [&self.safety_identifier, &self.user]
            .into_iter()
            .find_map(|v| v.as_ref()?.as_str().filter(|s| !s.is_empty()))
            .map(str::to_string)
    }

    /// The stored answer a Responses request continues, when it names one.
    pub fn previous_response_id(&self) -> Option<&str> {
        self.previous_response_id
            .as_ref()?
            .as_str()
            .filter(|s| !s.is_empty())
    }

    /// Reads and checks `body` for `route`; 400 on bad JSON, a missing model or a missing input.
    pub fn parse(route: Route, body: &[u8]) -> Result<Self, GatewayError> {
        let r: PassthroughRequest = super::parse_body(body)?;
        validate_model(&r.model)?;
        let missing = match route {
            Route::Embeddings | Route::Responses => r.input.as_ref().is_none_or(Value::is_null),
            Route::Tokenize => r.prompt.is_none() && r.messages.is_none(),
            Route::Detokenize => false,
        };
        if missing {
            let field = match route {
                Route::Tokenize => "prompt",
                _ => "input",
            };
            return Err(GatewayError::invalid(
                field,
                format!("`{field}` is required by {}", route.path()),
            ));
        }
        if route == Route::Responses
            && r.previous_response_id
                .as_ref()
                .is_some_and(|v| !v.is_string() && !v.is_null())
        {
            return Err(GatewayError::invalid(
                "previous_response_id",
                "`previous_response_id` must be a string",
            ));
        }
        if route != Route::Responses && r.stream == Some(true) {
            return Err(GatewayError::invalid(
                "stream",
                format!("{} does not stream", route.path()),
            ));
        }
        Ok(r)
    }

    /// Whether the answer is streamed.
    pub fn stream(&self) -> bool {
        self.stream == Some(true)
    }

    /// The text the prompt is made of, for routing and for the tenant's estimate: the input's
    /// strings (and a response's instructions) joined in order.
    pub fn text(&self) -> String {
        let mut out = String::new();
        if let Some(i) = &self.instructions {
            out.push_str(i);
        }
        for v in [&self.input, &self.prompt, &self.messages]
            .into_iter()
            .flatten()
        {
            collect_text(v, &mut out);
        }
        out
    }
}

/// Appends every string under `v` (message contents, input parts) to `out`, newline-separated.
fn collect_text(v: &Value, out: &mut String) {
    match v {
        Value::String(s) => {
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(s);
        }
        Value::Array(items) => items.iter().for_each(|i| collect_text(i, out)),
        Value::Object(map) => {
            for key in ["content", "text"] {
                if let Some(inner) = map.get(key) {
                    collect_text(inner, out);
                }
            }
        }
        _ => {}
    }
}

/// The longest answer id remembered ([`answer_id_of`]); a longer one is not an id vLLM makes.
const ANSWER_ID_BYTES: usize = 256;

/// The id of a `/v1/responses` answer (a whole body, or a streamed event's `response`), which a
/// later request may continue (`previous_response_id`); `None` for other routes.
pub fn answer_id_of(route: Route, body: &[u8]) -> Option<String> {
    if route != Route::Responses {
        return None;
    }
    let v: Value = serde_json::from_slice(body).ok()?;
    let response = v.get("response").unwrap_or(&v);
    let id = response.get("id")?.as_str()?;
    (!id.is_empty() && id.len() <= ANSWER_ID_BYTES).then(|| id.to_string())
}

/// The usage of an answer: embeddings report OpenAI's `usage`, responses
/// `usage.input_tokens` / `output_tokens` (in the body, or in a `response.completed` event's
/// `response`).
pub fn usage_of(route: Route, body: &[u8]) -> Option<Usage> {
    let v: Value = serde_json::from_slice(body).ok()?;
    match route {
        Route::Responses => {
            let response = v.get("response").unwrap_or(&v);
            responses_usage(response.get("usage")?)
        }
        _ => {
            let mut usage: Usage = serde_json::from_value(v.get("usage")?.clone()).ok()?;
            // A total that is missing or does not add up is the sum of what was billed.
            let sum = usage.prompt_tokens.saturating_add(usage.completion_tokens);
            usage.total_tokens = usage.total_tokens.max(sum);
            Some(usage)
        }
    }
}

/// A Responses `usage` object in chat terms.
fn responses_usage(u: &Value) -> Option<Usage> {
    let input = u.get("input_tokens")?.as_u64()?;
    let output = u.get("output_tokens").and_then(Value::as_u64).unwrap_or(0);
    let cached = u
        .pointer("/input_tokens_details/cached_tokens")
        .and_then(Value::as_u64);
    Some(Usage {
        prompt_tokens: input,
        completion_tokens: output,
        total_tokens: input.saturating_add(output),
        prompt_tokens_details: cached.map(|c| super::PromptTokensDetails {
            cached_tokens: Some(c),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_route_wants_its_fields() {
        let ok =
            PassthroughRequest::parse(Route::Embeddings, br#"{"model":"m","input":["a","b"]}"#);
        assert_eq!(ok.expect("embeddings").text(), "a\nb");
        for (route, body) in [
            (Route::Embeddings, &br#"{"model":"m"}"#[..]),
            (Route::Embeddings, br#"{"model":"","input":"x"}"#),
            (
                Route::Embeddings,
                br#"{"model":"m","input":"x","stream":true}"#,
            ),
            (Route::Tokenize, br#"{"model":"m"}"#),
            (Route::Responses, br#"{"input":"x"}"#),
            (Route::Detokenize, b"not json"),
        ] {
            let e = PassthroughRequest::parse(route, body).expect_err("must be refused");
            assert_eq!(e.status(), http::StatusCode::BAD_REQUEST, "{route:?}");
        }
    }

    #[test]
    fn a_response_routes_by_its_instructions_and_messages() {
        let r = PassthroughRequest::parse(
            Route::Responses,
            br#"{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]}],"stream":true}"#,
        )
        .expect("responses");
        assert_eq!(r.text(), "Be brief.\nhi");
        assert!(r.stream());
    }

    #[test]
    fn a_response_names_the_answer_it_continues_as_a_string() {
        let r = PassthroughRequest::parse(
            Route::Responses,
            br#"{"model":"m","input":"more","previous_response_id":"resp_7"}"#,
        )
        .expect("responses");
        assert_eq!(r.previous_response_id(), Some("resp_7"));
        let none = PassthroughRequest::parse(
            Route::Responses,
            br#"{"model":"m","input":"x","previous_response_id":null}"#,
        )
        .expect("null is none");
        assert_eq!(none.previous_response_id(), None);
        let e = PassthroughRequest::parse(
            Route::Responses,
            br#"{"model":"m","input":"x","previous_response_id":7}"#,
        )
        .expect_err("a number is refused");
        assert_eq!(e.status(), http::StatusCode::BAD_REQUEST);
    }

    #[test]
    fn an_answer_id_is_read_from_a_response_or_its_event() {
        let whole = br#"{"id":"resp_1","object":"response","usage":null}"#;
        assert_eq!(
            answer_id_of(Route::Responses, whole).as_deref(),
            Some("resp_1")
        );
        let event = br#"{"type":"response.created","response":{"id":"resp_2"}}"#;
        assert_eq!(
            answer_id_of(Route::Responses, event).as_deref(),
            Some("resp_2")
        );
        // Only Responses answers are continued; an absurd id is not one vLLM makes.
        assert_eq!(answer_id_of(Route::Embeddings, whole), None);
        let long = format!(r#"{{"id":"{}"}}"#, "r".repeat(ANSWER_ID_BYTES + 1));
        assert_eq!(answer_id_of(Route::Responses, long.as_bytes()), None);
    }

    #[test]
    fn usage_is_read_in_each_shape() {
        let u = usage_of(
            Route::Embeddings,
            br#"{"usage":{"prompt_tokens":7,"total_tokens":7}}"#,
        )
        .expect("embeddings usage");
        assert_eq!((u.prompt_tokens, u.completion_tokens), (7, 0));
        let u = usage_of(
            Route::Responses,
            br#"{"type":"response.completed","response":{"usage":{"input_tokens":9,"output_tokens":3,"input_tokens_details":{"cached_tokens":4}}}}"#,
        )
        .expect("responses usage");
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.total_tokens),
            (9, 3, 12)
        );
        assert_eq!(u.cached_tokens(), Some(4));
        assert!(usage_of(Route::Responses, br#"{"usage":null}"#).is_none());
    }
}
