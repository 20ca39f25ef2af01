//! `extproc-replay`: one HTTP request as a Gateway's Envoy handles it when an `InferencePool`'s
//! `endpointPickerRef` names Kinference, for places where no Envoy can run (the one-node cluster
//! e2e). It is the gateway tests' proxy's-eye client (`kinference-gateway/tests/support/envoy.rs`,
//! compiled in here unchanged): the request's headers and body sent to the picker over ext_proc in
//! the chosen body mode, the answers' mutations applied, the request forwarded to the endpoint the
//! picker named, the response shown to the picker chunk by chunk, and what the client would get
//! printed as one JSON line:
//!
//! ```text
//! {"status":200,"destination":"10.88.0.7:8000","served":"10.88.0.7:8000","body":"...","sent_body":"..."}
//! ```
//!
//! `destination` is null when the picker answered locally (a refusal in the client's protocol);
//! `processor_failed` is true when the picker could not be reached and the failure mode decided.
//!
//! ```sh
//! target/debug/extproc-replay --picker 10.88.0.5:9002 --path /v1/chat/completions \
//!   --header 'authorization: Bearer sk-...' --body '{"model":"m","messages":[...]}'
//! ```

use std::net::SocketAddr;

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};

#[allow(dead_code)]
#[path = "../../../kinference-gateway/tests/support/envoy.rs"]
mod envoy;

use envoy::{BodyMode, Envoy, FailureMode, ResponsePhase};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Mode {
    /// `FULL_DUPLEX_STREAMED` both ways: the standard endpoint picker's setting.
    FullDuplex,
    /// `BUFFERED` request body, `STREAMED` response.
    Buffered,
    /// `STREAMED` both ways.
    Streamed,
}

#[derive(Debug, Parser)]
#[command(about = "Replay one HTTP request through an ext_proc endpoint picker, as Envoy does")]
struct Args {
    /// The picker's ext_proc address (`ip:port`).
    #[arg(long)]
    picker: SocketAddr,
    /// The request path.
    #[arg(long, default_value = "/v1/chat/completions")]
    path: String,
    /// A request header, `name: value` (repeatable).
    #[arg(long = "header")]
    headers: Vec<String>,
    /// The request body (JSON as the client sends it).
    #[arg(long, default_value = "")]
    body: String,
    /// How the proxy sends bodies to the picker.
    #[arg(long, value_enum, default_value_t = Mode::FullDuplex)]
    mode: Mode,
    /// The subset hint (`envoy.lb.subset_hint`): only these `ip:port` may be picked (repeatable).
    #[arg(long)]
    subset: Vec<String>,
    /// `failureMode: FailOpen`: the proxy's own endpoint when the picker fails (default FailClose).
    #[arg(long)]
    fail_open_to: Option<String>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut headers = Vec::new();
    for h in &args.headers {
        let Some((name, value)) = h.split_once(':') else {
            bail!("--header {h:?}: expected `name: value`");
        };
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    let mut proxy = Envoy::lazy(args.picker);
    proxy.body_mode = match args.mode {
        Mode::FullDuplex => BodyMode::FullDuplex,
        Mode::Buffered => BodyMode::Buffered,
        Mode::Streamed => BodyMode::Streamed,
    };
    proxy.response_phase = ResponsePhase::Streamed;
    proxy.subset = (!args.subset.is_empty()).then(|| args.subset.clone());
    if let Some(endpoint) = &args.fail_open_to {
        proxy.failure_mode = FailureMode::FailOpen(endpoint.clone());
    }
    let borrowed: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let answer = proxy
        .request("POST", &args.path, &borrowed, args.body.as_bytes())
        .await;
    let text =
        |b: &Option<bytes::Bytes>| b.as_ref().map(|b| String::from_utf8_lossy(b).to_string());
    let line = serde_json::json!({
        "status": answer.status,
        "destination": answer.destination,
        "served": answer.served,
        "processor_failed": answer.processor_failed,
        "body": String::from_utf8_lossy(&answer.body),
        "sent_body": text(&answer.sent_body),
    });
    println!(
        "{}",
        serde_json::to_string(&line).context("the answer as JSON")?
    );
    Ok(())
}
