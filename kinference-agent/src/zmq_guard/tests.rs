use super::*;
use bytes::Bytes;
use testkit::free_port;
use zeromq::{PubSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

fn greeting(mechanism: &str, major: u8) -> Vec<u8> {
    let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, major, 1];
    let mut mech = mechanism.as_bytes().to_vec();
    mech.resize(20, 0);
    g.extend(mech);
    g.push(0);
    g.extend([0u8; 31]);
    g
}

fn ready() -> Vec<u8> {
    let mut body = vec![5];
    body.extend(b"READY");
    body.push(11);
    body.extend(b"Socket-Type");
    body.extend(3u32.to_be_bytes());
    body.extend(b"PUB");
    body.push(8);
    body.extend(b"Identity");
    body.extend(0u32.to_be_bytes());
    let mut f = vec![0x04, body.len() as u8];
    f.extend(body);
    f
}

fn frame(more: bool, body: &[u8]) -> Vec<u8> {
    let more = u8::from(more);
    let mut f = if body.len() > 255 {
        let mut f = vec![0x02 | more];
        f.extend((body.len() as u64).to_be_bytes());
        f
    } else {
        vec![more, body.len() as u8]
    };
    f.extend(body);
    f
}

fn handshake() -> Vec<u8> {
    let mut b = greeting("NULL", 3);
    b.extend(ready());
    b
}

fn small() -> Limits {
    Limits {
        max_frame: 1000,
        max_message: 1500,
        max_command: 200,
    }
}

#[test]
fn a_valid_stream_passes_in_one_piece_and_byte_by_byte() {
    let mut bytes = handshake();
    bytes.extend(frame(true, b"kv@w1@m"));
    bytes.extend(frame(true, &7u64.to_be_bytes()));
    bytes.extend(frame(false, &[0xab; 900]));
    let mut ping = vec![0x04, 7, 4];
    ping.extend(b"PING\0\0");
    bytes.extend(ping);
    bytes.extend(frame(false, b""));

    let mut whole = Inspector::new(small());
    let p = whole.feed(&bytes).expect("valid");
    assert!(p.handshake_done);
    assert_eq!(p.messages, 2);

    let mut split = Inspector::new(small());
    let (mut done, mut messages) = (false, 0);
    for b in &bytes {
        let p = split
            .feed(std::slice::from_ref(b))
            .expect("valid in pieces");
        done |= p.handshake_done;
        messages += p.messages;
    }
    assert!(done && split.handshake_done());
    assert_eq!(messages, 2);
}

#[test]
fn a_frame_declaring_two_to_the_forty_bytes_is_refused_from_its_header() {
    let mut bytes = handshake();
    bytes.push(0x02);
    bytes.extend((1u64 << 40).to_be_bytes());
    let mut i = Inspector::new(Limits::default());
    let v = i.feed(&bytes).expect_err("refused");
    assert_eq!(
        v,
        Violation::FrameTooLarge {
            size: 1 << 40,
            limit: 16 << 20
        }
    );
    assert_eq!(v.reason(), "frame_too_large");
    // Once refused, always refused.
    assert!(i.feed(b"\x00\x00").is_err());
}

#[test]
fn open_bytes_are_the_declared_size_of_the_unfinished_message() {
    let mut i = Inspector::new(small());
    i.feed(&handshake()).expect("handshake");
    assert_eq!(i.open_bytes(), 0);
    // A first frame of 300 bytes with more to come: declared at once, before its body.
    let first = frame(true, &[1; 300]);
    i.feed(&first[..9]).expect("header");
    assert_eq!(i.open_bytes(), 300);
    i.feed(&first[9..]).expect("body");
    assert_eq!(i.open_bytes(), 300, "held until the message's last frame");
    // The last frame declares 400 more; the message ends with its last byte.
    let last = frame(false, &[2; 400]);
    i.feed(&last[..100]).expect("part of the last frame");
    assert_eq!(i.open_bytes(), 700);
    i.feed(&last[100..]).expect("the rest");
    assert_eq!(i.open_bytes(), 0);
    // Empty frames and commands hold nothing.
    i.feed(&frame(false, b"")).expect("empty");
    let mut ping = vec![0x04, 7, 4];
    ping.extend(b"PING\0\0");
    i.feed(&ping).expect("ping");
    assert_eq!(i.open_bytes(), 0);
}

