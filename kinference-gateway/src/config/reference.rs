//! The configuration reference (`docs/configuration.md`), generated from the config structs' own
//! source: every key of `gateway.yaml` with its type, default and the first line of its doc comment.
//!
//! The test fails when the committed file differs from what the code says;
//! `KINFERENCE_BLESS=1 cargo test -p kinference-gateway --lib config::reference` rewrites it.

/// The structs of `gateway.yaml`, with the source they are defined in (read at compile time).
const SOURCES: &[(&str, &str)] = &[
    ("GatewayConfig", include_str!("../config.rs")),
    ("ModelConfig", include_str!("../routing/config.rs")),
    ("WorkerConfig", include_str!("../routing/config.rs")),
    ("KubernetesConfig", include_str!("../discovery/mod.rs")),
    ("DisaggregationConfig", include_str!("../config.rs")),
    ("ReplicasConfig", include_str!("../routing/replicas.rs")),
    ("SessionsConfig", include_str!("../routing/sessions.rs")),
    ("TenancyConfig", include_str!("../tenancy/mod.rs")),
    ("JournalConfig", include_str!("../tenancy/store/journal.rs")),
    ("TenantSettings", include_str!("../tenancy/limits.rs")),
    ("ModelLimits", include_str!("../tenancy/limits.rs")),
    ("KubeSourceConfig", include_str!("../config_source/kube.rs")),
    (
        "WorkerApiKey",
        include_str!("../backend/worker/credentials.rs"),
    ),
    (
        "ClassifierConfig",
        include_str!("../policy/classify/mod.rs"),
    ),
    (
        "ExternalConfig",
        include_str!("../policy/classify/external.rs"),
    ),
];

/// One field of a config struct as written in its source.
struct Field {
    name: String,
    ty: String,
    doc: String,
    default: Option<String>,
}

/// The fields of `pub struct name { ... }` in `source`, with their doc comments and serde defaults.
fn fields(name: &str, source: &str) -> Vec<Field> {
    let start = format!("pub struct {name} {{");
    let Some(body) = source.split(&start).nth(1) else {
        return Vec::new();
    };
    let struct_default = source
        .split(&start)
        .next()
        .and_then(|before| before.lines().rev().find(|l| l.contains("#[serde(")))
        .is_some_and(|l| l.contains("default"));
    let mut out = Vec::new();
    let (mut doc, mut attrs) = (Vec::new(), Vec::new());
    for line in body.lines() {
        let line = line.trim();
        if line == "}" {
            break;
        }
        if let Some(d) = line.strip_prefix("///") {
            doc.push(d.trim().to_string());
        } else if line.starts_with("#[") {
            attrs.push(line.to_string());
        } else if let Some((field, ty)) = line
            .strip_prefix("pub ")
            .and_then(|l| l.trim_end_matches(',').split_once(": "))
        {
            let default = attrs
                .iter()
                .find_map(|a| default_of(a, ty, source))
                .or_else(|| struct_default.then(|| impl_default(name, field, source)));
            out.push(Field {
                name: field.to_string(),
                ty: ty.to_string(),
                doc: first_sentence(&doc),
                default,
            });
            doc.clear();
            attrs.clear();
        }
    }
    out
}

/// The default a `#[serde(default ...)]` attribute gives: the body of a `default = "f"` function,
/// or the type's own default.
fn default_of(attr: &str, ty: &str, source: &str) -> Option<String> {
    if !attr.starts_with("#[serde(") || !attr.contains("default") {
        return None;
    }
    if let Some(function) = attr
        .split("default = \"")
        .nth(1)
        .and_then(|r| r.split('"').next())
    {
        let body = source
            .split(&format!("fn {function}() -> "))
            .nth(1)
            .and_then(|r| r.split('{').nth(1))
            .and_then(|r| r.split('}').next())
            .map(|b| b.trim().to_string());
        return Some(format!(
            "`{}`",
            body.unwrap_or_else(|| function.to_string())
        ));
    }
    Some(type_default(ty))
}

/// What `Default::default()` of a field's type is, as the YAML would say it.
fn type_default(ty: &str) -> String {
    let simple = ty.rsplit("::").next().unwrap_or(ty);
    if ty.starts_with("Option<") {
        "none".to_string()
    } else if ty.starts_with("Vec<") {
        "`[]`".to_string()
    } else if ty.starts_with("BTreeMap<") {
        "`{}`".to_string()
    } else if ty == "bool" {
        "`false`".to_string()
    } else if let Some(variant) = enum_default(simple) {
        format!("`{variant}`")
    } else {
        "each key's default".to_string()
    }
}

/// The serde name of the `#[default]` variant of `pub enum name`, if it is in [`SOURCES`].
fn enum_default(name: &str) -> Option<String> {
    let start = format!("pub enum {name} {{");
    let source = SOURCES
        .iter()
        .map(|(_, s)| *s)
        .find(|s| s.contains(&start))?;
    let mut parts = source.split(&start);
    let rename = parts
        .next()?
        .lines()
        .rev()
        .find(|l| l.contains("rename_all"))
        .and_then(|l| l.split('"').nth(1))
        .unwrap_or("");
    let body = parts.next()?;
    let variant = body
        .split("#[default]")
        .nth(1)?
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())?
        .trim_end_matches(',');
    let words: Vec<String> = variant.chars().fold(Vec::<String>::new(), |mut words, c| {
        if c.is_uppercase() || words.is_empty() {
            words.push(String::new());
        }
        if let Some(last) = words.last_mut() {
            last.push(c.to_ascii_lowercase());
        }
        words
    });
    Some(match rename {
        "kebab-case" => words.join("-"),
        "snake_case" => words.join("_"),
        _ => words.concat(),
    })
}

