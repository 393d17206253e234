//! Canonical JSON: the exact bytes that are signed and hashed.
//!
//! The encoding is RFC 8785 (JSON Canonicalization Scheme) restricted to the values our wire types
//! use: objects, arrays, strings, `null`, booleans and non-negative or negative *integers*.
//! Object members are sorted by key (bytewise; all our keys are ASCII, where this equals JCS's
//! UTF-16 order), there is no whitespace, strings are escaped minimally (`\"`, `\\`, `\b`, `\f`,
//! `\n`, `\r`, `\t`, other control characters as `\u00xx` lowercase; everything else is raw
//! UTF-8), integers are plain decimal. Floats are refused. `Option::None` fields are encoded as
//! `null`, never omitted. Integers are expected to stay below 2^53 for interoperability.
//!
//! Cost: O(n log n) in the size of the value (member sort per object).

use serde::Serialize;
use serde_json::Value;

use crate::error::{ReceiptsError, Result};

/// Encode `value` as canonical JSON bytes.
pub fn to_vec<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    let v = serde_json::to_value(value).map_err(|e| ReceiptsError::Canonical(e.to_string()))?;
    let mut out = Vec::with_capacity(512);
    write_value(&v, &mut out)?;
    Ok(out)
}

/// Encode an already-built JSON value canonically.
pub fn value_to_vec(value: &Value) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(512);
    write_value(value, &mut out)?;
    Ok(out)
}

fn write_value(v: &Value, out: &mut Vec<u8>) -> Result<()> {
    match v {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                out.extend_from_slice(u.to_string().as_bytes());
            } else if let Some(i) = n.as_i64() {
                out.extend_from_slice(i.to_string().as_bytes());
            } else {
                return Err(ReceiptsError::Canonical(format!(
                    "non-integer number {n} (floats are not allowed in signed objects)"
                )));
            }
        }
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(item, out)?;
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push(b'{');
            for (i, (k, val)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(k, out);
                out.push(b':');
                write_value(val, out)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for ch in s.chars() {
        match ch {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\u{08}' => out.extend_from_slice(b"\\b"),
            '\u{0c}' => out.extend_from_slice(b"\\f"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            c if (c as u32) < 0x20 => {
                out.extend_from_slice(format!("\\u{:04x}", c as u32).as_bytes());
            }
            c => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn sorts_keys_and_drops_whitespace() {
        let v = json!({"b": 1, "a": [true, null, "x"], "c": {"z": 0, "y": -3}});
        assert_eq!(
            value_to_vec(&v).unwrap(),
            br#"{"a":[true,null,"x"],"b":1,"c":{"y":-3,"z":0}}"#.to_vec()
        );
    }

    #[test]
    fn escapes_minimally() {
        let v = json!("q\"b\\n\nt\tc\u{1}é/\u{7f}");
        assert_eq!(
            value_to_vec(&v).unwrap(),
            "\"q\\\"b\\\\n\\nt\\tc\\u0001é/\u{7f}\"".as_bytes().to_vec()
        );
    }

    #[test]
    fn refuses_floats() {
        let err = value_to_vec(&json!({"x": 1.5})).unwrap_err();
        assert_eq!(err.error_type(), "canonical_encoding");
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|i| json!(i)),
            any::<u64>().prop_map(|u| json!(u)),
            ".{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map(".{0,6}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Canonical bytes parse back to the same value, and re-encoding them is a fixed point; the
        /// string escaping agrees with serde_json's (which is minimal escaping as in JCS).
        #[test]
        fn canonical_round_trips(v in arb_json()) {
            let bytes = value_to_vec(&v).unwrap();
            let back: Value = serde_json::from_slice(&bytes).unwrap();
            prop_assert_eq!(&back, &v);
            prop_assert_eq!(value_to_vec(&back).unwrap(), bytes);
        }

        #[test]
        fn string_escaping_matches_serde_json(s in any::<String>()) {
            let mut out = Vec::new();
            write_string(&s, &mut out);
            prop_assert_eq!(out, serde_json::to_vec(&s).unwrap());
        }
    }
}
