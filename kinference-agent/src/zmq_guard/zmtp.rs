//! A sans-IO inspector for the bytes one ZMTP 3.x peer sends: greeting, handshake commands, then frames.
//!
//! It never buffers a message: it reads frame headers as they stream past and decides, from the declared
//! size alone, whether the frame may pass. Only command bodies (READY, ERROR, PING...) are kept, up to
//! [`Limits::max_command`], to check their structure. Every input either passes or yields a typed
//! [`Violation`]; nothing here allocates in proportion to what a peer *declares*.

/// The largest sizes a peer may send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest single message frame, in bytes.
    pub max_frame: u64,
    /// Largest message (the sum of its frames), in bytes.
    pub max_message: u64,
    /// Largest command frame (READY metadata, PING...), in bytes.
    pub max_command: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_frame: 16 << 20,
            max_message: 16 << 20,
            max_command: 16 << 10,
        }
    }
}

/// Why a peer's bytes were refused. The label is a fixed string, fit for a metric label.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    #[error("greeting does not start with the ZMTP signature")]
    BadSignature,
    #[error("unsupported ZMTP version {0}.x (3.x only)")]
    Version(u8),
    #[error("security mechanism {0:?} refused (NULL only)")]
    Mechanism(String),
    #[error("malformed greeting")]
    BadGreeting,
    #[error("reserved flag bits set ({0:#04x})")]
    BadFlags(u8),
    #[error("frame of {size} bytes over the {limit}-byte limit")]
    FrameTooLarge { size: u64, limit: u64 },
    #[error("message of at least {size} bytes over the {limit}-byte limit")]
    MessageTooLarge { size: u64, limit: u64 },
    #[error("command of {size} bytes over the {limit}-byte limit")]
    CommandTooLarge { size: u64, limit: u64 },
    #[error("malformed command")]
    BadCommand,
    #[error("peer sent {0:?} before the handshake")]
    BeforeHandshake(&'static str),
    #[error("peer reported an error: {0}")]
    PeerError(String),
}

impl Violation {
    /// A short, fixed reason (a metric label value).
    pub fn reason(&self) -> &'static str {
        match self {
            Violation::BadSignature | Violation::BadGreeting | Violation::BadFlags(_) => "protocol",
            Violation::Version(_) => "version",
            Violation::Mechanism(_) => "mechanism",
            Violation::FrameTooLarge { .. } => "frame_too_large",
            Violation::MessageTooLarge { .. } => "message_too_large",
            Violation::CommandTooLarge { .. } => "command_too_large",
            Violation::BadCommand | Violation::BeforeHandshake(_) => "protocol",
            Violation::PeerError(_) => "peer_error",
        }
    }
}

const GREETING_LEN: usize = 64;
const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

#[derive(Clone, Copy, Debug)]
enum State {
    /// Bytes of the 64-byte greeting seen so far.
    Greeting(usize),
    /// Waiting for a frame's flags byte.
    Flags,
    /// Reading the size field: flags, bytes of the size seen so far, the size so far.
    Size { flags: u8, seen: u8, size: u64 },
    /// Skipping a message frame's body; `last`: the message's last frame.
    Body { left: u64, last: bool },
    /// Collecting a command's body into `command`.
    Command { left: u64 },
}

/// What one [`Inspector::feed`] call saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// The peer's handshake (greeting + READY) completed within these bytes.
    pub handshake_done: bool,
    /// Complete messages that ended within these bytes.
    pub messages: u64,
}

/// Follows one peer's byte stream and checks it against [`Limits`].
#[derive(Debug)]
pub struct Inspector {
    limits: Limits,
    state: State,
    greeting: [u8; GREETING_LEN],
    command: Vec<u8>,
    /// Bytes of the current (multi-frame) message so far, including the frame being read.
    message: u64,
    /// Declared bytes of the message being received (0 between messages): what the receiver holds
    /// for it until its last frame ends.
    open: u64,
    handshake_done: bool,
    /// A violation already reported: every later byte is refused too.
    failed: Option<Violation>,
}

