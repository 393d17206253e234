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
//! Cost: O(n log n) in the size of the value (member sort per object). The encoder is a serde
//! `Serializer` that writes the bytes directly (no intermediate `serde_json::Value` tree): one
//! scratch buffer per object, its members sorted by key at the object's end. A test checks it
//! byte for byte against a plain walk over `serde_json::Value` (the definition above, written
//! naively) on random values.

use std::borrow::Cow;
use std::ops::Range;

use serde::ser::{self, Serialize};
use serde_json::Value;

use crate::error::{ReceiptsError, Result};

impl ser::Error for ReceiptsError {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        ReceiptsError::Canonical(msg.to_string())
    }
}

/// Encode `value` as canonical JSON bytes.
pub fn to_vec<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(512);
    value.serialize(Canon { out: &mut out })?;
    Ok(out)
}

/// Encode an already-built JSON value canonically.
pub fn value_to_vec(value: &Value) -> Result<Vec<u8>> {
    to_vec(value)
}

/// Whether any of the eight bytes of `w` is `"`, `\\` or below 0x20 (the bytes
/// [`write_string`] escapes). Exact: each test sets a byte's high bit only for that byte's own
/// match (the classic "has zero byte" / "has byte less than" expressions, restricted to bytes
/// below 0x80 so a UTF-8 byte never matches).
fn needs_escape(w: u64) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let ascii = !w & HIGH;
    let zero = |x: u64| x.wrapping_sub(ONES) & ascii & !x & HIGH;
    let quote = zero(w ^ (ONES * u64::from(b'"')));
    let backslash = zero(w ^ (ONES * u64::from(b'\\')));
    let control = w.wrapping_sub(ONES * 0x20) & ascii;
    (quote | backslash | control) != 0
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut run = 0;
    let mut i = 0;
    while i < bytes.len() {
        // Eight bytes at a time past runs with nothing to escape (base64 tickets, hex digests).
        if let Some(chunk) = bytes.get(i..i + 8) {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            if !needs_escape(u64::from_le_bytes(word)) {
                i += 8;
                continue;
            }
        }
        let b = bytes[i];
        i += 1;
        // Only `"`, `\` and C0 controls are escaped; every other byte (UTF-8 included) is raw.
        if b != b'"' && b != b'\\' && b >= 0x20 {
            continue;
        }
        let i = i - 1;
        out.extend_from_slice(&bytes[run..i]);
        run = i + 1;
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            c => out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(c >> 4)],
                HEX[usize::from(c & 15)],
            ]),
        }
    }
    out.extend_from_slice(&bytes[run..]);
    out.push(b'"');
}

/// The ten `serialize_{i,u}{8..128}` methods of a serializer, each one `$write(v, self)`.
macro_rules! integers {
    ($write:ident) => {
        integers!(@ $write; serialize_i8 i8, serialize_i16 i16, serialize_i32 i32,
            serialize_i64 i64, serialize_i128 i128, serialize_u8 u8, serialize_u16 u16,
            serialize_u32 u32, serialize_u64 u64, serialize_u128 u128);
    };
    (@ $write:ident; $($name:ident $t:ty),*) => {$(
        fn $name(self, v: $t) -> Result<Self::Ok> {
            $write(v, self)
        }
    )*};
}

fn write_int(n: impl itoa_like::Int, ser: Canon<'_>) -> Result<()> {
    n.write(ser.out);
    Ok(())
}

