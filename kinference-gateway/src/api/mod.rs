//! The client-facing protocols: OpenAI (passed through to vLLM-compatible workers) and Anthropic
//! Messages (translated to the workers' OpenAI chat API and back).

pub mod anthropic;
pub mod members;
pub mod openai;