impl Inspector {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            state: State::Greeting(0),
            greeting: [0; GREETING_LEN],
            command: Vec::new(),
            message: 0,
            open: 0,
            handshake_done: false,
            failed: None,
        }
    }

    /// True once the peer's greeting and READY have passed.
    pub fn handshake_done(&self) -> bool {
        self.handshake_done
    }

    /// The declared size of the message the peer is sending, its frames so far and the whole of the
    /// frame being read; 0 between messages. The receiving ZeroMQ socket reserves a frame's declared
    /// size when its header arrives and holds a message's frames until the last one ends, so this is
    /// what the peer makes it hold now.
    pub fn open_bytes(&self) -> u64 {
        self.open
    }

    /// Inspects the next bytes from the peer. `Ok` means every byte so far may be forwarded.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Result<Progress, Violation> {
        if let Some(v) = &self.failed {
            return Err(v.clone());
        }
        let mut progress = Progress::default();
        while !bytes.is_empty() {
            match self.step(&mut bytes, &mut progress) {
                Ok(()) => {}
                Err(v) => {
                    self.failed = Some(v.clone());
                    return Err(v);
                }
            }
        }
        Ok(progress)
    }

    fn step(&mut self, bytes: &mut &[u8], progress: &mut Progress) -> Result<(), Violation> {
        match self.state {
            State::Greeting(seen) => {
                let take = (GREETING_LEN - seen).min(bytes.len());
                self.greeting[seen..seen + take].copy_from_slice(&bytes[..take]);
                *bytes = &bytes[take..];
                let seen = seen + take;
                // Check each field as soon as it has arrived: peers send the greeting in parts.
                check_greeting(&self.greeting[..seen])?;
                self.state = if seen == GREETING_LEN {
                    State::Flags
                } else {
                    State::Greeting(seen)
                };
            }
            State::Flags => {
                let flags = bytes[0];
                *bytes = &bytes[1..];
                if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
                    return Err(Violation::BadFlags(flags));
                }
                if flags & FLAG_COMMAND != 0 && flags & FLAG_MORE != 0 {
                    return Err(Violation::BadFlags(flags));
                }
                if flags & FLAG_COMMAND == 0 && !self.handshake_done {
                    return Err(Violation::BeforeHandshake("a message"));
                }
                self.state = State::Size {
                    flags,
                    seen: 0,
                    size: 0,
                };
            }
            State::Size { flags, seen, size } => {
                let width = if flags & FLAG_LONG != 0 { 8 } else { 1 };
                let size = (size << 8) | u64::from(bytes[0]);
                *bytes = &bytes[1..];
                let seen = seen + 1;
                if seen < width {
                    self.state = State::Size { flags, seen, size };
                    return Ok(());
                }
                self.start_frame(flags, size, progress)?;
            }
            State::Body { left, last } => {
                let take = left.min(bytes.len() as u64);
                *bytes = &bytes[take as usize..];
                let left = left - take;
                self.state = State::Body { left, last };
                if left == 0 {
                    self.state = State::Flags;
                    if last {
                        self.open = 0;
                    }
                }
            }
            State::Command { left } => {
                let take = left.min(bytes.len() as u64) as usize;
                self.command.extend_from_slice(&bytes[..take]);
                *bytes = &bytes[take..];
                let left = left - take as u64;
                self.state = State::Command { left };
                if left == 0 {
                    self.end_command(progress)?;
                    self.state = State::Flags;
                }
            }
        }
        Ok(())
    }

    fn start_frame(
        &mut self,
        flags: u8,
        size: u64,
        progress: &mut Progress,
    ) -> Result<(), Violation> {
        if flags & FLAG_COMMAND != 0 {
            if size > self.limits.max_command {
                return Err(Violation::CommandTooLarge {
                    size,
                    limit: self.limits.max_command,
                });
            }
            self.command.clear();
            self.state = State::Command { left: size };
            if size == 0 {
                return Err(Violation::BadCommand);
            }
            return Ok(());
        }
        if size > self.limits.max_frame {
            return Err(Violation::FrameTooLarge {
                size,
                limit: self.limits.max_frame,
            });
        }
        let total = self.message.saturating_add(size);
        if total > self.limits.max_message {
            return Err(Violation::MessageTooLarge {
                size: total,
                limit: self.limits.max_message,
            });
        }
        let last = flags & FLAG_MORE == 0;
        if last {
            self.message = 0;
            progress.messages += 1;
        } else {
            self.message = total;
        }
        self.open = total;
        self.state = if size == 0 {
            if last {
                self.open = 0;
            }
            State::Flags
        } else {
            State::Body { left: size, last }
        };
        Ok(())
    }

    fn end_command(&mut self, progress: &mut Progress) -> Result<(), Violation> {
        let (name, body) = split_command(&self.command)?;
        match name {
            b"READY" => {
                check_properties(body)?;
                if !self.handshake_done {
                    self.handshake_done = true;
                    progress.handshake_done = true;
                }
            }
            b"ERROR" => {
                let reason = body
                    .split_first()
                    .and_then(|(&n, rest)| rest.get(..usize::from(n)))
                    .ok_or(Violation::BadCommand)?;
                return Err(Violation::PeerError(
                    String::from_utf8_lossy(reason).into_owned(),
                ));
            }
            // Other commands (PING, PONG, SUBSCRIBE...) only after the handshake.
            _ if !self.handshake_done => return Err(Violation::BeforeHandshake("a command")),
            _ => {}
        }
        Ok(())
    }
}

