//! `--worker URL[,role=ROLE]` (repeatable): the gateway in front of OpenAI-compatible servers that
//! already run, without a configuration file. Each worker's served model is learned from its
//! `/v1/models`; the tokenizer comes from `--tokenizer-dir` or, without it, from the worker's own
//! `POST /tokenize`. `role=prefill` / `role=decode` make a prefill/decode disaggregation pair (vLLM
//! started with a KV connector); the default is `both`.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt as _, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use kinference_api::WorkerRole;

use super::GatewayConfig;
use crate::routing::{ModelConfig, WorkerConfig};

/// How long one worker gets to answer `/v1/models` at start.
const MODELS_TIMEOUT: Duration = Duration::from_secs(10);

/// `config` plus the `--worker` URLs, each serving the first model its `/v1/models` lists. A worker
/// that does not answer, or lists no model, is a start-up error: the operator named it, so a
/// gateway that silently left it out would route around a mistake.
pub async fn with_flag_workers(
    mut config: GatewayConfig,
    urls: &[String],
    tokenizer_dir: Option<&PathBuf>,
    headers: &http::HeaderMap,
) -> Result<GatewayConfig, String> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    for flag in urls {
        let (url, role) = parse_flag(flag)?;
        let model = served_model(&client, &url, headers).await?;
        if !config.models.iter().any(|m| m.name == model) {
            config.models.push(ModelConfig {
                name: model.clone(),
                tokenizer_dir: tokenizer_dir.cloned(),
                serves_messages: false,
                profile: None,
            });
        }
        if !config.workers.iter().any(|w| w.url == url) {
            config.workers.push(WorkerConfig { url, model, role });
        }
    }
    config.validate()?;
    Ok(config)
}

/// `URL` or `URL,role=ROLE` -> the URL without a trailing slash, and the role (default `both`).
fn parse_flag(flag: &str) -> Result<(String, WorkerRole), String> {
    let mut parts = flag.split(',');
    let url = parts
        .next()
        .unwrap_or_default()
        .trim()
        .trim_end_matches('/')
        .to_string();
    let mut role = WorkerRole::Both;
    for option in parts {
        match option.trim().split_once('=') {
            Some(("role", value)) => {
                role = value.parse().map_err(|e| format!("--worker {flag}: {e}"))?;
            }
            _ => {
                return Err(format!(
                    "--worker {flag}: unknown option `{option}` (expected URL or URL,role=prefill|decode|both)"
                ));
            }
        }
    }
    Ok((url, role))
}

/// The first model id of the worker's `GET /v1/models`.
async fn served_model(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
    url: &str,
    headers: &http::HeaderMap,
) -> Result<String, String> {
    let mut request = Request::builder()
        .method(Method::GET)
        .uri(format!("{url}/v1/models"))
        .body(Empty::new())
        .map_err(|e| format!("--worker {url}: {e}"))?;
    // A worker started with `--api-key` wants the key on `/v1/models` too.
    request.headers_mut().extend(headers.clone());
    let read = async {
        let response = client
            .request(request)
            .await
            .map_err(|e| format!("--worker {url}: GET /v1/models failed: {e}"))?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("--worker {url}: reading /v1/models: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("--worker {url}: GET /v1/models answered {status}"));
        }
        Ok(body)
    };
    let body = tokio::time::timeout(MODELS_TIMEOUT, read)
        .await
        .map_err(|_| format!("--worker {url}: no answer to /v1/models in {MODELS_TIMEOUT:?}"))??;
    first_model_id(&body).ok_or_else(|| format!("--worker {url}: /v1/models lists no model"))
}

/// `data[0].id` of an OpenAI model list.
fn first_model_id(body: &[u8]) -> Option<String> {
    let list: serde_json::Value = serde_json::from_slice(body).ok()?;
    list.pointer("/data/0/id")?.as_str().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::{WorkerRole, first_model_id, parse_flag};

    #[test]
    fn a_flag_may_name_the_workers_role() {
        assert_eq!(
            parse_flag("http://127.0.0.1:8001/").unwrap(),
            ("http://127.0.0.1:8001".to_string(), WorkerRole::Both)
        );
        assert_eq!(
            parse_flag("http://p:8001,role=prefill").unwrap(),
            ("http://p:8001".to_string(), WorkerRole::Prefill)
        );
        assert_eq!(
            parse_flag("http://d:8002, role=decode").unwrap().1,
            WorkerRole::Decode
        );
        assert!(parse_flag("http://d:8002,role=encode").is_err());
        assert!(parse_flag("http://d:8002,weight=2").is_err());
    }

    #[test]
    fn reads_the_first_model_of_an_openai_list() {
        let body = br#"{"object":"list","data":[{"id":"qwen2-sim","object":"model"},{"id":"b"}]}"#;
        assert_eq!(first_model_id(body).as_deref(), Some("qwen2-sim"));
        assert_eq!(first_model_id(br#"{"data":[]}"#), None);
        assert_eq!(first_model_id(b"not json"), None);
    }
}