#[test]
fn a_message_over_the_limit_is_refused_even_when_each_frame_fits() {
    let mut bytes = handshake();
    bytes.extend(frame(true, &[0; 800]));
    bytes.push(0x02);
    bytes.extend(800u64.to_be_bytes());
    let v = Inspector::new(small()).feed(&bytes).expect_err("refused");
    assert_eq!(v.reason(), "message_too_large");
    // The count starts again with each message.
    let mut ok = handshake();
    ok.extend(frame(false, &[0; 800]));
    ok.extend(frame(false, &[0; 800]));
    assert_eq!(Inspector::new(small()).feed(&ok).map(|p| p.messages), Ok(2));
}

#[test]
fn greetings_other_than_zmtp3_null_are_refused() {
    for (bytes, reason) in [
        (greeting("CURVE", 3), "mechanism"),
        (greeting("PLAIN", 3), "mechanism"),
        (greeting("NULLX", 3), "mechanism"),
        (greeting("NULL", 2), "version"),
        (b"GET / HTTP/1.1\r\n".to_vec(), "protocol"),
    ] {
        let v = Inspector::new(small()).feed(&bytes).expect_err("refused");
        assert_eq!(v.reason(), reason, "{v}");
    }
    // A mechanism name with bytes after its NUL padding.
    let mut g = greeting("NULL", 3);
    g[20] = b'x';
    assert_eq!(
        Inspector::new(small()).feed(&g).map_err(|v| v.reason()),
        Err("mechanism")
    );
    // A truncated greeting is not an error by itself (the relay's handshake deadline handles it).
    assert_eq!(
        Inspector::new(small()).feed(&greeting("NULL", 3)[..40]),
        Ok(Progress::default())
    );
}

#[test]
fn handshake_rules() {
    let mut msg_first = greeting("NULL", 3);
    msg_first.extend(frame(false, b"hi"));
    let mut big_command = greeting("NULL", 3);
    big_command.extend([0x06]);
    big_command.extend(300u64.to_be_bytes());
    let mut ping_first = greeting("NULL", 3);
    ping_first.extend([0x04, 5, 4]);
    ping_first.extend(b"PING");
    let mut bad_ready = greeting("NULL", 3);
    bad_ready.extend([0x04, 8, 5]);
    bad_ready.extend(b"READY");
    bad_ready.extend([9, b'x']);
    let mut command_more = greeting("NULL", 3);
    command_more.extend([0x05, 1, 0]);
    let mut error = greeting("NULL", 3);
    error.extend([0x04, 10, 5]);
    error.extend(b"ERROR");
    error.extend([3]);
    error.extend(b"bad");
    for (bytes, reason) in [
        (msg_first, "protocol"),
        (big_command, "command_too_large"),
        (ping_first, "protocol"),
        (bad_ready, "protocol"),
        (command_more, "protocol"),
        (error, "peer_error"),
    ] {
        let v = Inspector::new(small()).feed(&bytes).expect_err("refused");
        assert_eq!(v.reason(), reason, "{v}");
    }
}

#[test]
fn endpoints_parse() {
    assert_eq!(
        Endpoint::parse("tcp://*:5557").ok(),
        Some(Endpoint::Tcp {
            host: "0.0.0.0".into(),
            port: 5557
        })
    );
    assert_eq!(
        Endpoint::parse("tcp://[::1]:9").ok(),
        Some(Endpoint::Tcp {
            host: "::1".into(),
            port: 9
        })
    );
    assert_eq!(
        Endpoint::parse("ipc:///tmp/x").ok(),
        Some(Endpoint::Ipc("/tmp/x".into()))
    );
    for bad in [
        "tcp://host",
        "tcp://:1",
        "inproc://x",
        "ipc://",
        "tcp://h:99999",
    ] {
        assert!(Endpoint::parse(bad).is_err(), "{bad}");
    }
}