fn to_key(n: impl itoa_like::Int, _: KeyName) -> Result<String> {
    let mut out = Vec::new();
    n.write(&mut out);
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Decimal formatting of integers without a `String` per number.
mod itoa_like {
    pub trait Int {
        fn write(self, out: &mut Vec<u8>);
    }
    macro_rules! unsigned {
        ($($t:ty),*) => {$(
            impl Int for $t {
                fn write(self, out: &mut Vec<u8>) {
                    let mut buf = [0u8; 40];
                    let mut i = buf.len();
                    let mut n = self as u128;
                    loop {
                        i -= 1;
                        buf[i] = b'0' + (n % 10) as u8;
                        n /= 10;
                        if n == 0 {
                            break;
                        }
                    }
                    out.extend_from_slice(&buf[i..]);
                }
            }
        )*};
    }
    macro_rules! signed {
        ($($t:ty),*) => {$(
            impl Int for $t {
                fn write(self, out: &mut Vec<u8>) {
                    if self < 0 {
                        out.push(b'-');
                    }
                    (self as i128).unsigned_abs().write(out);
                }
            }
        )*};
    }
    unsigned!(u8, u16, u32, u64, u128);
    signed!(i8, i16, i32, i64, i128);
}

/// The canonical serializer: writes one value to `out`.
struct Canon<'a> {
    out: &'a mut Vec<u8>,
}

fn float_refused(v: f64) -> ReceiptsError {
    ReceiptsError::Canonical(format!(
        "non-integer number {v} (floats are not allowed in signed objects)"
    ))
}

impl<'a> ser::Serializer for Canon<'a> {
    type Ok = ();
    type Error = ReceiptsError;
    type SerializeSeq = Seq<'a>;
    type SerializeTuple = Seq<'a>;
    type SerializeTupleStruct = Seq<'a>;
    type SerializeTupleVariant = Seq<'a>;
    type SerializeMap = Object<'a>;
    type SerializeStruct = Object<'a>;
    type SerializeStructVariant = Object<'a>;

    fn serialize_bool(self, v: bool) -> Result<()> {
        self.out
            .extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }
    integers!(write_int);
    fn serialize_f32(self, v: f32) -> Result<()> {
        Err(float_refused(f64::from(v)))
    }
    fn serialize_f64(self, v: f64) -> Result<()> {
        Err(float_refused(v))
    }
    fn serialize_char(self, v: char) -> Result<()> {
        write_string(v.encode_utf8(&mut [0u8; 4]), self.out);
        Ok(())
    }
    fn serialize_str(self, v: &str) -> Result<()> {
        write_string(v, self.out);
        Ok(())
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<()> {
        // As serde_json: an array of numbers.
        self.out.push(b'[');
        for (i, b) in v.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            itoa_like::Int::write(*b, self.out);
        }
        self.out.push(b']');
        Ok(())
    }
    fn serialize_none(self) -> Result<()> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<()> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<()> {
        self.serialize_none()
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<()> {
        self.serialize_none()
    }
    fn serialize_unit_variant(
        self,
        _n: &'static str,
        _i: u32,
        variant: &'static str,
    ) -> Result<()> {
        self.serialize_str(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<()> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _i: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<()> {
        // `{"variant":value}`: one member, nothing to sort.
        self.out.push(b'{');
        write_string(variant, self.out);
        self.out.push(b':');
        value.serialize(Canon {
            out: &mut *self.out,
        })?;
        self.out.push(b'}');
        Ok(())
    }
    fn serialize_seq(self, _len: Option<usize>) -> Result<Seq<'a>> {
        self.out.push(b'[');
        Ok(Seq {
            out: self.out,
            first: true,
            variant: false,
        })
    }
    fn serialize_tuple(self, len: usize) -> Result<Seq<'a>> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(self, _name: &'static str, len: usize) -> Result<Seq<'a>> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _i: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Seq<'a>> {
        self.out.push(b'{');
        write_string(variant, self.out);
        self.out.extend_from_slice(b":[");
        Ok(Seq {
            out: self.out,
            first: true,
            variant: true,
        })
    }
    fn serialize_map(self, len: Option<usize>) -> Result<Object<'a>> {
        Ok(Object::new(self.out, len.unwrap_or(8), false))
    }
    fn serialize_struct(self, _name: &'static str, len: usize) -> Result<Object<'a>> {
        Ok(Object::new(self.out, len, false))
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _i: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Object<'a>> {
        self.out.push(b'{');
        write_string(variant, self.out);
        self.out.push(b':');
        Ok(Object::new(self.out, len, true))
    }
}

/// An array being written (`variant`: inside `{"variant":[...]}`).
struct Seq<'a> {
    out: &'a mut Vec<u8>,
    first: bool,
    variant: bool,
}

