//! Receipts: the worker's signed record of serving one request.
//!
//! A receipt is stored as one line of canonical JSON (see [`crate::canonical`]) holding every
//! field below, `signature` included. The signature is Ed25519 over
//! `RECEIPT_DOMAIN || canonical JSON of the receipt without its "signature" member`.
//! The receipt's hash (what the next receipt's `prev_hash` holds) is SHA-256 of the complete
//! line bytes without the trailing newline, i.e. of the canonical JSON of the whole receipt.

use prefix_index::{BlockKey, WorkerId};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::canonical;
use crate::error::{ReceiptsError, Result};
use crate::keys::{KeyId, KeyRing};
use crate::signer::Signer;
use crate::ticket::SignedTicket;

/// Domain-separation prefix of the bytes a receipt signature covers.
pub const RECEIPT_DOMAIN: &[u8] = b"kvgate.receipt.v1\n";

/// `prev_hash` of the first receipt of a log: 64 zeros.
pub const GENESIS_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// What the worker knows about a served request: the body of a receipt, carried once from the
/// worker's request handling into the signed [`Receipt`] (which flattens it); the log adds the
/// chain fields and signs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ReceiptDraft {
    /// The request id (from the ticket, or `x-request-id`, or generated for direct requests).
    pub request_id: String,
    /// The verified route ticket, verbatim; `None` for a direct (ticketless) request.
    pub ticket: Option<SignedTicket>,
    /// The model id served.
    pub model: String,
    /// The prompt profile identity digest (lowercase hex).
    pub profile_digest: String,
    /// SHA-256 of the request body bytes (lowercase hex).
    pub request_sha256: String,
    /// SHA-256 of the response content (the generated text, UTF-8) (lowercase hex).
    pub response_sha256: String,
    /// Prompt tokens as the engine tokenized them.
    pub prompt_tokens: u32,
    /// Prompt tokens reused from the prefix cache, as the engine saw them.
    pub cached_tokens: u32,
    /// Completion tokens generated.
    pub completion_tokens: u32,
    /// OpenAI finish reason (`stop`, `length`, ...), `None` when generation did not finish.
    pub finish_reason: Option<String>,
    /// HTTP status returned to the client.
    pub status: u16,
    /// Error code (an `error_type()` string) when the request failed.
    pub error_code: Option<String>,
    /// When the worker received the request (Unix ms).
    pub received_at_ms: u64,
    /// When the first token was produced (Unix ms), if any.
    pub first_token_at_ms: Option<u64>,
    /// When the response completed (Unix ms).
    pub completed_at_ms: u64,
    /// The worker's own key of the prompt's last full block (16 lowercase hex), if any.
    pub last_block_key: Option<BlockKey>,
}

/// A signed, chained receipt (one line of a [`crate::ReceiptLog`]): the chain fields, the
/// worker's [`ReceiptDraft`] (its fields sit at the top level of the JSON object) and the
/// signature. Unknown members are refused by [`Receipt::from_line`]'s canonical re-encoding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    /// Position in this log, from 0, without gaps.
    pub seq: u64,
    /// Hash of the previous receipt of this log ([`GENESIS_HASH`] for seq 0).
    pub prev_hash: String,
    /// The worker that served the request.
    pub worker_id: WorkerId,
    /// The key id of the worker key that signed this receipt.
    pub key_id: KeyId,
    /// What the worker recorded about the request.
    #[serde(flatten)]
    pub body: ReceiptDraft,
    /// Ed25519 signature, 128 lowercase hex digits.
    pub signature: String,
}

/// The receipt without its signature: the object whose canonical JSON is signed.
#[derive(Serialize)]
struct Unsigned<'a> {
    seq: u64,
    prev_hash: &'a str,
    worker_id: &'a WorkerId,
    key_id: &'a KeyId,
    #[serde(flatten)]
    body: &'a ReceiptDraft,
}

