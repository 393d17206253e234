//! Block keys: salted, parent-chained hashes of full blocks of token ids.
//!
//! The byte-level definition (shared by the gateway and the worker, reproducible in any
//! language) is in `docs/block-keys.md`; this module is its reference implementation and the
//! tests at the bottom reproduce that document's test vectors.
//!
//! In short: a [`NamespaceSeed`] is the SHA-256 of a length-prefixed encoding of the
//! [`NamespaceInputs`] (profile identity, block size, algorithm, salt, adapter). The chain digest
//! `D[-1]` is the seed (its first 8 bytes for `xxh3`), `D[i] = H(D[i-1] ‖ u32-LE token ids of
//! block i)`, and `key[i]` is the big-endian `u64` of the first 8 bytes of `D[i]`. Only full
//! blocks get a key.
//!
//! Complexity: [`KeyChain::keys`] hashes each token once, O(n) for n tokens, with one buffer
//! allocation per call; [`KeyChain::next`] is O(B), allocation-free for B ≤ 64.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};

use crate::error::IndexError;

/// Domain-separation prefix of the namespace seed encoding (version 1 of the definition).
pub const SEED_DOMAIN: &[u8] = b"kvgate/block-keys/v1";

/// Largest allowed block size, in tokens.
pub const MAX_BLOCK_SIZE: u32 = 1024;

/// Default block size, in tokens.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

// ---------------------------------------------------------------------------------------------
// BlockKey
// ---------------------------------------------------------------------------------------------

/// 64-bit key of one full block of tokens, chained on its parent.
/// On the wire (JSON) a key is a 16-character lowercase hex string; `Display` prints the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u64);

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl FromStr for BlockKey {
    type Err = IndexError;

    /// Parses exactly 16 hex digits (either case; lowercase is canonical).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |reason: String| IndexError::InvalidHex {
            what: "block key",
            reason,
        };
        if s.len() != 16 {
            return Err(bad(format!(
                "expected 16 hex digits, got {} bytes",
                s.len()
            )));
        }
        if !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad(format!("non-hex character in {s:?}")));
        }
        u64::from_str_radix(s, 16)
            .map(BlockKey)
            .map_err(|e| bad(e.to_string()))
    }
}

impl Serialize for BlockKey {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for BlockKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = BlockKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a block key as 16 hex digits")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<BlockKey, E> {
                v.parse().map_err(E::custom)
            }
        }
        deserializer.deserialize_str(Visitor)
    }
}

// ---------------------------------------------------------------------------------------------
// WorkerId
// ---------------------------------------------------------------------------------------------

/// Identifier of a worker as the operator names it (e.g. `w1`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkerId(pub String);

impl WorkerId {
    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for WorkerId {
    fn from(s: &str) -> Self {
        WorkerId(s.to_owned())
    }
}

impl From<String> for WorkerId {
    fn from(s: String) -> Self {
        WorkerId(s)
    }
}

// ---------------------------------------------------------------------------------------------
// HashAlgorithm
// ---------------------------------------------------------------------------------------------

/// Hash algorithm of a key chain. `xxh3` (XXH3-64, fast, the default) or `sha256`
/// (collision-resistant, for shared multi-tenant services).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HashAlgorithm {
    /// XXH3, 64-bit output, seed 0.
    #[default]
    Xxh3,
    /// SHA-256.
    Sha256,
}

impl HashAlgorithm {
    /// The wire name: `"xxh3"` or `"sha256"`.
    pub fn as_str(self) -> &'static str {
        match self {
            HashAlgorithm::Xxh3 => "xxh3",
            HashAlgorithm::Sha256 => "sha256",
        }
    }

    /// Length in bytes of the chain digest `D[i]`: 8 for xxh3, 32 for sha256.
    pub fn digest_len(self) -> usize {
        match self {
            HashAlgorithm::Xxh3 => 8,
            HashAlgorithm::Sha256 => 32,
        }
    }
}

impl fmt::Display for HashAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HashAlgorithm {
    type Err = IndexError;

    /// Accepts exactly `xxh3` or `sha256` (the wire names).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "xxh3" => Ok(HashAlgorithm::Xxh3),
            "sha256" => Ok(HashAlgorithm::Sha256),
            other => Err(IndexError::UnknownAlgorithm {
                name: other.to_owned(),
            }),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// BlockSize
// ---------------------------------------------------------------------------------------------

/// Tokens per block, 1..=1024 (default 16). A JSON number on the wire, validated when
/// deserialized.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "u64", into = "u32")]
pub struct BlockSize(u32);

impl BlockSize {
    /// A block size, or [`IndexError::InvalidBlockSize`] outside `1..=1024`.
    pub fn new(n: u32) -> Result<Self, IndexError> {
        if (1..=MAX_BLOCK_SIZE).contains(&n) {
            Ok(BlockSize(n))
        } else {
            Err(IndexError::InvalidBlockSize { value: n.into() })
        }
    }