impl Seq<'_> {
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        if !self.first {
            self.out.push(b',');
        }
        self.first = false;
        value.serialize(Canon {
            out: &mut *self.out,
        })
    }
    fn finish(self) -> Result<()> {
        self.out.push(b']');
        if self.variant {
            self.out.push(b'}');
        }
        Ok(())
    }
}

impl ser::SerializeSeq for Seq<'_> {
    type Ok = ();
    type Error = ReceiptsError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.element(value)
    }
    fn end(self) -> Result<()> {
        self.finish()
    }
}

impl ser::SerializeTuple for Seq<'_> {
    type Ok = ();
    type Error = ReceiptsError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.element(value)
    }
    fn end(self) -> Result<()> {
        self.finish()
    }
}

impl ser::SerializeTupleStruct for Seq<'_> {
    type Ok = ();
    type Error = ReceiptsError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.element(value)
    }
    fn end(self) -> Result<()> {
        self.finish()
    }
}

impl ser::SerializeTupleVariant for Seq<'_> {
    type Ok = ();
    type Error = ReceiptsError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.element(value)
    }
    fn end(self) -> Result<()> {
        self.finish()
    }
}

/// An object being written. While members arrive in strictly increasing key order (most
/// structs here declare their fields alphabetically, and maps from a `BTreeMap` are sorted) they
/// go straight to `out`; at the first member out of order (or a repeated key) the ones written
/// so far move to `scratch`, and from then on values are buffered there and copied to `out`
/// sorted by key at the end (a repeated key keeps its last value, as a JSON object would). Both
/// ways give the same bytes.
struct Object<'a> {
    out: &'a mut Vec<u8>,
    /// Where this object's `{` is in `out`.
    start: usize,
    /// Members are being written to `out` directly (`members` ranges index `out`); else to
    /// `scratch` (ranges index `scratch`) and `out` is cut back to `start`.
    direct: bool,
    scratch: Vec<u8>,
    members: Vec<(Cow<'static, str>, Range<usize>)>,
    pending_key: Option<String>,
    variant: bool,
}

impl<'a> Object<'a> {
    fn new(out: &'a mut Vec<u8>, len: usize, variant: bool) -> Object<'a> {
        let start = out.len();
        out.push(b'{');
        Object {
            out,
            start,
            direct: true,
            scratch: Vec::new(),
            members: Vec::with_capacity(len),
            pending_key: None,
            variant,
        }
    }

    fn member<T: Serialize + ?Sized>(&mut self, key: Cow<'static, str>, value: &T) -> Result<()> {
        if self.direct {
            let in_order = self
                .members
                .last()
                .is_none_or(|(last, _)| last.as_bytes() < key.as_bytes());
            if in_order {
                if !self.members.is_empty() {
                    self.out.push(b',');
                }
                write_string(&key, self.out);
                self.out.push(b':');
                let start = self.out.len();
                value.serialize(Canon { out: self.out })?;
                self.members.push((key, start..self.out.len()));
                return Ok(());
            }
            // Out of order: buffer what was written (ranges now relative to `scratch`).
            self.scratch = self.out.split_off(self.start);
            for (_, range) in &mut self.members {
                *range = range.start - self.start..range.end - self.start;
            }
            self.direct = false;
        }
        let start = self.scratch.len();
        value.serialize(Canon {
            out: &mut self.scratch,
        })?;
        self.members.push((key, start..self.scratch.len()));
        Ok(())
    }

    fn finish(mut self) -> Result<()> {
        if self.direct {
            self.out.push(b'}');
            if self.variant {
                self.out.push(b'}');
            }
            return Ok(());
        }
        // Stable: among equal keys the last written stays last.
        self.members
            .sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        self.out.push(b'{');
        let n = self.members.len();
        let mut first = true;
        for i in 0..n {
            if i + 1 < n && self.members[i + 1].0 == self.members[i].0 {
                continue;
            }
            if !first {
                self.out.push(b',');
            }
            first = false;
            let (key, range) = &self.members[i];
            write_string(key, self.out);
            self.out.push(b':');
            self.out.extend_from_slice(&self.scratch[range.clone()]);
        }
        self.out.push(b'}');
        if self.variant {
            self.out.push(b'}');
        }
        Ok(())
    }
}

impl ser::SerializeMap for Object<'_> {
    type Ok = ();
    type Error = ReceiptsError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<()> {
        self.pending_key = Some(key.serialize(KeyName)?);
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        let key = self
            .pending_key
            .take()
            .ok_or_else(|| ReceiptsError::Canonical("map value without a key".into()))?;
        self.member(Cow::Owned(key), value)
    }
    fn end(self) -> Result<()> {
        self.finish()
    }
}

