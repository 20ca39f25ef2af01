//! PII detectors over prompt text: e-mail addresses, phone numbers, IBANs (mod-97 checked),
//! payment cards (Luhn checked), IPv4/IPv6 addresses, US SSNs and UK National Insurance numbers.
//!
//! Each detector finds candidates with a regular expression and then checks them (checksums,
//! ranges, reserved values) so that look-alikes (dates, versions, order numbers, `std::vec`) do
//! not match. False negatives are the dangerous side here (a miss may send personal data to a
//! cloud provider), so the checks reject only what is provably not an identifier.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::LazyLock;

use regex::Regex;
use serde::Serialize;

#[cfg(test)]
mod tests;

/// A kind of personal data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PiiKind {
    Email,
    Phone,
    Iban,
    PaymentCard,
    IpAddress,
    UsSsn,
    UkNino,
}

impl PiiKind {
    /// The tag added for this kind: `pii:<kind>`.
    pub fn tag(self) -> &'static str {
        match self {
            PiiKind::Email => "pii:email",
            PiiKind::Phone => "pii:phone",
            PiiKind::Iban => "pii:iban",
            PiiKind::PaymentCard => "pii:payment_card",
            PiiKind::IpAddress => "pii:ip_address",
            PiiKind::UsSsn => "pii:us_ssn",
            PiiKind::UkNino => "pii:uk_nino",
        }
    }
}

/// One detection: kind and byte range in the scanned text (never the text itself, so logs and
/// decisions never carry the personal data).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PiiMatch {
    pub kind: PiiKind,
    pub start: usize,
    pub end: usize,
}

fn re(pattern: &str) -> Regex {
    // The patterns are constants covered by tests; failing here is a programming error.
    Regex::new(pattern).unwrap_or_else(|e| panic!("invalid built-in PII pattern {pattern}: {e}"))
}

static EMAIL: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?i)\b[a-z0-9][a-z0-9._%+-]{0,63}@(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,24}")
});
// International (+CC ...) with 8-15 digits, or North-American (555) 123-4567 / 555-123-4567,
// or UK national 0xxxx xxxxxx / 020 7946 0958. Separators are required in national forms so
// that bare numbers (order ids, timestamps) do not match.
//
// What may stand right before and after a number: a number glued to a word or to another value
// (`mail@example.com+44 20 7946 0958`, `2671jane`) is still one. A form opening with `+` or `(`
// may follow a digit too (`...1111+44 ...`); a national form may not, nor be followed by one,
// so that it is not read out of a longer run of digits.
static PHONE: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?x)
        (?:
            (?:^|[^+])(
                \+\d{1,3}(?:[\s.-]?\(?\d{1,5}\)?){2,6}
              | \(\d{3}\)\s?\d{3}[\s.-]\d{4}
            )
          | (?:^|[^0-9_+])(
                \d{3}[.\s-]\d{3}[.\s-]\d{4}
              | 0\d{2,4}\s\d{3,4}\s?\d{3,4}
            )
        )(?:$|[^0-9_-])")
});
// Glued to a lower-case word or a digit on either side it still counts: mod-97 keeps out look-alikes.
static IBAN: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?:^|[^A-Z])([A-Z]{2}\d{2}(?:[ ]?[A-Z0-9]{4}){2,7}(?:[ ]?[A-Z0-9]{1,3})?)(?:$|[^A-Z0-9])")
});
static CARD: LazyLock<Regex> =
    LazyLock::new(|| re(r"(?:^|[^\d-])(\d(?:[ -]?\d){12,18})(?:$|[^\d-])"));
static IPV4: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?:^|[^\w.])(\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3})(?:$|[^0-9_.]|\.(?:\s|$))")
});
static IPV6: LazyLock<Regex> =
    LazyLock::new(|| re(r"(?i)(?:^|[^\w:])([0-9a-f]{0,4}(?::[0-9a-f]{0,4}){2,7})(?:$|[^\w:])"));
