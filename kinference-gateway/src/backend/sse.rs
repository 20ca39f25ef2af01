//! Incremental Server-Sent Events parser for the worker's stream.
//!
//! TCP delivers the stream in arbitrary pieces: an event may be split across chunks, and one chunk may
//! hold several events. The parser buffers only the unfinished tail, and that tail is bounded: a line
//! longer than [`SseLimits::max_line`] or an event longer than [`SseLimits::max_event`] stops the
//! parser ([`SseParser::overflow`] says which), which from then on holds nothing and yields nothing.
//! A backend is a third party (a Remote pool, a provider): what it sends must not size the gateway's
//! memory. What the parser holds is at most a limit plus the chunk fed last.

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

/// The most the parser holds for one line and for one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SseLimits {
    /// Longest line (a field and its value), in bytes, without its line ending.
    pub max_line: usize,
    /// Longest event (its lines), in bytes, without the blank line that ends it.
    pub max_event: usize,
}

/// The defaults of `--upstream-max-line-bytes` and `--upstream-max-event-bytes`.
impl Default for SseLimits {
    fn default() -> Self {
        Self {
            max_line: DEFAULT_MAX_LINE,
            max_event: DEFAULT_MAX_EVENT,
        }
    }
}

/// Default longest line: 4 MiB (a streamed chunk is one `data:` line; vLLM's are a few KB, with
/// top-20 log-probabilities a few tens of KB).
pub const DEFAULT_MAX_LINE: usize = 4 << 20;
/// Default longest event: 8 MiB.
pub const DEFAULT_MAX_EVENT: usize = 8 << 20;

/// Which limit a stream passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SseOverflow {
    /// A line longer than the line limit.
    #[error("a stream line over the {limit}-byte limit (--upstream-max-line-bytes)")]
    Line {
        /// The limit passed.
        limit: usize,
    },
    /// An event longer than the event limit.
    #[error("a stream event over the {limit}-byte limit (--upstream-max-event-bytes)")]
    Event {
        /// The limit passed.
        limit: usize,
    },
}

/// Splits a byte stream into [`SseEvent`]s.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: BytesMut,
    /// Where to resume looking for the end of the current event (avoids rescanning a long event).
    scanned: usize,
    /// Where the unfinished event's last line begins.
    line_start: usize,
    limits: SseLimits,
    /// Set once a limit was passed: nothing is held or yielded after it.
    overflow: Option<SseOverflow>,
}

impl SseParser {
    /// An empty parser with the default limits.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty parser with `limits`.
    pub fn with_limits(limits: SseLimits) -> Self {
        Self {
            limits,
            ..Self::default()
        }
    }

    /// Appends bytes received from the network (dropped once a limit was passed).
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.overflow.is_none() {
            self.buf.extend_from_slice(chunk);
        }
    }

    /// The limit the stream passed, if it did; the parser then holds and yields nothing.
    pub fn overflow(&self) -> Option<SseOverflow> {
        self.overflow
    }

    fn stop(&mut self, overflow: SseOverflow) -> Option<SseEvent> {
        self.overflow = Some(overflow);
        self.buf = BytesMut::new();
        self.scanned = 0;
        self.line_start = 0;
        None
    }

    /// Checks the unfinished event (the whole buffer: it holds no separator) against the limits,
    /// looking only at the bytes that arrived since the last check: each line they end, and the
    /// line still open.
    fn check_tail(&mut self) -> Option<SseOverflow> {
        let from = self.scanned.min(self.buf.len());
        let line = SseOverflow::Line {
            limit: self.limits.max_line,
        };
        for (i, &b) in self.buf[from..].iter().enumerate() {
            if b == b'\n' || b == b'\r' {
                let end = from + i;
                if end - self.line_start.min(end) > self.limits.max_line {
                    return Some(line);
                }
                self.line_start = end + 1;
            }
        }
        // A line ending at the end may be the start of the blank line that ends the event: it is
        // not the event's (a complete event is measured without its separator).
        let ending = self
            .buf
            .iter()
            .rev()
            .take_while(|&&b| b == b'\n' || b == b'\r')
            .count();
        if self.buf.len() - ending > self.limits.max_event {
            return Some(SseOverflow::Event {
                limit: self.limits.max_event,
            });
        }
        (self.buf.len() - self.line_start.min(self.buf.len()) > self.limits.max_line)
            .then_some(line)
    }

    /// Checks a complete event's `raw` bytes against the limits.
    fn check_event(&self, raw: &[u8]) -> Option<SseOverflow> {
        if raw.len() > self.limits.max_event {
            return Some(SseOverflow::Event {
                limit: self.limits.max_event,
            });
        }
        raw.split(|&b| b == b'\n' || b == b'\r')
            .any(|line| line.len() > self.limits.max_line)
            .then_some(SseOverflow::Line {
                limit: self.limits.max_line,
            })
    }

    /// Bytes received but not yet part of a complete event.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next complete event, if the buffer holds one; `None` too once a limit was passed.
    pub fn next_event(&mut self) -> Option<SseEvent> {
        loop {
            if self.overflow.is_some() {
                return None;
            }
            let Some((end, sep)) = find_event_end(&self.buf, self.scanned) else {
                if let Some(overflow) = self.check_tail() {
                    return self.stop(overflow);
                }
                self.scanned = self.buf.len();
                return None;
            };
            if let Some(overflow) = self.check_event(&self.buf[..end]) {
                return self.stop(overflow);
            }
            let raw = self.buf.split_to(end).freeze();
            self.buf.advance(sep);
            self.scanned = 0;
            self.line_start = 0;
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
    // A line ends with \n, \r\n or a lone \r (as the separator search and the limits take it); the
    // empty piece between \r and \n is skipped like any empty line.
    for line in raw.split(|&b| b == b'\n' || b == b'\r') {
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