impl ser::SerializeStruct for Object<'_> {
    type Ok = ();
    type Error = ReceiptsError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<()> {
        self.member(Cow::Borrowed(key), value)
    }
    fn end(self) -> Result<()> {
        self.finish()
    }
}

impl ser::SerializeStructVariant for Object<'_> {
    type Ok = ();
    type Error = ReceiptsError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<()> {
        self.member(Cow::Borrowed(key), value)
    }
    fn end(self) -> Result<()> {
        self.finish()
    }
}

/// Map keys: strings, and what serde_json turns into strings (integers, chars, booleans, unit
/// variants); anything else is refused, as serde_json refuses it.
struct KeyName;

fn key_refused() -> ReceiptsError {
    ReceiptsError::Canonical("object keys must be strings".into())
}

impl ser::Serializer for KeyName {
    type Ok = String;
    type Error = ReceiptsError;
    type SerializeSeq = ser::Impossible<String, ReceiptsError>;
    type SerializeTuple = ser::Impossible<String, ReceiptsError>;
    type SerializeTupleStruct = ser::Impossible<String, ReceiptsError>;
    type SerializeTupleVariant = ser::Impossible<String, ReceiptsError>;
    type SerializeMap = ser::Impossible<String, ReceiptsError>;
    type SerializeStruct = ser::Impossible<String, ReceiptsError>;
    type SerializeStructVariant = ser::Impossible<String, ReceiptsError>;

