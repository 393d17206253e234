//! The profile identity: what must agree between a gateway and its workers for their
//! token ids (and therefore their block keys) to agree.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Model id, revision, template and tokenizer hashes, context limit and end-of-sequence ids.
///
/// Serialized as JSON with exactly these field names (the worker's `GET /v1/profile` embeds it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfileIdentity {
    /// The model id (by default the model file's stem, e.g. `SmolLM2-135M-Instruct.Q4_1`).
    pub model_id: String,
    /// The model revision: GGUF `general.version` if present, else `gguf-meta:` + the first
    /// 16 hex digits of the SHA-256 of the GGUF header and metadata bytes (for HF files,
    /// `hf-files:` + 16 hex digits of the SHA-256 of the two JSON files); or set explicitly.
    pub revision: String,
    /// SHA-256 hex of the chat template text (UTF-8 bytes).
    pub template_sha256: String,
    /// SHA-256 hex of the tokenizer's canonical serialization.
    pub tokenizer_sha256: String,
    /// Context length in tokens (prompt + output).
    pub context_limit: u32,
    /// Token ids that end generation.
    pub eos_token_ids: Vec<u32>,
    /// The beginning-of-sequence token id, if the model has one.
    pub bos_token_id: Option<u32>,
}

impl ProfileIdentity {
    /// A stable SHA-256 hex digest over every field.
    ///
    /// Byte layout (versioned by its domain tag): `"kvgate-profile-identity-v1\0"`, then for each
    /// string field in declaration order its UTF-8 length as u64 little-endian followed by
    /// its bytes, then `context_limit` as u32 LE, the number of eos ids as u64 LE and each id
    /// as u32 LE, then `0x00` for no bos or `0x01` followed by the id as u32 LE.
    pub fn digest(&self) -> String {
        let mut h = Sha256::new();
        h.update(b"kvgate-profile-identity-v1\0");
        for s in [
            &self.model_id,
            &self.revision,
            &self.template_sha256,
            &self.tokenizer_sha256,
        ] {
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        h.update(self.context_limit.to_le_bytes());
        h.update((self.eos_token_ids.len() as u64).to_le_bytes());
        for id in &self.eos_token_ids {
            h.update(id.to_le_bytes());
        }
        match self.bos_token_id {
            None => h.update([0u8]),
            Some(id) => {
                h.update([1u8]);
                h.update(id.to_le_bytes());
            }
        }
        hex::encode(h.finalize())
    }

    /// Names of the fields that differ between `self` and `other` (empty when equal), for
    /// "profile mismatch" errors.
    pub fn differing_fields(&self, other: &ProfileIdentity) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.model_id != other.model_id {
            out.push("model_id");
        }
        if self.revision != other.revision {
            out.push("revision");
        }
        if self.template_sha256 != other.template_sha256 {
            out.push("template_sha256");
        }
        if self.tokenizer_sha256 != other.tokenizer_sha256 {
            out.push("tokenizer_sha256");
        }
        if self.context_limit != other.context_limit {
            out.push("context_limit");
        }
        if self.eos_token_ids != other.eos_token_ids {
            out.push("eos_token_ids");
        }
        if self.bos_token_id != other.bos_token_id {
            out.push("bos_token_id");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ProfileIdentity {
        ProfileIdentity {
            model_id: "m".into(),
            revision: "r".into(),
            template_sha256: "t".into(),
            tokenizer_sha256: "k".into(),
            context_limit: 8192,
            eos_token_ids: vec![2],
            bos_token_id: Some(1),
        }
    }

    #[test]
    fn digest_is_pinned() {
        // Pinned so that an accidental change of the byte layout is noticed; computed
        // independently with Python hashlib over the layout documented on `digest`.
        assert_eq!(
            sample().digest(),
            "50c6fb1d5b4760ce5c889f051a4a37d0d2951e20bec05e318aa695ba87149c0c"
        );
    }

    #[test]
    fn every_field_changes_the_digest() {
        let base = sample();
        let d = base.digest();
        let variants = [
            ProfileIdentity {
                model_id: "m2".into(),
                ..base.clone()
            },
            ProfileIdentity {
                revision: "r2".into(),
                ..base.clone()
            },
            ProfileIdentity {
                template_sha256: "t2".into(),
                ..base.clone()
            },
            ProfileIdentity {
                tokenizer_sha256: "k2".into(),
                ..base.clone()
            },
            ProfileIdentity {
                context_limit: 4096,
                ..base.clone()
            },
            ProfileIdentity {
                eos_token_ids: vec![2, 0],
                ..base.clone()
            },
            ProfileIdentity {
                bos_token_id: None,
                ..base.clone()
            },
            // length prefixes: moving a byte between adjacent fields changes the digest
            ProfileIdentity {
                model_id: "mr".into(),
                revision: "".into(),
                ..base.clone()
            },
        ];
        for v in variants {
            assert_ne!(v.digest(), d, "{v:?}");
            assert!(!base.differing_fields(&v).is_empty());
        }
        assert!(base.differing_fields(&base.clone()).is_empty());
    }

    #[test]
    fn json_field_names_are_pinned() {
        let json = serde_json::to_string(&sample()).unwrap();
        assert_eq!(
            json,
            r#"{"model_id":"m","revision":"r","template_sha256":"t","tokenizer_sha256":"k","context_limit":8192,"eos_token_ids":[2],"bos_token_id":1}"#
        );
        let back: ProfileIdentity = serde_json::from_str(&json).unwrap();
        assert_eq!(back, sample());
    }
}