static SSN: LazyLock<Regex> =
    LazyLock::new(|| re(r"(?:^|[^\d-])(\d{3})-(\d{2})-(\d{4})(?:$|[^\d-])"));
// A digit may stand right before or after one (glued to another value); a letter may not, so that
// it is not read out of a word (`build202401a`).
static NINO: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?i)(?:^|[^a-z])([A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z])\s?(\d{2})\s?(\d{2})\s?(\d{2})\s?([A-D])(?:$|[^a-z])",
    )
});

/// Every PII match in `text`, in order of position.
pub fn scan(text: &str) -> Vec<PiiMatch> {
    let mut out = Vec::new();
    for m in EMAIL.find_iter(text) {
        out.push(PiiMatch {
            kind: PiiKind::Email,
            start: m.start(),
            end: m.end(),
        });
    }
    out.extend(checked(PiiKind::Phone, &PHONE, text, phone_valid));
    out.extend(checked(PiiKind::Iban, &IBAN, text, iban_valid));
    out.extend(checked(PiiKind::PaymentCard, &CARD, text, card_valid));
    for c in IPV4.captures_iter(text) {
        if let Some(m) = c.get(1)
            && let Ok(ip) = m.as_str().parse::<Ipv4Addr>()
            && !ip.is_loopback()
            && !ip.is_unspecified()
            && !ip.is_broadcast()
        {
            out.push(PiiMatch {
                kind: PiiKind::IpAddress,
                start: m.start(),
                end: m.end(),
            });
        }
    }
    for c in IPV6.captures_iter(text) {
        if let Some(m) = c.get(1)
            && ipv6_plausible(m.as_str())
        {
            out.push(PiiMatch {
                kind: PiiKind::IpAddress,
                start: m.start(),
                end: m.end(),
            });
        }
    }
    for c in SSN.captures_iter(text) {
        if let (Some(all), Some(area), Some(group), Some(serial)) =
            (c.get(0), c.get(1), c.get(2), c.get(3))
            && ssn_valid(area.as_str(), group.as_str(), serial.as_str())
        {
            let _ = all;
            out.push(PiiMatch {
                kind: PiiKind::UsSsn,
                start: area.start(),
                end: serial.end(),
            });
        }
    }
    for c in NINO.captures_iter(text) {
        if let (Some(prefix), Some(suffix)) = (c.get(1), c.get(5)) {
            let letters = prefix.as_str().to_ascii_uppercase();
            if !matches!(
                letters.as_str(),
                "BG" | "GB" | "NK" | "KN" | "TN" | "NT" | "ZZ"
            ) {
                out.push(PiiMatch {
                    kind: PiiKind::UkNino,
                    start: prefix.start(),
                    end: suffix.end(),
                });
            }
        }
    }
    out.sort_by_key(|m| (m.start, m.kind));
    out
}

/// The candidates `pattern` finds in `text` (its first capture group that took part in the match)
/// that `valid` accepts, as matches of `kind`.
///
/// A number pattern can take more than one number: two phone numbers written side by side read as
/// one, too long to be a number; a card number followed by its security code, or an IBAN followed by
/// a word of four capitals, as one that fails the checksum. So a rejected candidate does not hide
/// what it holds:
/// - its longest leading part that ends where a group ends and that `valid` accepts is taken instead,
///   and the search goes on after it;
/// - when no part is accepted, the search goes on from the candidate's second character, so a number
///   that starts inside it is still found.
fn checked(
    kind: PiiKind,
    pattern: &Regex,
    text: &str,
    valid: impl Fn(&str) -> bool,
) -> Vec<PiiMatch> {
    let mut found = Vec::new();
    let mut at = 0;
    while at <= text.len() {
        let captures = pattern.captures_at(text, at);
        let Some(candidate) = captures.and_then(|c| c.iter().skip(1).flatten().next()) else {
            break;
        };
        let (start, number) = (candidate.start(), candidate.as_str());
        let accepted = if valid(number) {
            Some(number.len())
        } else {
            group_ends(number).rev().find(|&end| valid(&number[..end]))
        };
        at = match accepted {
            Some(len) => {
                found.push(PiiMatch {
                    kind,
                    start,
                    end: start + len,
                });
                start + len
            }
            // The next character boundary after the candidate's start.
            None => start + number.chars().next().map_or(1, char::len_utf8),
        };
    }
    found
}

