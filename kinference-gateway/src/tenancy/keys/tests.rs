use http::{HeaderMap, HeaderValue};
use kinference_crds::{CredentialRef, SecretKeyRef};

use super::*;

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(*k, HeaderValue::from_str(v).unwrap());
    }
    h
}

#[test]
fn bearer_and_x_api_key_are_both_read() {
    let ring = {
        let mut r = KeyRing::default();
        r.insert(digest(b"sk-one"), 0);
        r.insert(digest(b"sk-two"), 1);
        r
    };
    let bearer = presented_key(&headers(&[("authorization", "Bearer sk-two")])).unwrap();
    assert_eq!(ring.lookup(&bearer), Some(1));
    let lower = presented_key(&headers(&[("authorization", "bearer  sk-one ")])).unwrap();
    assert_eq!(ring.lookup(&lower), Some(0));
    let anthropic = presented_key(&headers(&[("x-api-key", "sk-one")])).unwrap();
    assert_eq!(ring.lookup(&anthropic), Some(0));
    let unknown = presented_key(&headers(&[("x-api-key", "sk-three")])).unwrap();
    assert_eq!(ring.lookup(&unknown), None);
}

#[test]
fn missing_or_malformed_keys_are_none() {
    assert!(presented_key(&headers(&[])).is_none());
    assert!(presented_key(&headers(&[("authorization", "Basic abc")])).is_none());
    assert!(presented_key(&headers(&[("authorization", "Bearer ")])).is_none());
    assert!(presented_key(&headers(&[("x-api-key", "")])).is_none());
}

#[test]
fn the_last_matching_entry_is_not_confused_with_the_first() {
    let mut ring = KeyRing::default();
    for i in 0..50u32 {
        ring.insert(digest(format!("key-{i}").as_bytes()), i);
    }
    for i in [0u32, 17, 49] {
        let key = presented_key(&headers(&[("x-api-key", &format!("key-{i}"))])).unwrap();
        assert_eq!(ring.lookup(&key), Some(i));
    }
}

#[test]
fn credentials_resolve_from_a_mounted_secret_and_errors_never_hold_the_value() {
    let dir = std::env::temp_dir().join(format!("kinference-keys-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("acme")).unwrap();
    std::fs::write(dir.join("acme").join("key"), "sk-secret-value\n").unwrap();
    let cred = CredentialRef {
        secret_ref: Some(SecretKeyRef {
            name: "acme".into(),
            key: "key".into(),
        }),
        env: Some("KINFERENCE_TEST_UNSET_VARIABLE_X".into()),
    };
    assert_eq!(resolve(&cred, Some(&dir)).unwrap(), b"sk-secret-value");
    let missing = CredentialRef {
        secret_ref: Some(SecretKeyRef {
            name: "other".into(),
            key: "key".into(),
        }),
        env: None,
    };
    let err = resolve(&missing, Some(&dir)).unwrap_err().to_string();
    assert!(!err.contains("sk-secret-value"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
