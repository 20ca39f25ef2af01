use super::*;

/// Builds a tiny BTF blob: `struct inner { int a; int b; }`, `struct outer { int x; union { struct inner in; }; }`
/// plus a `btf_trace_demo` typedef and `enum kind { K_ZERO = 0, K_TWO = 2 }`.
fn sample() -> Vec<u8> {
    let mut strings =
        b"\0int\0inner\0a\0b\0outer\0x\0in\0btf_trace_demo\0kind\0K_ZERO\0K_TWO\0".to_vec();
    let off = |s: &str, strings: &[u8]| {
        let needle = format!("\0{s}\0");
        strings
            .windows(needle.len())
            .position(|w| w == needle.as_bytes())
            .map(|p| p as u32 + 1)
            .unwrap_or(0)
    };
    let (kind, k_zero, k_two) = (
        off("kind", &strings),
        off("K_ZERO", &strings),
        off("K_TWO", &strings),
    );
    let (int, inner, a, b, outer, x, inn, tp) = (
        off("int", &strings),
        off("inner", &strings),
        off("a", &strings),
        off("b", &strings),
        off("outer", &strings),
        off("x", &strings),
        off("in", &strings),
        off("btf_trace_demo", &strings),
    );
    let mut types = Vec::new();
    let mut push = |words: &[u32]| {
        for w in words {
            types.extend_from_slice(&w.to_le_bytes());
        }
    };
    // 1: int (size 4) + int encoding word
    push(&[int, KIND_INT << 24, 4, 32]);
    // 2: struct inner { a @0, b @32 bits }
    push(&[inner, (KIND_STRUCT << 24) | 2, 8, a, 1, 0, b, 1, 32]);
    // 3: anonymous union { struct inner in; }
    push(&[0, (KIND_UNION << 24) | 1, 8, inn, 2, 0]);
    // 4: struct outer { int x @0; union @64 bits }
    push(&[outer, (KIND_STRUCT << 24) | 2, 16, x, 1, 0, 0, 3, 64]);
    // 5: typedef btf_trace_demo -> int
    push(&[tp, KIND_TYPEDEF << 24, 1]);
    // 6: enum kind (size 4) { K_ZERO = 0, K_TWO = 2 }
    push(&[kind, (KIND_ENUM << 24) | 2, 4, k_zero, 0, k_two, 2]);
    let mut data = Vec::new();
    data.extend_from_slice(&BTF_MAGIC.to_le_bytes());
    data.extend_from_slice(&[1, 0]);
    for w in [
        24u32,
        0,
        types.len() as u32,
        types.len() as u32,
        strings.len() as u32,
    ] {
        data.extend_from_slice(&w.to_le_bytes());
    }
    data.extend_from_slice(&types);
    data.append(&mut strings);
    data
}

#[test]
fn finds_members_through_anonymous_unions() {
    let btf = Btf::parse(&sample()).expect("parses");
    assert_eq!(btf.member_offset("outer", "x").ok(), Some(0));
    assert_eq!(btf.member_offset("outer", "in").ok(), Some(8));
    assert_eq!(btf.member_offset("outer", "in.b").ok(), Some(12));
    assert_eq!(btf.member_offset("inner", "b").ok(), Some(4));
    assert!(matches!(
        btf.member_offset("outer", "nope"),
        Err(BtfError::NoMember { .. })
    ));
    assert!(matches!(
        btf.member_offset("nope", "x"),
        Err(BtfError::NoStruct(_))
    ));
    assert!(btf.has_tracepoint("demo"));
    assert!(!btf.has_tracepoint("other"));
    assert_eq!(btf.enum_value("kind", "K_TWO").ok(), Some(2));
    assert_eq!(btf.enum_value("kind", "K_ZERO").ok(), Some(0));
    assert!(matches!(
        btf.enum_value("kind", "K_ONE"),
        Err(BtfError::NoMember { .. })
    ));
    assert!(btf.enum_value("outer", "x").is_err());
}

#[test]
fn rejects_garbage() {
    assert!(matches!(
        Btf::parse(b"not btf at all, clearly"),
        Err(BtfError::Malformed(_))
    ));
    let mut truncated = sample();
    truncated.truncate(30);
    assert!(Btf::parse(&truncated).is_err());
}

/// On a kernel with BTF (this machine, CI), the offsets the eBPF program needs resolve and look sane.
#[test]
fn running_kernel_offsets() {
    if !testkit::require(
        std::path::Path::new(VMLINUX_BTF).exists(),
        "kernel BTF",
        format_args!("no {VMLINUX_BTF} on this kernel"),
    ) {
        return;
    }
    // Present but unreadable or malformed is a failure, not a skip.
    let btf = Btf::from_sys_fs().expect("the running kernel's BTF parses");
    let num = btf
        .member_offset("sock", "__sk_common.skc_num")
        .expect("skc_num");
    let dport = btf
        .member_offset("sock", "__sk_common.skc_dport")
        .expect("skc_dport");
    // skc_dport and skc_num share the 32-bit skc_portpair: dport first, then num.
    assert_eq!(num, dport + 2);
    let backlog = btf
        .member_offset("sock", "sk_ack_backlog")
        .expect("sk_ack_backlog");
    assert!(backlog > num);
    assert!(btf.member_offset("task_struct", "files").is_ok());
    assert!(btf.member_offset("fdtable", "fd").is_ok());
    assert!(btf.has_tracepoint("inet_sock_set_state"));
    // What the event-stream header check reads (tcp_sendmsg_locked's msghdr).
    let iter = btf.member_offset("msghdr", "msg_iter").expect("msg_iter");
    assert!(iter > 0);
    let count = btf.member_offset("iov_iter", "count").expect("count");
    let ptr = btf.member_offset("iov_iter", "__iov").expect("__iov");
    assert_eq!(count, ptr + 8, "count follows the buffer pointer");
    if let Ok(ubuf) = btf.member_offset("iov_iter", "ubuf") {
        assert_eq!(ubuf, ptr, "ubuf and __iov share a union");
    }
    assert!(btf.enum_value("iter_type", "ITER_IOVEC").is_ok());
}
