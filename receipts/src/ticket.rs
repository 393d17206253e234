//! Route tickets: the gateway's signed routing decision for one request, carried to the worker in
//! the [`TICKET_HEADER`] header.
//!
//! Header value: `base64url(payload) "." base64url(signature)` (RFC 4648 §5 alphabet, no padding),
//! where `payload` is the canonical JSON of the [`RouteTicket`] (see [`crate::canonical`]) and
//! `signature` is the 64-byte Ed25519 signature over `TICKET_DOMAIN || payload`.
//!
//! Validity window: a ticket is valid for `issued_at_ms - skew <= now <= expires_at_ms + skew`.
//! Within the window a worker rejects a second ticket for the same request id ([`ReplayGuard`]),
//! so a captured header cannot be replayed against the same worker.

use std::collections::{BTreeMap, HashMap};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use prefix_index::{BlockKey, HashAlgorithm, NamespaceSeed, WorkerId};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::canonical;
use crate::error::{ReceiptsError, Result};
#[cfg(doc)]
use crate::keys::KeyPair;
use crate::keys::{KeyId, KeyRing};
use crate::signer::Signer;

/// The HTTP header that carries a signed route ticket from the gateway to the worker.
pub const TICKET_HEADER: &str = "x-kvgate-ticket";

/// Domain-separation prefix of the bytes a ticket signature covers.
pub const TICKET_DOMAIN: &[u8] = b"kvgate.ticket.v1\n";

/// Default validity of a ticket issued by the gateway (documented in docs/receipts.md).
pub const DEFAULT_TICKET_TTL_MS: u64 = 60_000;

/// Default clock skew tolerated between gateway and worker clocks.
pub const DEFAULT_MAX_CLOCK_SKEW_MS: u64 = 5_000;

/// Which policy chose the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouteMode {
    /// Round-robin (no tokenization in the gateway).
    RoundRobin,
    /// KV-exact: longest cached prefix.
    KvExact,
}

impl RouteMode {
    /// The wire name.
    pub fn as_str(&self) -> &'static str {
        match self {
            RouteMode::RoundRobin => "round_robin",
            RouteMode::KvExact => "kv_exact",
        }
    }
}

/// The gateway's routing decision for one request (the signed content of a ticket).
///
/// Fields are declared in canonical key order (bytewise), so that the canonical encoder writes
/// them straight out without buffering and sorting (the bytes are the same either way).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteTicket {
    /// End of the ticket's validity window (Unix ms, gateway clock).
    pub expires_at_ms: u64,
    /// The gateway instance that issued the ticket.
    pub gateway_id: String,
    /// The block-key hash algorithm: `xxh3` or `sha256` (docs/block-keys.md).
    pub hash_algorithm: HashAlgorithm,
    /// When the ticket was issued (Unix ms, gateway clock).
    pub issued_at_ms: u64,
    /// The key id of the gateway key that signed it (set by [`RouteTicket::sign`]).
    pub key_id: KeyId,
    /// The block key of the prompt's last full block, 16 lowercase hex digits (when it tokenized).
    pub last_block_key: Option<BlockKey>,
    /// The routing policy.
    pub mode: RouteMode,
    /// The namespace seed the worker must use for its block keys (64 lowercase hex digits).
    pub namespace_seed: NamespaceSeed,
    /// Prefix tokens the gateway predicted the worker holds (KV-exact only).
    pub predicted_matched_tokens: Option<u32>,
    /// Prompt tokens as the gateway counted them (when it tokenized).
    pub prompt_tokens: Option<u32>,
    /// The request id (`x-request-id`) the gateway assigned.
    pub request_id: String,
    /// The rule that chose the worker.
    pub rule_id: String,
    /// The version of the rules snapshot the decision was taken under.
    pub rule_version: u64,
    /// The matched service.
    pub service: String,
    /// The chosen worker id.
    pub worker: WorkerId,
}

