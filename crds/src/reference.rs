//! The CRD reference (`kinference-gateway/docs/crds.md`), generated from the CRDs' own schema: every
//! `spec` field of the five kinds with its type, whether it is required, and the first line of its
//! description (the Rust doc comment it was generated from).
//!
//! `crds/tests/reference.rs` fails when the committed file differs;
//! `KINFERENCE_BLESS=1 cargo test -p kinference-crds --test reference` rewrites it.

use serde_json::Value;

/// The reference as Markdown.
pub fn markdown() -> String {
    let mut out = String::from(
        "# CRD reference\n\n\
         Generated from the `kinference-crds` types' schema (the same one `crds/*.yaml` carries) by\n\
         `KINFERENCE_BLESS=1 cargo test -p kinference-crds --test reference`; a test fails when this\n\
         file is stale. Unknown fields are errors (`kinfctl lint` names the nearest valid one).\n",
    );
    for (_, crd) in crate::all_crds() {
        let schema = crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .and_then(|s| serde_json::to_value(s).ok())
            .unwrap_or_default();
        out.push_str(&format!(
            "\n## {}\n\n| Field | Type | Required | Meaning |\n|---|---|---|---|\n",
            crd.spec.names.kind
        ));
        if let Some(spec) = schema.pointer("/properties/spec") {
            fields(spec, "spec", &mut out);
        }
    }
    out
}

/// One row per property of `schema` under `path`, nested objects and array items after their parent.
fn fields(schema: &Value, path: &str, out: &mut String) {
    let Some(properties) = schema.get("properties").and_then(Value::as_object) else {
        return;
    };
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for (name, prop) in properties {
        let field = format!("{path}.{name}");
        let description = prop
            .get("description")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .split("\n\n")
            .next()
            .unwrap_or_default()
            .replace('\n', " ")
            .replace('|', "\\|");
        out.push_str(&format!(
            "| `{field}` | {} | {} | {description} |\n",
            type_of(prop),
            if required.contains(&name.as_str()) {
                "yes"
            } else {
                "no"
            }
        ));
        fields(prop, &field, out);
        if let Some(items) = prop.get("items") {
            fields(items, &format!("{field}[]"), out);
        }
    }
}

/// `string`, `array of object`, `map of string`, or the enum's values.
fn type_of(prop: &Value) -> String {
    if let Some(values) = prop.get("enum").and_then(Value::as_array) {
        let names: Vec<String> = values
            .iter()
            .filter_map(Value::as_str)
            .map(|v| format!("`{v}`"))
            .collect();
        return names.join(", ");
    }
    let ty = prop.get("type").and_then(Value::as_str).unwrap_or("any");
    match ty {
        "array" => format!(
            "array of {}",
            prop.get("items").map_or("any".to_string(), type_of)
        ),
        "object" => match prop.get("additionalProperties") {
            Some(Value::Object(_)) => format!("map of {}", type_of(&prop["additionalProperties"])),
            _ => "object".to_string(),
        },
        other => other.to_string(),
    }
}
