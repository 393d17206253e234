//! Ed25519 keys: key pairs (PKCS#8 PEM private key, SPKI PEM public key), key ids, key rings.
//!
//! Files written by [`KeyPair::write_to_dir`]: `<name>.key` (private key, PKCS#8 PEM, mode 0600)
//! and `<name>.pub` (public key, SPKI PEM). Both formats are the ones `openssl pkey` reads, so a
//! third party can use the public key file directly. The [`KeyId`] is the first 16 lowercase hex
//! digits of SHA-256 over the raw 32-byte public key.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use ed25519_dalek::pkcs8::spki::der::pem::LineEnding;
use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{ReceiptsError, Result};

/// A key id: 16 lowercase hex digits, the first 8 bytes of SHA-256(raw 32-byte public key).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct KeyId(pub String);

impl KeyId {
    /// Derive the key id of a raw Ed25519 public key.
    pub fn of_public_key_bytes(public: &[u8; 32]) -> KeyId {
        let digest = Sha256::digest(public);
        KeyId(hex::encode(&digest[..8]))
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An Ed25519 public key with its key id.
#[derive(Clone, PartialEq, Eq)]
pub struct PublicKey {
    key: VerifyingKey,
    id: KeyId,
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "PublicKey({}, {})",
            self.id,
            hex::encode(self.key.as_bytes())
        )
    }
}

impl PublicKey {
    /// From raw 32 bytes.
    pub fn from_bytes(bytes: &[u8; 32]) -> Result<PublicKey> {
        let key = VerifyingKey::from_bytes(bytes).map_err(|e| ReceiptsError::InvalidKey {
            what: "public key bytes".into(),
            detail: e.to_string(),
        })?;
        Ok(PublicKey::from_verifying(key))
    }

    fn from_verifying(key: VerifyingKey) -> PublicKey {
        let id = KeyId::of_public_key_bytes(key.as_bytes());
        PublicKey { key, id }
    }

    /// Parse an SPKI PEM (`-----BEGIN PUBLIC KEY-----`) public key.
    pub fn from_pem(pem: &str) -> Result<PublicKey> {
        let key =
            VerifyingKey::from_public_key_pem(pem).map_err(|e| ReceiptsError::InvalidKey {
                what: "public key PEM".into(),
                detail: e.to_string(),
            })?;
        Ok(PublicKey::from_verifying(key))
    }

    /// Load a public key file (SPKI PEM, as written by `kvgate keygen`).
    pub fn load(path: &Path) -> Result<PublicKey> {
        let text = fs::read_to_string(path).map_err(|e| ReceiptsError::io("read", path, e))?;
        let key =
            VerifyingKey::from_public_key_pem(&text).map_err(|e| ReceiptsError::InvalidKey {
                what: path.display().to_string(),
                detail: e.to_string(),
            })?;
        Ok(PublicKey::from_verifying(key))
    }

    /// SPKI PEM text.
    pub fn to_pem(&self) -> Result<String> {
        self.key
            .to_public_key_pem(LineEnding::LF)
            .map_err(|e| ReceiptsError::InvalidKey {
                what: "public key".into(),
                detail: e.to_string(),
            })
    }

    /// Its key id.
    pub fn key_id(&self) -> &KeyId {
        &self.id
    }

    /// The raw 32 bytes.
    pub fn to_bytes(&self) -> [u8; 32] {
        self.key.to_bytes()
    }

    /// Verify `signature` (64 bytes) over `message` (strict RFC 8032 verification).
    pub fn verify(&self, message: &[u8], signature: &[u8; 64]) -> bool {
        let sig = Signature::from_bytes(signature);
        self.key.verify_strict(message, &sig).is_ok()
    }
}

