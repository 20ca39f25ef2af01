//! Strict YAML errors for every file the gateway and `kinfctl` read: where the problem is
//! (`file:line:column`) and, for a misspelt key, the nearest valid one.
//!
//! The configuration structs use `#[serde(deny_unknown_fields)]`, so serde already rejects a key
//! it does not know and lists the expected ones; this module turns that message into
//! "unknown key `max_tokns` at gateway.yaml:12:5; did you mean `max_tokens`?".

use std::path::Path;

/// A YAML error as one line: the file, the position (lines counted from `first_line`, for a
/// document that starts further down a multi-document file) and the cause, with the nearest
/// valid key when the cause is an unknown key.
pub fn describe(file: &Path, first_line: usize, e: &serde_yaml::Error) -> String {
    let at = match e.location() {
        Some(l) => format!(
            "{}:{}:{}",
            file.display(),
            first_line + l.line().saturating_sub(1),
            l.column()
        ),
        None => file.display().to_string(),
    };
    let message = cause(e);
    match unknown_key(&message) {
        Some(unknown) => format!("unknown key `{}` at {at}; {}", unknown.key, unknown.hint()),
        None => format!("{at}: {message}"),
    }
}

/// `message` with serde's "unknown field `x`, expected one of ..." tail replaced by the nearest
/// valid key (or the list, when none is close); other messages unchanged.
pub fn with_hint(message: &str) -> String {
    match (unknown_key(message), message.find("unknown field `")) {
        (Some(unknown), Some(start)) => format!(
            "{}unknown field `{}`; {}",
            &message[..start],
            unknown.key,
            unknown.hint()
        ),
        _ => message.to_string(),
    }
}

/// serde_yaml's message without its trailing " at line L column C" (the position is given apart).
fn cause(e: &serde_yaml::Error) -> String {
    let message = e.to_string();
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_string(),
        None => message,
    }
}

/// An unknown key and the keys that were expected in its place.
#[derive(Debug, PartialEq, Eq)]
pub struct UnknownKey {
    /// The key as written.
    pub key: String,
    /// The valid keys at that place (serde's list).
    pub expected: Vec<String>,
}

impl UnknownKey {
    /// The valid key closest to the one written, when it is close enough to be a misspelling.
    pub fn nearest(&self) -> Option<&str> {
        let limit = (self.key.chars().count() / 3).max(2);
        self.expected
            .iter()
            .map(|k| (edit_distance(&self.key, k), k))
            .filter(|(d, _)| *d <= limit)
            .min_by_key(|(d, _)| *d)
            .map(|(_, k)| k.as_str())
    }

    /// "did you mean `x`?", or the list of valid keys when none is close.
    pub fn hint(&self) -> String {
        match self.nearest() {
            Some(k) => format!("did you mean `{k}`?"),
            None if self.expected.is_empty() => "no keys are accepted here".to_string(),
            None => format!(
                "valid keys here: {}",
                self.expected
                    .iter()
                    .map(|k| format!("`{k}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

/// Reads serde's "unknown field `x`, expected one of `a`, `b`" (or "expected `a`", "there are no
/// fields") message.
pub fn unknown_key(message: &str) -> Option<UnknownKey> {
    let rest = message.split("unknown field `").nth(1)?;
    let (key, rest) = rest.split_once('`')?;
    let expected = rest
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    Some(UnknownKey {
        key: key.to_string(),
        expected,
    })
}

/// Levenshtein distance over characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitute = previous[j] + usize::from(ca != *cb);
            current.push(substitute.min(previous[j + 1] + 1).min(current[j] + 1));
        }
        previous = current;
    }
    previous[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_the_nearest_key_and_lists_them_when_none_is_close() {
        let unknown =
            unknown_key("unknown field `max_tokns`, expected one of `max_tokens`, `model`")
                .expect("recognised");
        assert_eq!(unknown.key, "max_tokns");
        assert_eq!(unknown.nearest(), Some("max_tokens"));
        let far = unknown_key("unknown field `colour`, expected `url` or `model`").expect("ok");
        assert_eq!(far.nearest(), None);
        assert_eq!(far.hint(), "valid keys here: `url`, `model`");
        assert_eq!(unknown_key("invalid type: string"), None);
        assert_eq!(
            with_hint(
                "spec.rules[0].match.tenant: unknown field `tenant`, expected one of `tenants`"
            ),
            "spec.rules[0].match.tenant: unknown field `tenant`; did you mean `tenants`?"
        );
        assert_eq!(with_hint("must be at least 1"), "must be at least 1");
    }

    #[test]
    fn edit_distance_counts_insertions_deletions_and_substitutions() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
    }
}
