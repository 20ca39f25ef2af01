//! PEM files into rustls' pieces, and a set of files watched for renewal.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

use super::{TlsError, TlsFileError};

/// The crypto provider of every TLS endpoint (ring, as the rest of the workspace).
pub(super) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn pem_error(path: &Path, what: impl std::fmt::Display) -> TlsError {
    TlsError::Pem {
        path: path.to_owned(),
        what: what.to_string(),
    }
}

/// A certificate chain and its private key, checked to belong together.
pub(super) fn certified_key(
    cert: (&Path, &[u8]),
    key: (&Path, &[u8]),
) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = certificates(cert.0, cert.1)?;
    let private = PrivateKeyDer::from_pem_slice(key.1)
        .map_err(|e| pem_error(key.0, format!("no private key: {e}")))?;
    CertifiedKey::from_der(chain, private, &provider())
        .map(Arc::new)
        .map_err(|e| TlsError::Config(format!("{} and {}: {e}", cert.0.display(), key.0.display())))
}

/// Every certificate in a PEM file (at least one).
pub(super) fn certificates(
    path: &Path,
    bytes: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(path, e))?;
    if chain.is_empty() {
        return Err(pem_error(path, "no certificate"));
    }
    Ok(chain)
}

/// The CA certificates of a PEM file as trust roots (at least one).
pub(super) fn roots(path: &Path, bytes: &[u8]) -> Result<Arc<RootCertStore>, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in certificates(path, bytes)? {
        store
            .add(cert)
            .map_err(|e| pem_error(path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(Arc::new(store))
}

/// Reads a file, naming it in the error.
pub(super) fn read(path: &Path) -> Result<Vec<u8>, TlsFileError> {
    std::fs::read(path).map_err(|source| TlsFileError {
        path: path.to_owned(),
        source,
    })
}

/// Makes an endpoint's configuration from its files' paths and bytes (in the same order).
pub(super) type Build<T> = fn(&[PathBuf], &[Vec<u8>]) -> Result<T, TlsError>;

/// What a set of files makes, rebuilt when their bytes change.
pub(super) struct Watched<T> {
    paths: Vec<PathBuf>,
    build: Build<T>,
    /// The fingerprint of the bytes last tried, good or bad (a bad set is tried once).
    last_tried: Mutex<u64>,
    current: RwLock<Arc<T>>,
}

impl<T> Watched<T> {
    /// Builds from the files now: any failure here is the caller's start-up error.
    pub(super) fn load(paths: Vec<PathBuf>, build: Build<T>) -> Result<Watched<T>, TlsError> {
        let bytes = read_all(&paths)?;
        let made = build(&paths, &bytes)?;
        Ok(Watched {
            last_tried: Mutex::new(fingerprint(&bytes)),
            paths,
            build,
            current: RwLock::new(Arc::new(made)),
        })
    }

    /// The set in use.
    pub(super) fn current(&self) -> Arc<T> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Reads the files again: `Ok(true)` when a changed set was swapped in, `Ok(false)` when
    /// nothing changed (or the same bad set is still there), an error when a changed set does not
    /// load (the current one stays).
    pub(super) fn reload(&self) -> Result<bool, TlsError> {
        // A file that cannot be read counts as one more changed set, tried (and reported) once.
        let read = read_all(&self.paths);
        let seen = read.as_ref().map_or(UNREADABLE, |bytes| fingerprint(bytes));
        {
            let mut last = self.last_tried.lock().unwrap_or_else(|e| e.into_inner());
            if *last == seen {
                return Ok(false);
            }
            *last = seen;
        }
        let bytes = read?;
        let made = (self.build)(&self.paths, &bytes)?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(made);
        Ok(true)
    }
}

/// The fingerprint of a set with a file that cannot be read.
const UNREADABLE: u64 = u64::MAX;

fn read_all(paths: &[PathBuf]) -> Result<Vec<Vec<u8>>, TlsFileError> {
    paths.iter().map(|p| read(p)).collect()
}

fn fingerprint(files: &[Vec<u8>]) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    files.hash(&mut hasher);
    hasher.finish()
}
