//! Test certificates made by the `openssl` command line: a private CA and certificates it signs,
//! written as `<name>.key` and `<name>.crt` in a directory.

use std::path::Path;
use std::process::{Command, Stdio};

/// Every key is an EC key on P-256: quick to make, and what rustls and OpenSSL both accept.
const NEW_KEY: &str = "ec";
const KEY_CURVE: &str = "ec_paramgen_curve:prime256v1";

/// Runs `openssl args` in `dir`; fails the test if it fails.
pub fn openssl(dir: &Path, args: &[&str]) {
    let status = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl runs");
    assert!(status.success(), "openssl {args:?}");
}

/// A self-signed CA `name` (P-256), valid for two days.
pub fn ca(dir: &Path, name: &str) {
    let (key, crt, subj) = (
        format!("{name}.key"),
        format!("{name}.crt"),
        format!("/CN={name}"),
    );
    openssl(
        dir,
        &[
            "req", "-x509", "-newkey", NEW_KEY, "-pkeyopt", KEY_CURVE, "-nodes", "-keyout", &key,
            "-out", &crt, "-days", "2", "-subj", &subj,
        ],
    );
}

/// A certificate `name` (P-256) for the subject alternative names `alt_names` (as openssl writes
/// them: `DNS:kinference-agent`, `IP:127.0.0.1,DNS:localhost`), signed by CA `by`.
pub fn leaf(dir: &Path, name: &str, alt_names: &str, by: &str) {
    let (key, csr, crt) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.crt"),
    );
    let (ca_crt, ca_key, ext) = (
        format!("{by}.crt"),
        format!("{by}.key"),
        format!("{name}.ext"),
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            NEW_KEY,
            "-pkeyopt",
            KEY_CURVE,
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    std::fs::write(dir.join(&ext), format!("subjectAltName={alt_names}\n")).unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_crt,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
}
