//! vLLM worker pods -> workers: which pods count (Running, Ready, with an IP, not terminating) and
//! the worker each one is (URL from the pod IP and the `kinference.ai/http-port` annotation, model from
//! the `kinference.ai/model` label or annotation), the chart's conventions (deploy/examples/vllm-worker.yaml).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;

/// Annotation with the port serving the OpenAI API (default [`DEFAULT_HTTP_PORT`]).
pub const HTTP_PORT_ANNOTATION: &str = "kinference.ai/http-port";
/// Label (or annotation) with the served model name.
pub const MODEL_KEY: &str = "kinference.ai/model";
/// vLLM's default port.
pub const DEFAULT_HTTP_PORT: u16 = 8000;

/// A worker as discovery sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodWorker {
    /// `http://<pod ip>:<http port>`.
    pub url: String,
    /// Served model.
    pub model: String,
    /// The pod's labels: which `InferencePool` selectors pick it.
    pub labels: BTreeMap<String, String>,
}

/// The worker a pod is, if it should receive requests now. A pod without a model, with an
/// unparsable port, not Running, not Ready, without an IP or being deleted is no worker (yet).
pub fn worker_of(pod: &Pod) -> Option<PodWorker> {
    let meta = &pod.metadata;
    let ip = ready_ip(pod)?;
    let model = lookup(meta.labels.as_ref(), MODEL_KEY)
        .or_else(|| lookup(meta.annotations.as_ref(), MODEL_KEY))?;
    let port = match lookup(meta.annotations.as_ref(), HTTP_PORT_ANNOTATION) {
        Some(p) => p.trim().parse::<u16>().ok()?,
        None => DEFAULT_HTTP_PORT,
    };
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    };
    Some(PodWorker {
        url: format!("http://{host}:{port}"),
        model: model.to_string(),
        labels: meta.labels.clone().unwrap_or_default(),
    })
}

/// The pod's IP when it should receive requests now: Running, Ready, with an IP, not being deleted.
pub fn ready_ip(pod: &Pod) -> Option<&str> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") {
        return None;
    }
    let ready = status
        .conditions
        .as_ref()?
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    status.pod_ip.as_deref().filter(|ip| !ip.is_empty())
}

fn lookup<'a>(map: Option<&'a BTreeMap<String, String>>, key: &str) -> Option<&'a str> {
    map?.get(key).map(String::as_str).filter(|v| !v.is_empty())
}

/// The key discovery tracks a pod by.
pub fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}
