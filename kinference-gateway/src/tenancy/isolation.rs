//! Prompt-cache isolation between tenants: the `cache_salt` the gateway puts on every request it
//! sends a worker, so that one tenant cannot learn another's prompts from `cached_tokens` or from
//! where a probe is routed.
//!
//! vLLM hashes a request's `cache_salt` into its first KV block, and so into every block chained
//! after it: a prompt is a prefix-cache hit only for requests of the same salt. The gateway derives
//! the salt from a secret of its own ([`SaltKey`]) and the tenant's scope
//! ([`kinference_crds::PromptCache`]): the tenant (the default), its group, or none (shared on
//! purpose). A client's own `cache_salt` never replaces it: it is mixed in
//! ([`SaltKey::worker_salt`]), so a client can still keep its own requests apart within its scope,
//! but no value it sends can name another scope's salt. An open gateway (no tenants) changes
//! nothing: the client's salt, if any, goes to the worker as sent.
//!
//! The salt is a keyed hash (HMAC-SHA256): without the key, knowing a tenant's name does not give
//! its salt, and the salt never leaves the gateway except towards the workers.

use std::path::Path;

use kinference_crds::{CacheIsolation, PromptCache};
use sha2::{Digest, Sha256};

/// Shortest key accepted from a file: 32 bytes, a SHA-256 block's worth of secret.
pub const MIN_KEY_BYTES: usize = 32;

/// What each salt is derived under; a new version would change every salt (and so start every
/// tenant's cache cold), never mix with this one.
const DOMAIN: &[u8] = b"kinference/cache-salt/v1";

/// The gateway's secret for cache salts.
#[derive(Clone)]
pub struct SaltKey {
    key: [u8; 32],
}

impl std::fmt::Debug for SaltKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SaltKey(..)")
    }
}

