//! Import layers, checked from a crate's sources: within every module (the crate root and every
//! module inside it), no child module imports a sibling that, directly or not, imports it back.
//!
//! [`Layers::scan`] reads `src/**/*.rs` (the library, or `main.rs` for a binary-only crate; not
//! `bin/`, not test modules: `tests.rs`, `tests/`, `#[cfg(test)] mod ..`) and records an edge
//! `a -> b` between two children of a module whenever code under `a` names something under `b`:
//! through `crate::..`, `super::..` or `self::..` paths (in `use` or inline), through a name the
//! parent imports or re-exports from `b` (`super::Thing` where the parent says `pub use b::Thing`),
//! and through a parent's glob (`use super::*`). Comments, doc links and string literals do not
//! count. [`Layers::assert_no_circles`] fails on every set of children that import each other in a
//! circle (a [`Circle`]: the strongly connected children of one module), naming each import with
//! its file and line, unless the set is allowed by name.

mod source;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::path::{Path, PathBuf};

use source::{bare_names, code_only, declares, rooted_paths, use_paths, without_test_modules};

/// A module's path below the crate root (empty: the root).
type ModPath = Vec<String>;

/// Where an import was first seen: the file (relative to `src`), the line and the path written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evidence {
    /// The file, relative to the scanned `src`.
    pub file: PathBuf,
    /// 1-based line.
    pub line: usize,
    /// The path as written (`crate::tenancy::store::Usage`).
    pub path: String,
}

/// The imports between the children of one module: child -> (sibling it imports -> first seen).
pub type Graph = BTreeMap<String, BTreeMap<String, Evidence>>;

/// Children of one module that import each other in a circle (a strongly connected set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Circle {
    /// The module whose children they are: `crate`, `crate::tenancy`.
    pub module: String,
    /// The children, sorted.
    pub members: Vec<String>,
    /// One way round, from the first member back to it: each step with the import that makes it.
    pub steps: Vec<(String, String, Evidence)>,
}

impl fmt::Display for Circle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {{{}}}", self.module, self.members.join(", "))?;
        for (from, to, e) in &self.steps {
            write!(
                f,
                "\n    {from} -> {to}  ({}:{} `{}`)",
                e.file.display(),
                e.line,
                e.path
            )?;
        }
        Ok(())
    }
}

/// A circle that a test tolerates for now: the module (`crate::pipeline`) and its members, exactly.
pub type Allowed<'a> = (&'a str, &'a [&'a str]);

/// The modules of one crate and the imports between siblings, at every level.
#[derive(Debug, Clone)]
pub struct Layers {
    modules: BTreeSet<ModPath>,
    levels: BTreeMap<ModPath, Graph>,
}

/// One scanned file.
struct File {
    rel: PathBuf,
    module: ModPath,
    code: String,
}

impl Layers {
    /// Scans the crate whose sources are in `src`. Panics when `src` cannot be read.
    pub fn scan(src: &Path) -> Layers {
        let mut paths = Vec::new();
        rust_files(src, &mut paths);
        let has_lib = src.join("lib.rs").is_file();
        let mut files = Vec::new();
        let mut test_only = BTreeSet::new();
        for path in paths {
            let rel = path.strip_prefix(src).expect("under src").to_path_buf();
            let Some(module) = module_of(&rel, has_lib) else {
                continue;
            };
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let (code, test_children) = without_test_modules(&code_only(&text));
            for child in test_children {
                test_only.insert([module.clone(), vec![child]].concat());
            }
            files.push(File { rel, module, code });
        }
        files.retain(|f| {
            !f.module.iter().any(|s| s == "tests")
                && !test_only.iter().any(|t| f.module.starts_with(t))
        });
        let modules: BTreeSet<ModPath> = files.iter().map(|f| f.module.clone()).collect();
        let code: BTreeMap<&ModPath, &str> =
            files.iter().map(|f| (&f.module, f.code.as_str())).collect();

        // What each module's own file imports (and so re-exports to, or shares with, its children).
        let mut scope = Scope {
            modules: &modules,
            code: &code,
            imports: BTreeMap::new(),
            globs: BTreeMap::new(),
        };
        let mut imports: BTreeMap<ModPath, BTreeMap<String, ModPath>> = BTreeMap::new();
        let mut globs: BTreeMap<ModPath, Vec<ModPath>> = BTreeMap::new();
        for f in &files {
            for path in use_paths(&f.code) {
                let Some(target) = scope.resolve(&f.module, &path.segments, true) else {
                    continue;
                };
                if path.glob {
                    globs.entry(f.module.clone()).or_default().push(target);
                } else if let Some(alias) = path.alias {
                    imports
                        .entry(f.module.clone())
                        .or_default()
                        .insert(alias, target);
                }
            }
        }
        scope.imports = imports;
        scope.globs = globs;

        let mut layers = Layers {
            modules: modules.clone(),
            levels: BTreeMap::new(),
        };
        for f in &files {
            let mut parent_glob = false;
            for path in rooted_paths(&f.code) {
                if path.glob && path.segments == ["super"] {
                    parent_glob = true;
                }
                if let Some(target) = scope.resolve(&f.module, &path.segments, false) {
                    let written = path.segments.join("::");
                    layers.add(&f.module, &target, &f.rel, path.line, written);
                }
            }
            // `use super::*`: the parent's names, siblings included, are in scope unprefixed.
            let Some((_, parent)) = f.module.split_last().filter(|_| parent_glob) else {
                continue;
            };
            for (name, line, is_path) in bare_names(&f.code) {
                let sibling = [parent.to_vec(), vec![name.clone()]].concat();
                let target = if is_path && modules.contains(&sibling) {
                    Some(sibling)
                } else {
                    scope.imported(&parent.to_vec(), &name)
                };
                if let Some(target) = target {
                    layers.add(
                        &f.module,
                        &target,
                        &f.rel,
                        line,
                        format!("super::*: {name}"),
                    );
                }
            }
        }
        layers
    }

