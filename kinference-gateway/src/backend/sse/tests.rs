use super::*;

fn collect(parser: &mut SseParser) -> Vec<SseEvent> {
    std::iter::from_fn(|| parser.next_event()).collect()
}

fn data(s: &str) -> SseEvent {
    SseEvent {
        event: None,
        data: Bytes::copy_from_slice(s.as_bytes()),
    }
}

#[test]
fn several_events_in_one_chunk() {
    let mut p = SseParser::new();
    p.feed(b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n");
    let events = collect(&mut p);
    assert_eq!(
        events,
        vec![data("{\"a\":1}"), data("{\"b\":2}"), data("[DONE]")]
    );
    assert!(events[2].is_done());
    assert_eq!(p.pending(), 0);
}

#[test]
fn event_split_at_every_byte() {
    let stream = b"event: message_start\ndata: {\"x\": \"y\"}\n\ndata: tail\r\n\r\n";
    let mut p = SseParser::new();
    let mut events = Vec::new();
    for byte in stream.iter() {
        p.feed(std::slice::from_ref(byte));
        events.extend(collect(&mut p));
    }
    assert_eq!(
        events,
        vec![
            SseEvent {
                event: Some("message_start".into()),
                data: Bytes::from_static(b"{\"x\": \"y\"}"),
            },
            data("tail"),
        ]
    );
}

#[test]
fn separator_split_across_chunks() {
    let mut p = SseParser::new();
    p.feed(b"data: one\n");
    assert!(p.next_event().is_none());
    p.feed(b"\ndata: tw");
    assert_eq!(p.next_event(), Some(data("one")));
    assert!(p.next_event().is_none());
    p.feed(b"o\n\n");
    assert_eq!(p.next_event(), Some(data("two")));
}

#[test]
fn crlf_split_between_cr_and_lf() {
    let mut p = SseParser::new();
    p.feed(b"data: a\r\n\r");
    assert!(p.next_event().is_none());
    p.feed(b"\n");
    assert_eq!(p.next_event(), Some(data("a")));
}

#[test]
fn multi_line_data_comments_and_keepalives() {
    let mut p = SseParser::new();
    p.feed(b": keep-alive\n\ndata: line1\ndata: line2\n: note\n\ndata:nospace\n\n");
    assert_eq!(collect(&mut p), vec![data("line1\nline2"), data("nospace")]);
}

#[test]
fn incomplete_event_stays_pending() {
    let mut p = SseParser::new();
    p.feed(b"data: {\"partial\":");
    assert!(p.next_event().is_none());
    assert_eq!(p.pending(), b"data: {\"partial\":".len());
}

#[test]
fn a_bare_data_field_is_an_empty_data_line_not_a_panic() {
    // Found by the sse_stream fuzz target: `data` without a colon has an empty value.
    let mut p = SseParser::new();
    p.feed(b"data\n\ndata\ndata: x\n\n");
    assert_eq!(collect(&mut p), vec![data(""), data("\nx")]);
}