/// Whose cache a request's prompt may hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope<'a> {
    /// One tenant's requests.
    Tenant(&'a str),
    /// Every tenant of a group.
    Group(&'a str),
    /// The workers' common cache (a tenant that shares on purpose).
    Shared,
}

impl<'a> Scope<'a> {
    /// The scope of tenant `name` under its `policy` (a `Group` without a group name keeps the
    /// tenant to itself: isolation is never lifted by a mistake).
    pub fn of(name: &'a str, policy: Option<&'a PromptCache>) -> Self {
        match policy {
            None => Scope::Tenant(name),
            Some(p) => match (p.isolation, p.group.as_deref()) {
                (CacheIsolation::Tenant, _) => Scope::Tenant(name),
                (CacheIsolation::Group, Some(group)) if !group.is_empty() => Scope::Group(group),
                (CacheIsolation::Group, _) => Scope::Tenant(name),
                (CacheIsolation::Shared, _) => Scope::Shared,
            },
        }
    }
}

/// Errors reading the key.
#[derive(Debug, thiserror::Error)]
pub enum SaltKeyError {
    /// The file could not be read.
    #[error("cache salt key {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds too little secret.
    #[error("cache salt key {path}: {len} bytes, at least {MIN_KEY_BYTES} are needed")]
    Short {
        /// The file.
        path: String,
        /// Its length (surrounding whitespace removed).
        len: usize,
    },
}

impl SaltKey {
    /// A key from `secret` (any length; it is hashed to 32 bytes).
    pub fn from_secret(secret: &[u8]) -> Self {
        SaltKey {
            key: Sha256::digest(secret).into(),
        }
    }

    /// The key in `path` (a mounted Secret: at least [`MIN_KEY_BYTES`] bytes, surrounding
    /// whitespace ignored, so a trailing newline does not change it).
    pub fn from_file(path: &Path) -> Result<Self, SaltKeyError> {
        let bytes = std::fs::read(path).map_err(|source| SaltKeyError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let secret = bytes.trim_ascii();
        if secret.len() < MIN_KEY_BYTES {
            return Err(SaltKeyError::Short {
                path: path.display().to_string(),
                len: secret.len(),
            });
        }
        Ok(SaltKey::from_secret(secret))
    }

    /// A key of this process alone (no file configured): salts change when it restarts, and differ
    /// between replicas, which costs cache hits but never isolation.
    pub fn generate() -> Self {
        SaltKey {
            key: rand::random(),
        }
    }

    /// The `cache_salt` a worker is sent for a request of `scope` whose client sent `client`
    /// (`None`: the request goes unsalted, into the workers' common cache: a shared scope without
    /// a salt of the client's). Salts are 64 hex digits: within vLLM's limit of 128 characters and
    /// free of the characters it refuses (`@`, `/`, `\`, NUL).
    pub fn worker_salt(&self, scope: Scope<'_>, client: Option<&str>) -> Option<String> {
        let (kind, name): (&[u8], &[u8]) = match scope {
            Scope::Tenant(t) => (b"tenant", t.as_bytes()),
            Scope::Group(g) => (b"group", g.as_bytes()),
            Scope::Shared if client.is_none() => return None,
            Scope::Shared => (b"shared", b""),
        };
        let scoped = self.mac(&[DOMAIN, kind, name]);
        let salt = match client {
            None => scoped,
            // The client's salt splits its scope's cache; it cannot leave the scope, since the
            // scope's own salt is under the hash.
            Some(c) => self.mac(&[DOMAIN, b"client", &scoped, c.as_bytes()]),
        };
        Some(hex(&salt))
    }

    /// HMAC-SHA256 (RFC 2104) of `parts`, each length-prefixed so no two lists of parts collide.
    fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut inner = Sha256::new();
        inner.update(self.pad(0x36));
        for p in parts {
            inner.update((p.len() as u64).to_le_bytes());
            inner.update(p);
        }
        let mut outer = Sha256::new();
        outer.update(self.pad(0x5c));
        outer.update(inner.finalize());
        outer.finalize().into()
    }

    /// The key padded to SHA-256's 64-byte block and XORed with `byte`.
    fn pad(&self, byte: u8) -> [u8; 64] {
        let mut block = [byte; 64];
        for (b, k) in block.iter_mut().zip(self.key) {
            *b ^= k;
        }
        block
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> SaltKey {
        SaltKey::from_secret(b"a gateway secret of thirty-two bytes!")
    }

    #[test]
    fn hmac_matches_rfc_4231_case_2() {
        // RFC 4231 test case 2: key "Jefe" (shorter than a block: padded with zeros as ours is).
        let mut k = SaltKey { key: [0; 32] };
        k.key[..4].copy_from_slice(b"Jefe");
        let mut inner = Sha256::new();
        inner.update(k.pad(0x36));
        inner.update(b"what do ya want for nothing?");
        let mut outer = Sha256::new();
        outer.update(k.pad(0x5c));
        outer.update(inner.finalize());
        assert_eq!(
            hex(&outer.finalize()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn each_scope_gets_its_own_salt_and_only_the_key_gives_it() {
        let k = key();
        let a = k.worker_salt(Scope::Tenant("a"), None).expect("salted");
        let b = k.worker_salt(Scope::Tenant("b"), None).expect("salted");
        let g = k.worker_salt(Scope::Group("a"), None).expect("salted");
        assert_ne!(a, b);
        assert_ne!(a, g, "a tenant and a group of the same name differ");
        assert_eq!(a, k.worker_salt(Scope::Tenant("a"), None).expect("salted"));
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        let other = SaltKey::from_secret(b"another gateway's secret, also long");
        assert_ne!(Some(a), other.worker_salt(Scope::Tenant("a"), None));
        assert_eq!(k.worker_salt(Scope::Shared, None), None);
    }

    #[test]
    fn a_client_salt_splits_its_scope_and_never_names_another() {
        let k = key();
        let a = k.worker_salt(Scope::Tenant("a"), None).expect("salted");
        let b = k.worker_salt(Scope::Tenant("b"), None).expect("salted");
        // B sends A's salt (were it ever known) as its own: it is mixed with B's, not used.
        let forged = k.worker_salt(Scope::Tenant("b"), Some(&a)).expect("salted");
        assert_ne!(forged, a);
        assert_ne!(forged, b);
        let x_in_a = k
            .worker_salt(Scope::Tenant("a"), Some("x"))
            .expect("salted");
        let x_in_b = k
            .worker_salt(Scope::Tenant("b"), Some("x"))
            .expect("salted");
        assert_ne!(x_in_a, x_in_b, "the same client salt in two tenants");
        assert_ne!(x_in_a, a);
        let shared_x = k.worker_salt(Scope::Shared, Some("x")).expect("salted");
        assert_ne!(shared_x, "x", "a raw client salt never reaches a worker");
    }

    #[test]
    fn scopes_follow_the_policy() {
        let policy = |isolation, group: Option<&str>| PromptCache {
            isolation,
            group: group.map(str::to_string),
        };
        assert_eq!(Scope::of("a", None), Scope::Tenant("a"));
        let g = policy(CacheIsolation::Group, Some("team"));
        assert_eq!(Scope::of("a", Some(&g)), Scope::Group("team"));
        let no_group = policy(CacheIsolation::Group, None);
        assert_eq!(Scope::of("a", Some(&no_group)), Scope::Tenant("a"));
        let shared = policy(CacheIsolation::Shared, None);
        assert_eq!(Scope::of("a", Some(&shared)), Scope::Shared);
    }

    #[test]
    fn a_short_key_file_is_refused() {
        let path = std::env::temp_dir().join(format!("kinference-salt-key-{}", std::process::id()));
        std::fs::write(&path, "short\n").expect("write");
        assert!(matches!(
            SaltKey::from_file(&path),
            Err(SaltKeyError::Short { len: 5, .. })
        ));
        std::fs::write(&path, format!("{}\n", "k".repeat(40))).expect("write");
        let k = SaltKey::from_file(&path).expect("read");
        assert_eq!(
            k.worker_salt(Scope::Tenant("a"), None),
            SaltKey::from_secret("k".repeat(40).as_bytes()).worker_salt(Scope::Tenant("a"), None)
        );
        let _ = std::fs::remove_file(&path);
    }
}
