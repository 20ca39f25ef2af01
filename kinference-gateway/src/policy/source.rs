//! Local mode: the policy set from a directory of CRD-shaped YAML, reloaded on change.
//!
//! Every `*.yaml`/`*.yml` file under the directory (recursively) may hold several documents.
//! Documents of other API groups are ignored (a directory may also hold Secrets). Each object is
//! checked on its own: YAML syntax, the CRD's schema ([`kinference_crds::schema`]), the typed
//! spec, then the cross-checks of [`PolicySet::build`]. An object that fails is not applied; its
//! previous version keeps serving and the log says why. The gateway watches the directory through
//! its one local configuration source (`config_source::files`, started once at start-up and shared
//! by the policy stage and tenancy), which swaps the set atomically; requests in flight keep the
//! `Arc` of the set they started with, so a reload never loses a request.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kinference_crds::{
    InferenceModel, InferencePolicy, InferencePool, InferenceProvider, InferenceTenant,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use super::model::{BuildOutcome, Manifest, ObjectKey, Origin, PolicySet, Spec};

#[cfg(test)]
mod tests;

/// Reading the directory failed (not a problem with an object: those are [`SourceProblem`]s).
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("cannot read policy directory {path}: {source}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A problem with one document, with its place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SourceProblem {
    pub file: PathBuf,
    /// 1-based line.
    pub line: usize,
    /// The object, when the document got far enough to name it.
    pub object: Option<ObjectKey>,
    /// `yaml`, `schema`, `kind` or `spec`.
    pub check: &'static str,
    pub message: String,
}

impl std::fmt::Display for SourceProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: ", self.file.display(), self.line)?;
        if let Some(o) = &self.object {
            write!(f, "{o}: ")?;
        }
        f.write_str(&self.message)
    }
}

/// The parsed documents of one file.
#[derive(Debug, Default)]
pub struct ParsedFile {
    pub manifests: Vec<Manifest>,
    pub problems: Vec<SourceProblem>,
    /// Objects named by documents that failed to parse, with the reason.
    pub invalid: BTreeMap<ObjectKey, String>,
    /// Some document could not be read far enough to know which object it is.
    pub unreadable: bool,
}

/// A loaded directory: the built set and everything that went wrong.
#[derive(Debug, Default)]
pub struct Loaded {
    pub outcome: BuildOutcome,
    pub problems: Vec<SourceProblem>,
    pub files: Vec<PathBuf>,
}

/// Loads `dir`, keeping objects of `previous` whose new versions are invalid.
pub fn load_dir(dir: &Path, previous: Option<&PolicySet>) -> Result<Loaded, SourceError> {
    let files = yaml_files(dir)?;
    let mut manifests = Vec::new();
    let mut problems = Vec::new();
    let mut kept = BTreeMap::new();
    let mut unreadable_files = BTreeSet::new();
    for file in &files {
        let parsed = match std::fs::read_to_string(file) {
            Ok(text) => parse_file(file, &text),
            Err(e) => ParsedFile {
                problems: vec![SourceProblem {
                    file: file.clone(),
                    line: 1,
                    object: None,
                    check: "yaml",
                    message: format!("cannot read: {e}"),
                }],
                unreadable: true,
                ..ParsedFile::default()
            },
        };
        manifests.extend(parsed.manifests);
        problems.extend(parsed.problems);
        kept.extend(parsed.invalid);
        if parsed.unreadable {
            unreadable_files.insert(file.clone());
        }
    }
    // A document we could not identify may be a broken version of any object that file held.
    if let Some(prev) = previous {
        let present: BTreeSet<ObjectKey> = manifests.iter().map(Manifest::key).collect();
        for key in objects_from(prev, &unreadable_files) {
            if !present.contains(&key) {
                kept.entry(key)
                    .or_insert_with(|| "its file has errors; the previous version stays".into());
            }
        }
    }
    let outcome = PolicySet::build(&manifests, previous, &kept);
    Ok(Loaded {
        outcome,
        problems,
        files,
    })
}

fn objects_from(set: &PolicySet, files: &BTreeSet<PathBuf>) -> Vec<ObjectKey> {
    let mut keys = Vec::new();
    let mut add = |kind: &'static str, name: &str, origin: &Origin| {
        if files.contains(&origin.file) {
            keys.push(ObjectKey {
                kind,
                name: name.to_string(),
            });
        }
    };
    set.models
        .values()
        .for_each(|n| add("InferenceModel", &n.name, &n.origin));
    set.pools
        .values()
        .for_each(|n| add("InferencePool", &n.name, &n.origin));
    set.providers
        .values()
        .for_each(|n| add("InferenceProvider", &n.name, &n.origin));
    set.tenants
        .values()
        .for_each(|n| add("InferenceTenant", &n.name, &n.origin));
    set.policies
        .iter()
        .for_each(|n| add("InferencePolicy", &n.name, &n.origin));
    keys
}