fn is_lower_hex(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl RouteTicket {
    /// Field-level checks (key id, window order); the typed fields check themselves when
    /// parsed. Signatures are checked separately.
    pub fn validate(&self) -> Result<()> {
        let bad = |detail: String| ReceiptsError::Malformed {
            what: "ticket",
            detail,
        };
        if self.key_id.0.len() != 16 || !is_lower_hex(&self.key_id.0) {
            return Err(bad(format!(
                "key_id {:?} is not 16 lowercase hex",
                self.key_id.0
            )));
        }
        if self.expires_at_ms < self.issued_at_ms {
            return Err(bad("expires_at_ms is before issued_at_ms".into()));
        }
        Ok(())
    }

    /// Sign with the gateway key (a [`KeyPair`]: RFC 8032 deterministic signatures; a
    /// [`crate::PrecomputedSigner`]: the same verification, nonces computed ahead). `key_id` is
    /// overwritten with the signing key's id.
    pub fn sign(&self, key: &impl Signer) -> SignedTicket {
        let mut ticket = self.clone();
        ticket.key_id = key.key_id().clone();
        // A RouteTicket holds only strings, integers and nulls, so canonical encoding cannot
        // fail (only floats can); were it ever to, the empty payload fails every verification.
        let payload = canonical::to_vec(&ticket).unwrap_or_default();
        let mut msg = Vec::with_capacity(TICKET_DOMAIN.len() + payload.len());
        msg.extend_from_slice(TICKET_DOMAIN);
        msg.extend_from_slice(&payload);
        let signature = key.sign_message(&msg);
        let header = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(&payload),
            URL_SAFE_NO_PAD.encode(signature)
        );
        SignedTicket {
            ticket,
            payload,
            signature,
            header,
        }
    }
}

/// A ticket with its exact signed bytes and signature, as carried in the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedTicket {
    ticket: RouteTicket,
    payload: Vec<u8>,
    signature: [u8; 64],
    header: String,
}

impl SignedTicket {
    /// The header value: `base64url(payload).base64url(signature)`.
    pub fn to_header_value(&self) -> String {
        self.header.clone()
    }

    /// The header value, borrowed.
    pub fn header(&self) -> &str {
        &self.header
    }

    /// Decode a header value (does NOT verify the signature: use [`SignedTicket::verify`]).
    /// The payload must be canonical JSON of a well-formed ticket with no unknown fields.
    pub fn parse_header(value: &str) -> Result<SignedTicket> {
        let bad = |detail: String| ReceiptsError::Malformed {
            what: "ticket",
            detail,
        };
        let value = value.trim();
        let (p64, s64) = value
            .split_once('.')
            .ok_or_else(|| bad("expected `payload.signature`".into()))?;
        let payload = URL_SAFE_NO_PAD
            .decode(p64)
            .map_err(|e| bad(format!("payload is not base64url: {e}")))?;
        let sig_bytes = URL_SAFE_NO_PAD
            .decode(s64)
            .map_err(|e| bad(format!("signature is not base64url: {e}")))?;
        let signature: [u8; 64] = sig_bytes
            .as_slice()
            .try_into()
            .map_err(|_| bad(format!("signature is {} bytes, not 64", sig_bytes.len())))?;
        let ticket: RouteTicket = serde_json::from_slice(&payload)
            .map_err(|e| bad(format!("payload is not a ticket: {e}")))?;
        ticket.validate()?;
        if canonical::to_vec(&ticket)? != payload {
            return Err(ReceiptsError::NonCanonical { what: "ticket" });
        }
        // Re-encode so the stored header is the unique form (base64 decoders may accept
        // non-canonical trailing bits).
        let header = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(&payload),
            URL_SAFE_NO_PAD.encode(signature)
        );
        if header != value {
            return Err(ReceiptsError::NonCanonical { what: "ticket" });
        }
        Ok(SignedTicket {
            ticket,
            payload,
            signature,
            header,
        })
    }

    /// The ticket content, NOT yet verified.
    pub fn ticket_unverified(&self) -> &RouteTicket {
        &self.ticket
    }

    /// The exact canonical payload bytes.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The 64-byte signature.
    pub fn signature(&self) -> &[u8; 64] {
        &self.signature
    }

    /// The bytes the signature covers: `TICKET_DOMAIN || payload`.
    pub fn signed_bytes(&self) -> Vec<u8> {
        let mut msg = Vec::with_capacity(TICKET_DOMAIN.len() + self.payload.len());
        msg.extend_from_slice(TICKET_DOMAIN);
        msg.extend_from_slice(&self.payload);
        msg
    }

    /// Check the signature only (no clock): the key must be in `keys`.
    pub fn verify_signature(&self, keys: &KeyRing) -> Result<&RouteTicket> {
        let key = keys
            .get(&self.ticket.key_id)
            .ok_or_else(|| ReceiptsError::UnknownKey {
                what: "ticket",
                key_id: self.ticket.key_id.0.clone(),
            })?;
        if !key.verify(&self.signed_bytes(), &self.signature) {
            return Err(ReceiptsError::BadSignature {
                what: "ticket",
                key_id: self.ticket.key_id.0.clone(),
            });
        }
        Ok(&self.ticket)
    }

    /// Check the signature and the validity window against `now_ms`, tolerating
    /// `max_clock_skew_ms` on both ends. Returns the verified ticket.
    pub fn verify(
        &self,
        keys: &KeyRing,
        now_ms: u64,
        max_clock_skew_ms: u64,
    ) -> Result<RouteTicket> {
        let t = self.verify_signature(keys)?;
        check_window(t, now_ms, max_clock_skew_ms)?;
        Ok(t.clone())
    }
}

