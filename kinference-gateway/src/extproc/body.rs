//! The API of a request through ext_proc whose path names no endpoint of the route table (an
//! HTTPRoute may rewrite it): the body's shape decides, `messages` for OpenAI chat, `prompt` for a
//! completion (Anthropic is recognised by its path only). Parsing itself is the pipeline's own parse
//! stage, so a body the HTTP gateway would refuse with 400 is refused here with the same message.

use serde_json::Value;

use crate::api::openai;
use crate::errors::GatewayError;
use crate::pipeline::Endpoint;

/// The endpoint a body of an unknown path stands for, by its shape.
pub fn detect(path: Option<Endpoint>, body: &[u8]) -> Result<Endpoint, GatewayError> {
    if let Some(endpoint) = path {
        return Ok(endpoint);
    }
    let value: Value = openai::parse_body(body)?;
    if value.get("messages").is_some() {
        Ok(Endpoint::ChatCompletions)
    } else if value.get("prompt").is_some() {
        Ok(Endpoint::Completions)
    } else {
        Err(GatewayError::invalid(
            "messages",
            "the body has neither `messages` nor `prompt`",
        ))
    }
}
