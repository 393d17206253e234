//! Who sent a request and in which prefix-cache namespace it runs: the `x-request-id` rules and
//! route-ticket verification.
//!
//! - `x-request-id`: honoured when it is 1..=128 visible ASCII characters, else 400
//!   `invalid_request_id`; generated (`req-<uuid v4>`) when absent. A ticket carries its own
//!   request id: when both are present they must be equal (401 `ticket_request_mismatch`);
//!   when only the ticket is present its id is used.
//! - The ticket (header [`receipts::TICKET_HEADER`]) must parse, be signed by a key in the
//!   configured gateway key ring, be inside its validity window (± the allowed skew), name this
//!   worker, not be a replay of an already accepted ticket ([`TicketGate::claim`], once the body
//!   was read: the guard is seeded from the receipt log's live tickets at start-up, so a restart
//!   does not forget it), and use this worker's hash algorithm (a sidecar accepts any). Any
//!   failure is 401 with the `receipts` error type as the code (`bad_signature`,
//!   `unknown_key`, `ticket_expired`, ...), except an algorithm mismatch (400
//!   `hash_algorithm_mismatch`: the ticket is genuine but cannot be honoured).
//!
//! [`TicketGate`] holds these rules; the embedded worker and `kvgate sidecar` both use it.
//! - Without a ticket: 401 `ticket_required` under [`TicketPolicy::Require`]; otherwise the
//!   request is a *direct* request and runs in the worker's default namespace.
//!
//! The namespace seed of a ticketed request is the ticket's `namespace_seed`: the gateway has
//! already folded the profile, block size, algorithm and tenant salt into it.

use axum::http::HeaderMap;
use parking_lot::Mutex;
use prefix_index::{HashAlgorithm, NamespaceSeed};
use receipts::{KeyRing, ReceiptLog, ReplayGuard, SignedTicket, TICKET_HEADER};
use serde::{Deserialize, Serialize};

use crate::api_error::ApiError;

/// Header echoed on every answer and read from requests.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// Response header naming the receipt of a generation request (its value is the request id,
/// the key of `GET /v1/receipts/{request_id}`).
pub const RECEIPT_HEADER: &str = "x-kvgate-receipt";
/// Request header that opts a request out of prefix-cache insertion (`1` or `true`).
pub const NO_CACHE_HEADER: &str = "x-kvgate-no-cache";
/// Longest accepted `x-request-id`.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// Whether requests must carry a route ticket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TicketPolicy {
    /// Requests without a ticket are refused (401 `ticket_required`).
    Require,
    /// Requests without a ticket are served in the worker's default namespace.
    #[default]
    Optional,
}

/// The identity and namespace of an accepted request.
#[derive(Clone, Debug)]
pub struct Admission {
    pub request_id: String,
    /// The verified ticket, kept verbatim for the receipt.
    pub ticket: Option<SignedTicket>,
    pub namespace: NamespaceSeed,
}

/// The request id of `headers` (validated), if any.
pub fn header_request_id(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get(REQUEST_ID_HEADER) else {
        return Ok(None);
    };
    let ok = v
        .to_str()
        .ok()
        .filter(|s| {
            !s.is_empty()
                && s.len() <= MAX_REQUEST_ID_LEN
                && s.bytes().all(|b| b.is_ascii_graphic())
        })
        .map(str::to_string);
    match ok {
        Some(s) => Ok(Some(s)),
        None => Err(ApiError::bad_request(
            "invalid_request_id",
            None,
            format!(
                "`{REQUEST_ID_HEADER}` must be 1..={MAX_REQUEST_ID_LEN} visible ASCII characters"
            ),
        )),
    }
}

/// A fresh request id.
pub fn generate_request_id() -> String {
    format!("req-{}", uuid::Uuid::new_v4().simple())
}