impl Receipt {
    /// Build and sign a receipt from a draft and its chain position.
    pub fn sign(
        draft: ReceiptDraft,
        seq: u64,
        prev_hash: String,
        worker_id: WorkerId,
        key: &impl Signer,
    ) -> Result<Receipt> {
        let mut r = Receipt {
            seq,
            prev_hash,
            worker_id,
            key_id: key.key_id().clone(),
            body: draft,
            signature: String::new(),
        };
        let sig = key.sign_message(&r.signed_bytes()?);
        r.signature = hex::encode(sig);
        Ok(r)
    }

    /// The bytes the signature covers: `RECEIPT_DOMAIN || canonical JSON without "signature"`.
    pub fn signed_bytes(&self) -> Result<Vec<u8>> {
        let unsigned = Unsigned {
            seq: self.seq,
            prev_hash: &self.prev_hash,
            worker_id: &self.worker_id,
            key_id: &self.key_id,
            body: &self.body,
        };
        let mut out = RECEIPT_DOMAIN.to_vec();
        out.extend_from_slice(&canonical::to_vec(&unsigned)?);
        Ok(out)
    }

    /// The log line (canonical JSON of the whole receipt, without newline).
    pub fn to_line(&self) -> Result<Vec<u8>> {
        canonical::to_vec(self)
    }

    /// Parse one log line (without its newline); it must be canonical.
    pub fn from_line(line: &[u8]) -> Result<Receipt> {
        let r: Receipt = serde_json::from_slice(line).map_err(|e| ReceiptsError::Malformed {
            what: "receipt",
            detail: e.to_string(),
        })?;
        if r.to_line()? != line {
            return Err(ReceiptsError::NonCanonical { what: "receipt" });
        }
        Ok(r)
    }

    /// SHA-256 of a line's bytes (lowercase hex): the value the next receipt's `prev_hash` holds.
    pub fn line_hash(line: &[u8]) -> String {
        hex::encode(Sha256::digest(line))
    }

    /// Check the receipt's signature with the key its `key_id` names.
    pub fn verify_signature(&self, keys: &KeyRing) -> Result<()> {
        let key = keys
            .get(&self.key_id)
            .ok_or_else(|| ReceiptsError::UnknownKey {
                what: "receipt",
                key_id: self.key_id.0.clone(),
            })?;
        let bad = || ReceiptsError::BadSignature {
            what: "receipt",
            key_id: self.key_id.0.clone(),
        };
        let sig_vec = hex::decode(&self.signature).map_err(|_| bad())?;
        let sig: [u8; 64] = sig_vec.as_slice().try_into().map_err(|_| bad())?;
        // Only the lowercase spelling is valid: the line's bytes (and so the chain hash) must be
        // unique for a given signature.
        if hex::encode(sig) != self.signature {
            return Err(bad());
        }
        if !key.verify(&self.signed_bytes()?, &sig) {
            return Err(bad());
        }
        Ok(())
    }
}

/// SHA-256 of `bytes` as lowercase hex (for `request_sha256` / `response_sha256`).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// `finish_reason` of an answer from its choices' finish reasons in index order: `stop` when
/// every choice stopped, else the first other reason; `None` when no choice finished.
pub fn finish_reason_of<'a>(reasons: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let mut first = None;
    for r in reasons {
        if r != "stop" {
            return Some(r.to_string());
        }
        first.get_or_insert(r);
    }
    first.map(str::to_string)
}

/// `response_sha256` of an answer from its choices' text SHA-256s in index order: the one
/// choice's hash, or for several choices (`n > 1`) the SHA-256 of their concatenation
/// (32 raw bytes each). No choice: the SHA-256 of nothing.
pub fn response_sha256(choice_hashes: &[[u8; 32]]) -> String {
    match choice_hashes {
        [] => sha256_hex(b""),
        [one] => hex::encode(one),
        many => sha256_hex(&many.concat()),
    }
}
