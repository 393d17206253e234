//! Who sent a request and in which prefix-cache namespace it runs: the `x-request-id` rules and
//! route-ticket verification.
//!
//! - `x-request-id`: honoured when it is 1..=128 visible ASCII characters, else 400
//!   `invalid_request_id`; generated (`req-<uuid v4>`) when absent. A ticket carries its own
//!   request id: when both are present they must be equal (401 `ticket_request_mismatch`);
//!   when only the ticket is present its id is used.
//! - The ticket (header [`receipts::TICKET_HEADER`]) must parse, be signed by a key in the
//!   configured gateway key ring, be inside its validity window (± the allowed skew), name this
//!   worker, not be a replay of an already accepted ticket ([`claim`], once the body was read:
//!   the guard is seeded from the receipt log's live tickets at start-up, so a restart does not
//!   forget it), and use this worker's hash algorithm. Any failure is 401 with the `receipts` error type as the code (`bad_signature`,
//!   `unknown_key`, `ticket_expired`, ...), except an algorithm mismatch (400
//!   `hash_algorithm_mismatch`: the ticket is genuine but cannot be honoured).
//! - Without a ticket: 401 `ticket_required` under [`TicketPolicy::Require`]; otherwise the
//!   request is a *direct* request and runs in the worker's default namespace.
//!
//! The namespace seed of a ticketed request is the ticket's `namespace_seed`: the gateway has
//! already folded the profile, block size, algorithm and tenant salt into it.

use axum::http::HeaderMap;
use prefix_index::NamespaceSeed;
use receipts::{SignedTicket, TICKET_HEADER};
use serde::{Deserialize, Serialize};

use crate::api_error::ApiError;
use crate::AppState;

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

/// Applies the request-id and ticket rules to `headers`.
pub fn admit(st: &AppState, headers: &HeaderMap) -> Result<Admission, ApiError> {
    let header_id = header_request_id(headers)?;
    let Some(raw) = headers.get(TICKET_HEADER) else {
        if st.settings.ticket_policy == TicketPolicy::Require {
            return Err(ApiError::unauthorized(
                "ticket_required",
                format!("this worker serves only requests with a route ticket (`{TICKET_HEADER}`)"),
            ));
        }
        return Ok(Admission {
            request_id: header_id.unwrap_or_else(generate_request_id),
            ticket: None,
            namespace: st.default_namespace,
        });
    };
    let raw = raw.to_str().map_err(|_| {
        ApiError::unauthorized("malformed", format!("`{TICKET_HEADER}` is not ASCII"))
    })?;
    let signed = SignedTicket::parse_header(raw)
        .map_err(|e| ApiError::unauthorized(e.error_type(), format!("route ticket: {e}")))?;
    let now = receipts::now_ms();
    let ticket = signed
        .verify(&st.gateway_keys, now, st.settings.ticket_skew_ms)
        .map_err(|e| ApiError::unauthorized(e.error_type(), format!("route ticket: {e}")))?;
    if ticket.worker.as_str() != st.settings.worker_id {
        return Err(ApiError::unauthorized(
            "ticket_wrong_worker",
            format!(
                "the route ticket is for worker `{}`, this is `{}`",
                ticket.worker, st.settings.worker_id
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
    if ticket.hash_algorithm != st.settings.hash_algorithm {
        return Err(ApiError::bad_request(
            "hash_algorithm_mismatch",
            None,
            format!(
                "the route ticket uses hash algorithm `{}`, this worker `{}`",
                ticket.hash_algorithm, st.settings.hash_algorithm
            ),
        ));
    }
    Ok(Admission {
        request_id: ticket.request_id.clone(),
        ticket: Some(signed),
        namespace: ticket.namespace_seed,
    })
}

/// Marks the admission's ticket as used (replay guard), once the request is going to be served
/// and receipted: a ticket that was verified but refused before its receipt (an oversized body)
/// is not used up. 401 `ticket_replayed` when it was used before — also before a restart, as the
/// guard is seeded from the receipt log at start-up.
pub fn claim(st: &AppState, admission: &Admission) -> Result<(), ApiError> {
    let Some(signed) = &admission.ticket else {
        return Ok(());
    };
    st.replay
        .lock()
        .check_and_insert(signed.ticket_unverified(), receipts::now_ms())
        .map_err(|e| ApiError::unauthorized(e.error_type(), format!("route ticket: {e}")))
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
