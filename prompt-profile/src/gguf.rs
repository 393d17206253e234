//! A minimal GGUF metadata reader: the header and the key/value section, nothing else.
//!
//! It reads the file sequentially through a buffered reader and stops at the end of the
//! metadata, before the tensor-info table and the tensor data, so it never touches weights
//! (for the default model it reads ~1.6 MB of a 98 MB file). GGUF versions 2 and 3
//! (little-endian) are supported with every value type, including (nested) arrays.
//! Version 1 (32-bit lengths) and big-endian files are refused with a clear error.
//!
//! Robustness: every length read from the file is checked against the bytes left in the
//! file before anything is allocated, so a corrupt or hostile file yields
//! [`ProfileError::GgufTruncated`] (lengths past the end of the file) or
//! [`ProfileError::GgufMalformed`] (bad type codes, UTF-8, nesting), never a panic or a
//! huge allocation: a vector announced by a header is pre-sized to at most the bytes left in
//! the file (not to the announced count), so a hostile count costs memory in proportion to the
//! file (`tests/gguf_alloc.rs` measures peak heap with a counting allocator; the byte-flip
//! property test in `tests/fixtures.rs` fuzzes the reader). Cost: O(metadata bytes) time,
//! O(metadata) memory.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{ProfileError, Result};

/// The four magic bytes at the start of every GGUF file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Maximum nesting of arrays inside arrays accepted.
const MAX_ARRAY_DEPTH: u32 = 8;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7.
    Bool(bool),
    /// Type 8 (UTF-8).
    String(String),
    /// Type 9: all elements have the same type.
    Array(Vec<GgufValue>),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

impl GgufValue {
    /// The GGUF type name, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "u8",
            GgufValue::I8(_) => "i8",
            GgufValue::U16(_) => "u16",
            GgufValue::I16(_) => "i16",
            GgufValue::U32(_) => "u32",
            GgufValue::I32(_) => "i32",
            GgufValue::F32(_) => "f32",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
            GgufValue::U64(_) => "u64",
            GgufValue::I64(_) => "i64",
            GgufValue::F64(_) => "f64",
        }
    }

    /// The value as a signed integer, if it is an integer of any width.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as a string slice, if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
}

/// The header and metadata of a GGUF file.
#[derive(Debug, Clone)]
pub struct GgufMetadata {
    /// The file it was read from.
    pub path: PathBuf,
    /// GGUF version (2 or 3).
    pub version: u32,
    /// Number of tensors announced by the header (their table is not read).
    pub tensor_count: u64,
    /// The key/value pairs in file order.
    pub entries: Vec<(String, GgufValue)>,
    /// SHA-256 (hex) of the raw bytes from the start of the file to the end of the metadata.
    pub metadata_sha256: String,
}

impl GgufMetadata {
    /// Read the header and metadata of the GGUF file at `path`.
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|cause| ProfileError::Io {
            path: path.clone(),
            cause,
        })?;
        let len = file
            .metadata()
            .map_err(|cause| ProfileError::Io {
                path: path.clone(),
                cause,
            })?
            .len();
        Self::from_reader(BufReader::with_capacity(1 << 16, file), len, path)
    }

    /// Read the header and metadata from `reader`, which holds `len` bytes in total.
    /// `path` is only used in error messages.
    pub fn from_reader(reader: impl Read, len: u64, path: PathBuf) -> Result<Self> {
        let mut r = Cursor {
            inner: reader,
            pos: 0,
            len,
            path,
            hasher: Sha256::new(),
        };
        let mut magic = [0u8; 4];
        let have = r.read_prefix(&mut magic)?;
        if have < 4 || magic != GGUF_MAGIC {
            return Err(ProfileError::NotGguf {
                path: r.path,
                found: String::from_utf8_lossy(&magic[..have]).into_owned(),
            });
        }
        let version = r.u32("version")?;
        if version != 2 && version != 3 {
            if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
                return Err(ProfileError::GgufMalformed {
                    offset: 4,
                    reason: "big-endian GGUF files are not supported".into(),
                    path: r.path,
                });
            }
            return Err(ProfileError::UnsupportedGgufVersion {
                path: r.path,
                version,
            });
        }
        let tensor_count = r.u64("tensor count")?;
        let kv_count = r.u64("metadata count")?;
        // Each entry needs at least a key length (8), a type (4) and a 1-byte value.
        r.check_room(kv_count, 13, "metadata count")?;
        let mut entries = Vec::with_capacity(r.capacity_for::<(String, GgufValue)>(kv_count));
        for i in 0..kv_count {
            let key = r.string(&format!("key of metadata entry {i}"))?;
            let ty = r.u32(&format!("type of `{key}`"))?;
            let value = r.value(ty, &key, 0)?;
            entries.push((key, value));
        }
        let metadata_sha256 = hex::encode(r.hasher.finalize());
        Ok(GgufMetadata {
            path: r.path,
            version,
            tensor_count,
            entries,
            metadata_sha256,
        })
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The value of `key`, or [`ProfileError::MissingMetadata`].
    pub fn require(&self, key: &str) -> Result<&GgufValue> {
        self.get(key)
            .ok_or_else(|| ProfileError::MissingMetadata { key: key.into() })
    }

    /// The string value of `key`, if present; an error if present with another type.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::String(s)) => Ok(Some(s)),
            Some(other) => Err(wrong(key, "string", other)),
        }
    }

    /// The integer value of `key` as `u32`, if present; an error if of another type or
    /// out of range.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_i128()
                .and_then(|i| u32::try_from(i).ok())
                .map(Some)
                .ok_or_else(|| wrong(key, "an integer in u32 range", v)),
        }
    }

    /// The boolean value of `key`, if present.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(wrong(key, "bool", other)),
        }
    }

    /// The array value of `key`, or an error if absent or not an array.
    pub fn require_array(&self, key: &str) -> Result<&[GgufValue]> {
        match self.require(key)? {
            GgufValue::Array(items) => Ok(items),
            other => Err(wrong(key, "array", other)),
        }
    }
}