/// Checks the greeting bytes received so far (a prefix of the 64).
fn check_greeting(g: &[u8]) -> Result<(), Violation> {
    // Signature: 0xFF, 8 bytes of padding, 0x7F.
    if g.first().is_some_and(|&b| b != 0xff) {
        return Err(Violation::BadSignature);
    }
    if g.get(9).is_some_and(|&b| b != 0x7f) {
        return Err(Violation::BadSignature);
    }
    if let Some(&major) = g.get(10)
        && major != 3
    {
        return Err(Violation::Version(major));
    }
    // The mechanism: 20 bytes, a name padded with NULs.
    if g.len() >= 32 {
        let mech = &g[12..32];
        let end = mech.iter().position(|&b| b == 0).unwrap_or(mech.len());
        if &mech[..end] != b"NULL" || mech[end..].iter().any(|&b| b != 0) {
            return Err(Violation::Mechanism(
                String::from_utf8_lossy(&mech[..end]).into_owned(),
            ));
        }
    }
    if g.get(32).is_some_and(|&b| b > 1) {
        return Err(Violation::BadGreeting);
    }
    Ok(())
}

/// A command body: a 1-byte name length, the name, then the command's data.
fn split_command(c: &[u8]) -> Result<(&[u8], &[u8]), Violation> {
    let (&len, rest) = c.split_first().ok_or(Violation::BadCommand)?;
    let len = usize::from(len);
    if len == 0 || rest.len() < len {
        return Err(Violation::BadCommand);
    }
    Ok(rest.split_at(len))
}

/// READY's metadata: properties of a 1-byte name length, a name, a 4-byte value length and a value.
fn check_properties(mut p: &[u8]) -> Result<(), Violation> {
    while !p.is_empty() {
        let (&n, rest) = p.split_first().ok_or(Violation::BadCommand)?;
        let n = usize::from(n);
        if n == 0 || rest.len() < n + 4 {
            return Err(Violation::BadCommand);
        }
        let rest = &rest[n..];
        let v = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let rest = &rest[4..];
        if rest.len() < v {
            return Err(Violation::BadCommand);
        }
        p = &rest[v..];
    }
    Ok(())
}