    /// Records that code in `from` (file `file`, `line`) names something in `to`.
    fn add(&mut self, from: &ModPath, to: &ModPath, file: &Path, line: usize, path: String) {
        let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
        if common >= from.len() || common >= to.len() {
            // Within one module, or to an ancestor or a descendant: no sibling is involved.
            return;
        }
        self.levels
            .entry(from[..common].to_vec())
            .or_default()
            .entry(from[common].clone())
            .or_default()
            .entry(to[common].clone())
            .or_insert(Evidence {
                file: file.to_path_buf(),
                line,
                path,
            });
    }

    /// How many modules the scan found (the root included).
    pub fn module_count(&self) -> usize {
        self.modules.len()
    }

    /// The imports between the children of `module` (`crate`, `crate::tenancy`): child -> siblings.
    pub fn graph(&self, module: &str) -> BTreeMap<String, BTreeSet<String>> {
        self.levels
            .get(&parse_module(module))
            .map(|g| {
                g.iter()
                    .map(|(k, v)| (k.clone(), v.keys().cloned().collect()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every circle, module by module (each the strongly connected children of one module).
    pub fn circles(&self) -> Vec<Circle> {
        let mut found = Vec::new();
        for (module, graph) in &self.levels {
            let reach: BTreeMap<&String, BTreeSet<&String>> =
                graph.keys().map(|n| (n, reachable(graph, n))).collect();
            let mut seen = BTreeSet::new();
            for node in graph.keys() {
                if seen.contains(node) {
                    continue;
                }
                let members: BTreeSet<&String> = reach[node]
                    .iter()
                    .copied()
                    .filter(|m| reach.get(m).is_some_and(|r| r.contains(node)))
                    .chain([node])
                    .collect();
                seen.extend(members.iter().copied());
                if members.len() < 2 {
                    continue;
                }
                found.push(Circle {
                    module: module_name(module),
                    members: members.iter().map(|m| m.to_string()).collect(),
                    steps: way_round(graph, node, &members),
                });
            }
        }
        found
    }

    /// Panics naming every circle that `allowed` does not name exactly (module and members), and
    /// every entry of `allowed` that names no circle any more (remove it: it was fixed). Prints the
    /// allowed circles it found.
    #[track_caller]
    pub fn assert_no_circles(&self, allowed: &[Allowed<'_>]) {
        let circles = self.circles();
        let is_allowed = |c: &Circle| {
            allowed
                .iter()
                .any(|(m, members)| *m == c.module && sorted(members) == c.members)
        };
        let (tolerated, unexpected): (Vec<&Circle>, Vec<&Circle>) =
            circles.iter().partition(|c| is_allowed(c));
        let stale: Vec<String> = allowed
            .iter()
            .filter(|(m, members)| {
                !circles
                    .iter()
                    .any(|c| c.module == *m && c.members == sorted(members))
            })
            .map(|(m, members)| format!("{m}: {{{}}}", sorted(members).join(", ")))
            .collect();
        for c in &tolerated {
            eprintln!("allowed for now: {c}");
        }
        let mut problems = Vec::new();
        if !unexpected.is_empty() {
            problems.push(format!(
                "{} import circle(s) (children of one module that import each other):\n{}",
                unexpected.len(),
                unexpected
                    .iter()
                    .map(|c| format!("  {c}"))
                    .collect::<Vec<_>>()
                    .join("\n")
            ));
        }
        if !stale.is_empty() {
            problems.push(format!(
                "allowed circle(s) no longer found; remove the entries:\n  {}",
                stale.join("\n  ")
            ));
        }
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }
}

/// What paths resolve against: the modules, their files' code, and what each module's file imports.
struct Scope<'a> {
    modules: &'a BTreeSet<ModPath>,
    code: &'a BTreeMap<&'a ModPath, &'a str>,
    /// module -> (name it imports -> the module the name comes from).
    imports: BTreeMap<ModPath, BTreeMap<String, ModPath>>,
    /// module -> the modules it glob-imports (`pub use child::*`).
    globs: BTreeMap<ModPath, Vec<ModPath>>,
}

impl Scope<'_> {
    /// The module that `segments`, written in `from`, names (its deepest module; an item's path
    /// stops at the module holding it). `bare`: a `use` whose first segment may be a child module.
    fn resolve(&self, from: &ModPath, segments: &[String], bare: bool) -> Option<ModPath> {
        let first = segments.first()?;
        let (mut base, mut i) = match first.as_str() {
            "crate" => (Vec::new(), 1),
            "self" => (from.clone(), 1),
            "super" => {
                let mut base = from.clone();
                let mut i = 0;
                while segments.get(i).is_some_and(|s| s == "super") {
                    base.pop()?;
                    i += 1;
                }
                (base, i)
            }
            _ if bare => (from.clone(), 0),
            _ => return None,
        };
        if i == 0
            && !self
                .modules
                .contains(&[from.clone(), vec![first.clone()]].concat())
        {
            // A plain name that is not a child: another crate.
            return None;
        }
        while let Some(segment) = segments.get(i) {
            let child = [base.clone(), vec![segment.clone()]].concat();
            if self.modules.contains(&child) {
                base = child;
            } else if let Some(target) = self.imported(&base, segment) {
                base = target;
            } else {
                break;
            }
            i += 1;
        }
        Some(base)
    }

    /// The module that `name`, as imported by `module`'s file, comes from (following re-exports
    /// of re-exports a few steps).
    fn imported(&self, module: &ModPath, name: &str) -> Option<ModPath> {
        let mut at = self.imports.get(module).and_then(|m| m.get(name)).cloned();
        if at.is_none() {
            at = self.globs.get(module).and_then(|targets| {
                targets
                    .iter()
                    .find(|t| self.code.get(t).is_some_and(|c| declares(c, name)))
                    .cloned()
            });
        }
        let mut target = at?;
        for _ in 0..8 {
            match self.imports.get(&target).and_then(|m| m.get(name)) {
                Some(next) if *next != target => target = next.clone(),
                _ => break,
            }
        }
        Some(target)
    }
}

fn sorted(members: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = members.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}

/// `crate`, or `crate::a::b`.
fn module_name(path: &ModPath) -> String {
    std::iter::once("crate")
        .chain(path.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("::")
}

fn parse_module(name: &str) -> ModPath {
    name.split("::")
        .filter(|s| *s != "crate")
        .map(String::from)
        .collect()
}

/// The nodes reachable from `start` in one or more steps.
fn reachable<'a>(graph: &'a Graph, start: &'a String) -> BTreeSet<&'a String> {
    let mut seen = BTreeSet::new();
    let mut stack: Vec<&String> = graph
        .get(start)
        .into_iter()
        .flat_map(|e| e.keys())
        .collect();
    while let Some(n) = stack.pop() {
        if seen.insert(n) {
            stack.extend(graph.get(n).into_iter().flat_map(|e| e.keys()));
        }
    }
    seen
}

/// The shortest way from `start` back to it through `members`, step by step.
fn way_round(
    graph: &Graph,
    start: &String,
    members: &BTreeSet<&String>,
) -> Vec<(String, String, Evidence)> {
    let mut came_from: BTreeMap<&String, &String> = BTreeMap::new();
    let mut queue = VecDeque::from([start]);
    while let Some(n) = queue.pop_front() {
        for next in graph.get(n).into_iter().flat_map(|e| e.keys()) {
            if !members.contains(next) || came_from.contains_key(next) {
                continue;
            }
            came_from.insert(next, n);
            if next == start {
                queue.clear();
                break;
            }
            queue.push_back(next);
        }
    }
    let mut steps = Vec::new();
    let mut at = start;
    while let Some(prev) = came_from.get(at).copied() {
        steps.push((prev.clone(), at.clone(), graph[prev][at].clone()));
        at = prev;
        if at == start {
            break;
        }
    }
    steps.reverse();
    steps
}

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
    out.sort();
}

/// The module a file under `src` holds: `a/b.rs` and `a/b/mod.rs` are `a::b`; `lib.rs` (or
/// `main.rs` without one) the root. `None`: another crate (`bin/`, `main.rs` beside `lib.rs`).
fn module_of(rel: &Path, has_lib: bool) -> Option<ModPath> {
    let parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let (file, dirs) = parts.split_last()?;
    match (dirs, file.as_str()) {
        ([], "lib.rs") => return Some(Vec::new()),
        ([], "main.rs") => return (!has_lib).then(Vec::new),
        ([first, ..], _) if first == "bin" => return None,
        _ => {}
    }
    let mut module = dirs.to_vec();
    if file != "mod.rs" {
        module.push(file.trim_end_matches(".rs").to_string());
    }
    Some(module)
}