fn wrong(key: &str, expected: &str, found: &GgufValue) -> ProfileError {
    ProfileError::WrongMetadataType {
        key: key.into(),
        expected: expected.into(),
        found: found.type_name().into(),
    }
}

/// A byte reader that tracks its position, knows the total length, and hashes what it reads.
struct Cursor<R> {
    inner: R,
    pos: u64,
    len: u64,
    path: PathBuf,
    hasher: Sha256,
}

impl<R: Read> Cursor<R> {
    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    /// How many `T`s to pre-size a vector for, when a header announces `count`: never more
    /// memory than the bytes left in the file (a value takes more room in memory than its
    /// encoding — 32 bytes for a one-byte `u8` — so pre-sizing by the count alone let a corrupt
    /// count allocate ~30× the file). The vector grows past it only with elements actually read.
    fn capacity_for<T>(&self, count: u64) -> usize {
        let by_bytes = self.remaining() / (std::mem::size_of::<T>().max(1) as u64);
        usize::try_from(count.min(by_bytes)).unwrap_or(0)
    }

    /// Fail unless `count` items of at least `min_size` bytes each can still fit in the file
    /// (a file cut short, or a corrupt count; either way nothing is allocated for it).
    fn check_room(&self, count: u64, min_size: u64, what: &str) -> Result<()> {
        if count.saturating_mul(min_size) > self.remaining() {
            return Err(ProfileError::GgufTruncated {
                path: self.path.clone(),
                offset: self.len,
                what: format!(
                    "{what}: {count} items need at least {} bytes, {} left",
                    count.saturating_mul(min_size),
                    self.remaining()
                ),
            });
        }
        Ok(())
    }

    /// Read up to `buf.len()` bytes; returns how many were read (fewer only at end of file).
    fn read_prefix(&mut self, buf: &mut [u8]) -> Result<usize> {
        let mut filled = 0;
        while filled < buf.len() {
            match self.inner.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(cause) => {
                    return Err(ProfileError::Io {
                        path: self.path.clone(),
                        cause,
                    })
                }
            }
        }
        self.hasher.update(&buf[..filled]);
        self.pos += filled as u64;
        Ok(filled)
    }

    fn exact(&mut self, buf: &mut [u8], what: &str) -> Result<()> {
        let start = self.pos;
        let n = self.read_prefix(buf)?;
        if n < buf.len() {
            return Err(ProfileError::GgufTruncated {
                path: self.path.clone(),
                offset: start + n as u64,
                what: what.into(),
            });
        }
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.exact(&mut b, what)?;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(ProfileError::GgufTruncated {
                path: self.path.clone(),
                offset: self.len,
                what: format!("{what} ({len} bytes announced)"),
            });
        }
        let start = self.pos;
        // `len` fits in the file, hence in memory addressing on any 64-bit host.
        let mut buf = vec![0u8; usize::try_from(len).unwrap_or(usize::MAX)];
        self.exact(&mut buf, what)?;
        String::from_utf8(buf).map_err(|e| ProfileError::GgufMalformed {
            path: self.path.clone(),
            offset: start,
            reason: format!("{what} is not valid UTF-8: {e}"),
        })
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<GgufValue> {
        let what = || format!("value of `{key}`");
        Ok(match ty {
            0 => GgufValue::U8(u8::from_le_bytes(self.array(&what())?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(&what())?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(&what())?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(&what())?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.array(&what())?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(&what())?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(&what())?)),
            7 => {
                let offset = self.pos;
                match self.array::<1>(&what())?[0] {
                    0 => GgufValue::Bool(false),
                    1 => GgufValue::Bool(true),
                    b => {
                        return Err(ProfileError::GgufMalformed {
                            path: self.path.clone(),
                            offset,
                            reason: format!("`{key}`: invalid bool byte {b}"),
                        })
                    }
                }
            }
            8 => GgufValue::String(self.string(&what())?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(ProfileError::GgufMalformed {
                        path: self.path.clone(),
                        offset: self.pos,
                        reason: format!("`{key}`: arrays nested deeper than {MAX_ARRAY_DEPTH}"),
                    });
                }
                let elem_ty = self.u32(&format!("element type of `{key}`"))?;
                let count = self.u64(&format!("length of `{key}`"))?;
                let min_size = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    other => {
                        return Err(ProfileError::GgufMalformed {
                            path: self.path.clone(),
                            offset: self.pos,
                            reason: format!("`{key}`: unknown array element type {other}"),
                        })
                    }
                };
                self.check_room(count, min_size, &format!("length of `{key}`"))?;
                let mut items = Vec::with_capacity(self.capacity_for::<GgufValue>(count));
                for _ in 0..count {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(u64::from_le_bytes(self.array(&what())?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(&what())?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(&what())?)),
            other => {
                return Err(ProfileError::GgufMalformed {
                    path: self.path.clone(),
                    offset: self.pos.saturating_sub(4),
                    reason: format!("`{key}`: unknown value type {other}"),
                })
            }
        })
    }
}
