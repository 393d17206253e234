//! The work a request asks of a worker, as counted where nothing tokenized it: the gateway's
//! count for a request it did not tokenize (a round-robin service's), a tenant's token rate
//! limit, and a sidecar's load report for a request whose ticket carries no prompt count. One
//! reading, so that a gateway and a sidecar count the same body the same way.

use serde::Deserialize;

/// The output tokens counted for a request that names no `max_tokens` (per choice).
pub const DEFAULT_OUTPUT_TOKENS: u64 = 256;

/// Body bytes counted as one prompt token for a prompt nothing tokenized (a typical English
/// byte-level BPE averages about four bytes per token; an estimate, never used for a decision
/// that needs the real count).
pub const BYTES_PER_TOKEN: u64 = 4;

#[derive(Deserialize)]
struct OutputOnly {
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    /// The Responses API's.
    max_output_tokens: Option<u64>,
    n: Option<serde_json::Value>,
}

fn read(body: &[u8]) -> Option<OutputOnly> {
    if body.is_empty() {
        return None;
    }
    serde_json::from_slice::<OutputOnly>(body).ok()
}

/// The output tokens a body asks for: `max_completion_tokens`, else `max_tokens`, else
/// `max_output_tokens` (the Responses API's), times its choices (`n`, [`crate::choices`]);
/// `None` when it names none of them or is not a JSON object.
pub fn requested_output_tokens(body: &[u8]) -> Option<u64> {
    let o = read(body)?;
    let each = o
        .max_completion_tokens
        .or(o.max_tokens)
        .or(o.max_output_tokens)?;
    Some(each.saturating_mul(crate::choices(o.n.as_ref()) as u64))
}

/// The decode work a request is counted for while it runs: [`requested_output_tokens`], else
/// [`DEFAULT_OUTPUT_TOKENS`] times its choices.
pub fn queued_output_tokens(body: &[u8]) -> u64 {
    match read(body) {
        Some(o) => o
            .max_completion_tokens
            .or(o.max_tokens)
            .or(o.max_output_tokens)
            .unwrap_or(DEFAULT_OUTPUT_TOKENS)
            .saturating_mul(crate::choices(o.n.as_ref()) as u64),
        None => DEFAULT_OUTPUT_TOKENS,
    }
}

/// The prompt tokens counted for a body nothing tokenized: its bytes / [`BYTES_PER_TOKEN`].
pub fn untokenized_prompt_tokens(body_len: usize) -> u64 {
    body_len as u64 / BYTES_PER_TOKEN
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_tokens_by_field_and_choices() {
        for (body, requested, queued) in [
            (&br#"{"max_tokens":5}"#[..], Some(5), 5),
            (br#"{"max_tokens":5,"max_completion_tokens":7}"#, Some(7), 7),
            (br#"{"max_output_tokens":9}"#, Some(9), 9),
            (br#"{"max_tokens":4,"n":2}"#, Some(8), 8),
            (br#"{"max_tokens":4,"n":17}"#, Some(4), 4),
            (br#"{"max_tokens":4,"n":"x"}"#, Some(4), 4),
            (br#"{"n":4}"#, None, 4 * DEFAULT_OUTPUT_TOKENS),
            (br#"{}"#, None, DEFAULT_OUTPUT_TOKENS),
            (b"", None, DEFAULT_OUTPUT_TOKENS),
            (b"not json", None, DEFAULT_OUTPUT_TOKENS),
            (br#"{"max_tokens":-1}"#, None, DEFAULT_OUTPUT_TOKENS),
            (
                br#"{"max_tokens":18446744073709551615,"n":2}"#,
                Some(u64::MAX),
                u64::MAX,
            ),
        ] {
            let text = String::from_utf8_lossy(body);
            assert_eq!(requested_output_tokens(body), requested, "{text}");
            assert_eq!(queued_output_tokens(body), queued, "{text}");
        }
        assert_eq!(untokenized_prompt_tokens(0), 0);
        assert_eq!(untokenized_prompt_tokens(4099), 1024);
    }
}