    fn serialize_bool(self, v: bool) -> Result<String> {
        Ok(v.to_string())
    }
    integers!(to_key);
    fn serialize_f32(self, _v: f32) -> Result<String> {
        Err(key_refused())
    }
    fn serialize_f64(self, _v: f64) -> Result<String> {
        Err(key_refused())
    }
    fn serialize_char(self, v: char) -> Result<String> {
        Ok(v.to_string())
    }
    fn serialize_str(self, v: &str) -> Result<String> {
        Ok(v.to_owned())
    }
    fn serialize_bytes(self, _v: &[u8]) -> Result<String> {
        Err(key_refused())
    }
    fn serialize_none(self) -> Result<String> {
        Err(key_refused())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _value: &T) -> Result<String> {
        Err(key_refused())
    }
    fn serialize_unit(self) -> Result<String> {
        Err(key_refused())
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<String> {
        Err(key_refused())
    }
    fn serialize_unit_variant(
        self,
        _n: &'static str,
        _i: u32,
        variant: &'static str,
    ) -> Result<String> {
        Ok(variant.to_owned())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<String> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _n: &'static str,
        _i: u32,
        _v: &'static str,
        _value: &T,
    ) -> Result<String> {
        Err(key_refused())
    }
    fn serialize_seq(self, _len: Option<usize>) -> Result<Self::SerializeSeq> {
        Err(key_refused())
    }
    fn serialize_tuple(self, _len: usize) -> Result<Self::SerializeTuple> {
        Err(key_refused())
    }
    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeTupleStruct> {
        Err(key_refused())
    }
    fn serialize_tuple_variant(
        self,
        _n: &'static str,
        _i: u32,
        _v: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeTupleVariant> {
        Err(key_refused())
    }
    fn serialize_map(self, _len: Option<usize>) -> Result<Self::SerializeMap> {
        Err(key_refused())
    }
    fn serialize_struct(self, _name: &'static str, _len: usize) -> Result<Self::SerializeStruct> {
        Err(key_refused())
    }
    fn serialize_struct_variant(
        self,
        _n: &'static str,
        _i: u32,
        _v: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeStructVariant> {
        Err(key_refused())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    /// The definition, written naively over a `serde_json::Value` tree (the encoder before it
    /// became a serializer): the oracle of the differential tests below.
    fn naive(v: &Value, out: &mut Vec<u8>) -> std::result::Result<(), ()> {
        match v {
            Value::Null => out.extend_from_slice(b"null"),
            Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
            Value::Number(n) => match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => out.extend_from_slice(u.to_string().as_bytes()),
                (None, Some(i)) => out.extend_from_slice(i.to_string().as_bytes()),
                _ => return Err(()),
            },
            Value::String(s) => naive_string(s, out),
            Value::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    naive(item, out)?;
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
                    naive_string(k, out);
                    out.push(b':');
                    naive(val, out)?;
                }
                out.push(b'}');
            }
        }
        Ok(())
    }

    fn naive_string(s: &str, out: &mut Vec<u8>) {
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
                    out.extend_from_slice(format!("\\u{:04x}", c as u32).as_bytes())
                }
                c => out.extend_from_slice(c.encode_utf8(&mut [0u8; 4]).as_bytes()),
            }
        }
        out.push(b'"');
    }

    /// The eight-byte test finds exactly the bytes the byte loop escapes, at every position,
    /// beside every other byte value.
    #[test]
    fn needs_escape_is_exact_for_every_byte_at_every_position() {
        for b in 0..=255u8 {
            let escaped = b == b'"' || b == b'\\' || b < 0x20;
            for pos in 0..8 {
                for fill in [b'a', 0x00, 0x1f, 0x20, 0x7f, 0x80, 0xff] {
                    let mut w = [fill; 8];
                    w[pos] = b;
                    let fill_escaped = fill < 0x20;
                    assert_eq!(
                        needs_escape(u64::from_le_bytes(w)),
                        escaped || fill_escaped,
                        "byte {b:#04x} at {pos} among {fill:#04x}"
                    );
                }
            }
        }
    }

    /// The serializer's bytes for any `Serialize` type equal the naive walk over its
    /// `serde_json::Value` (also when both refuse).
    fn same_as_naive<T: serde::Serialize>(value: &T) {
        let tree = serde_json::to_value(value).unwrap();
        let mut expected = Vec::new();
        let naive_ok = naive(&tree, &mut expected).is_ok();
        match to_vec(value) {
            Ok(bytes) => {
                assert!(
                    naive_ok,
                    "the serializer accepted what the definition refuses"
                );
                assert_eq!(
                    String::from_utf8_lossy(&bytes),
                    String::from_utf8_lossy(&expected)
                );
            }
            Err(_) => assert!(!naive_ok, "the serializer refused {tree}"),
        }
    }

    #[derive(serde::Serialize)]
    #[serde(rename_all = "snake_case")]
    enum Shape {
        Unit,
        Newtype(u32),
        Tuple(i64, String),
        Struct { zeta: Option<u8>, alpha: Vec<u16> },
    }

    #[derive(serde::Serialize)]
    struct Wrapper(String);

    #[derive(serde::Serialize)]
    struct Mixed {
        zz: Wrapper,
        a: Vec<Shape>,
        m: std::collections::BTreeMap<u32, bool>,
        #[serde(skip_serializing_if = "Option::is_none")]
        skipped: Option<u8>,
        none: Option<String>,
        c: char,
        neg: i64,
        big: u64,
        unit: (),
        tuple: (u8, &'static str),
        #[serde(flatten)]
        extra: std::collections::BTreeMap<String, u8>,
    }

    #[test]
    fn serde_shapes_encode_as_their_json_values() {
        let m = Mixed {
            zz: Wrapper("w\u{1f}\"".into()),
            a: vec![
                Shape::Unit,
                Shape::Newtype(7),
                Shape::Tuple(-3, "t".into()),
                Shape::Struct {
                    zeta: None,
                    alpha: vec![1, 2],
                },
            ],
            m: [(10, true), (2, false)].into_iter().collect(),
            skipped: None,
            none: None,
            c: 'é',
            neg: i64::MIN,
            big: u64::MAX,
            unit: (),
            tuple: (1, "x"),
            extra: [("b".to_owned(), 1), ("aa".to_owned(), 2)]
                .into_iter()
                .collect(),
        };
        same_as_naive(&m);
        same_as_naive(&Shape::Struct {
            zeta: Some(1),
            alpha: vec![],
        });
        same_as_naive(&json!({"x": 1.5}));
        same_as_naive(&json!([1.0]));
    }

    /// A value whose objects are written in the given member order, repeats included (what a
    /// `Serialize` impl may emit; a JSON object keeps the last value of a repeated key).
    #[derive(Debug, Clone)]
    enum Node {
        Leaf(Value),
        Members(Vec<(String, Node)>),
    }

    impl Node {
        fn to_value(&self) -> Value {
            match self {
                Node::Leaf(v) => v.clone(),
                Node::Members(ms) => {
                    let mut m = serde_json::Map::new();
                    for (k, v) in ms {
                        m.insert(k.clone(), v.to_value());
                    }
                    Value::Object(m)
                }
            }
        }
    }

    impl serde::Serialize for Node {
        fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
            use serde::ser::SerializeMap;
            match self {
                Node::Leaf(v) => v.serialize(s),
                Node::Members(ms) => {
                    let mut m = s.serialize_map(Some(ms.len()))?;
                    for (k, v) in ms {
                        m.serialize_entry(k, v)?;
                    }
                    m.end()
                }
            }
        }
    }

    fn arb_node() -> impl Strategy<Value = Node> {
        arb_json()
            .prop_map(Node::Leaf)
            .prop_recursive(3, 48, 6, |inner| {
                prop::collection::vec(("[a-d]{0,2}", inner), 0..6).prop_map(Node::Members)
            })
    }

    proptest! {
        /// Objects with members in any order, with repeats, nested in sorted or unsorted
        /// objects: the direct and the buffered paths of `Object` give the naive definition's
        /// bytes.
        #[test]
        fn members_in_any_order_encode_as_the_sorted_object(node in arb_node()) {
            let mut expected = Vec::new();
            naive(&node.to_value(), &mut expected).unwrap();
            prop_assert_eq!(to_vec(&node).unwrap(), expected);
        }
    }

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

        /// The serializer agrees byte for byte with the naive definition on random values.
        #[test]
        fn serializer_matches_the_naive_definition(v in arb_json()) {
            same_as_naive(&v);
        }

        /// Strings dense in escapable bytes, at every alignment of the eight-byte fast path.
        #[test]
        fn string_escaping_matches_the_naive_definition(s in "[a-z0-9\"\\\\\\x00-\\x1f\\x7f\u{80}-\u{7ff}\u{10000}]{0,80}") {
            let mut out = Vec::new();
            write_string(&s, &mut out);
            let mut expected = Vec::new();
            naive_string(&s, &mut expected);
            prop_assert_eq!(out, expected);
        }

        #[test]
        fn string_escaping_matches_serde_json(s in any::<String>()) {
            let mut out = Vec::new();
            write_string(&s, &mut out);
            prop_assert_eq!(out, serde_json::to_vec(&s).unwrap());
        }
    }
}