/// A field's value in `impl Default for name` (for structs with `#[serde(default)]` on the struct).
fn impl_default(name: &str, field: &str, source: &str) -> String {
    source
        .split(&format!("impl Default for {name} {{"))
        .nth(1)
        .and_then(|body| {
            body.lines()
                .map(str::trim)
                .find_map(|l| l.strip_prefix(&format!("{field}: ")))
        })
        .map(|v| format!("`{}`", v.trim_end_matches(',')))
        .unwrap_or_else(|| "see the struct's default".to_string())
}

/// The doc comment up to its first full stop, on one line, intra-doc links as plain code.
fn first_sentence(doc: &[String]) -> String {
    let joined = doc.join(" ").replace("[`", "`").replace("`]", "`");
    // Past a leading "..." (a sentence continued from the field above).
    let from = if joined.starts_with("...") { 3 } else { 0 };
    match joined[from..].find(". ") {
        Some(i) => joined[..=from + i].to_string(),
        None => joined,
    }
}

/// A type without its module path (`crate::tenancy::TenancyConfig` reads `TenancyConfig`).
fn short_type(ty: &str) -> String {
    let mut out = String::new();
    let mut word = String::new();
    for c in ty.chars() {
        if c.is_alphanumeric() || c == '_' || c == ':' {
            word.push(c);
        } else {
            out.push_str(word.rsplit("::").next().unwrap_or(&word));
            word.clear();
            out.push(c);
        }
    }
    out.push_str(word.rsplit("::").next().unwrap_or(&word));
    out
}

/// The struct a field's type holds (through `Option`, `Vec` and `BTreeMap<String, _>`), if it is
/// one of [`SOURCES`], with the key suffix that reaches inside it.
fn nested(ty: &str) -> Option<(&'static str, &'static str)> {
    let (inner, suffix) = if let Some(i) = ty.strip_prefix("Vec<") {
        (i, "[]")
    } else if let Some(i) = ty.strip_prefix("BTreeMap<String, ") {
        (i, ".<name>")
    } else {
        (ty.strip_prefix("Option<").unwrap_or(ty), "")
    };
    let inner = inner.trim_end_matches('>');
    let last = inner.rsplit("::").next().unwrap_or(inner);
    SOURCES
        .iter()
        .find(|(name, _)| *name == last)
        .map(|(name, _)| (*name, suffix))
}

fn render_struct(name: &str, prefix: &str, out: &mut String) {
    let Some((_, source)) = SOURCES.iter().find(|(n, _)| *n == name) else {
        return;
    };
    for field in fields(name, source) {
        let key = format!("{prefix}{}", field.name);
        let default = field.default.as_deref().unwrap_or("required");
        let cell = |s: &str| s.replace('|', "\\|");
        out.push_str(&format!(
            "| `{key}` | `{}` | {} | {} |\n",
            cell(&short_type(&field.ty)),
            cell(default),
            cell(&field.doc)
        ));
        if let Some((inner, suffix)) = nested(&field.ty) {
            render_struct(inner, &format!("{key}{suffix}."), out);
        }
    }
}

/// The whole reference as Markdown.
pub fn render() -> String {
    let mut out = String::from(
        "# gateway.yaml reference\n\n\
         Generated from the configuration structs of `kinference-gateway` (their doc comments and\n\
         serde defaults) by `KINFERENCE_BLESS=1 cargo test -p kinference-gateway --lib config::reference`;\n\
         a test fails when this file is stale. Unknown keys are errors. Command-line flags: `kinference-gateway --help`.\n\n\
         | Key | Type | Default | Meaning |\n|---|---|---|---|\n",
    );
    render_struct("GatewayConfig", "", &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md");

    #[test]
    fn the_committed_reference_matches_the_code() {
        let generated = render();
        if std::env::var_os("KINFERENCE_BLESS").is_some() {
            std::fs::write(PATH, &generated).expect("writing docs/configuration.md");
        }
        let committed = std::fs::read_to_string(PATH).unwrap_or_default();
        assert!(
            committed == generated,
            "docs/configuration.md is stale: run KINFERENCE_BLESS=1 cargo test -p kinference-gateway --lib config::reference"
        );
    }

    #[test]
    fn every_top_level_key_is_documented() {
        let reference = render();
        for key in [
            "models",
            "workers",
            "policy_dir",
            "tenancy",
            "crds",
            "classifier",
        ] {
            assert!(reference.contains(&format!("| `{key}` |")), "{key}");
        }
        assert!(reference.contains("| `tenancy.journal.segment_max_bytes` |"));
        assert!(reference.contains("| `crds.lease_duration_s` | `u64` |"));
    }
}