    /// The size as a `usize` (for slicing).
    pub fn get(self) -> usize {
        self.0 as usize
    }

    /// The size as a `u32` (its wire type).
    pub fn as_u32(self) -> u32 {
        self.0
    }
}

impl Default for BlockSize {
    fn default() -> Self {
        BlockSize(DEFAULT_BLOCK_SIZE)
    }
}

impl fmt::Display for BlockSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl TryFrom<u64> for BlockSize {
    type Error = IndexError;
    fn try_from(n: u64) -> Result<Self, Self::Error> {
        match u32::try_from(n) {
            Ok(n) => BlockSize::new(n),
            Err(_) => Err(IndexError::InvalidBlockSize { value: n }),
        }
    }
}

impl From<BlockSize> for u32 {
    fn from(b: BlockSize) -> u32 {
        b.0
    }
}

// ---------------------------------------------------------------------------------------------
// NamespaceSeed
// ---------------------------------------------------------------------------------------------

/// The seed of a chain (`D[-1]`), derived from the namespace inputs. 32 bytes; 64 lowercase
/// hex characters on the wire.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct NamespaceSeed(pub [u8; 32]);

/// Everything that selects a key namespace: two requests share block keys only when all of
/// these are equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NamespaceInputs<'a> {
    /// Model id of the profile (e.g. `HuggingFaceTB/SmolLM2-135M-Instruct`).
    pub model_id: &'a str,
    /// Model revision of the profile.
    pub revision: &'a str,
    /// SHA-256 (lowercase hex, as the profile publishes it) of the chat template.
    pub template_sha256: &'a str,
    /// SHA-256 (lowercase hex, as the profile publishes it) of the tokenizer.
    pub tokenizer_sha256: &'a str,
    /// Tokens per block.
    pub block_size: BlockSize,
    /// Hash algorithm of the chain.
    pub algorithm: HashAlgorithm,
    /// Optional cache salt (tenant, service or per-request). `None` and `Some("")` differ.
    pub salt: Option<&'a str>,
    /// Optional adapter (LoRA) id. `None` and `Some("")` differ.
    pub adapter: Option<&'a str>,
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_opt_str(buf: &mut Vec<u8>, s: Option<&str>) {
    match s {
        None => buf.push(0),
        Some(s) => {
            buf.push(1);
            put_str(buf, s);
        }
    }
}

impl NamespaceSeed {
    /// The exact bytes hashed by [`NamespaceSeed::derive`] (see `docs/block-keys.md`):
    /// `"kvgate/block-keys/v1"`, then model id, revision, template SHA-256, tokenizer SHA-256
    /// (each u64-LE length ‖ UTF-8), block size (u32 LE), algorithm name (length-prefixed),
    /// salt and adapter (each `0x00`, or `0x01` ‖ length-prefixed string).
    pub fn encode_inputs(inputs: &NamespaceInputs<'_>) -> Vec<u8> {
        let mut buf = Vec::with_capacity(
            SEED_DOMAIN.len()
                + 6 * 8
                + 2
                + 4
                + inputs.model_id.len()
                + inputs.revision.len()
                + inputs.template_sha256.len()
                + inputs.tokenizer_sha256.len()
                + 6
                + inputs.salt.map_or(0, str::len)
                + inputs.adapter.map_or(0, str::len),
        );
        buf.extend_from_slice(SEED_DOMAIN);
        put_str(&mut buf, inputs.model_id);
        put_str(&mut buf, inputs.revision);
        put_str(&mut buf, inputs.template_sha256);
        put_str(&mut buf, inputs.tokenizer_sha256);
        buf.extend_from_slice(&inputs.block_size.as_u32().to_le_bytes());
        put_str(&mut buf, inputs.algorithm.as_str());
        put_opt_str(&mut buf, inputs.salt);
        put_opt_str(&mut buf, inputs.adapter);
        buf
    }

    /// Derives the seed: SHA-256 of [`NamespaceSeed::encode_inputs`]. Always SHA-256,
    /// whatever the chain's algorithm. Cost: one SHA-256 over ~200 bytes; cache it per
    /// namespace when convenient.
    pub fn derive(inputs: &NamespaceInputs<'_>) -> Self {
        NamespaceSeed(Sha256::digest(Self::encode_inputs(inputs)).into())
    }

