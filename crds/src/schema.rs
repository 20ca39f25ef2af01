//! Offline validation of an object against the OpenAPI schema of its generated CRD: the checks the
//! apiserver makes (types, required fields, enums, ranges, lengths, patterns), so `kinfctl lint`
//! and local mode reject what a cluster would reject, with a path to the offending field.

use std::fmt;

use serde_json::Value;

/// One schema violation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaError {
    /// JSON path, e.g. `spec.rules[2].action.reject.status`.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for SchemaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Validates `object` (a whole manifest: apiVersion, kind, metadata, spec) against the schema of
/// `kind`. Unknown kinds yield one error. `status` is not checked (the gateways own it).
pub fn validate(kind: &str, object: &Value) -> Vec<SchemaError> {
    let mut errors = Vec::new();
    let Some(crd) = crate::crd_for_kind(kind) else {
        errors.push(SchemaError {
            path: "kind".into(),
            message: format!("unknown kind {kind:?}; expected one of {:?}", crate::KINDS),
        });
        return errors;
    };
    let schema = crd
        .spec
        .versions
        .first()
        .and_then(|v| v.schema.as_ref())
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or(Value::Null);
    match object.get("metadata").and_then(|m| m.get("name")) {
        Some(Value::String(name)) if is_dns_subdomain(name) => {}
        Some(Value::String(name)) => errors.push(SchemaError {
            path: "metadata.name".into(),
            message: format!(
                "{name:?} is not a valid name (lowercase letters, digits, '-' and '.', at most 253)"
            ),
        }),
        _ => errors.push(SchemaError {
            path: "metadata.name".into(),
            message: "required field is missing".into(),
        }),
    }
    match (object.get("spec"), schema.pointer("/properties/spec")) {
        (Some(spec), Some(spec_schema)) => check(spec_schema, spec, "spec", &mut errors),
        (None, _) => errors.push(SchemaError {
            path: "spec".into(),
            message: "required field is missing".into(),
        }),
        (Some(_), None) => {}
    }
    errors
}

fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric()
}

fn push(errors: &mut Vec<SchemaError>, path: &str, message: String) {
    errors.push(SchemaError {
        path: path.to_string(),
        message,
    });
}

fn check(schema: &Value, value: &Value, path: &str, errors: &mut Vec<SchemaError>) {
    if value.is_null() {
        if schema.get("nullable").and_then(Value::as_bool) != Some(true) {
            push(errors, path, "must not be null".into());
        }
        return;
    }
    if let Some(ty) = schema.get("type").and_then(Value::as_str) {
        let ok = match ty {
            "object" => value.is_object(),
            "array" => value.is_array(),
            "string" => value.is_string(),
            "boolean" => value.is_boolean(),
            "integer" => value.is_i64() || value.is_u64(),
            "number" => value.is_number(),
            _ => true,
        };
        if !ok {
            push(
                errors,
                path,
                format!("must be of type {ty}, got {}", type_name(value)),
            );
            return;
        }
    }
    if let Some(Value::Array(allowed)) = schema.get("enum")
        && !allowed.contains(value)
    {
        let names: Vec<String> = allowed.iter().map(|v| v.to_string()).collect();
        push(
            errors,
            path,
            format!("{value} is not one of {}", names.join(", ")),
        );
    }
    if let Some(n) = value.as_f64() {
        if let Some(min) = schema.get("minimum").and_then(Value::as_f64)
            && n < min
        {
            push(errors, path, format!("{value} is below the minimum {min}"));
        }
        if let Some(max) = schema.get("maximum").and_then(Value::as_f64)
            && n > max
        {
            push(errors, path, format!("{value} is above the maximum {max}"));
        }
    }
    if let Some(s) = value.as_str() {
        let len = s.chars().count() as u64;
        if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
            && len < min
        {
            push(
                errors,
                path,
                format!("must be at least {min} characters long"),
            );
        }
        if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
            && len > max
        {
            push(
                errors,
                path,
                format!("must be at most {max} characters long"),
            );
        }
        if let Some(pattern) = schema.get("pattern").and_then(Value::as_str)
            && let Ok(re) = regex::Regex::new(pattern)
            && !re.is_match(s)
        {
            push(
                errors,
                path,
                format!("{s:?} does not match the pattern {pattern}"),
            );
        }
    }
    if let Some(items) = value.as_array() {
        let len = items.len() as u64;
        if let Some(min) = schema.get("minItems").and_then(Value::as_u64)
            && len < min
        {
            push(errors, path, format!("must have at least {min} item(s)"));
        }
        if let Some(max) = schema.get("maxItems").and_then(Value::as_u64)
            && len > max
        {
            push(errors, path, format!("must have at most {max} items"));
        }
        if let Some(item_schema) = schema.get("items") {
            for (i, item) in items.iter().enumerate() {
                check(item_schema, item, &format!("{path}[{i}]"), errors);
            }
        }
    }
    if let Some(map) = value.as_object() {
        if let Some(n) = schema.get("minProperties").and_then(Value::as_u64)
            && (map.len() as u64) < n
        {
            push(errors, path, format!("must have at least {n} entries"));
        }
        if let Some(Value::Array(required)) = schema.get("required") {
            for field in required.iter().filter_map(Value::as_str) {
                if !map.contains_key(field) {
                    push(
                        errors,
                        &format!("{path}.{field}"),
                        "required field is missing".into(),
                    );
                }
            }
        }
        let properties = schema.get("properties").and_then(Value::as_object);
        let additional = schema.get("additionalProperties");
        for (key, child) in map {
            let child_path = format!("{path}.{key}");
            if let Some(prop) = properties.and_then(|p| p.get(key)) {
                check(prop, child, &child_path, errors);
            } else if let Some(extra) = additional.filter(|a| a.is_object()) {
                check(extra, child, &child_path, errors);
            } else if properties.is_some() {
                // The apiserver would silently prune it; offline a typo deserves a loud error, worded
                // as serde words it so that readers can suggest the nearest valid key.
                let expected: Vec<String> = properties
                    .into_iter()
                    .flat_map(|p| p.keys())
                    .map(|k| format!("`{k}`"))
                    .collect();
                push(
                    errors,
                    &child_path,
                    format!(
                        "unknown field `{key}`, expected one of {}",
                        expected.join(", ")
                    ),
                );
            }
        }
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests;
