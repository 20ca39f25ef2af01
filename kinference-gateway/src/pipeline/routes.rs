//! The gateway's client-facing routes: the one table ([`ROUTES`]) the HTTP server dispatches on and
//! the ext_proc door recognises paths by, and that the governance tests enumerate
//! (`tests/governance_matrix.rs`), so an endpoint cannot be served without being checked.
//!
//! Each [`Endpoint`] says what the stages need to know of it: its protocol (errors are answered in
//! it), whether it names a model, whether a worker answers it or the gateway itself, what its tenant
//! is billed for, and whether it may stream.

use http::Method;

use crate::api::openai::passthrough::Route;
use crate::errors::Protocol;

/// Every endpoint the gateway serves on its API port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// OpenAI `POST /v1/chat/completions`.
    ChatCompletions,
    /// OpenAI `POST /v1/completions`.
    Completions,
    /// Anthropic `POST /v1/messages`.
    Messages,
    /// Anthropic `POST /v1/messages/count_tokens` (answered by the gateway's tokenizer).
    CountTokens,
    /// OpenAI `POST /v1/embeddings`.
    Embeddings,
    /// OpenAI `POST /v1/responses`.
    Responses,
    /// vLLM's `POST /tokenize`.
    Tokenize,
    /// vLLM's `POST /detokenize`.
    Detokenize,
    /// OpenAI `GET /v1/models` (answered by the gateway).
    Models,
}

/// The table the server dispatches on: every endpoint, once.
pub const ROUTES: [Endpoint; 9] = [
    Endpoint::ChatCompletions,
    Endpoint::Completions,
    Endpoint::Messages,
    Endpoint::CountTokens,
    Endpoint::Embeddings,
    Endpoint::Responses,
    Endpoint::Tokenize,
    Endpoint::Detokenize,
    Endpoint::Models,
];

/// What a tenant is billed for on an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Billing {
    /// Prompt and generated tokens (an output reservation at admission).
    Generation,
    /// Prompt tokens only (embeddings generate nothing).
    Input,
    /// Nothing but the request itself (it counts against the request rate).
    RequestOnly,
}

impl Endpoint {
    /// The endpoint `method path` names (query string ignored, a trailing slash tolerated); `None`
    /// for anything else.
    pub fn of(method: &Method, path: &str) -> Option<Self> {
        let path = path.split('?').next().unwrap_or(path);
        let path = match path.strip_suffix('/') {
            Some(p) if !p.is_empty() => p,
            _ => path,
        };
        ROUTES
            .into_iter()
            .find(|e| e.path() == path && e.method() == method)
    }

    /// The endpoint a path names whatever the method (the ext_proc door, where Envoy's route
    /// already matched the method).
    pub fn of_path(path: &str) -> Option<Self> {
        ROUTES
            .into_iter()
            .find(|e| Endpoint::of(&e.method(), path) == Some(*e))
    }

    /// The client's method.
    pub fn method(self) -> Method {
        match self {
            Endpoint::Models => Method::GET,
            _ => Method::POST,
        }
    }

    /// The client's path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Messages => "/v1/messages",
            Endpoint::CountTokens => "/v1/messages/count_tokens",
            Endpoint::Embeddings => "/v1/embeddings",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Tokenize => "/tokenize",
            Endpoint::Detokenize => "/detokenize",
            Endpoint::Models => "/v1/models",
        }
    }

    /// The client's protocol (errors are answered in it).
    pub fn protocol(self) -> Protocol {
        match self {
            Endpoint::Messages | Endpoint::CountTokens => Protocol::Anthropic,
            _ => Protocol::OpenAi,
        }
    }

    /// Whether the request names a model (every endpoint but the model list).
    pub fn names_model(self) -> bool {
        self != Endpoint::Models
    }

    /// Whether a backend answers it (else the gateway does: the model list, token counts).
    pub fn reaches_backend(self) -> bool {
        !matches!(self, Endpoint::Models | Endpoint::CountTokens)
    }

    /// What the tenant is billed for.
    pub fn billing(self) -> Billing {
        match self {
            Endpoint::ChatCompletions
            | Endpoint::Completions
            | Endpoint::Messages
            | Endpoint::Responses => Billing::Generation,
            Endpoint::Embeddings => Billing::Input,
            Endpoint::CountTokens
            | Endpoint::Tokenize
            | Endpoint::Detokenize
            | Endpoint::Models => Billing::RequestOnly,
        }
    }

    /// Whether its worker keeps the prompt in a prefix cache that a `cache_salt` partitions (vLLM
    /// takes one on chat, completions, `/v1/messages`, responses and embeddings): its requests are
    /// salted with the tenant's salt ([`crate::tenancy::isolation`]). Tokenizing caches nothing.
    pub fn reaches_prefix_cache(self) -> bool {
        matches!(
            self,
            Endpoint::ChatCompletions
                | Endpoint::Completions
                | Endpoint::Messages
                | Endpoint::Responses
                | Endpoint::Embeddings
        )
    }

    /// Whether the answer may be streamed (`"stream": true`).
    pub fn streams(self) -> bool {
        matches!(
            self,
            Endpoint::ChatCompletions
                | Endpoint::Completions
                | Endpoint::Messages
                | Endpoint::Responses
        )
    }

    /// Whether the request has a body.
    pub fn has_body(self) -> bool {
        self.method() == Method::POST
    }

    /// The worker's endpoint a chat, completion or Anthropic request goes to (an Anthropic request
    /// is translated to chat unless the model's workers serve `/v1/messages`); the pass-through
    /// endpoints go to their own path.
    pub fn upstream_path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::CountTokens => {
                "/v1/chat/completions"
            }
            Endpoint::Completions => "/v1/completions",
            other => other.path(),
        }
    }

    /// The pass-through endpoint behind it: its body reaches the worker as sent (the model renamed
    /// and the output limit set where the gateway must), its answer comes back byte for byte.
    pub fn passthrough(self) -> Option<Route> {
        match self {
            Endpoint::Embeddings => Some(Route::Embeddings),
            Endpoint::Responses => Some(Route::Responses),
            Endpoint::Tokenize => Some(Route::Tokenize),
            Endpoint::Detokenize => Some(Route::Detokenize),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_is_found_by_its_own_method_and_path_only() {
        for e in ROUTES {
            assert_eq!(Endpoint::of(&e.method(), e.path()), Some(e), "{e:?}");
            assert_eq!(
                Endpoint::of(&e.method(), &format!("{}/", e.path())),
                Some(e)
            );
            assert_eq!(
                Endpoint::of(&e.method(), &format!("{}?x=1", e.path())),
                Some(e)
            );
            assert_eq!(Endpoint::of_path(e.path()), Some(e));
            let other = if e.method() == Method::GET {
                Method::POST
            } else {
                Method::GET
            };
            assert_eq!(Endpoint::of(&other, e.path()), None, "{e:?}");
        }
        assert_eq!(Endpoint::of(&Method::POST, "/v1/nope"), None);
        assert_eq!(Endpoint::of(&Method::POST, "/"), None);
        let paths: std::collections::BTreeSet<_> = ROUTES.iter().map(|e| e.path()).collect();
        assert_eq!(paths.len(), ROUTES.len(), "one path per endpoint");
    }
}
