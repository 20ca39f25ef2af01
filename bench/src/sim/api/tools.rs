//! Tool calls the way vLLM's tool parsers return them (`--enable-auto-tool-choice
//! --tool-call-parser hermes`): the model writes `<tool_call>{"name": .., "arguments": ..}</tool_call>`,
//! the parser turns it into `message.tool_calls` (whole) or `delta.tool_calls` (streamed: the id, type
//! and name first, then the arguments string in pieces), and `finish_reason` is `"tool_calls"`.
//!
//! The simulated model calls a tool by a fixed rule, so tests know what comes back:
//! - `tool_choice` `"none"`, or no `tools`: never;
//! - `"required"`, or a named function: always (the named one, else the first tool);
//! - `"auto"` (or absent): when the last message is the user's and its text names a tool (the first
//!   named tool in `tools` order); after a `tool` message it answers in text, so a conversation ends.
//!
//! Arguments follow the tool's JSON schema: each property in `required` (all properties when there is
//! no `required`) gets `key=value` from the last user text when it says so (`city=Paris`), else a
//! value of its type (`"sim"`, `1`, `true`, `[]`, `{}`).

use serde_json::{Map, Value, json};

/// Characters per streamed piece of the arguments: vLLM streams what each token decodes to, a few
/// characters at a time.
const PIECE_CHARS: usize = 4;

/// The tool call the simulated model makes.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedCall {
    /// `chatcmpl-tool-<hex>`, as vLLM names calls.
    pub id: String,
    /// The function.
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

impl PlannedCall {
    /// What the model writes for this call (hermes format): its token count is the completion's.
    pub fn model_text(&self) -> String {
        format!(
            "<tool_call>\n{{\"name\": \"{}\", \"arguments\": {}}}\n</tool_call>",
            self.name, self.arguments
        )
    }

    /// The arguments in the pieces a stream carries them in.
    pub fn argument_pieces(&self) -> Vec<String> {
        let chars: Vec<char> = self.arguments.chars().collect();
        chars
            .chunks(PIECE_CHARS)
            .map(|c| c.iter().collect())
            .collect()
    }

    /// `message.tool_calls[0]` of a whole response.
    pub fn whole(&self) -> Value {
        json!({"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}})
    }

    /// The first streamed piece: id, type and name, no arguments yet.
    pub fn opening_delta(&self) -> Value {
        json!({"tool_calls": [{"index": 0, "id": self.id, "type": "function",
                               "function": {"name": self.name}}]})
    }

    /// A later streamed piece: more of the arguments.
    pub fn arguments_delta(piece: &str) -> Value {
        json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
    }
}

/// vLLM's answer (400) to `auto` tool choice when it was started without a tool parser.
pub const AUTO_REFUSED: &str =
    "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set";

/// Whether `body` has tools and lets the model choose (`tool_choice` `auto` or absent).
pub fn wants_auto(body: &Value) -> bool {
    let has_tools = body
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    let auto = match body.get("tool_choice") {
        None | Some(Value::Null) => true,
        Some(Value::String(c)) => c == "auto",
        Some(_) => false,
    };
    has_tools && auto
}

/// The call the simulated model makes for a chat request `body`, if any (the rule in the module doc).
pub fn plan(body: &Value) -> Option<PlannedCall> {
    let tools: Vec<&Value> = body.get("tools")?.as_array()?.iter().collect();
    let messages = body.get("messages")?.as_array()?;
    let last = messages.last()?;
    let last_user_text = if last.get("role").and_then(Value::as_str) == Some("user") {
        text_of(last)
    } else {
        String::new()
    };
    let tool = match body.get("tool_choice") {
        Some(Value::String(c)) if c == "none" => return None,
        Some(Value::String(c)) if c == "required" => tools.first().copied(),
        Some(Value::Object(choice)) => {
            let wanted = choice.get("function")?.get("name")?.as_str()?;
            tools.iter().copied().find(|t| name_of(t) == Some(wanted))
        }
        _ => tools
            .iter()
            .copied()
            .find(|t| name_of(t).is_some_and(|n| last_user_text.contains(n))),
    }?;
    let name = name_of(tool)?.to_string();
    let schema = tool.pointer("/function/parameters");
    let arguments = Value::Object(arguments(schema, &last_user_text)).to_string();
    Some(PlannedCall {
        id: format!("chatcmpl-tool-{:032x}", rand::random::<u128>()),
        name,
        arguments,
    })
}

/// A tool definition's function name.
fn name_of(tool: &Value) -> Option<&str> {
    tool.pointer("/function/name").and_then(Value::as_str)
}

/// The text of a message: its string content or its text parts.
fn text_of(message: &Value) -> String {
    match message.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// Arguments for `schema` from `key=value` words of `text`, else a value of each property's type.
fn arguments(schema: Option<&Value>, text: &str) -> Map<String, Value> {
    let mut out = Map::new();
    let Some(properties) = schema
        .and_then(|s| s.get("properties"))
        .and_then(Value::as_object)
    else {
        return out;
    };
    let required: Option<Vec<&str>> = schema
        .and_then(|s| s.get("required"))
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect());
    for (key, property) in properties {
        if required
            .as_ref()
            .is_some_and(|r| !r.contains(&key.as_str()))
        {
            continue;
        }
        let kind = property
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("string");
        let said = said_value(text, key);
        let value = match (kind, said) {
            ("string", Some(v)) => json!(v),
            ("integer", Some(v)) if v.parse::<i64>().is_ok() => json!(v.parse::<i64>().ok()),
            ("number", Some(v)) if v.parse::<f64>().is_ok() => json!(v.parse::<f64>().ok()),
            ("boolean", Some(v)) if v == "true" || v == "false" => json!(v == "true"),
            ("string", None) => json!("sim"),
            ("integer" | "number", _) => json!(1),
            ("boolean", _) => json!(true),
            ("array", _) => json!([]),
            ("object", _) => json!({}),
            _ => json!("sim"),
        };
        out.insert(key.clone(), value);
    }
    out
}

/// The word after `key=` in `text`, without trailing punctuation.
fn said_value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.split_whitespace().find_map(|word| {
        let value = word.strip_prefix(key)?.strip_prefix('=')?;
        let value = value.trim_end_matches(['.', ',', '?', '!', ';', ':']);
        (!value.is_empty()).then_some(value)
    })
}