/// Check `issued_at_ms - skew <= now_ms <= expires_at_ms + skew`.
pub fn check_window(t: &RouteTicket, now_ms: u64, max_clock_skew_ms: u64) -> Result<()> {
    if t.issued_at_ms > now_ms.saturating_add(max_clock_skew_ms) {
        return Err(ReceiptsError::TicketNotYetValid {
            issued_at_ms: t.issued_at_ms,
            now_ms,
        });
    }
    if now_ms > t.expires_at_ms.saturating_add(max_clock_skew_ms) {
        return Err(ReceiptsError::TicketExpired {
            expires_at_ms: t.expires_at_ms,
            now_ms,
        });
    }
    Ok(())
}

impl Serialize for SignedTicket {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.header)
    }
}

impl<'de> Deserialize<'de> for SignedTicket {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        SignedTicket::parse_header(&s).map_err(serde::de::Error::custom)
    }
}

/// Rejects a second ticket for the same request id while the first is inside its window.
///
/// Memory is bounded by the number of tickets accepted within one validity window; entries are
/// pruned on insert once their window (plus skew) has passed. Insert is O(log n) amortized.
#[derive(Debug, Default)]
pub struct ReplayGuard {
    seen: HashMap<String, u64>,
    by_expiry: BTreeMap<(u64, String), ()>,
    max_clock_skew_ms: u64,
}

impl ReplayGuard {
    /// A guard tolerating `max_clock_skew_ms`.
    pub fn new(max_clock_skew_ms: u64) -> ReplayGuard {
        ReplayGuard {
            max_clock_skew_ms,
            ..ReplayGuard::default()
        }
    }

    /// Record an already verified ticket; fails if its request id was seen within its window.
    pub fn check_and_insert(&mut self, t: &RouteTicket, now_ms: u64) -> Result<()> {
        while let Some(((exp, _), ())) = self.by_expiry.first_key_value() {
            if exp.saturating_add(self.max_clock_skew_ms) >= now_ms {
                break;
            }
            if let Some(((_, id), ())) = self.by_expiry.pop_first() {
                self.seen.remove(&id);
            }
        }
        if self.seen.contains_key(&t.request_id) {
            return Err(ReceiptsError::TicketReplayed {
                request_id: t.request_id.clone(),
            });
        }
        self.seen.insert(t.request_id.clone(), t.expires_at_ms);
        self.by_expiry
            .insert((t.expires_at_ms, t.request_id.clone()), ());
        Ok(())
    }

    /// Number of request ids remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}