    /// 64 lowercase hex characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses 64 hex characters (either case).
    pub fn from_hex(s: &str) -> Result<Self, IndexError> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|e| IndexError::InvalidHex {
            what: "namespace seed",
            reason: format!("expected 64 hex digits: {e}"),
        })?;
        Ok(NamespaceSeed(out))
    }
}

impl fmt::Debug for NamespaceSeed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NamespaceSeed({})", self.to_hex())
    }
}

impl fmt::Display for NamespaceSeed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl Serialize for NamespaceSeed {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for NamespaceSeed {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        NamespaceSeed::from_hex(&s).map_err(serde::de::Error::custom)
    }
}

// ---------------------------------------------------------------------------------------------
// KeyChain / ChainLink
// ---------------------------------------------------------------------------------------------

/// One position of a chain: the full digest `D[i]` (8 bytes for xxh3, 32 for sha256), from
/// which the 64-bit key is taken. [`KeyChain::root`] gives `D[-1]`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChainLink {
    digest: [u8; 32],
    len: u8,
}

impl ChainLink {
    /// The 64-bit key of this position: big-endian `u64` of the digest's first 8 bytes.
    /// (For the root this is the "key" of the seed, which is never stored in an index.)
    pub fn key(&self) -> BlockKey {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.digest[..8]);
        BlockKey(u64::from_be_bytes(b))
    }

    /// The full digest `D[i]`: 8 bytes (xxh3) or 32 bytes (sha256).
    pub fn digest(&self) -> &[u8] {
        &self.digest[..self.len as usize]
    }
}

impl fmt::Debug for ChainLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChainLink({})", hex::encode(self.digest()))
    }
}

/// A key namespace ready to hash: seed + algorithm + block size. Cheap to copy (~40 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyChain {
    seed: NamespaceSeed,
    algorithm: HashAlgorithm,
    block_size: BlockSize,
}

impl KeyChain {
    /// A chain over `seed`. The seed should come from [`NamespaceSeed::derive`] with the same
    /// algorithm and block size, but nothing checks that.
    pub fn new(seed: NamespaceSeed, algorithm: HashAlgorithm, block_size: BlockSize) -> Self {
        KeyChain {
            seed,
            algorithm,
            block_size,
        }
    }

    /// Derives the seed from `inputs` and builds the chain with their algorithm and block size.
    pub fn from_inputs(inputs: &NamespaceInputs<'_>) -> Self {
        KeyChain::new(
            NamespaceSeed::derive(inputs),
            inputs.algorithm,
            inputs.block_size,
        )
    }

    /// Tokens per block.
    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    /// Hash algorithm.
    pub fn algorithm(&self) -> HashAlgorithm {
        self.algorithm
    }

    /// Namespace seed.
    pub fn seed(&self) -> NamespaceSeed {
        self.seed
    }

    /// `D[-1]`: the seed's first 8 bytes for xxh3, the whole seed for sha256.
    pub fn root(&self) -> ChainLink {
        ChainLink {
            digest: self.seed.0,
            len: self.algorithm.digest_len() as u8,
        }
    }

    /// The keys of every **full** block of `tokens`, in order (a trailing partial block has
    /// no key). `keys(t)[..k]` equals `keys(&t[..k*B])`. O(len) hashing, one allocation for
    /// the result and one scratch buffer.
    pub fn keys(&self, tokens: &[u32]) -> Vec<BlockKey> {
        let mut out = Vec::new();
        self.keys_into(tokens, &mut out);
        out
    }

    /// Like [`KeyChain::keys`], but clears `out` and fills it (reuses its allocation).
    pub fn keys_into(&self, tokens: &[u32], out: &mut Vec<BlockKey>) {
        out.clear();
        let b = self.block_size.get();
        let blocks = tokens.len() / b;
        out.reserve(blocks);
        match self.algorithm {
            HashAlgorithm::Xxh3 => {
                let mut buf = vec![0u8; 8 + 4 * b];
                let mut parent = self.root().key().0;
                for block in tokens.chunks_exact(b) {
                    parent = xxh3_step(&mut buf, parent, block);
                    out.push(BlockKey(parent));
                }
            }
            HashAlgorithm::Sha256 => {
                let mut buf = vec![0u8; 32 + 4 * b];
                let mut parent = self.seed.0;
                for block in tokens.chunks_exact(b) {
                    parent = sha256_step(&mut buf, &parent, block);
                    out.push(
                        ChainLink {
                            digest: parent,
                            len: 32,
                        }
                        .key(),
                    );
                }
            }
        }
    }

