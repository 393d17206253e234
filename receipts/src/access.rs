//! Access tokens: the gateway's signed credential for a worker's operations endpoints (the KV
//! event stream, tokenization, receipts), which a worker that requires route tickets also
//! requires. Carried as `Authorization: Bearer <token>`.
//!
//! Token: `base64url(payload) "." base64url(signature)` (RFC 4648 §5 alphabet, no padding), where
//! `payload` is the canonical JSON ([`crate::canonical`]) of an [`AccessToken`] and `signature`
//! is Ed25519 over `ACCESS_DOMAIN || payload` with a gateway key — the same keys, format and
//! canonical encoding as route tickets, under another domain, so a ticket can never pass as an
//! access token or the reverse. A worker accepts a token that verifies with a key of its gateway
//! key ring, names it, and is inside `issued_at_ms − skew ≤ now ≤ expires_at_ms + skew`. The
//! gateway signs a fresh token (valid [`DEFAULT_ACCESS_TTL_MS`]) for each connection it opens;
//! a long event stream stays open after its token expires (validity is checked at connect).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use prefix_index::WorkerId;
use serde::{Deserialize, Serialize};

use crate::canonical;
use crate::error::{ReceiptsError, Result};
use crate::keys::{KeyId, KeyRing};
use crate::signer::Signer;

/// Domain-separation prefix of the bytes an access token signature covers.
pub const ACCESS_DOMAIN: &[u8] = b"kvgate.access.v1\n";

/// Validity of an access token the gateway signs.
pub const DEFAULT_ACCESS_TTL_MS: u64 = 5 * 60 * 1000;

/// What an access token says (the signed content).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessToken {
    /// The gateway instance.
    pub gateway_id: String,
    /// The gateway key that signed (set by [`AccessToken::sign`]).
    pub key_id: KeyId,
    /// The worker the token is for.
    pub worker: WorkerId,
    /// Unix ms, gateway clock.
    pub issued_at_ms: u64,
    /// End of the validity window, Unix ms.
    pub expires_at_ms: u64,
}

impl AccessToken {
    /// A token for `worker` valid from `now_ms` for [`DEFAULT_ACCESS_TTL_MS`].
    pub fn new(gateway_id: &str, worker: &WorkerId, now_ms: u64) -> AccessToken {
        AccessToken {
            gateway_id: gateway_id.to_owned(),
            key_id: KeyId(String::new()),
            worker: worker.clone(),
            issued_at_ms: now_ms,
            expires_at_ms: now_ms.saturating_add(DEFAULT_ACCESS_TTL_MS),
        }
    }

    /// Signs with `key` (its id replaces `key_id`); returns the bearer token string.
    pub fn sign(&self, key: &impl Signer) -> String {
        let mut t = self.clone();
        t.key_id = key.key_id().clone();
        // Strings and integers only: canonical encoding cannot fail (an empty payload would
        // fail every verification).
        let payload = canonical::to_vec(&t).unwrap_or_default();
        let mut msg = ACCESS_DOMAIN.to_vec();
        msg.extend_from_slice(&payload);
        format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(&payload),
            URL_SAFE_NO_PAD.encode(key.sign_message(&msg))
        )
    }

    /// Parses and verifies a bearer token for `worker` at `now_ms`: signature by a key of
    /// `keys`, the worker named, the window ± `skew_ms`. The error's `error_type()` is the code
    /// a worker answers with.
    pub fn verify(
        token: &str,
        keys: &KeyRing,
        worker: &str,
        now_ms: u64,
        skew_ms: u64,
    ) -> Result<AccessToken> {
        let bad = |detail: String| ReceiptsError::Malformed {
            what: "access token",
            detail,
        };
        let (p64, s64) = token
            .trim()
            .split_once('.')
            .ok_or_else(|| bad("expected `payload.signature`".into()))?;
        let payload = URL_SAFE_NO_PAD
            .decode(p64)
            .map_err(|e| bad(format!("payload is not base64url: {e}")))?;
        let sig = URL_SAFE_NO_PAD
            .decode(s64)
            .map_err(|e| bad(format!("signature is not base64url: {e}")))?;
        let sig: [u8; 64] = sig
            .as_slice()
            .try_into()
            .map_err(|_| bad(format!("signature is {} bytes, not 64", sig.len())))?;
        let t: AccessToken = serde_json::from_slice(&payload)
            .map_err(|e| bad(format!("payload is not an access token: {e}")))?;
        if canonical::to_vec(&t)? != payload {
            return Err(ReceiptsError::NonCanonical {
                what: "access token",
            });
        }
        let key = keys
            .get(&t.key_id)
            .ok_or_else(|| ReceiptsError::UnknownKey {
                what: "access token",
                key_id: t.key_id.0.clone(),
            })?;
        let mut msg = ACCESS_DOMAIN.to_vec();
        msg.extend_from_slice(&payload);
        if !key.verify(&msg, &sig) {
            return Err(ReceiptsError::BadSignature {
                what: "access token",
                key_id: t.key_id.0.clone(),
            });
        }
        if t.issued_at_ms > now_ms.saturating_add(skew_ms) {
            return Err(ReceiptsError::TicketNotYetValid {
                issued_at_ms: t.issued_at_ms,
                now_ms,
            });
        }
        if now_ms > t.expires_at_ms.saturating_add(skew_ms) {
            return Err(ReceiptsError::TicketExpired {
                expires_at_ms: t.expires_at_ms,
                now_ms,
            });
        }
        if t.worker.as_str() != worker {
            return Err(bad(format!(
                "the token is for worker `{}`, this is `{worker}`",
                t.worker
            )));
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::KeyPair;

    #[test]
    fn tokens_verify_only_for_their_worker_window_and_keys() {
        let gw = KeyPair::generate();
        let other = KeyPair::generate();
        let mut ring = KeyRing::new();
        ring.insert("gw", gw.public().clone());
        let w = WorkerId::from("w1");
        let t = AccessToken::new("gw-1", &w, 1_000_000).sign(&gw);
        let ok = AccessToken::verify(&t, &ring, "w1", 1_000_500, 5_000).unwrap();
        assert_eq!(ok.worker, w);
        let code = |r: Result<AccessToken>| r.unwrap_err().error_type();
        assert_eq!(
            code(AccessToken::verify(&t, &ring, "w2", 1_000_500, 5_000)),
            "malformed"
        );
        assert_eq!(
            code(AccessToken::verify(
                &t,
                &ring,
                "w1",
                1_000_000 + DEFAULT_ACCESS_TTL_MS + 6_000,
                5_000
            )),
            "ticket_expired"
        );
        let forged = AccessToken::new("gw-1", &w, 1_000_000).sign(&other);
        assert_eq!(
            code(AccessToken::verify(&forged, &ring, "w1", 1_000_500, 5_000)),
            "unknown_key"
        );
        assert_eq!(
            code(AccessToken::verify("x.y", &ring, "w1", 0, 0)),
            "malformed"
        );
        // A signature over the same bytes under the ticket domain does not pass.
        let payload = t.split_once('.').unwrap().0;
        let raw = URL_SAFE_NO_PAD.decode(payload).unwrap();
        let mut msg = crate::ticket::TICKET_DOMAIN.to_vec();
        msg.extend_from_slice(&raw);
        let cross = format!("{payload}.{}", URL_SAFE_NO_PAD.encode(gw.sign(&msg)));
        assert_eq!(
            code(AccessToken::verify(&cross, &ring, "w1", 1_000_500, 5_000)),
            "bad_signature"
        );
    }
}