/// An Ed25519 key pair (the signing side of a gateway or a worker).
///
/// Signatures are made by AWS-LC (`aws-lc-rs`), whose constant-time base-point multiplication
/// is about 2× faster than ed25519-dalek's on this project's machines (docs/receipts.md); both implement RFC 8032's deterministic
/// signing, so the 64 bytes are the same either way (tested). Parsing, PEM and verification use
/// ed25519-dalek.
#[derive(Clone)]
pub struct KeyPair {
    signing: SigningKey,
    /// `None` only if AWS-LC refused the seed or derived another public key (never seen; then
    /// ed25519-dalek signs).
    fast: Option<std::sync::Arc<aws_lc_rs::signature::Ed25519KeyPair>>,
    public: PublicKey,
}

impl fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyPair({})", self.public.id)
    }
}

impl KeyPair {
    /// A fresh key pair from the operating system's random source.
    pub fn generate() -> KeyPair {
        let signing = SigningKey::generate(&mut rand::rngs::OsRng);
        KeyPair::from_signing(signing)
    }

    /// A key pair from a 32-byte seed (RFC 8032 secret key). Used for test vectors.
    pub fn from_seed(seed: &[u8; 32]) -> KeyPair {
        KeyPair::from_signing(SigningKey::from_bytes(seed))
    }

    fn from_signing(signing: SigningKey) -> KeyPair {
        let public = PublicKey::from_verifying(signing.verifying_key());
        // The public key dalek derived is checked against AWS-LC's own derivation.
        let fast = aws_lc_rs::signature::Ed25519KeyPair::from_seed_and_public_key(
            signing.as_bytes(),
            signing.verifying_key().as_bytes(),
        )
        .ok()
        .map(std::sync::Arc::new);
        KeyPair {
            signing,
            fast,
            public,
        }
    }

    /// Its key id.
    pub fn key_id(&self) -> &KeyId {
        &self.public.id
    }

    /// The Ed25519 signing key (for [`crate::signer`]).
    pub(crate) fn signing_key(&self) -> &SigningKey {
        &self.signing
    }

    /// Its public key.
    pub fn public(&self) -> &PublicKey {
        &self.public
    }

    /// Sign `message`, returning the 64-byte signature.
    pub fn sign(&self, message: &[u8]) -> [u8; 64] {
        let Some(fast) = &self.fast else {
            return self.sign_reference(message);
        };
        let sig = fast.sign(message);
        let mut out = [0u8; 64];
        out.copy_from_slice(sig.as_ref());
        out
    }

    /// The same signature made by ed25519-dalek (the reference [`KeyPair::sign`] is tested
    /// against, and the timing bench's baseline).
    pub fn sign_reference(&self, message: &[u8]) -> [u8; 64] {
        self.signing.sign(message).to_bytes()
    }

    /// Write `<dir>/<name>.key` (PKCS#8 PEM, mode 0600, created exclusively) and `<dir>/<name>.pub`
    /// (SPKI PEM). Refuses to overwrite either file. Returns (private path, public path).
    pub fn write_to_dir(&self, dir: &Path, name: &str) -> Result<(PathBuf, PathBuf)> {
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
            || name.starts_with('.')
        {
            return Err(ReceiptsError::InvalidKey {
                what: format!("name {name:?}"),
                detail: "a key name uses only ASCII letters, digits, '-', '_' and '.'".into(),
            });
        }
        fs::create_dir_all(dir).map_err(|e| ReceiptsError::io("create directory", dir, e))?;
        let key_path = dir.join(format!("{name}.key"));
        let pub_path = dir.join(format!("{name}.pub"));
        for p in [&key_path, &pub_path] {
            if p.exists() {
                return Err(ReceiptsError::KeyExists { path: p.clone() });
            }
        }
        let pem = self.private_pem()?;
        write_new_file(&key_path, pem.as_bytes(), 0o600)?;
        write_new_file(&pub_path, self.public.to_pem()?.as_bytes(), 0o644)?;
        Ok((key_path, pub_path))
    }