/// The ticket rules of one worker or sidecar: who it is, which gateway keys it trusts, and the
/// replay guard. The embedded worker and `kvgate sidecar` both admit requests through this one
/// type, so a ticket is accepted or refused the same way (and with the same codes) by both.
pub struct TicketGate {
    /// The id tickets must name (`ticket.worker`).
    pub worker_id: String,
    pub policy: TicketPolicy,
    /// Clock skew tolerated on both ends of a ticket's validity window.
    pub skew_ms: u64,
    /// The block-key algorithm tickets must use; `None` accepts any (a sidecar: the engine
    /// behind it computes no kvgate block keys).
    pub hash_algorithm: Option<HashAlgorithm>,
    /// Gateway public keys trusted for tickets and access tokens: the configured ones (the
    /// `--gateway-keys` folder) plus, in cluster mode, the replicas' keys read from the shared
    /// store ([`TicketGate::trust_cluster_keys`]).
    configured_keys: KeyRing,
    gateway_keys: arc_swap::ArcSwap<KeyRing>,
    /// The namespace of direct (ticketless) requests.
    pub default_namespace: NamespaceSeed,
    replay: Mutex<ReplayGuard>,
}

impl TicketGate {
    /// A gate whose replay guard is seeded from `log`'s live tickets, so a ticket accepted
    /// before a restart stays used.
    pub fn seeded(
        worker_id: String,
        policy: TicketPolicy,
        skew_ms: u64,
        hash_algorithm: Option<HashAlgorithm>,
        gateway_keys: KeyRing,
        default_namespace: NamespaceSeed,
        log: &ReceiptLog,
    ) -> TicketGate {
        let mut replay = ReplayGuard::new(skew_ms);
        let now = receipts::now_ms();
        for t in &log.open_report().live_tickets {
            let _ = replay.check_and_insert(t, now);
        }
        TicketGate {
            worker_id,
            policy,
            skew_ms,
            hash_algorithm,
            gateway_keys: arc_swap::ArcSwap::from_pointee(gateway_keys.clone()),
            configured_keys: gateway_keys,
            default_namespace,
            replay: Mutex::new(replay),
        }
    }

    /// Trusts, besides the configured keys, exactly `keys` (named by gateway id): the gateway
    /// replicas' public keys as the cluster store lists them now. A replica whose record lapsed
    /// is no longer trusted; the configured keys always are.
    pub fn trust_cluster_keys(&self, keys: Vec<(String, receipts::PublicKey)>) {
        let mut ring = self.configured_keys.clone();
        for (name, k) in keys {
            ring.insert(name, k);
        }
        self.gateway_keys.store(std::sync::Arc::new(ring));
    }

    /// How many gateway keys are trusted now.
    pub fn trusted_keys(&self) -> usize {
        self.gateway_keys.load().len()
    }

    /// Applies the request-id and ticket rules to `headers`.
    pub fn admit(&self, headers: &HeaderMap) -> Result<Admission, ApiError> {
        let header_id = header_request_id(headers)?;
        let Some(raw) = headers.get(TICKET_HEADER) else {
            if self.policy == TicketPolicy::Require {
                return Err(ApiError::unauthorized(
                    "ticket_required",
                    format!(
                        "this worker serves only requests with a route ticket (`{TICKET_HEADER}`)"
                    ),
                ));
            }
            return Ok(Admission {
                request_id: header_id.unwrap_or_else(generate_request_id),
                ticket: None,
                namespace: self.default_namespace,
            });
        };
        let raw = raw.to_str().map_err(|_| {
            ApiError::unauthorized("malformed", format!("`{TICKET_HEADER}` is not ASCII"))
        })?;
        let signed = SignedTicket::parse_header(raw)
            .map_err(|e| ApiError::unauthorized(e.error_type(), format!("route ticket: {e}")))?;
        let now = receipts::now_ms();
        let ticket = signed
            .verify(&self.gateway_keys.load(), now, self.skew_ms)
            .map_err(|e| ApiError::unauthorized(e.error_type(), format!("route ticket: {e}")))?;
        if ticket.worker.as_str() != self.worker_id {
            return Err(ApiError::unauthorized(
                "ticket_wrong_worker",
                format!(
                    "the route ticket is for worker `{}`, this is `{}`",
                    ticket.worker, self.worker_id
                ),
            ));
        }
        if let Some(h) = &header_id {
            if h != &ticket.request_id {
                return Err(ApiError::unauthorized(
                    "ticket_request_mismatch",
                    format!(
                        "`{REQUEST_ID_HEADER}` is `{h}` but the route ticket is for `{}`",
                        ticket.request_id
                    ),
                ));
            }
        }
        if let Some(alg) = self.hash_algorithm {
            if ticket.hash_algorithm != alg {
                return Err(ApiError::bad_request(
                    "hash_algorithm_mismatch",
                    None,
                    format!(
                        "the route ticket uses hash algorithm `{}`, this worker `{alg}`",
                        ticket.hash_algorithm
                    ),
                ));
            }
        }
        Ok(Admission {
            request_id: ticket.request_id.clone(),
            ticket: Some(signed),
            namespace: ticket.namespace_seed,
        })
    }

