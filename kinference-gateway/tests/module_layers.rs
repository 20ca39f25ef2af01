//! The gateway's top-level modules form layers: no module imports one that (directly or not)
//! imports it back. Reads `src/**/*.rs`, builds the graph of `crate::<top>` references between
//! top-level modules (code only: comments, doc links and `tests.rs` modules do not count), and
//! fails with the cycle when there is one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The source without comments (line comments, doc comments, block comments); string literals are
/// kept (a `crate::` inside one is rare and would only make the check stricter).
fn code_only(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("//") {
            rest = after.find('\n').map_or("", |i| &after[i..]);
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |i| &after[i + 2..]);
        } else {
            let mut chars = rest.chars();
            if let Some(c) = chars.next() {
                out.push(c);
            }
            rest = chars.as_str();
        }
    }
    out
}

/// The top-level modules `code` names as `crate::<name>` or inside `crate::{a, b::c}`.
fn references(code: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut found = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        let after = &code[i + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            // Top-level names in the group: after `{` and after each `,` at brace depth 0.
            let mut depth = 0;
            let mut start = true;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if c.is_whitespace() => {}
                    _ if start => {
                        start = false;
                        let name = ident(&group[j..]);
                        if !name.is_empty() {
                            found.insert(name);
                        }
                    }
                    _ => {}
                }
            }
        } else {
            let name = ident(after);
            if !name.is_empty() {
                found.insert(name);
            }
        }
    }
    found
}

/// Edges between the top-level modules of `src` (`lib.rs`, `main.rs`, `bin/` and tests excluded).
fn graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph = Graph::new();
    for file in files {
        let rel = file.strip_prefix(src).expect("under src");
        let parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let Some(first) = parts.first() else { continue };
        let is_test = parts.last().is_some_and(|f| f == "tests.rs")
            || parts[..parts.len() - 1].iter().any(|p| p == "tests");
        if matches!(first.as_str(), "lib.rs" | "main.rs" | "bin") || is_test {
            continue;
        }
        let top = first.trim_end_matches(".rs").to_string();
        let text = std::fs::read_to_string(&file).expect("read source");
        let edges = graph.entry(top.clone()).or_default();
        for name in references(&code_only(&text)) {
            if name != top && name != "self" {
                edges.insert(name);
            }
        }
    }
    graph
}

/// One cycle of `graph`, if any (depth-first search, the path back to the first repeated node).
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        node: &str,
        graph: &Graph,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(node) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let from = path.iter().position(|n| n == node).unwrap_or(0);
                let mut cycle = path[from..].to_vec();
                cycle.push(node.to_string());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(node.to_string(), Mark::Open);
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, marks, path) {
                return Some(cycle);
            }
        }
        path.pop();
        marks.insert(node.to_string(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for node in graph.keys() {
        if let Some(cycle) = visit(node, graph, &mut marks, &mut Vec::new()) {
            return Some(cycle);
        }
    }
    None
}

#[test]
fn top_level_modules_import_each_other_in_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = graph(&src);
    assert!(
        graph.len() >= 10,
        "the scan found too few modules to mean anything: {graph:?}"
    );
    // The edges this layering rests on are really seen (the scan is not blind).
    assert!(graph["pipeline"].contains("backend"), "{graph:?}");
    assert!(graph["errors"].contains("body"), "{graph:?}");
    if let Some(cycle) = find_cycle(&graph) {
        let edges: Vec<String> = graph
            .iter()
            .map(|(k, v)| {
                format!(
                    "  {k} -> {}",
                    v.iter().cloned().collect::<Vec<_>>().join(", ")
                )
            })
            .collect();
        panic!(
            "import cycle between the gateway's top-level modules: {}\nedges:\n{}",
            cycle.join(" -> "),
            edges.join("\n")
        );
    }
}

#[test]
fn the_check_sees_a_cycle_and_ignores_comments() {
    let code = code_only(
        "use crate::{body::{Body, full}, errors};\n// use crate::pipeline;\n/// [`crate::server`]\nfn f() { crate::gateway::x(); }\n",
    );
    assert_eq!(
        references(&code),
        ["body", "errors", "gateway"].map(String::from).into()
    );
    let mut g = Graph::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    assert_eq!(find_cycle(&g), None);
    g.entry("c".into()).or_default().insert("a".into());
    assert_eq!(
        find_cycle(&g),
        Some(["a", "b", "c", "a"].map(String::from).to_vec())
    );
}