    /// The private key as PKCS#8 v1 PEM (RFC 8410 §7: the 32-byte seed, no embedded public key):
    /// the form OpenSSL 3 (`openssl pkey`) and Python `cryptography` read. (`ed25519-dalek`
    /// writes a v2 "OneAsymmetricKey" with the public key by default, which both refuse.)
    pub fn private_pem(&self) -> Result<String> {
        let bytes = ed25519_dalek::pkcs8::KeypairBytes {
            secret_key: self.signing.to_bytes(),
            public_key: None,
        };
        bytes
            .to_pkcs8_pem(LineEnding::LF)
            .map(|p| p.to_string())
            .map_err(|e| ReceiptsError::InvalidKey {
                what: "private key".into(),
                detail: e.to_string(),
            })
    }

    /// Load a private key file (PKCS#8 PEM, v1 or v2). Refuses files whose permissions allow any access by
    /// group or others (anything looser than 0600).
    pub fn load_private(path: &Path) -> Result<KeyPair> {
        let meta = fs::metadata(path).map_err(|e| ReceiptsError::io("stat", path, e))?;
        let mode = file_mode(&meta);
        if mode & 0o077 != 0 {
            return Err(ReceiptsError::KeyPermissions {
                path: path.to_path_buf(),
                mode,
            });
        }
        let text = fs::read_to_string(path).map_err(|e| ReceiptsError::io("read", path, e))?;
        let signing = SigningKey::from_pkcs8_pem(&text).map_err(|e| ReceiptsError::InvalidKey {
            what: path.display().to_string(),
            detail: e.to_string(),
        })?;
        Ok(KeyPair::from_signing(signing))
    }
}

#[cfg(unix)]
fn file_mode(meta: &fs::Metadata) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    meta.permissions().mode() & 0o7777
}

#[cfg(not(unix))]
fn file_mode(_meta: &fs::Metadata) -> u32 {
    0o600
}

fn write_new_file(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let mut opts = OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(mode);
    }
    let mut f = opts
        .open(path)
        .map_err(|e| ReceiptsError::io("create", path, e))?;
    #[cfg(unix)]
    {
        // The umask can only remove bits; make the mode exact anyway.
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(fs::Permissions::from_mode(mode))
            .map_err(|e| ReceiptsError::io("chmod", path, e))?;
    }
    #[cfg(not(unix))]
    let _ = mode;
    f.write_all(bytes)
        .map_err(|e| ReceiptsError::io("write", path, e))?;
    f.sync_all()
        .map_err(|e| ReceiptsError::io("fsync", path, e))?;
    Ok(())
}

/// Trusted public keys by key id (gateway keys for tickets, worker keys for receipts).
#[derive(Debug, Clone, Default)]
pub struct KeyRing {
    keys: BTreeMap<KeyId, (String, PublicKey)>,
}

impl KeyRing {
    /// An empty key ring.
    pub fn new() -> KeyRing {
        KeyRing::default()
    }

    /// Add a key under a human-readable name (the file stem, e.g. the gateway or worker id).
    pub fn insert(&mut self, name: impl Into<String>, key: PublicKey) {
        self.keys.insert(key.id.clone(), (name.into(), key));
    }

    /// Add one public key file; its name is the file stem.
    pub fn add_file(&mut self, path: &Path) -> Result<KeyId> {
        let key = PublicKey::load(path)?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let id = key.id.clone();
        self.insert(name, key);
        Ok(id)
    }

    /// Load every `*.pub` file of `dir` (other files, e.g. `*.key`, are ignored).
    pub fn load_dir(dir: &Path) -> Result<KeyRing> {
        let mut ring = KeyRing::new();
        ring.add_dir(dir)?;
        Ok(ring)
    }