fn yaml_files(dir: &Path) -> Result<Vec<PathBuf>, SourceError> {
    // A single file named directly (e.g. `tenancy.tenants_dir: tenants.yaml`) is read as is.
    if dir.is_file() {
        return Ok(vec![dir.to_path_buf()]);
    }
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|source| SourceError::Dir {
            path: d.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            if name.to_string_lossy().starts_with('.') {
                continue;
            }
            if path.is_dir() {
                stack.push(path);
            } else if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml")
            ) {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// One YAML document of a file: its text and the 1-based line it starts on.
struct Document {
    text: String,
    first_line: usize,
    /// Line of the first non-blank, non-comment line (what messages point at).
    content_line: usize,
}

fn split_documents(text: &str) -> Vec<Document> {
    let mut docs = Vec::new();
    let mut current = String::new();
    let mut first_line = 1;
    let mut content_line = 0;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line == "---" || line.starts_with("--- ") {
            docs.push(Document {
                text: std::mem::take(&mut current),
                first_line,
                content_line,
            });
            first_line = n + 1;
            content_line = 0;
            continue;
        }
        if content_line == 0 && !line.trim().is_empty() && !line.trim_start().starts_with('#') {
            content_line = n;
        }
        current.push_str(line);
        current.push('\n');
    }
    docs.push(Document {
        text: current,
        first_line,
        content_line,
    });
    docs.retain(|d| d.content_line > 0);
    docs
}

/// Parses every document of a file.
pub fn parse_file(file: &Path, text: &str) -> ParsedFile {
    let mut out = ParsedFile::default();
    for doc in split_documents(text) {
        parse_document(file, &doc, &mut out);
    }
    out
}

fn yaml_line(e: &serde_yaml::Error, doc: &Document) -> usize {
    e.location().map_or(doc.content_line, |l| {
        doc.first_line + l.line().saturating_sub(1)
    })
}

fn parse_document(file: &Path, doc: &Document, out: &mut ParsedFile) {
    let problem = |line: usize, object: Option<ObjectKey>, check: &'static str, message: String| {
        SourceProblem {
            file: file.to_path_buf(),
            line,
            object,
            check,
            message,
        }
    };
    let value: serde_json::Value = match serde_yaml::from_str::<serde_json::Value>(&doc.text) {
        Ok(v) => v,
        Err(e) => {
            out.problems.push(problem(
                yaml_line(&e, doc),
                None,
                "yaml",
                format!("invalid YAML: {e}"),
            ));
            out.unreadable = true;
            return;
        }
    };
    let api_version = value
        .get("apiVersion")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    if !api_version.starts_with(kinference_crds::GROUP) {
        if api_version.is_empty() {
            out.problems.push(problem(
                doc.content_line,
                None,
                "kind",
                "document has no apiVersion".into(),
            ));
            out.unreadable = true;
        }
        return; // another API group: not ours to read
    }
    let kind_str = value
        .get("kind")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    let Some(kind) = kinference_crds::KINDS
        .iter()
        .copied()
        .find(|k| *k == kind_str)
    else {
        out.problems.push(problem(
            doc.content_line,
            None,
            "kind",
            format!(
                "unknown kind {kind_str:?}; expected one of {:?}",
                kinference_crds::KINDS
            ),
        ));
        out.unreadable = true;
        return;
    };
    let name = value
        .pointer("/metadata/name")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_string();
    let key = (!name.is_empty()).then(|| ObjectKey {
        kind,
        name: name.clone(),
    });
    if api_version != kinference_crds::API_VERSION {
        out.problems.push(problem(
            doc.content_line,
            key.clone(),
            "kind",
            format!(
                "apiVersion {api_version:?} is not {:?}",
                kinference_crds::API_VERSION
            ),
        ));
        mark_invalid(out, key, "unsupported apiVersion");
        return;
    }
    let schema_errors = kinference_crds::schema::validate(kind, &value);
    if !schema_errors.is_empty() {
        for e in &schema_errors {
            out.problems.push(problem(
                line_of_path(doc, &e.path),
                key.clone(),
                "schema",
                crate::yaml::with_hint(&e.to_string()),
            ));
        }
        let reason = schema_errors
            .iter()
            .map(|e| crate::yaml::with_hint(&e.to_string()))
            .collect::<Vec<_>>()
            .join("; ");
        mark_invalid(out, key, &reason);
        return;
    }
    let generation = value
        .pointer("/metadata/generation")
        .and_then(|v| v.as_i64());
    let spec = match kind {
        "InferenceModel" => typed::<InferenceModel>(doc).map(|r| Spec::Model(r.spec)),
        "InferencePool" => typed::<InferencePool>(doc).map(|r| Spec::Pool(r.spec)),
        "InferenceProvider" => typed::<InferenceProvider>(doc).map(|r| Spec::Provider(r.spec)),
        "InferenceTenant" => typed::<InferenceTenant>(doc).map(|r| Spec::Tenant(r.spec)),
        _ => typed::<InferencePolicy>(doc).map(|r| Spec::Policy(r.spec)),
    };
    match spec {
        Ok(spec) => {
            let rule_lines = match &spec {
                Spec::Policy(p) => rule_lines(doc, p.rules.iter().map(|r| r.name.as_str())),
                _ => Vec::new(),
            };
            out.manifests.push(Manifest {
                name,
                generation,
                spec,
                origin: Origin {
                    file: file.to_path_buf(),
                    line: doc.content_line,
                    rule_lines,
                },
            });
        }
        Err((line, message)) => {
            out.problems
                .push(problem(line, key.clone(), "spec", message.clone()));
            mark_invalid(out, key, &message);
        }
    }
}

