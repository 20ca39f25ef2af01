use std::net::SocketAddr;

use http::{HeaderMap, HeaderValue};

use super::*;

const KEY: &str = "admin-key-0123456789";

fn peer(addr: &str) -> Peer {
    Peer(addr.parse::<SocketAddr>().unwrap())
}

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in pairs {
        h.insert(*name, HeaderValue::from_str(value).unwrap());
    }
    h
}

fn with_key() -> Access {
    Access::new(&AccessArgs {
        admin_key: Some(AdminKey::parse(KEY).unwrap()),
        admin_key_for_metrics: false,
    })
}

#[test]
fn short_keys_are_refused_at_start_up() {
    assert!(AdminKey::parse("changeme").is_err());
    assert!(AdminKey::parse("   ").is_err());
    assert!(AdminKey::parse(KEY).is_ok());
    assert_eq!(
        format!("{:?}", AdminKey::parse(KEY).unwrap()),
        "AdminKey(<redacted>)"
    );
}

#[test]
fn without_a_key_only_loopback_is_admin() {
    let access = Access::default();
    let none = HeaderMap::new();
    for local in [
        "127.0.0.1:5000",
        "127.8.0.1:5000",
        "[::1]:5000",
        "[::ffff:127.0.0.1]:5000",
    ] {
        assert!(
            access.admin_port_admin(&none, Some(&peer(local))),
            "{local}"
        );
        assert!(
            access.serving_port_admin(&none, Some(&peer(local))),
            "{local}"
        );
    }
    for remote in ["10.0.0.7:5000", "[fd00::7]:5000", "[::ffff:10.0.0.7]:5000"] {
        assert!(
            !access.admin_port_admin(&none, Some(&peer(remote))),
            "{remote}"
        );
        assert!(
            !access.serving_port_admin(&none, Some(&peer(remote))),
            "{remote}"
        );
    }
    // A peer the server did not record is never trusted.
    assert!(!access.admin_port_admin(&none, None));
}

#[test]
fn with_a_key_loopback_alone_is_not_enough() {
    let access = with_key();
    let local = peer("127.0.0.1:5000");
    let remote = peer("10.0.0.7:5000");
    assert!(!access.admin_port_admin(&HeaderMap::new(), Some(&local)));
    assert!(!access.serving_port_admin(&HeaderMap::new(), Some(&local)));
    let bearer = format!("Bearer {KEY}");
    assert!(access.admin_port_admin(&headers(&[("authorization", &bearer)]), Some(&remote)));
    assert!(access.admin_port_admin(&headers(&[("x-api-key", KEY)]), Some(&remote)));
    assert!(access.serving_port_admin(&headers(&[(ADMIN_KEY_HEADER, KEY)]), Some(&remote)));
    // The wrong key, or the key in the header of the other port, is refused.
    assert!(!access.admin_port_admin(
        &headers(&[("authorization", "Bearer admin-key-0123456780")]),
        Some(&remote)
    ));
    assert!(!access.serving_port_admin(&headers(&[("authorization", &bearer)]), Some(&remote)));
}