    /// Add every `*.pub` file of `dir`; returns how many were added.
    pub fn add_dir(&mut self, dir: &Path) -> Result<usize> {
        let entries = fs::read_dir(dir).map_err(|e| ReceiptsError::io("read directory", dir, e))?;
        let mut paths = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| ReceiptsError::io("read directory", dir, e))?;
            let p = entry.path();
            if p.extension().is_some_and(|x| x == "pub") && p.is_file() {
                paths.push(p);
            }
        }
        paths.sort();
        for p in &paths {
            self.add_file(p)?;
        }
        Ok(paths.len())
    }

    /// The key with this id.
    pub fn get(&self, id: &KeyId) -> Option<&PublicKey> {
        self.keys.get(id).map(|(_, k)| k)
    }

    /// The name the key was loaded under.
    pub fn name_of(&self, id: &KeyId) -> Option<&str> {
        self.keys.get(id).map(|(n, _)| n.as_str())
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// True when there is no key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Key ids, sorted.
    pub fn ids(&self) -> impl Iterator<Item = &KeyId> {
        self.keys.keys()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// AWS-LC's signature is RFC 8032's, byte for byte: ed25519-dalek's for every seed and
        /// message, and it verifies strictly.
        #[test]
        fn aws_lc_signatures_equal_ed25519_dalek(seed in any::<[u8; 32]>(), msg in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let kp = KeyPair::from_seed(&seed);
            prop_assert!(kp.fast.is_some());
            let sig = kp.sign(&msg);
            prop_assert_eq!(sig, kp.sign_reference(&msg));
            prop_assert!(kp.public().verify(&msg, &sig));
        }
    }

    #[test]
    fn key_id_is_sha256_prefix_of_public_key() {
        let kp = KeyPair::from_seed(&[7u8; 32]);
        let expect = hex::encode(&Sha256::digest(kp.public().to_bytes())[..8]);
        assert_eq!(kp.key_id().as_str(), expect);
        assert_eq!(kp.key_id().as_str().len(), 16);
    }

    #[test]
    fn write_load_round_trip_and_permissions() {
        let dir = tempfile::tempdir().unwrap();
        let kp = KeyPair::generate();
        let (key, pubf) = kp.write_to_dir(dir.path(), "gw-1").unwrap();
        let loaded = KeyPair::load_private(&key).unwrap();
        assert_eq!(loaded.key_id(), kp.key_id());
        let public = PublicKey::load(&pubf).unwrap();
        assert_eq!(public.key_id(), kp.key_id());
        let sig = loaded.sign(b"hello");
        assert!(public.verify(b"hello", &sig));
        assert!(!public.verify(b"hellp", &sig));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&key).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
            fs::set_permissions(&key, fs::Permissions::from_mode(0o640)).unwrap();
            let err = KeyPair::load_private(&key).unwrap_err();
            assert_eq!(err.error_type(), "key_permissions");
            assert!(err.to_string().contains("0640"), "{err}");
            fs::set_permissions(&key, fs::Permissions::from_mode(0o400)).unwrap();
            assert!(KeyPair::load_private(&key).is_ok());
        }
        // never overwrites
        let err = kp.write_to_dir(dir.path(), "gw-1").unwrap_err();
        assert_eq!(err.error_type(), "key_exists");
    }

    #[test]
    fn key_ring_loads_pub_files_only() {
        let dir = tempfile::tempdir().unwrap();
        let a = KeyPair::generate();
        let b = KeyPair::generate();
        a.write_to_dir(dir.path(), "gw").unwrap();
        b.write_to_dir(dir.path(), "worker-0").unwrap();
        let ring = KeyRing::load_dir(dir.path()).unwrap();
        assert_eq!(ring.len(), 2);
        assert_eq!(ring.name_of(a.key_id()), Some("gw"));
        assert_eq!(ring.name_of(b.key_id()), Some("worker-0"));
        assert!(ring.get(&KeyId("0000000000000000".into())).is_none());
    }

    #[test]
    fn rejects_bad_names() {
        let dir = tempfile::tempdir().unwrap();
        for bad in ["", "../x", "a/b", ".hidden"] {
            assert!(
                KeyPair::generate().write_to_dir(dir.path(), bad).is_err(),
                "{bad}"
            );
        }
    }
}