fn mark_invalid(out: &mut ParsedFile, key: Option<ObjectKey>, reason: &str) {
    match key {
        Some(k) => {
            out.invalid.insert(k, reason.to_string());
        }
        None => out.unreadable = true,
    }
}

fn typed<T: DeserializeOwned>(doc: &Document) -> Result<T, (usize, String)> {
    serde_yaml::from_str::<T>(&doc.text)
        .map_err(|e| (yaml_line(&e, doc), crate::yaml::with_hint(&e.to_string())))
}

/// The line of each rule's `name:` inside `rules:`, in order (0 when not found).
fn rule_lines<'n>(doc: &Document, names: impl Iterator<Item = &'n str>) -> Vec<usize> {
    let lines: Vec<&str> = doc.text.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.trim_start().starts_with("rules:"))
        .unwrap_or(0);
    let mut cursor = start;
    let mut out = Vec::new();
    for name in names {
        let found = lines.iter().enumerate().skip(cursor).find(|(_, l)| {
            let t = l.trim_start().trim_start_matches("- ").trim_start();
            t.strip_prefix("name:")
                .map(|v| v.trim().trim_matches(|c| c == '"' || c == '\''))
                .is_some_and(|v| v == name)
        });
        match found {
            Some((i, _)) => {
                out.push(doc.first_line + i);
                cursor = i + 1;
            }
            None => out.push(0),
        }
    }
    out
}

/// Best-effort line of a schema path like `spec.rules[2].action.reject.status`: the last key,
/// searched from the line of the rule it is in (or the document start).
fn line_of_path(doc: &Document, path: &str) -> usize {
    let lines: Vec<&str> = doc.text.lines().collect();
    let mut from = 0;
    if let Some(rest) = path.split("rules[").nth(1)
        && let Some(idx) = rest.split(']').next().and_then(|i| i.parse::<usize>().ok())
    {
        let start = lines
            .iter()
            .position(|l| l.trim_start().starts_with("rules:"))
            .unwrap_or(0);
        let mut seen = 0;
        for (i, l) in lines.iter().enumerate().skip(start + 1) {
            if l.trim_start().starts_with("- ")
                && l.len() - l.trim_start().len() <= indent_of_first_item(&lines, start)
            {
                if seen == idx {
                    from = i;
                    break;
                }
                seen += 1;
            }
        }
    }
    let last = path.rsplit('.').next().unwrap_or(path);
    let key = last.split('[').next().unwrap_or(last);
    lines
        .iter()
        .enumerate()
        .skip(from)
        .find(|(_, l)| {
            l.trim_start()
                .trim_start_matches("- ")
                .starts_with(&format!("{key}:"))
        })
        .map_or(
            if from > 0 {
                doc.first_line + from
            } else {
                doc.content_line
            },
            |(i, _)| doc.first_line + i,
        )
}

fn indent_of_first_item(lines: &[&str], start: usize) -> usize {
    lines
        .iter()
        .skip(start + 1)
        .find(|l| l.trim_start().starts_with("- "))
        .map_or(usize::MAX, |l| l.len() - l.trim_start().len())
}

/// The current policy set of a configuration source ([`crate::config_source::ConfigSource`]: the
/// policy directory's, or the cluster's), and every new one.
pub struct PolicyWatcher {
    rx: watch::Receiver<Arc<PolicySet>>,
}

impl PolicyWatcher {
    /// A watcher over the sets a source publishes.
    pub fn from_receiver(rx: watch::Receiver<Arc<PolicySet>>) -> Self {
        PolicyWatcher { rx }
    }

    /// The set to evaluate a request against (hold the `Arc` for the request's lifetime).
    pub fn current(&self) -> Arc<PolicySet> {
        self.rx.borrow().clone()
    }

    /// A receiver that sees every new set.
    pub fn subscribe(&self) -> watch::Receiver<Arc<PolicySet>> {
        self.rx.clone()
    }
}
