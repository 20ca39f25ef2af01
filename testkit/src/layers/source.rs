//! Reading one source file for [`super`]: the code without comments and literals, test-only modules
//! cut out, and the paths it names (`crate::a::b`, `super::x`, `self::y`, with `use` groups spread
//! out).

/// `text` with comments removed and string and character literals emptied (`""`, `' '`), so that
/// nothing inside them reads as a path. Newlines are kept, so line numbers stay those of the file.
pub(crate) fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    // Newlines inside what is skipped, so that lines keep their numbers.
    let keep_lines = |out: &mut String, skipped: &[char]| {
        out.extend(skipped.iter().filter(|c| **c == '\n'));
    };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let word_start = i == 0 || !is_ident(chars[i - 1]);
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            // Block comments nest.
            let start = i;
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            keep_lines(&mut out, &chars[start..i]);
        } else if let Some(len) = word_start.then(|| raw_string_prefix(&chars[i..])).flatten() {
            // r"..", r#".."#, br"..", cr#".."#: no escapes, ends at a quote and as many #.
            let hashes = chars[i..i + len].iter().filter(|c| **c == '#').count();
            let start = i;
            i += len;
            while i < chars.len() {
                if chars[i] == '"'
                    && chars[i + 1..].iter().take_while(|c| **c == '#').count() >= hashes
                {
                    i += 1 + hashes;
                    break;
                }
                i += 1;
            }
            keep_lines(&mut out, &chars[start..i]);
            out.push_str("\"\"");
        } else if c == '"' || (word_start && matches!(c, 'b' | 'c') && next == Some('"')) {
            let start = i;
            i += if c == '"' { 1 } else { 2 };
            while i < chars.len() {
                match chars[i] {
                    '\\' => i += 2,
                    '"' => {
                        i += 1;
                        break;
                    }
                    _ => i += 1,
                }
            }
            keep_lines(&mut out, &chars[start..i.min(chars.len())]);
            out.push_str("\"\"");
        } else if c == '\'' {
            // A character literal ('a', '\n', '\u{1F600}', b'x' after its b), or a lifetime ('a).
            if next == Some('\\') {
                // Past the quote, the backslash and the escaped character (which may be a quote).
                i += 3;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
                out.push_str("' '");
            } else if chars.get(i + 2) == Some(&'\'') {
                i += 3;
                out.push_str("' '");
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// The length of a raw string's opening (`r#"`, `br"`, `cr##"`), when `s` starts with one.
fn raw_string_prefix(s: &[char]) -> Option<usize> {
    let after_letter = match s {
        ['r', ..] => 1,
        ['b' | 'c', 'r', ..] => 2,
        _ => return None,
    };
    let hashes = s[after_letter..].iter().take_while(|c| **c == '#').count();
    (s.get(after_letter + hashes) == Some(&'"')).then_some(after_letter + hashes + 1)
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `code` without the modules compiled only for tests (`#[cfg(test)] mod name { .. }`), and the
/// names of the child modules declared test-only in files of their own (`#[cfg(test)] mod name;`).
pub(crate) fn without_test_modules(code: &str) -> (String, Vec<String>) {
    let mut out = String::with_capacity(code.len());
    let mut test_children = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let Some((name, tail)) = declared_module(after) else {
            out.push_str("#[cfg(test)]");
            rest = after;
            continue;
        };
        if let Some(body) = tail.strip_prefix(';') {
            test_children.push(name);
            out.extend(
                after[..after.len() - tail.len()]
                    .chars()
                    .filter(|c| *c == '\n'),
            );
            rest = body;
        } else {
            // `{`: skip to its closing brace, keeping the lines.
            let mut depth = 0;
            let mut end = tail.len();
            for (i, c) in tail.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = i + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let skipped = &code[code.len() - after.len()..code.len() - tail.len() + end];
            out.extend(skipped.chars().filter(|c| *c == '\n'));
            rest = &tail[end..];
        }
    }
    out.push_str(rest);
    (out, test_children)
}

/// After an attribute: `[other attributes] [pub[(..)]] mod name` followed by `;` or `{`, as (name,
/// the text from that `;` or `{`).
fn declared_module(text: &str) -> Option<(String, &str)> {
    let mut s = text.trim_start();
    while s.starts_with("#[") {
        s = s[s.find(']')? + 1..].trim_start();
    }
    if let Some(after) = s.strip_prefix("pub") {
        s = after.trim_start();
        if s.starts_with('(') {
            s = s[s.find(')')? + 1..].trim_start();
        }
    }
    let after = s.strip_prefix("mod")?;
    if !after.starts_with(char::is_whitespace) {
        return None;
    }
    let after = after.trim_start();
    let name: String = after.chars().take_while(|c| is_ident(*c)).collect();
    let tail = after[name.len()..].trim_start();
    (!name.is_empty() && (tail.starts_with(';') || tail.starts_with('{')))
        .then(|| (name.clone(), tail))
}

/// One path a file names: its segments (the first is `crate`, `super`, `self` or, in a `use`, a
/// name), the name it is known by when imported (an `as` or the last segment), and its line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NamedPath {
    pub segments: Vec<String>,
    /// The name a `use` brings into scope (`None` for a glob and outside `use`).
    pub alias: Option<String>,
    /// A `use ...::*`.
    pub glob: bool,
    pub line: usize,
}

/// Every path of `code` that starts with `crate`, `$crate`, `super` or `self` (`use` groups spread
/// out into one path each).
pub(crate) fn rooted_paths(code: &str) -> Vec<NamedPath> {
    let mut found = Vec::new();
    for start in ["crate", "super", "self"] {
        for (i, _) in code.match_indices(start) {
            let before = code[..i].chars().next_back();
            let boundary = before.is_none_or(|c| !is_ident(c) && c != ':' || c == '$');
            let after = code[i + start.len()..].trim_start();
            // `super::super::x`: the inner `super` (after `::`) starts no path of its own.
            if !boundary || !after.starts_with("::") {
                continue;
            }
            let line = code[..i].matches('\n').count() + 1;
            let mut trees = Vec::new();
            parse_tree(&code[i..], Vec::new(), &mut trees);
            for mut path in trees {
                path.line = line;
                found.push(path);
            }
        }
    }
    found.sort_by_key(|p| p.line);
    found
}

/// The paths of every `use` declaration of `code`, including those that start with a plain name
/// (a child module, or another crate).
pub(crate) fn use_paths(code: &str) -> Vec<NamedPath> {
    let mut found = Vec::new();
    for (i, _) in code.match_indices("use") {
        let before = code[..i].chars().next_back();
        let after = &code[i + 3..];
        if before.is_some_and(is_ident) || !after.starts_with(char::is_whitespace) {
            continue;
        }
        let line = code[..i].matches('\n').count() + 1;
        let mut trees = Vec::new();
        parse_tree(
            after.trim_start().trim_start_matches("::"),
            Vec::new(),
            &mut trees,
        );
        for mut path in trees {
            path.line = line;
            found.push(path);
        }
    }
    found
}

/// Parses one use tree (or a plain path) at the start of `s`, below `prefix`, into `out`; how many
/// bytes it read.
fn parse_tree(s: &str, prefix: Vec<String>, out: &mut Vec<NamedPath>) -> usize {
    let skip_ws = |pos: usize| pos + (s[pos..].len() - s[pos..].trim_start().len());
    let mut segments = prefix;
    let mut pos = skip_ws(0);
    loop {
        let rest = &s[pos..];
        if rest.starts_with('{') {
            pos += 1;
            loop {
                pos = skip_ws(pos);
                let rest = &s[pos..];
                if rest.starts_with('}') {
                    return pos + 1;
                }
                if rest.starts_with(',') {
                    pos += 1;
                    continue;
                }
                let used = parse_tree(rest, segments.clone(), out);
                if used == 0 {
                    return pos;
                }
                pos += used;
            }
        }
        if rest.starts_with('*') {
            out.push(NamedPath {
                segments,
                alias: None,
                glob: true,
                line: 0,
            });
            return pos + 1;
        }
        let ident = ident_at(rest);
        if ident.is_empty() {
            return pos;
        }
        pos += ident.len();
        // `a::{self, b}`: `self` is `a` itself.
        if ident != "self" || segments.is_empty() {
            segments.push(ident.to_string());
        }
        let after = skip_ws(pos);
        if s[after..].starts_with("::") {
            pos = skip_ws(after + 2);
            continue;
        }
        let mut alias = segments.last().cloned();
        if s[after..].starts_with("as") && s[after + 2..].starts_with(char::is_whitespace) {
            let at = skip_ws(after + 2);
            let name = ident_at(&s[at..]);
            alias = Some(name.to_string());
            pos = at + name.len();
        }
        out.push(NamedPath {
            segments,
            alias,
            glob: false,
            line: 0,
        });
        return pos;
    }
}

/// The identifier at the start of `s`.
fn ident_at(s: &str) -> &str {
    &s[..s.find(|c: char| !is_ident(c)).unwrap_or(s.len())]
}

/// Whether `code` declares an item called `name` (`struct`, `enum`, `fn`, `trait`, `type`,
/// `const`, `static`, `mod`, `union`, `macro_rules!`).
pub(crate) fn declares(code: &str, name: &str) -> bool {
    const KEYWORDS: [&str; 10] = [
        "struct",
        "enum",
        "fn",
        "trait",
        "type",
        "const",
        "static",
        "mod",
        "union",
        "macro_rules!",
    ];
    KEYWORDS.iter().any(|k| {
        code.match_indices(k).any(|(i, _)| {
            let before = code[..i].chars().next_back();
            let after = code[i + k.len()..].trim_start();
            before.is_none_or(|c| !is_ident(c))
                && after.starts_with(name)
                && !after[name.len()..].starts_with(is_ident)
        })
    })
}

/// The identifiers of `code` that start a path (not after `::` or `.`), with their lines and
/// whether `::` follows: what a glob import (`use super::*`) may bring into scope.
pub(crate) fn bare_names(code: &str) -> Vec<(String, usize, bool)> {
    let mut names = Vec::new();
    let mut line = 1;
    let mut chars = code.char_indices().peekable();
    let mut previous = ' ';
    while let Some((i, c)) = chars.next() {
        if c == '\n' {
            line += 1;
        }
        if is_ident(c) && !is_ident(previous) {
            let end = code[i..]
                .find(|c: char| !is_ident(c))
                .map_or(code.len(), |n| i + n);
            let name = &code[i..end];
            let before = code[..i].trim_end();
            let after_path = before.ends_with("::") || before.ends_with('.');
            if !after_path && !name.starts_with(|c: char| c.is_ascii_digit()) {
                let path = code[end..].trim_start().starts_with("::");
                names.push((name.to_string(), line, path));
            }
            while chars.peek().is_some_and(|(j, _)| *j < end) {
                chars.next();
            }
            previous = 'a';
            continue;
        }
        previous = c;
    }
    names
}
