//! Incremental Server-Sent Events parser for the worker's stream.
//!
//! TCP delivers the stream in arbitrary pieces: an event may be split across chunks, and one chunk may
//! hold several events. The parser buffers only the unfinished tail, so memory stays bounded by the
//! largest single event, never the whole response.

use bytes::{Buf, Bytes, BytesMut};

/// One complete event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, when present.
    pub event: Option<String>,
    /// The `data:` lines joined by `\n`.
    pub data: Bytes,
}

impl SseEvent {
    /// Whether this is OpenAI's end-of-stream marker `data: [DONE]`.
    pub fn is_done(&self) -> bool {
        self.data.as_ref() == b"[DONE]"
    }
}

/// Splits a byte stream into [`SseEvent`]s.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: BytesMut,
    /// Where to resume looking for the end of the current event (avoids rescanning a long event).
    scanned: usize,
}

impl SseParser {
    /// An empty parser.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends bytes received from the network.
    pub fn feed(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Bytes received but not yet part of a complete event.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next complete event, if the buffer holds one.
    pub fn next_event(&mut self) -> Option<SseEvent> {
        loop {
            let Some((end, sep)) = find_event_end(&self.buf, self.scanned) else {
                self.scanned = self.buf.len();
                return None;
            };
            let raw = self.buf.split_to(end).freeze();
            self.buf.advance(sep);
            self.scanned = 0;
            if let Some(event) = parse_event(raw) {
                return Some(event);
            }
            // Comment-only or empty events (keep-alives) are skipped.
        }
    }
}

/// Finds the blank line that ends an event: returns (end of event, length of the separator).
/// Starts a few bytes before `from` (where the previous search gave up) so a separator split across
/// two chunks is still found.
fn find_event_end(buf: &[u8], from: usize) -> Option<(usize, usize)> {
    // A separator is "\n\n", "\r\n\r\n" or "\r\r"; a line ending is \n, \r\n or \r. Scanning for a line
    // ending followed by another line ending covers all mixes.
    let start = from.saturating_sub(3);
    let mut i = start;
    while i < buf.len() {
        let b = buf[i];
        if b == b'\n' || b == b'\r' {
            let first_len = if b == b'\r' && buf.get(i + 1) == Some(&b'\n') {
                2
            } else if b == b'\r' && i + 1 == buf.len() {
                // A lone \r at the end could be the start of \r\n: wait for more bytes.
                return None;
            } else {
                1
            };
            let j = i + first_len;
            match buf.get(j) {
                Some(b'\n') => return Some((i, first_len + 1)),
                Some(b'\r') => {
                    let second_len = if buf.get(j + 1) == Some(&b'\n') {
                        2
                    } else if j + 1 == buf.len() {
                        return None;
                    } else {
                        1
                    };
                    return Some((i, first_len + second_len));
                }
                Some(_) => i = j,
                None => return None,
            }
        } else {
            i += 1;
        }
    }
    None
}

fn parse_event(raw: Bytes) -> Option<SseEvent> {
    let mut event = None;
    let mut data: Option<BytesMut> = None;
    let mut single: Option<Bytes> = None;
    for line in raw
        .split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
    {
        if line.is_empty() || line[0] == b':' {
            continue;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(p) => {
                let v = &line[p + 1..];
                (&line[..p], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"event" => event = Some(String::from_utf8_lossy(value).into_owned()),
            b"data" => {
                // The common case (one data line) slices the buffer without copying.
                // `slice_ref`, not pointer arithmetic: a bare `data` line's value is a static empty
                // slice outside `raw` (a fuzzer found the panic).
                if single.is_none() && data.is_none() {
                    single = Some(raw.slice_ref(value));
                } else {
                    let acc = data.get_or_insert_with(|| {
                        let mut acc = BytesMut::new();
                        if let Some(first) = single.take() {
                            acc.extend_from_slice(&first);
                        }
                        acc
                    });
                    acc.extend_from_slice(b"\n");
                    acc.extend_from_slice(value);
                }
            }
            _ => {}
        }
    }
    let data = match (data, single) {
        (Some(acc), _) => acc.freeze(),
        (None, Some(one)) => one,
        (None, None) if event.is_some() => Bytes::new(),
        (None, None) => return None,
    };
    Some(SseEvent { event, data })
}

#[cfg(test)]
mod tests;
