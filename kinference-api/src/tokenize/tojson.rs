//! The chat template's `tojson` filter as transformers defines it: Python's `json.dumps` with its
//! default separators (`", "` and `": "`), keys in the order given, nothing escaped for HTML.
//!
//! Templates render tools with it (Qwen2's `{{ tool | tojson }}`), so it decides how many tokens a tool
//! costs: minijinja's own filter writes compact JSON with `<`, `>`, `&` and `'` escaped, which is 19
//! tokens fewer than vLLM 0.32 counted for a one-tool Qwen2 prompt. The order of keys counts too, so
//! the `tools` handed to the template are laid out as vLLM lays them out ([`template_kwargs`]).

use minijinja::value::{Kwargs, Value};
use minijinja::{Error, ErrorKind};
use serde::Serialize;
use serde_json::Map;
use serde_json::ser::{Formatter, PrettyFormatter, Serializer};

/// The template's keyword arguments, each of `tools` as vLLM hands it to the template (its request
/// model's fields in their order): `type`, then `function` with `name`, `description` (null when
/// absent), `parameters`, then any other key (`strict`). The rest as given.
pub(super) fn template_kwargs(kwargs: &Map<String, serde_json::Value>) -> Value {
    kwargs
        .iter()
        .map(|(name, value)| match (name.as_str(), value) {
            ("tools", serde_json::Value::Array(tools)) => {
                (name.as_str(), tools.iter().map(tool).collect::<Value>())
            }
            _ => (name.as_str(), Value::from_serialize(value)),
        })
        .collect()
}

/// An assistant message's `tool_calls` as vLLM hands them to the template: each call's `arguments`
/// string parsed to its JSON value (`{}` when empty or not JSON), so the template writes it with
/// `tojson` as vLLM's does, not the client's string verbatim.
pub(super) struct ToolCalls<'a>(pub &'a serde_json::Value);

impl Serialize for ToolCalls<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let Some(calls) = self.0.as_array() else {
            return self.0.serialize(serializer);
        };
        let calls: Vec<serde_json::Value> = calls.iter().map(parsed_arguments).collect();
        calls.serialize(serializer)
    }
}

fn parsed_arguments(call: &serde_json::Value) -> serde_json::Value {
    let mut call = call.clone();
    if let Some(arguments) = call
        .get_mut("function")
        .and_then(|f| f.get_mut("arguments"))
        && let serde_json::Value::String(text) = arguments
    {
        *arguments = serde_json::from_str(text).unwrap_or_else(|_| serde_json::json!({}));
    }
    call
}

/// One tool in vLLM's layout (a function tool; anything else as given).
fn tool(tool: &serde_json::Value) -> Value {
    let (Some(kind), Some(serde_json::Value::Object(function))) =
        (tool.get("type"), tool.get("function"))
    else {
        return Value::from_serialize(tool);
    };
    const FIRST: [&str; 3] = ["name", "description", "parameters"];
    let first = FIRST.iter().map(|&key| {
        let value = function
            .get(key)
            .map_or(Value::from(()), Value::from_serialize);
        (key, value)
    });
    let rest = function
        .iter()
        .filter(|(key, _)| !FIRST.contains(&key.as_str()))
        .map(|(key, value)| (key.as_str(), Value::from_serialize(value)));
    let function: Value = first.chain(rest).collect();
    [
        ("type", Value::from_serialize(kind)),
        ("function", function),
    ]
    .into_iter()
    .collect()
}

/// `value | tojson` or `value | tojson(indent=n)`.
pub(super) fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let spaces = vec![b' '; n];
            value.serialize(&mut Serializer::with_formatter(
                &mut out,
                PrettyFormatter::with_indent(&spaces),
            ))
        }
        None => value.serialize(&mut Serializer::with_formatter(&mut out, PythonFormatter)),
    };
    written.map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    let text = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    Ok(Value::from_safe_string(text))
}

/// One line, with a space after each `,` and `:`, as `json.dumps` writes by default.
struct PythonFormatter;

/// `", "` before every array item and object entry but the first.
fn item_separator<W: ?Sized + std::io::Write>(writer: &mut W, first: bool) -> std::io::Result<()> {
    if first {
        Ok(())
    } else {
        writer.write_all(b", ")
    }
}

impl Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(writer, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

#[cfg(test)]
mod tests;