    /// Marks the admission's ticket as used (replay guard), once the request is going to be
    /// served and receipted: a ticket that was verified but refused before its receipt (an
    /// oversized body) is not used up. 401 `ticket_replayed` when it was used before — also
    /// before a restart, as the guard is seeded from the receipt log at start-up.
    pub fn claim(&self, admission: &Admission) -> Result<(), ApiError> {
        let Some(signed) = &admission.ticket else {
            return Ok(());
        };
        self.replay
            .lock()
            .check_and_insert(signed.ticket_unverified(), receipts::now_ms())
            .map_err(|e| ApiError::unauthorized(e.error_type(), format!("route ticket: {e}")))
    }

    /// The operations-endpoint rule: with [`TicketPolicy::Require`], a request must carry the
    /// gateway's access token (`Authorization: Bearer`, [`receipts::AccessToken`] signed by a
    /// key of the gateway key ring for this worker): 401 `access_required` without one, 401
    /// with the token's error code (`bad_signature`, `unknown_key`, `ticket_expired`,
    /// `malformed`, ...) for a bad one. With optional tickets (local use) everything passes.
    pub fn check_access(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        if self.policy != TicketPolicy::Require {
            return Ok(());
        }
        let bearer = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let Some(token) = bearer else {
            return Err(ApiError::unauthorized(
                "access_required",
                "this endpoint needs the gateway's access token (`Authorization: Bearer ...`)",
            ));
        };
        receipts::AccessToken::verify(
            token,
            &self.gateway_keys.load(),
            &self.worker_id,
            receipts::now_ms(),
            self.skew_ms,
        )
        .map(|_| ())
        .map_err(|e| ApiError::unauthorized(e.error_type(), format!("access token: {e}")))
    }
}

/// Whether `headers` opt the request out of cache insertion.
pub fn no_cache_header(headers: &HeaderMap) -> Result<bool, ApiError> {
    match headers.get(NO_CACHE_HEADER).map(|v| v.to_str()) {
        None => Ok(false),
        Some(Ok("1")) | Some(Ok("true")) => Ok(true),
        Some(Ok("0")) | Some(Ok("false")) => Ok(false),
        Some(_) => Err(ApiError::bad_request(
            "invalid_value",
            Some(NO_CACHE_HEADER),
            format!("`{NO_CACHE_HEADER}` must be 1, true, 0 or false"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn request_id_rules() {
        let mut h = HeaderMap::new();
        assert_eq!(header_request_id(&h).unwrap(), None);
        h.insert(REQUEST_ID_HEADER, HeaderValue::from_static("abc-1"));
        assert_eq!(header_request_id(&h).unwrap().as_deref(), Some("abc-1"));
        h.insert(REQUEST_ID_HEADER, HeaderValue::from_static("has space"));
        assert_eq!(
            header_request_id(&h).unwrap_err().code,
            "invalid_request_id"
        );
        let long = "x".repeat(MAX_REQUEST_ID_LEN + 1);
        h.insert(REQUEST_ID_HEADER, HeaderValue::from_str(&long).unwrap());
        assert!(header_request_id(&h).is_err());
        let a = generate_request_id();
        assert!(a.starts_with("req-") && a != generate_request_id());
    }

    #[test]
    fn no_cache_header_values() {
        let mut h = HeaderMap::new();
        assert!(!no_cache_header(&h).unwrap());
        h.insert(NO_CACHE_HEADER, HeaderValue::from_static("1"));
        assert!(no_cache_header(&h).unwrap());
        h.insert(NO_CACHE_HEADER, HeaderValue::from_static("maybe"));
        assert_eq!(
            no_cache_header(&h).unwrap_err().param.as_deref(),
            Some(NO_CACHE_HEADER)
        );
    }
}
