//! API keys -> tenant.
//!
//! A tenant's keys are `CredentialRef`s of its `InferenceTenant`: an environment variable (local
//! mode) or a Secret key, read from `<secrets_dir>/<secret name>/<key>` (how Kubernetes mounts a
//! Secret volume). Only the SHA-256 digest of each key is kept in memory; a presented key is hashed
//! the same way and compared with every stored digest in constant time (`subtle`), with no early
//! exit, so neither the comparison nor the position of the match leaks through timing.
//!
//! Keys never appear in logs, metrics or error bodies: errors name the tenant and the reference
//! (`env ACME_API_KEY`), never the value, and [`PresentedKey`] has no `Debug`/`Display`.

use std::path::Path;

use http::HeaderMap;
use kinference_crds::CredentialRef;
use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};

/// SHA-256 of a key.
pub type KeyDigest = [u8; 32];

/// A key as the client sent it. Deliberately neither `Debug` nor `Display`.
pub struct PresentedKey(Vec<u8>);

impl PresentedKey {
    /// The digest compared against the key ring.
    pub fn digest(&self) -> KeyDigest {
        digest(&self.0)
    }
}

/// SHA-256 of `bytes`.
pub fn digest(bytes: &[u8]) -> KeyDigest {
    Sha256::digest(bytes).into()
}

/// The key a request carries: `Authorization: Bearer <key>` (OpenAI) or `x-api-key: <key>`
/// (Anthropic); either is accepted on every endpoint, as SDKs of both kinds may be pointed at any.
pub fn presented_key(headers: &HeaderMap) -> Option<PresentedKey> {
    if let Some(value) = headers.get("x-api-key") {
        let key = value.as_bytes().trim_ascii();
        if !key.is_empty() {
            return Some(PresentedKey(key.to_vec()));
        }
    }
    let value = headers.get(http::header::AUTHORIZATION)?.as_bytes();
    let value = value.trim_ascii();
    let prefix = b"bearer ";
    if value.len() <= prefix.len() || !value[..prefix.len()].eq_ignore_ascii_case(prefix) {
        return None;
    }
    let key = value[prefix.len()..].trim_ascii();
    (!key.is_empty()).then(|| PresentedKey(key.to_vec()))
}

/// Every known key digest with the index of its tenant.
#[derive(Debug, Default, Clone)]
pub struct KeyRing {
    entries: Vec<(KeyDigest, u32)>,
}

impl KeyRing {
    /// Adds a key of tenant number `tenant`.
    pub fn insert(&mut self, digest: KeyDigest, tenant: u32) {
        self.entries.push((digest, tenant));
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// No keys at all.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The tenant number of `key`, comparing against every entry in constant time.
    pub fn lookup(&self, key: &PresentedKey) -> Option<u32> {
        let presented = key.digest();
        let mut found = subtle::Choice::from(0);
        let mut tenant = 0u32;
        for (digest, index) in &self.entries {
            let equal = digest[..].ct_eq(&presented[..]);
            tenant = u32::conditional_select(&tenant, index, equal);
            found |= equal;
        }
        bool::from(found).then_some(tenant)
    }
}

/// Why a credential could not be read (never contains the credential).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredentialError {
    /// Neither `env` nor `secretRef` resolved.
    #[error("{0}")]
    Unresolved(String),
}

/// Reads a credential: the environment variable first (local mode), then the mounted Secret file.
pub fn resolve(
    cred: &CredentialRef,
    secrets_dir: Option<&Path>,
) -> Result<Vec<u8>, CredentialError> {
    let mut tried = Vec::new();
    if let Some(var) = &cred.env {
        match std::env::var_os(var) {
            Some(v) if !v.is_empty() => {
                return Ok(v.as_encoded_bytes().trim_ascii().to_vec());
            }
            _ => tried.push(format!("env {var} is not set")),
        }
    }
    if let Some(secret) = &cred.secret_ref {
        match secrets_dir {
            Some(dir) => {
                let path = dir.join(&secret.name).join(&secret.key);
                match std::fs::read(&path) {
                    Ok(bytes) if !bytes.trim_ascii().is_empty() => {
                        return Ok(bytes.trim_ascii().to_vec());
                    }
                    Ok(_) => tried.push(format!("{} is empty", path.display())),
                    Err(e) => tried.push(format!("{}: {e}", path.display())),
                }
            }
            None => tried.push(format!(
                "secretRef {}/{} needs tenancy.secrets_dir in local mode",
                secret.name, secret.key
            )),
        }
    }
    if tried.is_empty() {
        tried.push("neither env nor secretRef is set".into());
    }
    Err(CredentialError::Unresolved(tried.join("; ")))
}

#[cfg(test)]
mod tests;