    /// The chain position after `parent` for one full `block`, for callers that build the
    /// chain incrementally (the engine's prefix cache). Errors with
    /// [`IndexError::BlockLength`] unless `block.len()` equals the block size. `parent` must
    /// come from this chain ([`KeyChain::root`] or an earlier `next`); a link of another
    /// algorithm gives a well-defined but meaningless key, never a panic.
    pub fn next(&self, parent: &ChainLink, block: &[u32]) -> Result<ChainLink, IndexError> {
        let b = self.block_size.get();
        if block.len() != b {
            return Err(IndexError::BlockLength {
                expected: b,
                got: block.len(),
            });
        }
        // Scratch: on the stack for blocks of up to 64 tokens, on the heap above that.
        let need = 32 + 4 * b;
        let mut small = [0u8; 32 + 4 * 64];
        let mut big = Vec::new();
        let buf: &mut [u8] = if need <= small.len() {
            &mut small[..need]
        } else {
            big.resize(need, 0u8);
            &mut big
        };
        let link = match self.algorithm {
            HashAlgorithm::Xxh3 => {
                let mut pd = [0u8; 8];
                let n = parent.digest().len().min(8);
                pd[..n].copy_from_slice(&parent.digest()[..n]);
                let k = xxh3_step(&mut buf[..8 + 4 * b], u64::from_be_bytes(pd), block);
                let mut digest = [0u8; 32];
                digest[..8].copy_from_slice(&k.to_be_bytes());
                ChainLink { digest, len: 8 }
            }
            HashAlgorithm::Sha256 => {
                let pd = parent.digest();
                let scratch = &mut buf[..pd.len() + 4 * b];
                scratch[..pd.len()].copy_from_slice(pd);
                fill_tokens(&mut scratch[pd.len()..], block);
                ChainLink {
                    digest: Sha256::digest(&*scratch).into(),
                    len: 32,
                }
            }
        };
        Ok(link)
    }
}

/// Writes `block` as u32 little-endian into `dst` (exactly `4 * block.len()` bytes).
#[inline]
fn fill_tokens(dst: &mut [u8], block: &[u32]) {
    for (d, t) in dst.chunks_exact_mut(4).zip(block) {
        d.copy_from_slice(&t.to_le_bytes());
    }
}

/// `XXH3_64(BE64(parent) ‖ LE32(block))`; `buf` is exactly `8 + 4 * block.len()` bytes.
#[inline]
fn xxh3_step(buf: &mut [u8], parent: u64, block: &[u32]) -> u64 {
    buf[..8].copy_from_slice(&parent.to_be_bytes());
    fill_tokens(&mut buf[8..], block);
    xxhash_rust::xxh3::xxh3_64(buf)
}