/// Where a group ends inside `number`, before its last character: after a digit, a letter or a
/// closing parenthesis that a separator follows.
fn group_ends(number: &str) -> impl DoubleEndedIterator<Item = usize> + '_ {
    let bytes = number.as_bytes();
    let in_group = |b: u8| b.is_ascii_alphanumeric() || b == b')';
    (1..bytes.len()).filter(move |&i| in_group(bytes[i - 1]) && !in_group(bytes[i]))
}

/// Phone number check: 8 to 15 digits (E.164 allows at most 15).
pub fn phone_valid(candidate: &str) -> bool {
    (8..=15).contains(&candidate.chars().filter(char::is_ascii_digit).count())
}

/// IBAN check: country code, length 15-34, and the ISO 13616 mod-97 remainder of 1.
pub fn iban_valid(candidate: &str) -> bool {
    let s: String = candidate.chars().filter(|c| !c.is_whitespace()).collect();
    if !(15..=34).contains(&s.len()) || !s.is_ascii() {
        return false;
    }
    let (head, tail) = s.split_at(4);
    let mut rem: u32 = 0;
    for c in tail.chars().chain(head.chars()) {
        let v = match c {
            '0'..='9' => c as u32 - '0' as u32,
            'A'..='Z' => c as u32 - 'A' as u32 + 10,
            _ => return false,
        };
        rem = if v >= 10 {
            (rem * 100 + v) % 97
        } else {
            (rem * 10 + v) % 97
        };
    }
    rem == 1
}

/// Payment card check: 13-19 digits, a known issuer prefix, and the Luhn checksum.
pub fn card_valid(candidate: &str) -> bool {
    let digits: Vec<u32> = candidate.chars().filter_map(|c| c.to_digit(10)).collect();
    if !(13..=19).contains(&digits.len()) || digits.iter().all(|d| *d == digits[0]) {
        return false;
    }
    // Visa 4, Mastercard 51-55/22-27, Amex 34/37, Discover/UnionPay 6, Diners 30/36/38, JCB 35.
    let issuer = match digits[0] {
        4 | 6 => true,
        5 => (1..=5).contains(&digits[1]),
        2 => (2..=7).contains(&digits[1]),
        3 => matches!(digits[1], 0 | 4 | 5 | 6 | 7 | 8),
        _ => false,
    };
    issuer && luhn(&digits)
}

/// The Luhn (mod 10) checksum.
pub fn luhn(digits: &[u32]) -> bool {
    let sum: u32 = digits
        .iter()
        .rev()
        .enumerate()
        .map(|(i, d)| {
            if i % 2 == 1 {
                if d * 2 > 9 { d * 2 - 9 } else { d * 2 }
            } else {
                *d
            }
        })
        .sum();
    sum.is_multiple_of(10)
}

/// US SSN rules: area not 000, 666 or 900-999; group not 00; serial not 0000.
fn ssn_valid(area: &str, group: &str, serial: &str) -> bool {
    let area: u32 = area.parse().unwrap_or(0);
    area != 0 && area != 666 && area < 900 && group != "00" && serial != "0000"
}

/// An IPv6 address with at least three non-empty groups (so `a::b`, `::1` and C++/Rust paths
/// like `abc::def` do not count), not loopback or unspecified.
fn ipv6_plausible(candidate: &str) -> bool {
    let groups = candidate.split(':').filter(|g| !g.is_empty()).count();
    groups >= 3
        && candidate
            .parse::<Ipv6Addr>()
            .is_ok_and(|ip| !ip.is_loopback() && !ip.is_unspecified())
}
