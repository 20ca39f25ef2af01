//! What the gateway sends every worker besides the request: the workers' API key (vLLM started
//! with `--api-key` wants `Authorization: Bearer <key>` on every `/v1` route) and any other
//! configured headers. A key that is named but cannot be read stops the start: a gateway that
//! silently sent no key would answer 401 to every request.

use std::collections::BTreeMap;
use std::path::PathBuf;

use http::{HeaderMap, HeaderName, HeaderValue, header};
use serde::Deserialize;

/// Where the workers' API key is read from (local mode: an environment variable or a file; the
/// Helm chart fills the variable from a Secret).
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WorkerApiKey {
    /// Environment variable holding the key.
    #[serde(default)]
    pub env: Option<String>,
    /// File holding the key (a mounted Secret), trimmed of surrounding whitespace.
    #[serde(default)]
    pub file: Option<PathBuf>,
}

impl WorkerApiKey {
    /// The key, read now; an unset variable, an unreadable file or an empty key is an error.
    pub fn read(&self) -> Result<String, String> {
        let key = match (&self.env, &self.file) {
            (Some(var), None) => std::env::var(var)
                .map_err(|_| format!("worker_api_key: environment variable `{var}` is not set"))?,
            (None, Some(path)) => std::fs::read_to_string(path)
                .map_err(|e| format!("worker_api_key: reading {}: {e}", path.display()))?,
            _ => return Err("worker_api_key needs exactly one of `env` and `file`".into()),
        };
        let key = key.trim().to_string();
        if key.is_empty() {
            return Err("worker_api_key: the key is empty".into());
        }
        Ok(key)
    }
}

/// The workers' key from `--worker-api-key` (`KINFERENCE_WORKER_API_KEY`, which the Helm chart
/// fills from a Secret) or from `worker_api_key` in `gateway.yaml`; both at once is an error (which
/// one was meant is not clear), and so is an empty key.
pub fn resolve(
    flag: Option<&str>,
    configured: Option<&WorkerApiKey>,
) -> Result<Option<String>, String> {
    match (flag, configured) {
        (Some(_), Some(_)) => Err(
            "--worker-api-key (KINFERENCE_WORKER_API_KEY) and worker_api_key in the configuration \
             both set the workers' key: keep one"
                .into(),
        ),
        (Some(key), None) if key.trim().is_empty() => {
            Err("--worker-api-key: the key is empty".into())
        }
        (Some(key), None) => Ok(Some(key.trim().to_string())),
        (None, Some(c)) => c.read().map(Some),
        (None, None) => Ok(None),
    }
}

/// The headers sent with every request to a worker: `extra` (name to value), then
/// `Authorization: Bearer <key>` when there is a key ([`resolve`]; it wins over an `extra` one).
pub fn worker_headers(
    api_key: Option<&str>,
    extra: &BTreeMap<String, String>,
) -> Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    for (name, value) in extra {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|e| format!("worker_headers: `{name}` is not a header name: {e}"))?;
        let value = HeaderValue::from_str(value)
            .map_err(|e| format!("worker_headers: the value of `{name}`: {e}"))?;
        headers.insert(name, value);
    }
    if let Some(key) = api_key {
        let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| "worker_api_key: the key holds characters a header cannot".to_string())?;
        value.set_sensitive(true);
        headers.insert(header::AUTHORIZATION, value);
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_from_a_file_becomes_a_bearer_token() {
        let dir = std::env::temp_dir().join(format!("kinference-wk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("key");
        std::fs::write(&path, "sk-worker\n").expect("write");
        let key = WorkerApiKey {
            env: None,
            file: Some(path),
        };
        let extra = BTreeMap::from([("x-team".to_string(), "search".to_string())]);
        let key = resolve(None, Some(&key)).expect("read");
        let h = worker_headers(key.as_deref(), &extra).expect("headers");
        assert_eq!(h[header::AUTHORIZATION], "Bearer sk-worker");
        assert_eq!(h["x-team"], "search");
    }

    #[test]
    fn a_named_key_that_cannot_be_read_fails_closed() {
        let unset = WorkerApiKey {
            env: Some("KINFERENCE_TEST_NO_SUCH_VARIABLE".into()),
            file: None,
        };
        assert!(resolve(None, Some(&unset)).is_err());
        let both = WorkerApiKey {
            env: Some("HOME".into()),
            file: Some("/dev/null".into()),
        };
        assert!(resolve(None, Some(&both)).is_err());
        let empty = WorkerApiKey {
            env: None,
            file: Some("/dev/null".into()),
        };
        assert!(resolve(None, Some(&empty)).is_err());
        // The flag and the file at once: which one was meant is not clear.
        assert!(resolve(Some("sk-flag"), Some(&unset)).is_err());
        assert!(resolve(Some("  "), None).is_err());
        assert_eq!(resolve(Some("sk-flag"), None), Ok(Some("sk-flag".into())));
        let bad_name = BTreeMap::from([("bad name".to_string(), "v".to_string())]);
        assert!(worker_headers(None, &bad_name).is_err());
    }
}
