//! A JSON request body's top-level members set or replaced without reading the rest of it into a
//! tree: the other members are kept as their raw text. What the gateway changes in a body it
//! otherwise forwards as sent (the model a policy chose, the output limit it reserved).

use std::collections::BTreeMap;

use bytes::Bytes;
use serde_json::value::RawValue;

use crate::errors::GatewayError;

/// `body` (a JSON object) with each `(name, json)` of `set` as a member: replacing one of that name,
/// or added. `json` must be JSON text (`serde_json::to_string` of the value). A body whose members
/// already hold exactly these values comes back as it was (no copy).
pub fn with_members(body: &Bytes, set: &[(&str, String)]) -> Result<Bytes, GatewayError> {
    let members: BTreeMap<String, &RawValue> = serde_json::from_slice(body)
        .map_err(|e| GatewayError::MalformedJson(format!("a JSON object was expected: {e}")))?;
    if set
        .iter()
        .all(|(name, json)| members.get(*name).is_some_and(|raw| raw.get() == json))
    {
        return Ok(body.clone());
    }
    let mut out = Vec::with_capacity(body.len() + 64);
    out.push(b'{');
    let mut first = true;
    let mut put = |out: &mut Vec<u8>, name: &str, json: &str| {
        if !std::mem::take(&mut first) {
            out.push(b',');
        }
        // A name from the body or the gateway's own: always valid JSON as a string.
        out.extend_from_slice(serde_json::to_string(name).unwrap_or_default().as_bytes());
        out.push(b':');
        out.extend_from_slice(json.as_bytes());
    };
    for (name, raw) in &members {
        if set.iter().any(|(n, _)| *n == name.as_str()) {
            continue;
        }
        put(&mut out, name, raw.get());
    }
    for (name, json) in set {
        put(&mut out, name, json);
    }
    out.push(b'}');
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    #[test]
    fn members_are_replaced_or_added_and_the_rest_kept() {
        let body = Bytes::from(r#"{"model":"a","input":["x",{"y":[1,2]}],"max_tokens":1}"#);
        let out = with_members(
            &body,
            &[
                ("model", "\"b\"".into()),
                ("max_completion_tokens", "7".into()),
            ],
        )
        .unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v,
            json!({"model": "b", "input": ["x", {"y": [1, 2]}], "max_tokens": 1,
                "max_completion_tokens": 7})
        );
        let same = with_members(&body, &[("model", "\"a\"".into())]).unwrap();
        assert_eq!(same, body, "unchanged when nothing changes");
        assert!(with_members(&Bytes::from("[1]"), &[("model", "\"b\"".into())]).is_err());
        let escaped = with_members(&Bytes::from(r#"{"a\"b":1}"#), &[("c", "2".into())]).unwrap();
        let v: Value = serde_json::from_slice(&escaped).unwrap();
        assert_eq!(v, json!({"a\"b": 1, "c": 2}));
    }
}