/// `SHA-256(parent ‖ LE32(block))`; `buf` is exactly `32 + 4 * block.len()` bytes.
#[inline]
fn sha256_step(buf: &mut [u8], parent: &[u8; 32], block: &[u32]) -> [u8; 32] {
    buf[..32].copy_from_slice(parent);
    fill_tokens(&mut buf[32..], block);
    Sha256::digest(&*buf).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(alg: HashAlgorithm, b: u32, salt: Option<&'static str>) -> NamespaceInputs<'static> {
        NamespaceInputs {
            model_id: "HuggingFaceTB/SmolLM2-135M-Instruct",
            revision: "main",
            template_sha256: "aa",
            tokenizer_sha256: "bb",
            block_size: BlockSize::new(b).unwrap(),
            algorithm: alg,
            salt,
            adapter: None,
        }
    }

    #[test]
    fn block_key_json_is_16_lowercase_hex() {
        let k = BlockKey(0x00ab_cdef_0123_4567);
        assert_eq!(serde_json::to_string(&k).unwrap(), "\"00abcdef01234567\"");
        assert_eq!(k.to_string(), "00abcdef01234567");
        let back: BlockKey = serde_json::from_str("\"00abcdef01234567\"").unwrap();
        assert_eq!(back, k);
        assert_eq!("00ABCDEF01234567".parse::<BlockKey>().unwrap(), k);
        for bad in [
            "\"abc\"",
            "\"+0abcdef01234567\"",
            "\"00abcdef0123456g\"",
            "17",
        ] {
            assert!(serde_json::from_str::<BlockKey>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn block_size_bounds_and_serde() {
        assert!(BlockSize::new(0).is_err());
        assert!(BlockSize::new(1025).is_err());
        assert_eq!(BlockSize::new(1).unwrap().get(), 1);
        assert_eq!(BlockSize::new(1024).unwrap().get(), 1024);
        assert_eq!(BlockSize::default().get(), 16);
        assert_eq!(serde_json::to_string(&BlockSize::default()).unwrap(), "16");
        assert_eq!(
            serde_json::from_str::<BlockSize>("4").unwrap(),
            BlockSize::new(4).unwrap()
        );
        for bad in ["0", "1025", "5000000000", "-1", "\"16\""] {
            assert!(serde_json::from_str::<BlockSize>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn algorithm_names() {
        assert_eq!(HashAlgorithm::default(), HashAlgorithm::Xxh3);
        for a in [HashAlgorithm::Xxh3, HashAlgorithm::Sha256] {
            assert_eq!(a.to_string().parse::<HashAlgorithm>().unwrap(), a);
            let json = serde_json::to_string(&a).unwrap();
            assert_eq!(json, format!("\"{a}\""));
        }
        assert_eq!(
            "md5".parse::<HashAlgorithm>().unwrap_err().error_type(),
            "unknown_hash_algorithm"
        );
    }

    #[test]
    fn seed_hex_round_trip() {
        let s = NamespaceSeed::derive(&inputs(HashAlgorithm::Xxh3, 16, None));
        assert_eq!(s.to_hex().len(), 64);
        assert_eq!(NamespaceSeed::from_hex(&s.to_hex()).unwrap(), s);
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json, format!("\"{}\"", s.to_hex()));
        assert_eq!(serde_json::from_str::<NamespaceSeed>(&json).unwrap(), s);
        assert!(NamespaceSeed::from_hex("00").is_err());
        assert!(NamespaceSeed::from_hex(&"zz".repeat(32)).is_err());
    }

    #[test]
    fn only_full_blocks_get_keys_and_prefixes_chain() {
        for alg in [HashAlgorithm::Xxh3, HashAlgorithm::Sha256] {
            let chain = KeyChain::from_inputs(&inputs(alg, 4, None));
            let tokens: Vec<u32> = (0..23).collect();
            let keys = chain.keys(&tokens);
            assert_eq!(keys.len(), 5);
            assert_eq!(chain.keys(&tokens[..3]), Vec::<BlockKey>::new());
            assert_eq!(chain.keys(&tokens[..12]), keys[..3].to_vec());
            // incremental == batch
            let mut link = chain.root();
            for (i, block) in tokens.chunks_exact(4).enumerate() {
                link = chain.next(&link, block).unwrap();
                assert_eq!(link.key(), keys[i]);
                assert_eq!(link.digest().len(), alg.digest_len());
            }
            assert_eq!(
                chain.next(&chain.root(), &tokens[..3]).unwrap_err(),
                IndexError::BlockLength {
                    expected: 4,
                    got: 3
                }
            );
        }
    }

    #[test]
    fn every_namespace_input_changes_every_key() {
        let tokens: Vec<u32> = (100..164).collect();
        let base = inputs(HashAlgorithm::Xxh3, 4, None);
        let base_keys = KeyChain::from_inputs(&base).keys(&tokens);
        let variants = [
            NamespaceInputs {
                model_id: "other",
                ..base
            },
            NamespaceInputs {
                revision: "v2",
                ..base
            },
            NamespaceInputs {
                template_sha256: "ab",
                ..base
            },
            NamespaceInputs {
                tokenizer_sha256: "bc",
                ..base
            },
            NamespaceInputs {
                algorithm: HashAlgorithm::Sha256,
                ..base
            },
            NamespaceInputs {
                salt: Some(""),
                ..base
            },
            NamespaceInputs {
                salt: Some("tenant-a"),
                ..base
            },
            NamespaceInputs {
                adapter: Some("lora-1"),
                ..base
            },
        ];
        for v in variants {
            let keys = KeyChain::from_inputs(&v).keys(&tokens);
            assert_eq!(keys.len(), base_keys.len());
            for (a, b) in keys.iter().zip(&base_keys) {
                assert_ne!(a, b, "{v:?}");
            }
        }
        // block size changes the seed too (same chain input bytes, different seed)
        let b2 = NamespaceInputs {
            block_size: BlockSize::new(2).unwrap(),
            ..base
        };
        assert_ne!(NamespaceSeed::derive(&b2), NamespaceSeed::derive(&base));
    }
}