fn rejected(m: &AgentMetrics, reason: &'static str) -> u64 {
    m.rejected
        .get_or_create(&crate::metrics::RejectLabel {
            listener: "kv_events",
            reason,
        })
        .get()
}

async fn recv_one(sub: &mut SubSocket, pubs: &mut PubSocket, tag: &'static [u8]) {
    // A PUB drops messages until the subscription reaches it: resend until one arrives.
    for _ in 0..100 {
        pubs.send(ZmqMessage::from(Bytes::from_static(tag)))
            .await
            .expect("send");
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            assert_eq!(m.get(0).map(|b| b.as_ref()), Some(tag));
            return;
        }
    }
    panic!("nothing arrived through the guard");
}

#[tokio::test]
async fn bind_mode_relays_a_real_publisher_and_drops_a_giant_frame() {
    let metrics = AgentMetrics::default();
    let public = format!("tcp://127.0.0.1:{}", free_port());
    let (guard, private) = Guard::bind(
        &public,
        "kv_events",
        GuardConfig::default(),
        metrics.clone(),
    )
    .await
    .expect("guard binds");
    let mut sub = SubSocket::new();
    sub.bind_listener(private)
        .await
        .expect("SUB adopts the private listener");
    sub.subscribe("").await.expect("subscribe");
    let mut pubs = PubSocket::new();
    pubs.connect(&public).await.expect("PUB connects");
    recv_one(&mut sub, &mut pubs, b"before").await;

    let mut bytes = handshake();
    bytes.push(0x02);
    bytes.extend((1u64 << 40).to_be_bytes());
    let addr = public.trim_start_matches("tcp://");
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(&bytes).await.expect("write");
    let mut buf = [0u8; 256];
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        while s.read(&mut buf).await.is_ok_and(|n| n > 0) {}
    })
    .await;
    assert!(closed.is_ok(), "the hostile connection is closed");
    assert_eq!(rejected(&metrics, "frame_too_large"), 1);

    recv_one(&mut sub, &mut pubs, b"after").await;
    drop(guard);
}

#[tokio::test]
async fn connect_mode_relays_to_a_bound_publisher_and_keeps_idle_peers_from_locking_it_out() {
    let metrics = AgentMetrics::default();
    let public = format!("tcp://127.0.0.1:{}", free_port());
    let mut pubs = PubSocket::new();
    pubs.bind(&public).await.expect("PUB binds");
    let guard = Guard::connect(
        &public,
        "kv_events",
        GuardConfig::default(),
        metrics.clone(),
    )
    .expect("guard");
    let mut sub = SubSocket::new();
    sub.connect(guard.endpoint()).await.expect("SUB connects");
    sub.subscribe("").await.expect("subscribe");
    recv_one(&mut sub, &mut pubs, b"through").await;

    // Pending connections: a bind guard with 2 slots, 5 idle peers, then a real one.
    let config = GuardConfig {
        max_pending: 2,
        handshake_timeout: Duration::from_millis(300),
        ..GuardConfig::default()
    };
    let public = format!("tcp://127.0.0.1:{}", free_port());
    let (_g, private) = Guard::bind(&public, "kv_events", config, metrics.clone())
        .await
        .expect("guard binds");
    let mut sub = SubSocket::new();
    sub.bind_listener(private).await.expect("adopt");
    sub.subscribe("").await.expect("subscribe");
    let addr = public.trim_start_matches("tcp://").to_string();
    let mut idle = Vec::new();
    for _ in 0..5 {
        idle.push(
            tokio::net::TcpStream::connect(&addr)
                .await
                .expect("connect"),
        );
    }
    let mut pubs = PubSocket::new();
    pubs.connect(&public).await.expect("PUB connects");
    recv_one(&mut sub, &mut pubs, b"still").await;
    assert!(rejected(&metrics, "handshake_evicted") >= 3);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(rejected(&metrics, "handshake_timeout") >= 1);
    recv_one(&mut sub, &mut pubs, b"and still").await;
}
