//! A small, allocation-free msgpack reader over a byte slice.
//!
//! vLLM encodes KV events with msgspec, whose choices (header widths, int widths, map vs array) vary by
//! version; this reader accepts every width the msgpack spec allows and reports malformed input as an
//! error, never a panic. Skipping is iterative, so hostile nesting cannot overflow the stack.

use super::DecodeError;

/// A cursor over one msgpack document.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// An integer as msgpack carries it: any width, signed or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Int {
    U(u64),
    I(i64),
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Bytes not yet read.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn eof(&self) -> DecodeError {
        DecodeError::Eof { pos: self.pos }
    }

    fn unexpected(&self, expected: &'static str, marker: u8) -> DecodeError {
        DecodeError::Unexpected {
            expected,
            marker,
            pos: self.pos.saturating_sub(1),
        }
    }

    pub(crate) fn peek(&self) -> Result<u8, DecodeError> {
        self.buf.get(self.pos).copied().ok_or_else(|| self.eof())
    }

    fn byte(&mut self) -> Result<u8, DecodeError> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or_else(|| self.eof())?;
        let s = self.buf.get(self.pos..end).ok_or_else(|| self.eof())?;
        self.pos = end;
        Ok(s)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let s = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn len_u8(&mut self) -> Result<usize, DecodeError> {
        Ok(self.byte()? as usize)
    }
    fn len_u16(&mut self) -> Result<usize, DecodeError> {
        Ok(u16::from_be_bytes(self.be()?) as usize)
    }
    fn len_u32(&mut self) -> Result<usize, DecodeError> {
        Ok(u32::from_be_bytes(self.be()?) as usize)
    }

    /// Consumes a nil if one is next; returns whether it did.
    pub(crate) fn nil(&mut self) -> Result<bool, DecodeError> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    /// An array header of any width; the element count.
    pub(crate) fn array_len(&mut self) -> Result<usize, DecodeError> {
        match self.byte()? {
            m @ 0x90..=0x9f => Ok((m & 0x0f) as usize),
            0xdc => self.len_u16(),
            0xdd => self.len_u32(),
            m => Err(self.unexpected("array", m)),
        }
    }

    /// A map header of any width; the entry count.
    pub(crate) fn map_len(&mut self) -> Result<usize, DecodeError> {
        match self.byte()? {
            m @ 0x80..=0x8f => Ok((m & 0x0f) as usize),
            0xde => self.len_u16(),
            0xdf => self.len_u32(),
            m => Err(self.unexpected("map", m)),
        }
    }

    /// A str or bin value's bytes.
    pub(crate) fn bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        let n = match self.byte()? {
            m @ 0xa0..=0xbf => (m & 0x1f) as usize,
            0xd9 | 0xc4 => self.len_u8()?,
            0xda | 0xc5 => self.len_u16()?,
            0xdb | 0xc6 => self.len_u32()?,
            m => return Err(self.unexpected("str or bin", m)),
        };
        self.take(n)
    }

    /// An integer of any width.
    pub(crate) fn int(&mut self) -> Result<Int, DecodeError> {
        Ok(match self.byte()? {
            m @ 0x00..=0x7f => Int::U(m as u64),
            m @ 0xe0..=0xff => Int::I(m as i8 as i64),
            0xcc => Int::U(self.byte()? as u64),
            0xcd => Int::U(u16::from_be_bytes(self.be()?) as u64),
            0xce => Int::U(u32::from_be_bytes(self.be()?) as u64),
            0xcf => Int::U(u64::from_be_bytes(self.be()?)),
            0xd0 => Int::I(self.byte()? as i8 as i64),
            0xd1 => Int::I(i16::from_be_bytes(self.be()?) as i64),
            0xd2 => Int::I(i32::from_be_bytes(self.be()?) as i64),
            0xd3 => Int::I(i64::from_be_bytes(self.be()?)),
            m => return Err(self.unexpected("int", m)),
        })
    }

    /// A non-negative integer that fits in a u32.
    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        let pos = self.pos;
        match self.int()? {
            Int::U(v) => u32::try_from(v).ok(),
            Int::I(v) => u32::try_from(v).ok(),
        }
        .ok_or(DecodeError::OutOfRange { pos })
    }

    /// A float (or an integer, which msgspec never writes here but a hand-made publisher might).
    pub(crate) fn f64(&mut self) -> Result<f64, DecodeError> {
        match self.peek()? {
            0xca => {
                self.pos += 1;
                Ok(f32::from_be_bytes(self.be()?) as f64)
            }
            0xcb => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            _ => Ok(match self.int()? {
                Int::U(v) => v as f64,
                Int::I(v) => v as f64,
            }),
        }
    }

    /// The encoded bytes of the next value, whatever its type (the value is consumed).
    pub(crate) fn raw(&mut self) -> Result<&'a [u8], DecodeError> {
        let start = self.pos;
        self.skip()?;
        Ok(&self.buf[start..self.pos])
    }

    /// Skips one complete value of any type, however deeply nested, without recursion.
    pub(crate) fn skip(&mut self) -> Result<(), DecodeError> {
        // Values still to skip. Every value consumes at least one byte, so this ends with the input.
        let mut remaining: u64 = 1;
        while remaining > 0 {
            remaining -= 1;
            let m = self.byte()?;
            let skip_bytes = match m {
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 0,
                0x80..=0x8f => {
                    remaining += 2 * (m & 0x0f) as u64;
                    0
                }
                0x90..=0x9f => {
                    remaining += (m & 0x0f) as u64;
                    0
                }
                0xa0..=0xbf => (m & 0x1f) as usize,
                0xc4 | 0xd9 => self.len_u8()?,
                0xc5 | 0xda => self.len_u16()?,
                0xc6 | 0xdb => self.len_u32()?,
                0xc7 => self.len_u8()? + 1,
                0xc8 => self.len_u16()? + 1,
                0xc9 => self.len_u32()? + 1,
                0xca => 4,
                0xcb => 8,
                0xcc | 0xd0 => 1,
                0xcd | 0xd1 => 2,
                0xce | 0xd2 => 4,
                0xcf | 0xd3 => 8,
                0xd4 => 2,
                0xd5 => 3,
                0xd6 => 5,
                0xd7 => 9,
                0xd8 => 17,
                0xdc => {
                    remaining += self.len_u16()? as u64;
                    0
                }
                0xdd => {
                    remaining += self.len_u32()? as u64;
                    0
                }
                0xde => {
                    remaining += 2 * self.len_u16()? as u64;
                    0
                }
                0xdf => {
                    remaining += 2 * self.len_u32()? as u64;
                    0
                }
                0xc1 => return Err(self.unexpected("any value", m)),
            };
            self.take(skip_bytes)?;
        }
        Ok(())
    }
}
